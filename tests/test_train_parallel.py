"""The trainer's launch modes on the CPU: the MPI reward pool, tensor parallelism under mpirun,
pipelines under torchrun (alone, tensor x pipeline resumed, data-parallel replicas) and a
pipeline with the reward pool."""

from __future__ import annotations

import math
import re
import shutil

import pytest
import yaml

from tests.train_support import LIBRARY_WARNINGS, small_config, train_under_mpirun, train_under_torchrun

pytestmark = LIBRARY_WARNINGS


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_training_with_the_reward_pool_under_mpirun(tmp_path):
    """Rank 0 trains, ranks 1-2 score its episodes: every sample's reward comes from a worker."""
    from hpc.results.training import read_steps, read_trajectories

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                            {"name": "measure", "kind": "measure", "steps": 1}])
    out = train_under_mpirun(3, config, tmp_path / "run")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "warmup_sft", "measure"]
    trajectories = read_trajectories(tmp_path / "run" / "train.h5", step=3)
    assert len(trajectories) == 2
    assert all(t["record"]["task_id"] == "level1/04_max_dim" for t in trajectories)
    assert out.stdout.count("trained 3 steps") == 1
    assert re.search(r"reward pool of trainer rank 0: \d+ answered by 2 worker rank\(s\)", out.stderr), out.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_tensor_parallel_training_runs_sft_and_ppo_on_a_sharded_policy(tmp_path):
    """Two trainer ranks as one TP=2 group and its worker rank: SFT then a PPO step train the
    sharded policy, the group's first rank scoring through the worker, and the sharded checkpoint
    records the layout (that the other rank never scores is tests/test_policy_parallel.py's)."""
    import json

    from hpc.results.training import read_steps, read_trajectories

    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"tensor": 2}},
                          stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                  {"name": "ppo", "kind": "ppo", "steps": 1}])
    out = train_under_mpirun(3, config, tmp_path / "run", "--trainers", "2", timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "warmup_sft", "ppo"]
    assert steps[-1]["optimizer_steps"] == 1 and steps[-1]["samples"] == 2 and steps[-1]["update_tokens"] > 0
    trajectories = read_trajectories(tmp_path / "run" / "train.h5", step=3)
    assert len(trajectories) == 2 and all(t["record"]["task_id"] == "level1/04_max_dim" for t in trajectories)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "policy" / "iter_0000003" / "hpc_policy.json").read_text())
    assert meta["tensor_parallel"] == 2 and meta["optimizer"], meta
    assert out.stdout.count("trained 3 steps") == 2      # both trainer ranks finish
    bad = train_under_mpirun(3, config, tmp_path / "bad", "--trainers", "3", timeout=300)
    assert bad.returncode != 0 and "error: --trainers 3: must be a positive multiple of policy.parallel.tensor 2" \
        in bad.stderr, bad.stderr[-2000:]


def test_pipeline_parallel_training_runs_end_to_end_under_torchrun(tmp_path):
    """Two trainer processes as one pipeline of two stages (torchrun; each scores its share of the
    episodes with its own evaluator): SFT, then a PPO step whose rollout the stages split. The
    results file has the rows, metrics and trajectories a one-stage run of the config writes,
    and the checkpoint is the pipelined one."""
    import json

    from jobs.train import train
    from hpc.results.training import read_steps, read_trajectories

    stages = [{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
              {"name": "ppo", "kind": "ppo", "steps": 1}]
    one = small_config(tmp_path, stages=stages)
    train(str(one), str(tmp_path / "one"), quiet=True)
    two = tmp_path / "pp"
    two.mkdir()
    small_config(two, stages=stages, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"pipeline": 2}})
    out = train_under_torchrun(2, two / "train.yaml", two / "run", "--verbose")      # every rank's lines
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows, reference = read_steps(two / "run" / "train.h5"), read_steps(tmp_path / "one" / "train.h5")
    assert [r["stage"] for r in rows] == [r["stage"] for r in reference] == ["warmup_sft", "warmup_sft", "ppo"]
    for row, ref in zip(rows, reference):
        assert row.keys() == ref.keys()
        assert all(math.isfinite(row[k]) == math.isfinite(ref[k]) for k in ref if isinstance(ref[k], float)), (row, ref)
    assert rows[-1]["samples"] == reference[-1]["samples"] == 2 and rows[-1]["optimizer_steps"] == 1
    assert rows[-1]["value_loss"] > 0 and rows[-1]["update_tokens"] > 0
    trajectories = read_trajectories(two / "run" / "train.h5", step=3)
    assert len(trajectories) == 2 and all(t["record"]["task_id"] == "level1/04_max_dim" for t in trajectories)
    meta = json.loads((two / "run" / "checkpoints" / "policy" / "iter_0000003" / "hpc_policy.json").read_text())
    assert meta["pipeline_parallel"] == 2, meta
    assert out.stderr.count("stage ppo: ppo") == 2      # both stages' ranks train it


def test_a_tensor_x_pipeline_parallel_run_resumes_with_the_same_next_step(tmp_path):
    """Four trainer processes as one pipeline of two stages, each stage tensor-parallel over two
    (torchrun): SFT then PPO, checkpointed every 2 steps. The same run rolled back to its step-2
    checkpoint (as if stopped before step 4's) and resumed computes steps 3-5 as the whole run did."""
    import json

    from hpc.results.training import read_steps

    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512,
                                            "parallel": {"pipeline": 2, "tensor": 2}})
    out = train_under_torchrun(4, config, tmp_path / "whole", timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    whole = read_steps(tmp_path / "whole" / "train.h5")
    assert [r["stage"] for r in whole] == ["warmup_sft"] * 4 + ["ppo"]
    meta = json.loads((tmp_path / "whole" / "checkpoints" / "policy" / "iter_0000005" / "hpc_policy.json").read_text())
    assert (meta["tensor_parallel"], meta["pipeline_parallel"]) == (2, 2), meta

    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    for model in ("policy", "critic"):
        for later in (4, 5):
            shutil.rmtree(cut / "checkpoints" / model / f"iter_{later:07d}")
        (cut / "checkpoints" / model / "latest").write_text("2")
    for later in (4, 5):   # the trainer state that publishes a step goes with it
        (cut / "checkpoints" / f"trainer.json.{later}").unlink()
    out = train_under_torchrun(4, config, cut, "--verbose", timeout=1200)      # every rank's lines
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stderr.count("resumed at step 2") == 4, out.stderr[-3000:]
    resumed = read_steps(cut / "train.h5")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(whole[:4], resumed[:4]):
        assert b["sft_loss"] == pytest.approx(a["sft_loss"], rel=1e-5), (a, b)
    assert whole[2]["sft_loss"] != pytest.approx(whole[1]["sft_loss"], rel=1e-3)   # the steps differ
    assert resumed[4]["stage"] == "ppo" and resumed[4]["samples"] == whole[4]["samples"] == 2
    assert resumed[4]["optimizer_steps"] == 1 and resumed[4]["update_tokens"] > 0


def test_data_parallel_pipelines_split_the_episodes(tmp_path):
    """Four trainer processes as two data-parallel replicas of a two-stage pipeline (torchrun):
    each replica plays its share of the step's tasks, and the step reports all of them."""
    from hpc.results.training import read_steps, read_trajectories

    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"pipeline": 2}},
                          stages=[{"name": "warmup_sft", "kind": "sft", "steps": 1, "batch_size": 2},
                                  {"name": "ppo", "kind": "ppo", "steps": 1}])
    data = yaml.safe_load(config.read_text())
    data.update(only=["level1/04_max_dim", "level1/05_softmax"])
    data["rollout"]["tasks_per_step"] = 2
    config.write_text(yaml.safe_dump(data))
    out = train_under_torchrun(4, config, tmp_path / "run", timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "ppo"]
    assert steps[-1]["samples"] == 4 and steps[-1]["optimizer_steps"] == 1
    trajectories = read_trajectories(tmp_path / "run" / "train.h5", step=2)
    assert sorted(t["record"]["task_id"] for t in trajectories) == ["level1/04_max_dim"] * 2 + ["level1/05_softmax"] * 2


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_pipeline_parallel_training_with_the_reward_pool_under_mpirun(tmp_path):
    """Two trainer ranks as the two stages of one pipeline, each with its worker rank: each stage's
    rank plays its share of the PPO step's episodes and its own pool scores them."""
    from hpc.results.training import read_steps, read_trajectories

    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"pipeline": 2}},
                          stages=[{"name": "warmup_sft", "kind": "sft", "steps": 1, "batch_size": 2},
                                  {"name": "ppo", "kind": "ppo", "steps": 1}])
    out = train_under_mpirun(4, config, tmp_path / "run", "--trainers", "2", "--verbose")     # every rank's lines
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "ppo"] and steps[-1]["samples"] == 2
    assert len(read_trajectories(tmp_path / "run" / "train.h5", step=2)) == 2
    for rank in (0, 1):
        assert f"reward pool of trainer rank {rank}: 1 answered by 1 worker rank(s)" in out.stderr, out.stderr

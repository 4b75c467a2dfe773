"""The trainer end to end on the CPU: the recipe's config, the embedded default learning, resume
giving the same next step, and the two launch modes (MPI reward pool, submitit)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc.errors import UserError
from hpc.rl.train_config import load_train_config, train_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "train" / "default.yaml"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


def small_config(tmp_path: Path, **changes) -> Path:
    """The default's shape, cut to seconds: short SFT, one task, small groups."""
    data = yaml.safe_load(DEFAULT.read_text())
    data.update(only=["level1/04_max_dim"], checkpoint_every=2)
    data["rl"]["group_size"] = 2
    data["rollout"]["tasks_per_step"] = 1
    data["stages"] = [{"name": "warmup_sft", "kind": "sft", "steps": 4, "lr": 3e-3, "batch_size": 2},
                      {"name": "ppo", "kind": "ppo", "steps": 1}]
    data.update(changes)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(args: list[str], timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _train_under_mpirun(ranks: int, config: Path, out: Path, *flags: str,
                        timeout: float = 900) -> subprocess.CompletedProcess:
    """`jobs/train.py --pool` on `ranks` MPI ranks, oversubscribed and unbound (2 cores here)."""
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    return _run(["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "mpi4py",
                 "jobs/train.py", "--config", str(config), "--out", str(out), "--pool", *flags], timeout=timeout, env=env)


def _train_under_torchrun(procs: int, config: Path, out: Path, *flags: str,
                          timeout: float = 900) -> subprocess.CompletedProcess:
    """`jobs/train.py` as `procs` trainer processes started by torchrun, each with its own evaluator."""
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                 "jobs/train.py", "--config", str(config), "--out", str(out), *flags], timeout=timeout)


@pytest.mark.parametrize("change, message", [
    ({"stages": [{"kind": "tune", "steps": 1}]}, "config stages[0].kind: expected one of"),
    ({"stages": [{"kind": "value", "steps": 1}]}, "config stages[0]: value on rft data needs an rft stage"),
    ({"stages": [{"kind": "sft", "steps": 0}]}, "config stages[0].steps: must be >= 1"),
    ({"stages": []}, "config stages: the recipe has no stage"),
    ({"rollout": {"concurency": 2}}, "rollout.concurency"),
    ({"tokenizer": "bpe:12"}, "config tokenizer: bpe:N needs a vocabulary size"),
    ({"agent": {"max_context_tokens": 4096, "max_response_tokens": 256}}, "exceeds policy.max_seq_len"),
    ({"policy": {"preset": "tiny", "parallel": {"microbatches": -1}}}, "config policy.parallel.microbatches"),
    ({"rl": {"ppo_epochs": 0}}, "config rl.ppo_epochs: must be an integer >= 1, got 0"),
    ({"rl": {"minibatches": 2.5}}, "config rl.minibatches: expected int, got float 2.5"),
    ({"rl": {"minibatches": 32}}, "config rl.minibatches: 32 minibatches, but stages[2] samples 16 episodes"),
])
def test_bad_configs_name_the_key(change, message):
    data = yaml.safe_load(DEFAULT.read_text())
    data.update(change)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        train_config(data)


def test_the_shipped_recipes_load():
    for path in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        cfg = load_train_config(path)
        assert cfg.total_steps > 0, path


def test_a_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [{kind: tune}]\n")
    out = _run([sys.executable, "jobs/train.py", "--config", str(bad), "--out", str(tmp_path / "run")], timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: config stages[0].kind: expected one of sft, ppo, rft, value, "
                                               "measure, got 'tune'"]


def test_the_old_name_of_the_eval_sections_rules_is_one_line_and_exit_2(tmp_path):
    """The training config's `policy:` is the LLM; `eval.policy` is the evaluator's rules' old name."""
    data = yaml.safe_load(DEFAULT.read_text())
    data["eval"] = {**data.get("eval", {}), "policy": {"libraries": ["cublas"]}}
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data))
    out = _run([sys.executable, "jobs/train.py", "--config", str(old), "--out", str(tmp_path / "run")], timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: config eval.policy: renamed to rules (the candidate's op and "
                                               "library rules)"]
    assert not (tmp_path / "run").exists()


def test_a_pipeline_in_one_process_is_an_error_naming_the_key_and_exit_2(tmp_path):
    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"pipeline": 2}})
    out = _run([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")], timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: config policy.parallel: tensor 1 x pipeline 2 does not divide the 1 trainer process(es) started"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr      # before any library's import warnings


def test_a_config_with_more_minibatches_than_a_rank_has_episodes_is_an_error_and_exit_2(tmp_path):
    """Two tasks per step of groups of 2 split into 3 minibatches on paper, but `only` selects one
    task: the trainer says so before training (not at its first RL step)."""
    config = small_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["rl"]["minibatches"] = 3
    data["rollout"]["tasks_per_step"] = 2
    config.write_text(yaml.safe_dump(data))
    out = _run([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")], timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]      # before it, only megatron's import warnings
    assert out.stderr.strip().splitlines()[-1] == ("error: config rl.minibatches: 3 minibatches, but stage ppo gives a "
                                                   "trainer rank as few as 2 episodes per step (tasks selected: 1, "
                                                   "trainer ranks: 1)")


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "run")], "missing.yaml"),
             (["--config", str(DEFAULT), "--out", str(tmp_path / "file")], "exists and is not a folder"),
             (["--out", str(tmp_path / "run")], "the following arguments are required: --config")]
    for args, message in cases:
        out = _run([sys.executable, "jobs/train.py", *args], timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_embedded_default_raises_the_mean_reward(tmp_path):
    """README command 1: SFT warm-up, then PPO against the real CPU evaluator. RL, not chance,
    raised the pass rate: over the PPO stage's last quarter of steps it is above its first
    quarter's with a two-proportion z of at least 3 (128 on-policy samples each), and the reward
    after training is above the reward before (same tasks, as many samples). Measured
    (docs/benchmarks.md): z 8.85-11.28 over seeds 0-4; with RL switched off
    (`benchmarks/default_learning.py --control`, PPO learning rate 1e-30) z was 0.66, -1.25 and
    -0.75 on seeds 0-2 while two of their rewards rose by chance (+0.125): the assertion on z
    fails for all three."""
    from hpc.analysis.metrics import pass_rate_trend
    from hpc.results.training import read_steps, read_trajectories

    out = _run([sys.executable, "jobs/train.py", "--config", str(DEFAULT), "--out", str(tmp_path / "run")],
               timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_steps(tmp_path / "run" / "train.h5")
    first, last, z = pass_rate_trend([r for r in rows if r["stage"] == "ppo"])
    assert z >= 3.0, (first, last, z)
    steps = {r["stage"]: r for r in rows if r["stage"].startswith("measure")}
    before, after = steps["measure_before"], steps["measure_after"]
    assert after["reward_mean"] > before["reward_mean"] and after["pass_rate"] > before["pass_rate"], (before, after)
    assert "measure_after: mean reward" in out.stdout
    trajectories = read_trajectories(tmp_path / "run" / "train.h5", step=after["step"])
    assert len(trajectories) == after["samples"]
    assert (tmp_path / "run" / "report" / "report.md").exists()


def test_resume_continues_with_the_same_next_step(tmp_path):
    """A run stopped after its checkpoint at step 2 and resumed computes steps 3-5 exactly as
    an uninterrupted run does, and its results file has each step once."""
    from jobs.train import train
    from hpc.results.training import read_steps

    config = small_config(tmp_path)
    train(str(config), str(tmp_path / "whole"), quiet=True)
    whole = read_steps(tmp_path / "whole" / "train.h5")

    class Stop(Exception):
        pass

    from hpc.agent.backend import CachedBackend, LocalBackend
    from hpc.results.training import TrainingWriter
    from hpc.rl.trainer import Trainer

    cfg = load_train_config(config)
    trainer = Trainer(cfg, tmp_path / "cut", CachedBackend(LocalBackend(cfg.eval)))
    with TrainingWriter(tmp_path / "cut" / "train.h5") as writer:
        def stop_after_three(metrics, samples):
            writer.append_step(metrics)
            if metrics["step"] == 3:   # checkpointed at 2: step 3 is lost with the "preemption"
                raise Stop

        with pytest.raises(Stop):
            trainer.run(stop_after_three)
    # a save of step 4 killed after the policy's part: the policy's `latest` names a step whose
    # critic and trainer state were never written, and the resume must not take it
    policy = tmp_path / "cut" / "checkpoints" / "policy"
    (policy / "iter_0000004").mkdir()
    (policy / "latest").write_text("4\n")
    train(str(config), str(tmp_path / "cut"), quiet=True)
    resumed = read_steps(tmp_path / "cut" / "train.h5")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(whole[:4], resumed[:4]):
        assert a["sft_loss"] == pytest.approx(b["sft_loss"], rel=1e-5), (a, b)
    assert resumed[4]["stage"] == "ppo" and resumed[4]["samples"] == 2


KILL_SWEEP = """
import os, sys
from pathlib import Path


def main():
    root, config, at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    import megatron.core, torch   # imported once, before the forks
    from jobs.train import train
    for n in map(int, sys.argv[4:]):
        pid = os.fork()
        if pid == 0:
            for _ in range(at - n):   # strace counts each process's renames from 1: these shift its n-th to `at`
                try:
                    os.rename("/nonexistent/a", "/nonexistent/b")
                except OSError:
                    pass
            try:
                train(config, str(root / f"k{n}"), quiet=True)
            except BaseException as e:
                print(f"k{n}: {type(e).__name__}: {e}", file=sys.stderr)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"k{n} {status}", flush=True)


if __name__ == "__main__":   # megatron's checkpoint writer spawns a process that imports this file
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/system-deps.sh installs it)")
def test_a_kill_at_any_step_of_a_save_resumes_from_a_complete_checkpoint(tmp_path):
    """Two SFT steps, a checkpoint after each. The trainer is SIGKILLed at each rename of the second
    save in turn (strace's fault injection, before the call: every state the checkpoint folders
    pass through, from the policy's staging folder to the trainer state that publishes the step),
    then run again on the same folder: it resumes from a complete checkpoint, never a partial one,
    and ends with the rows of an uninterrupted run, each step once."""
    from hpc.results.training import read_steps

    config = small_config(tmp_path, checkpoint_every=1)
    data = yaml.safe_load(config.read_text())
    data["stages"] = data["stages"][:1]
    data["stages"][0]["steps"] = 2
    config.write_text(yaml.safe_dump(data))
    script = tmp_path / "sweep.py"
    script.write_text(KILL_SWEEP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def sweep(at: int, points: list[int], *strace: str) -> str:
        proc = subprocess.run(["strace", "-f", "-qq", *strace, sys.executable, "-W", "ignore", str(script),
                               str(tmp_path), str(config), str(at), *map(str, points)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    big = 10_000   # beyond every rename of a run: the reference run is never killed
    sweep(big, [big], "-o", str(tmp_path / "trace"), "-e", "trace=rename")
    whole = read_steps(tmp_path / f"k{big}" / "train.h5")
    assert [r["step"] for r in whole] == [1, 2]
    trace = (tmp_path / "trace").read_text().splitlines()
    main = next(line.split()[0] for line in trace if "trainer.json.2" in line)   # the trainer's pid
    renames = [line for line in trace if line.startswith(main + " ") and "rename(" in line]
    names = [line.split('"')[1] for line in renames]
    first = next(k for k, name in enumerate(names) if "trainer.json.1" in name) + 1
    last = next(k for k, name in enumerate(names) if "trainer.json.2" in name) + 1
    points = list(range(first + 1, last + 1))   # every rename of the second save (1-based, as strace counts)
    assert any("policy/iter_0000002.partial" in names[k - 1] for k in points), names
    killed = sweep(big, points, "-o", os.devnull, "-e", "trace=rename", "-e", f"inject=rename:signal=KILL:when={big}")
    for n in points:
        assert f"k{n} 9" in killed, (n, killed)   # SIGKILLed at its n-th rename
        done = tmp_path / f"k{n}" / "checkpoints"
        assert not (done / "trainer.json.2").exists(), n
    resumed = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path), str(config), "0",
                              *map(str, points)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    for n in points:   # each killed run, run again on its folder (no strace: at 0 shifts nothing)
        assert f"k{n} 0" in resumed.stdout, (n, resumed.stdout, resumed.stderr[-3000:])
        rows = read_steps(tmp_path / f"k{n}" / "train.h5")
        assert [r["step"] for r in rows] == [1, 2], n
        for a, b in zip(whole, rows):
            assert a["sft_loss"] == pytest.approx(b["sft_loss"], rel=1e-5), (n, a, b)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_error_line_and_the_run_resumes_with_room(tmp_path):
    """megatron's writer reports a full disk from its worker processes, wrapped (or as torch's
    "unexpected pos"): the trainer says it in one line, exit 2, leaves no staging folder behind,
    and the same command resumes once there is room."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        config = small_config(tmp_path, checkpoint_every=1)
        data = yaml.safe_load(config.read_text())
        data["stages"] = [{"name": "warmup_sft", "kind": "sft", "steps": 2, "lr": 3e-3, "batch_size": 2}]
        config.write_text(yaml.safe_dump(data))
        command = [sys.executable, "jobs/train.py", "--config", str(config), "--out", str(disk / "run"), "-q"]
        full = _run(command)
        lines = full.stderr.strip().splitlines()
        assert full.returncode == 2 and len(lines) == 1, full.stderr[-3000:]
        assert lines[0].startswith("error: checkpoint ") and "no space left on device" in lines[0], lines
        assert not list((disk / "run" / "checkpoints").rglob("*.partial")), "a staging folder was left behind"
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = _run(command)
        assert again.returncode == 0, again.stderr[-3000:]
        from hpc.results.training import read_steps

        assert [r["step"] for r in read_steps(disk / "run" / "train.h5")] == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_trainer_killed_after_a_save_leaves_no_process_behind(tmp_path):
    """megatron's checkpoint writer serves its results queue from a process spawned at the first
    save; SIGKILL of the trainer must end it (and whatever else it started) too."""
    import signal
    import time

    from hpc.pool.processes import process_with

    mark = f"HPC_TEST_MARK={tmp_path}"
    config = small_config(tmp_path, checkpoint_every=1)
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HPC_TEST_MARK": str(tmp_path)})
    saved = tmp_path / "run" / "checkpoints" / "trainer.json.1"
    deadline = time.monotonic() + 600
    while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert saved.exists() and proc.poll() is None, "the trainer ended or never saved"
    children = list(map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()))
    assert children, "no child process: the checkpoint writer's manager was expected"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while process_with(b"", mark) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    left = process_with(b"", mark)
    assert left is None, Path(f"/proc/{left}/cmdline").read_bytes()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()


def test_every_stage_kind_of_the_recipe_runs_in_order(tmp_path):
    """The paper's pipeline at toy scale: SFT, single-turn PPO, rejection sampling of multi-turn
    episodes, SFT on what it kept, value pretraining, multi-turn PPO (each PPO step 2 epochs of 2
    minibatches); each stage's metrics land, with the optimizer steps it took."""
    from jobs.train import train
    from hpc.results.training import read_steps, read_trajectories

    stages = [{"name": "warmup_sft", "kind": "sft", "steps": 80, "lr": 3e-3, "batch_size": 2},
              {"name": "ppo_single", "kind": "ppo", "steps": 1},
              {"name": "rft_sample", "kind": "rft", "mode": "multi_turn", "steps": 1, "min_reward": -2.0},
              {"name": "rft", "kind": "sft", "data": "rft", "steps": 1, "batch_size": 2},
              {"name": "value_pretrain", "kind": "value", "steps": 1, "batch_size": 2},
              {"name": "ppo_multi", "kind": "ppo", "mode": "multi_turn", "steps": 1}]
    config = small_config(tmp_path, stages=stages)
    data = yaml.safe_load(config.read_text())
    data["agent"].update(max_turns=2, end_without_tool_call=False)
    data["rl"].update(ppo_epochs=2, minibatches=2)      # each PPO step: 2 passes over its 2 episodes, 1 a step
    config.write_text(yaml.safe_dump(data))
    summary = train(str(config), str(tmp_path / "run"), quiet=True)
    assert summary["steps"] == 85
    rows = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in rows] == ["warmup_sft"] * 80 + ["ppo_single", "rft_sample", "rft", "value_pretrain",
                                                                 "ppo_multi"]
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["rft_sample"]["samples_kept"] >= 1
    assert by_stage["rft"]["sft_loss"] > 0 and by_stage["value_pretrain"]["value_loss"] >= 0
    assert by_stage["ppo_multi"]["turns_mean"] >= 1
    assert {stage: by_stage[stage]["optimizer_steps"] for stage in by_stage} == {
        "warmup_sft": 1, "ppo_single": 4, "rft_sample": 0, "rft": 1, "value_pretrain": 1, "ppo_multi": 4}
    assert all(by_stage[stage]["update_tokens"] > 0 for stage in ("warmup_sft", "ppo_single", "rft", "ppo_multi"))
    assert math.isnan(by_stage["rft_sample"]["update_tokens"]) and math.isnan(by_stage["value_pretrain"]["update_tokens"])
    multi = read_trajectories(tmp_path / "run" / "train.h5", step=85)
    assert len(multi) == 2 and all(t["mode"] == "multi_turn" for t in multi)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_training_with_the_reward_pool_under_mpirun(tmp_path):
    """Rank 0 trains, ranks 1-2 score its episodes: every sample's reward comes from a worker."""
    from hpc.results.training import read_steps, read_trajectories

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                            {"name": "measure", "kind": "measure", "steps": 1}])
    out = _train_under_mpirun(3, config, tmp_path / "run")
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
    out = _train_under_mpirun(3, config, tmp_path / "run", "--trainers", "2", timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "warmup_sft", "ppo"]
    assert steps[-1]["optimizer_steps"] == 1 and steps[-1]["samples"] == 2 and steps[-1]["update_tokens"] > 0
    trajectories = read_trajectories(tmp_path / "run" / "train.h5", step=3)
    assert len(trajectories) == 2 and all(t["record"]["task_id"] == "level1/04_max_dim" for t in trajectories)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "policy" / "iter_0000003" / "hpc_policy.json").read_text())
    assert meta["tensor_parallel"] == 2 and meta["optimizer"], meta
    assert out.stdout.count("trained 3 steps") == 2      # both trainer ranks finish
    bad = _train_under_mpirun(3, config, tmp_path / "bad", "--trainers", "3", timeout=300)
    assert bad.returncode != 0 and "error: --trainers 3: must be a positive multiple of policy.parallel.tensor 2" \
        in bad.stderr, bad.stderr[-2000:]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_a_reward_rank_killed_during_training_loses_no_sample_and_the_job_ends(tmp_path):
    """benchmarks/full_scale.py's fault drill at CPU scale: a TP=2 group of trainers and two
    workers; the last worker is SIGKILLed in the PPO stage. The step completes with every sample
    scored, the loss is reported, and the job ends (no rank left waiting in MPI_Finalize, no
    child process holding mpirun's output open)."""
    import json

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                            {"name": "ppo", "kind": "ppo", "steps": 1}])
    out = _run([sys.executable, "benchmarks/full_scale.py", "--config", str(config), "--tensor", "2", "--out",
                str(tmp_path / "fs"), "--ranks", "4", "--trainers", "2", "--scaling", "1", "--kill-after", "0.5"],
               timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    figures = json.loads((tmp_path / "fs" / "full_scale.json").read_text())
    main, scaling = figures["runs"]["main"], figures["runs"]["scaling-1"]
    assert main["killed"]["rank"] == 3 and main["lost"] and "worker rank 3" in main["lost"][0], main
    assert [s["scored"] for s in main["steps"]] == [s["samples"] for s in main["steps"]] == [2]
    assert main["pools"][0]["workers"] == 2 and scaling["pools"][0]["workers"] == 1
    assert figures["params"] > 0 and main["steps"][0]["update_tokens_per_s"] > 0


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
    out = _train_under_torchrun(2, two / "train.yaml", two / "run", "--verbose")      # every rank's lines
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
    out = _train_under_torchrun(4, config, tmp_path / "whole", timeout=1200)
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
    out = _train_under_torchrun(4, config, cut, "--verbose", timeout=1200)      # every rank's lines
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
    out = _train_under_torchrun(4, config, tmp_path / "run", timeout=1200)
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
    out = _train_under_mpirun(4, config, tmp_path / "run", "--trainers", "2", "--verbose")     # every rank's lines
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = read_steps(tmp_path / "run" / "train.h5")
    assert [r["stage"] for r in steps] == ["warmup_sft", "ppo"] and steps[-1]["samples"] == 2
    assert len(read_trajectories(tmp_path / "run" / "train.h5", step=2)) == 2
    for rank in (0, 1):
        assert f"reward pool of trainer rank {rank}: 1 answered by 1 worker rank(s)" in out.stderr, out.stderr


def test_submitit_runs_the_job_and_resumes_the_run(tmp_path):
    """--submit (local executor without Slurm) runs the Checkpointable job; submitting the same
    run again resumes it from its last checkpoint and trains nothing twice."""
    from hpc.results.training import read_steps

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2}])
    args = [sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run"), "--submit",
            "--executor", "local"]
    first = _run(args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "trained 2 steps" in first.stdout
    again = _run(args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_steps(tmp_path / "run" / "train.h5")] == [1, 2]

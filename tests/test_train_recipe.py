"""One trainer process end to end on the CPU: every stage kind of the recipe in order, resume
giving the same next step, and the submitit job resuming its run."""

from __future__ import annotations

import math
import sys

import pytest
import yaml

from hpc.rl.train_config import load_train_config
from tests.train_support import LIBRARY_WARNINGS, run_command, small_config

pytestmark = LIBRARY_WARNINGS


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


def test_submitit_runs_the_job_and_resumes_the_run(tmp_path):
    """--submit (local executor without Slurm) runs the Checkpointable job; submitting the same
    run again resumes it from its last checkpoint and trains nothing twice."""
    from hpc.results.training import read_steps

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2}])
    args = [sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run"), "--submit",
            "--executor", "local"]
    first = run_command(args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "trained 2 steps" in first.stdout
    again = run_command(args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_steps(tmp_path / "run" / "train.h5")] == [1, 2]

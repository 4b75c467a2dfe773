"""jobs/evaluate.py --policy: a tiny trained checkpoint played as an agent over a task by a local
submitit array, scored by the real CPU evaluator; each sample's record and trajectory once in the
merged file, nothing redone on a second run, checkpoints side by side in the analysis."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.results.hdf5 import file_attrs, read_records
from hpc.results.training import read_trajectories
from tests.conftest import ROOT, plumbing_config
from tests.train_support import small_config

TASK = "level1/04_max_dim"
SAMPLES = 3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


def _run(args: list[str], cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HPC_CACHE_DIR": str(cache_dir)})


def _evaluate(policy: Path, out: Path, cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    config = plumbing_config(out.parent)
    return _run(["jobs/evaluate.py", "kernels/tasks", "--policy", str(policy), "--out", str(out), "--only", TASK,
                 "--backend", "cpu", "--iterations", "10", "--config", str(config), "--max-turns", "2",
                 "--max-response-tokens", "64", "--progress-every", "5", *args], cache_dir)


def _sample_path(run: Path, step: int, k: int) -> str:
    return f"policy:{run / 'checkpoints' / 'policy' / f'iter_{step:07d}'}#{TASK}/{k:04d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir) -> Path:
    """A training run folder: a tiny policy after two SFT steps, checkpointed after each."""
    root = tmp_path_factory.mktemp("trained")
    config = small_config(root, checkpoint_every=1,
                          stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "lr": 3e-3, "batch_size": 2}])
    out = _run(["jobs/train.py", "--config", str(config), "--out", str(root / "run"), "--quiet"], cache_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory, cache_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """The run's latest checkpoint (step 2), SAMPLES episodes of one task over a local array of 2 shards."""
    out = tmp_path_factory.mktemp("evaluated") / "ev"
    proc = _evaluate(trained, out, cache_dir, "--samples", str(SAMPLES), "--shards", "2", "--executor", "local")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc


def test_every_sample_has_its_record_and_trajectory_in_the_results(trained, evaluated):
    out, proc = evaluated
    records = read_records(out / "results.h5")
    # every sample once, though the untrained policy's samples may end with the same code
    assert sorted(r.candidate_path for r in records) == [_sample_path(trained, 2, k) for k in range(SAMPLES)]
    assert all(r.task_id == TASK and r.status in ("ok", "failed") and r.reward == r.reward for r in records)
    trajectories = read_trajectories(out / "results.h5")
    assert sorted(t["sample"] for t in trajectories) == list(range(SAMPLES))
    by_path = {r.candidate_path: r for r in records}
    for t in trajectories:
        assert t["step"] == 2 and t["stage"] == "evaluate" and t["mode"] == "multi_turn"
        assert t["state_selection"] == "best" and 1 <= len(t["turns"]) <= 2 and t["messages"]
        rec = by_path[t["record"]["candidate_path"]]
        assert t["reward"] == rec.reward and t["record"]["timestamp"] == rec.timestamp
    # shard s holds samples s, s + 2, ...: 2 and 1
    assert [len(read_records(out / f"shard-000{s}.h5")) for s in (0, 1)] == [2, 1]
    assert [len(read_trajectories(out / f"shard-000{s}.h5")) for s in (0, 1)] == [2, 1]
    attrs = file_attrs(out / "results.h5")
    assert attrs["model"] == "run@2" and attrs["checkpoint_step"] == "2"
    assert attrs["checkpoint"] == str(trained / "checkpoints" / "policy" / "iter_0000002")
    assert json.loads(attrs["agent"])["max_turns"] == 2 and json.loads(attrs["sampling"])["samples"] == SAMPLES
    assert proc.stdout.count(TASK) == SAMPLES and f"{SAMPLES} records in" in proc.stderr


def test_a_second_run_evaluates_nothing_new(trained, evaluated, cache_dir):
    out, _ = evaluated
    again = _evaluate(trained, out, cache_dir, "--samples", str(SAMPLES), "--shards", "2", "--executor", "local")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "shard 0 done (0 evaluated, 2 already recorded)" in again.stderr, again.stderr[-3000:]
    assert "shard 1 done (0 evaluated, 1 already recorded)" in again.stderr, again.stderr[-3000:]
    assert [len(read_records(out / f"shard-000{s}.h5")) for s in (0, 1)] == [2, 1]
    assert len(read_records(out / "results.h5")) == len(read_trajectories(out / "results.h5")) == SAMPLES


def test_a_sample_two_shards_recorded_is_merged_once(trained, evaluated, cache_dir, tmp_path):
    """Re-sharded (3 shards), sample 2 falls to shard 2, whose file lacks it: played again there.
    The merge keeps one record of it, the later, and the trajectory of that record."""
    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    proc = _evaluate(trained, out, cache_dir, "--samples", str(SAMPLES), "--shards", "3", "--shard", "2")
    assert proc.returncode == 0 and "1 evaluated, 0 already recorded" in proc.stderr, proc.stderr[-3000:]
    (again,) = read_records(out / "shard-0002.h5")
    report = _run(["jobs/analyze.py", str(out), "--out", str(tmp_path / "report")], cache_dir)
    assert report.returncode == 0, report.stderr[-3000:]
    records = read_records(out / "results.h5")
    assert sorted(r.candidate_path for r in records) == [_sample_path(trained, 2, k) for k in range(SAMPLES)]
    assert next(r for r in records if r.candidate_path == again.candidate_path).timestamp == again.timestamp
    trajectories = read_trajectories(out / "results.h5")
    assert sorted(t["sample"] for t in trajectories) == list(range(SAMPLES))
    assert next(t for t in trajectories if t["sample"] == 2)["record"]["timestamp"] == again.timestamp


def test_two_checkpoints_are_reported_side_by_side(trained, evaluated, cache_dir, tmp_path):
    first = tmp_path / "ev1"
    proc = _evaluate(trained / "checkpoints" / "policy" / "iter_0000001", first, cache_dir, "--shard", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r.candidate_path for r in read_records(first / "shard-0000.h5")] == [_sample_path(trained, 1, 0)]
    report = _run(["jobs/analyze.py", str(first), str(evaluated[0]), "--out", str(tmp_path / "report")], cache_dir)
    assert report.returncode == 0, report.stderr[-3000:]
    runs = json.loads((tmp_path / "report" / "summary.json").read_text())["runs"]
    assert [(r["label"], r["overall"]["samples"]) for r in runs] == [("run@1", 1), ("run@2", SAMPLES)]
    assert "run@1" in (tmp_path / "report" / "report.md").read_text()


def test_bad_arguments_are_one_line_and_exit_2(trained, evaluated, tmp_path, capsys):
    from jobs.evaluate import main

    out = str(tmp_path / "out")
    tasks, solutions = str(ROOT / "kernels" / "tasks"), str(ROOT / "kernels" / "solutions")
    (tmp_path / "empty").mkdir()
    one_of = "give exactly one of CANDIDATES and --policy"
    cases = [
        ([tasks, solutions, "--policy", str(trained)], one_of),
        ([tasks], one_of),
        ([tasks, solutions, "--samples", "2"], "--samples: only with --policy"),
        ([tasks, "--policy", str(tmp_path / "missing")], "missing: no such folder"),
        ([tasks, "--policy", str(tmp_path / "empty")], "no policy checkpoint there"),
        ([tasks, "--policy", str(trained / "checkpoints" / "policy" / "iter_0000009")], "no such folder"),
        ([tasks, "--policy", str(trained), "--samples", "0"], "--samples: must be >= 1"),
        ([tasks, "--policy", str(trained / "checkpoints" / "policy" / "iter_0000001"), "--only", TASK,
          "--out", str(evaluated[0])], "shard-0000.h5 holds results of"),
    ]
    for args, message in cases:
        assert main([*args, "--out", out] if "--out" not in args else args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (args, err)
    assert not Path(out).exists()

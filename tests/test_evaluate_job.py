"""jobs/evaluate.py: a submitit array on a real local Slurm, one array task requeued mid-run,
every record in the merged HDF5 exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

from hpc.results.hdf5 import read_records
from hpc.results.record import record_key
from tests.conftest import ROOT, plumbing_config
from tests.test_pool import _suite


def _evaluate(tmp_path, *args: str, cache_dir) -> subprocess.Popen:
    config = plumbing_config(tmp_path)
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / "evaluate.py"), *args, "--backend", "cpu",
                             "--iterations", "10", "--config", str(config), "--progress-every", "5"],
                            env={**os.environ, "HPC_CACHE_DIR": str(cache_dir)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_array_task_requeued_mid_run_leaves_every_record_once(slurm, tmp_path, cache_dir):
    tasks, solutions = _suite(tmp_path, 6)
    run = tmp_path / "run"
    proc = _evaluate(tmp_path, str(tasks), str(solutions), "--out", str(run), "--shards", "2", "--executor", "slurm",
                     cache_dir=cache_dir)
    shard0 = run / "shard-0000.h5"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (shard0.exists() and read_records(shard0)):
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)
    array = next(p.name.split("_")[0] for p in (run / "submitit").glob("*_0_log.out"))
    subprocess.run(["scontrol", "requeue", f"{array}_0"], check=True, capture_output=True, timeout=30)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log

    states = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", f"{array}_0", "-o", "State"],
                            capture_output=True, text=True, timeout=30).stdout.split()
    assert "REQUEUED" in states, states
    for shard in run.glob("shard-*.h5"):
        counts = Counter(record_key(r) for r in read_records(shard))
        assert max(counts.values()) == 1, counts          # the requeued task did not redo finished work
    merged = read_records(run / "results.h5")
    assert sorted(r.task_id for r in merged) == [f"level1/relu_{k}" for k in range(6)], log
    assert all(r.status == "ok" and r.correct for r in merged), [r.reason for r in merged]


def test_a_second_submission_evaluates_only_what_is_missing(tmp_path, cache_dir):
    tasks, solutions = _suite(tmp_path, 2)
    run = tmp_path / "run"
    first = _evaluate(tmp_path, str(tasks), str(solutions), "--out", str(run), "--executor", "local",
                      cache_dir=cache_dir)
    log, _ = first.communicate(timeout=900)
    assert first.returncode == 0, log
    again = _evaluate(tmp_path, str(tasks), str(solutions), "--out", str(run), "--executor", "local",
                      cache_dir=cache_dir)
    log, _ = again.communicate(timeout=900)
    assert again.returncode == 0 and "0 evaluated, 2 already recorded" in log, log
    assert len(read_records(run / "results.h5")) == 2


def test_bad_arguments_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), str(tmp_path), str(tmp_path),
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: tasks {tmp_path}: no problem files (*.py) found"]


def test_a_damaged_shard_file_is_one_error_line_and_exit_2(tmp_path):
    """A shard file damaged past its journal (no journal at all): its array task fails naming it,
    and the merge after the array says so in one line, exit 2 (it was a traceback)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "shard-0000.h5").write_bytes(b"\x89not hdf5" * 300)
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), str(ROOT / "kernels" / "tasks"),
                           str(ROOT / "kernels" / "solutions"), "--only", "level1/01", "--out", str(run),
                           "--executor", "local", "--shards", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [f"error: results {run / 'shard-0000.h5'}: cannot read as HDF5 (Unable to synchronously open "
                      "file (file signature not found))"], proc.stderr
    assert "array task" in proc.stderr and "damaged, and no journal to rebuild it from" in proc.stderr, proc.stderr

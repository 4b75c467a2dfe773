"""The reward pool over real Open MPI (mpirun + mpi4py): every request answered once, resumable,
and a worker rank killed mid-batch loses no finished result and no request."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.pool.processes import process_with
from hpc.results.hdf5 import read_records, repair
from tests.conftest import RELU_TASK, ROOT, TESTS, plumbing_config

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (scripts/test.sh installs it)")


def _suite(root: Path, n: int) -> tuple[Path, Path]:
    tasks, solutions = root / "tasks" / "level1", root / "solutions" / "level1"
    tasks.mkdir(parents=True)
    for k in range(n):
        (tasks / f"relu_{k}.py").write_text(RELU_TASK.read_text())
        shutil.copytree(TESTS / "fixtures" / "honest_relu", solutions / f"relu_{k}")
    return tasks.parent, solutions.parent


def _pool(ranks: int, tasks: Path, solutions: Path, out: Path, cache: Path, *extra: str,
          launch: tuple[str, ...] = ("--enable-recovery",), work: Path | None = None) -> subprocess.Popen:
    """The pool under mpirun; `work` (default: --out's folder) holds its config and TMPDIR."""
    work = work or out.parent
    config = plumbing_config(work)
    env = {**os.environ, "HPC_CACHE_DIR": str(cache), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "TMPDIR": str(work)}
    cmd = ["mpirun", "-n", str(ranks), *launch, sys.executable, "-m", "mpi4py", "-m", "hpc.pool",
           str(tasks), str(solutions), "--out", str(out), "--backend", "cpu", "--iterations", "10",
           "--config", str(config), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return out


def _kill_rank_once_streaming(proc: subprocess.Popen, out: Path, tmp_path: Path, rank: int) -> None:
    """SIGKILL MPI rank `rank` of the pool `proc` once its first result is in `out`."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and read_records(out):
            break
        time.sleep(0.5)
    victim = process_with(b"hpc.pool", f"OMPI_COMM_WORLD_RANK={rank}", f"TMPDIR={tmp_path}")
    assert victim is not None and proc.poll() is None, f"pool finished before rank {rank} could be killed"
    os.kill(victim, signal.SIGKILL)


def test_pool_answers_every_request_once_and_a_rerun_skips_finished_ones(tmp_path, cache_dir):
    tasks, solutions = _suite(tmp_path, 4)
    out = tmp_path / "pool.h5"
    proc = _pool(3, tasks, solutions, out, cache_dir)
    log = _finish(proc)
    assert proc.returncode == 0, log
    records = read_records(out)
    assert sorted(r.task_id for r in records) == [f"level1/relu_{k}" for k in range(4)]
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    assert "(rank 1," in log and "(rank 2," in log, log   # both workers served
    busy = re.search(r"pool: 4 answered by 2 worker rank\(s\) in \d+ s \([\d.]+/min\), workers busy (\d+)%", log)
    assert busy and 0 < int(busy.group(1)) <= 100, log

    status = tmp_path / "status.json"
    again = _pool(3, tasks, solutions, out, cache_dir, "--status-file", str(status))
    log = _finish(again)
    assert again.returncode == 0 and "0 to evaluate, 4 already recorded" in log, log
    assert len(read_records(out)) == 4
    assert json.loads(status.read_text()) == {"items": 4, "finished": 4, "unfinished": 0, "error": None}


def test_one_worker_rank_runs_evaluations_concurrently(tmp_path, cache_dir):
    """--concurrency 2: one rank answers every request once, and its evaluations overlap in time."""
    tasks, solutions = _suite(tmp_path, 4)
    out = tmp_path / "pool.h5"
    proc = _pool(2, tasks, solutions, out, cache_dir, "--concurrency", "2")
    log = _finish(proc)
    assert proc.returncode == 0, log
    records = sorted(read_records(out), key=lambda r: r.timestamp)
    assert sorted(r.task_id for r in records) == [f"level1/relu_{k}" for k in range(4)]
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    assert any(b.timestamp < a.timestamp + a.wall_seconds for a, b in zip(records, records[1:])), [
        (r.timestamp, r.wall_seconds) for r in records]


def test_a_worker_rank_killed_mid_batch_loses_no_result(tmp_path, cache_dir):
    """1 coordinator + 3 workers; rank 2 is SIGKILLed once results are streaming."""
    tasks, solutions = _suite(tmp_path, 6)
    out = tmp_path / "pool.h5"
    proc = _pool(4, tasks, solutions, out, cache_dir, "--dead-after", "6")
    _kill_rank_once_streaming(proc, out, tmp_path, 2)
    log = _finish(proc)
    assert proc.returncode == 0, log
    assert "lost worker rank 2" in log, log
    records = read_records(out)
    assert sorted(r.task_id for r in records) == [f"level1/relu_{k}" for k in range(6)], log
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]


def test_workers_leave_when_the_coordinator_is_killed(tmp_path, cache_dir):
    """Under --enable-recovery nothing else ends a worker whose coordinator died (they spun in a
    send forever): each hears nothing for --coordinator-silent seconds, says so and leaves, so
    the job ends."""
    tasks, solutions = _suite(tmp_path, 6)
    out = tmp_path / "pool.h5"
    proc = _pool(3, tasks, solutions, out, cache_dir, "--coordinator-silent", "5")
    _kill_rank_once_streaming(proc, out, tmp_path, 0)
    killed = time.monotonic()
    log = _finish(proc, timeout=120)   # its status says nothing: mpirun --enable-recovery exits 0 whatever the ranks did
    assert time.monotonic() - killed < 60, log
    for rank in (1, 2):
        assert f"[rank {rank}] error: worker rank {rank}: nothing from the coordinator (rank 0) for" in log, log
    assert process_with(b"hpc.pool", f"TMPDIR={tmp_path}") is None, "a worker rank outlived the job"


def test_a_request_of_unknown_kind_is_refused_at_submit():
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.messages import WorkItem

    with pytest.raises(ValueError, match="kind must be one of"):
        Coordinator(comm=None, workers=[]).submit(WorkItem(id="x", task="t.py", candidate="c", kind="bogus"))


def test_a_request_of_a_kind_under_its_old_name_is_refused_with_the_new_name():
    """A request's kind is the stage it stops after (compile / verify / profile, as the agent's
    tools): `evaluate` was profile's name before."""
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.messages import WorkItem

    with pytest.raises(ValueError, match=r"got 'evaluate' \('evaluate' is now 'profile'\)$"):
        Coordinator(comm=None, workers=[]).submit(WorkItem(id="x", task="t.py", candidate="c", kind="evaluate"))


def test_a_config_with_the_old_name_of_the_rules_is_one_error_line_from_every_rank(tmp_path):
    """Every rank reads the config; rank 0's line stands for all, and names the new key."""
    (tmp_path / "c.yaml").write_text("policy:\n  libraries: [cublas]\n")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    proc = subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m", "hpc.pool",
                           str(RELU_TASK.parent.parent), str(TESTS / "fixtures"), "--out", str(tmp_path / "r.h5"),
                           "--config", str(tmp_path / "c.yaml")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]   # mpirun may add its own
    assert errors == ["error: config policy: renamed to rules (the candidate's op and library rules)"], proc.stderr
    assert not (tmp_path / "r.h5").exists()

@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("bind, warned", [("core", True), ("none", False)])
def test_a_worker_rank_bound_to_one_core_says_so(tmp_path, bind, warned):
    """Open MPI binds each of 2 ranks to a core by default: the worker's compiles and evaluation
    processes would all share it, so the rank says so (issue 4's H200 pool ran 20% slower bound)."""
    tasks = tmp_path / "tasks" / "level1"
    tasks.mkdir(parents=True)
    shutil.copy(RELU_TASK, tasks / "relu.py")
    (tmp_path / "candidates").mkdir()   # nothing to evaluate: the worker starts, says what it says, stops
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run(["mpirun", "-n", "2", "--bind-to", bind, sys.executable, "-m", "mpi4py", "-m", "hpc.pool",
                           str(tasks.parent), str(tmp_path / "candidates"), "--out", str(tmp_path / "r.h5"),
                           "--backend", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("pool worker rank 1: bound to 1 of" in proc.stderr) is warned, proc.stderr
    assert [r.reason for r in read_records(tmp_path / "r.h5")] == [f"no candidate for level1/relu under "
                                                                   f"{tmp_path / 'candidates'}"]


def test_a_worker_rank_takes_the_gpus_after_the_ones_trainers_use():
    """A node's first GPUs are its trainer ranks' (`first`), a worker rank's the next ones, in
    CUDA_VISIBLE_DEVICES order: a worker never shares a trainer's GPU while GPUs remain."""
    code = ("from mpi4py import MPI; from hpc.pool.worker import pin_device; import os; "
            "print(pin_device(MPI.COMM_SELF, first=2), os.environ['CUDA_VISIBLE_DEVICES'])")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "4,5,6,7", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["6", "6"], out.stdout + out.stderr


def test_a_damaged_results_file_is_refused_in_one_line_and_every_rank_exits(tmp_path):
    """A results file cut short, with no journal to rebuild it from: rank 0 says so in one line and
    stops the worker ranks (no traceback, no MPI_ABORT), before any evaluation."""
    from hpc.results.hdf5 import ResultWriter
    from hpc.results.journal import journal_path
    from hpc.results.record import EvalRecord

    tasks, solutions = _suite(tmp_path, 1)
    out = tmp_path / "pool.h5"
    with ResultWriter(out) as w:
        for k in range(20):
            w.append(EvalRecord(task_id=f"level1/t{k}", reason="x" * 200))
    journal_path(out).unlink()
    out.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    proc = _pool(2, tasks, solutions, out, tmp_path / "cache")
    log = _finish(proc, timeout=300)
    errors = [line for line in log.splitlines() if line.startswith("error")]   # rank 0's exit code: mpirun
    assert len(errors) == 1, log                                                # --enable-recovery drops it
    assert errors[0].startswith(f"error: results {out}: damaged, and no journal to rebuild it from"), log
    assert "Traceback" not in log and "MPI_ABORT" not in log, log


def _fill(disk: Path) -> Path:
    """Fill a file system to the last byte; the file that fills it."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return ballast


def _fill_once_streaming(proc: subprocess.Popen, out: Path) -> list[str]:
    """Fill --out's disk once its first record is in; the records finished by then."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and not (out.exists() and read_records(out)):
        time.sleep(0.2)
    assert proc.poll() is None, "the pool finished before its disk could be filled"
    before = [r.task_id for r in read_records(out)]
    _fill(out.parent)
    return before


QUIET = ("-q",)   # mpirun without --enable-recovery passes rank 0's exit status on; -q: without its banner


def _one_error_line(log: str) -> str:
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), log
    assert "Traceback" not in log and "MPI_ABORT" not in log, log
    return errors[0]


@pytest.mark.slow
def test_a_read_only_out_is_one_error_line_and_exit_2_from_the_pool(tmp_path, read_only):
    tasks, solutions = _suite(tmp_path, 1)
    proc = _pool(2, tasks, solutions, read_only / "r.h5", tmp_path / "cache", "--status-file",
                 str(tmp_path / "status.json"), launch=QUIET, work=tmp_path)
    log = _finish(proc, timeout=300)
    assert proc.returncode == 2, log
    assert _one_error_line(log) == f"error: results {read_only / 'r.h5'}: cannot write (read-only file system)"
    assert json.loads((tmp_path / "status.json").read_text()) == \
        {"items": 0, "finished": 0, "unfinished": 0, "error": f"results {read_only / 'r.h5'}: cannot write "
                                                              "(read-only file system)"}


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_error_line_and_exit_2_from_the_pool_and_keeps_every_record(
        tmp_path, small_disk, cache_dir):
    tasks, solutions = _suite(tmp_path, 6)
    out = small_disk / "pool.h5"
    proc = _pool(3, tasks, solutions, out, cache_dir, launch=QUIET, work=tmp_path)
    before = _fill_once_streaming(proc, out)
    log = _finish(proc, timeout=600)
    assert proc.returncode == 2, log
    assert _one_error_line(log).startswith(f"error: results {out}: cannot write (no space left on device)"), log
    (small_disk / "ballast").unlink()
    again = _pool(3, tasks, solutions, out, cache_dir, launch=QUIET, work=tmp_path)   # the rest, once
    log = _finish(again)
    assert again.returncode == 0, log
    got = [r.task_id for r in read_records(out)]
    assert got[:len(before)] == before and sorted(got) == [f"level1/relu_{k}" for k in range(6)], log


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_error_line_and_exit_2_from_eval_suite(tmp_path, small_disk, cache_dir):
    tasks, solutions = _suite(tmp_path, 4)
    out = small_disk / "r.h5"
    env = {**os.environ, "HPC_CACHE_DIR": str(cache_dir), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "hpc.cli", "eval-suite", str(tasks), str(solutions), "--out",
                             str(out), "--backend", "cpu", "--iterations", "10", "--config",
                             str(plumbing_config(tmp_path))], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    before = _fill_once_streaming(proc, out)
    log = _finish(proc, timeout=600)
    assert proc.returncode == 2, log
    assert _one_error_line(log).startswith(f"error: results {out}: cannot write (no space left on device)"), log
    (small_disk / "ballast").unlink()
    got = [r.task_id for r in read_records(out)] if not repair(out).endswith("(no tables)") else []
    assert got[:len(before)] == before and len(set(got)) == len(got), (before, got)

"""Worker processes started ahead of their evaluation (hpc.sandbox.prestart), for real."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hpc.candidate import load_candidate
from hpc.config import SandboxConfig
from hpc.pipeline import evaluate
from hpc.profile.device_lock import DeviceLock
from hpc.sandbox import prestart
from hpc.sandbox.messages import Ok, Ready
from hpc.sandbox.prestart import PrestartedWorkers, prestarted_workers
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS

SOLUTION = TESTS / "fixtures" / "honest_relu"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:   # gone (reaped between the lookup and the read: ProcessLookupError)
        return False


def test_evaluations_in_a_block_take_prestarted_processes_and_leave_none_behind(fast_config):
    task, candidate = load_task(RELU_TASK), load_candidate(SOLUTION)
    seen: list[tuple[int, int]] = []
    real_kill = prestart.WorkerPair.kill

    def spy(pair):
        seen.append((pair.reference.proc.pid, pair.program.proc.pid))
        real_kill(pair)

    with prestarted_workers(1) as spares, pytest.MonkeyPatch.context() as mp:
        mp.setattr(prestart.WorkerPair, "kill", spy)
        records = [evaluate(task, candidate, fast_config) for _ in range(2)]
        assert spares.taken >= 2 and spares.started == 4   # candidates' pairs and baselines' pairs, 2 each
        spare_pids = [(s.pair.reference.proc.pid, s.pair.program.proc.pid) for q in spares._spares.values()
                      for s in q if s.result() is not None]
        workroots = [s.pair.workroot for q in spares._spares.values() for s in q]
    assert [r.status for r in records] == ["ok", "ok"], [r.reason for r in records]
    assert all(r.reward >= 1 for r in records)
    pids = [p for pair in seen + spare_pids for p in pair]
    # each evaluation: its candidate's pair and its baselines' pair; and a spare of each kind left
    assert len(set(pids)) == len(pids) == 12, "every evaluation had processes of its own"
    assert not any(_alive(p) for p in pids)
    assert workroots and not any(w.exists() for w in workroots)


def test_a_spare_that_died_is_replaced_by_a_fresh_pair(fast_config):
    spares = PrestartedWorkers(1)
    try:
        spares._refill(prestart._key(fast_config.sandbox, "cpu"), fast_config.sandbox, "cpu")
        dead = spares._spares[prestart._key(fast_config.sandbox, "cpu")][0].result()
        dead.program.kill()
        dead.program.proc.wait()
        pair = spares.take(fast_config.sandbox, "cpu")
        assert spares.taken == 0, "the dead spare was not handed out"
        assert pair.program.request(Ready()) == Ok()
        pair.kill()
        pair.close()
    finally:
        spares.close()


def test_a_spare_does_not_start_while_a_timed_run_holds_the_device(fast_config):
    spares = PrestartedWorkers(1)
    key = prestart._key(fast_config.sandbox, "cpu")
    try:
        with DeviceLock("cpu").exclusive():
            spares._refill(key, fast_config.sandbox, "cpu")
            time.sleep(1.5)
            assert spares._spares[key][0].pair is None, "a spare started during the timed run"
        pair = spares.take(fast_config.sandbox, "cpu")
        assert spares.taken == 1
        assert pair.reference.request(Ready()) == Ok()
        pair.kill()
        pair.close()
    finally:
        spares.close()


def test_a_program_that_must_write_outside_its_workdir_starts_its_own(fast_config, tmp_path):
    with prestarted_workers(1) as spares:
        pair = prestart.worker_pair(fast_config.sandbox, "cpu", [tmp_path])
        try:
            assert spares.taken == 0 and spares.started == 0
        finally:
            pair.kill()
            pair.close()
        pair = prestart.worker_pair(fast_config.sandbox, "cpu")
        pair.kill()
        pair.close()
        assert spares.started == 1


def test_nested_blocks_share_the_outer_spares_and_depth_zero_is_off():
    with prestarted_workers(1) as outer, prestarted_workers(3) as inner:
        assert inner is outer and outer.depth == 1
    with prestarted_workers(0) as none:
        assert none is None and prestart._active is None
    assert prestart._active is None


def test_closing_while_a_spare_starts_leaves_no_process(fast_config):
    spares = PrestartedWorkers(2)
    key = prestart._key(SandboxConfig(), "cpu")
    spares._refill(key, SandboxConfig(), "cpu")
    time.sleep(0.5)
    started = [s for s in spares._spares[key]]
    closer = threading.Thread(target=spares.close)
    closer.start()
    closer.join(60)
    assert not closer.is_alive()
    for s in started:
        if s.pair is not None:
            assert not _alive(s.pair.reference.proc.pid) and not s.pair.workroot.exists()


HARNESS_KILLED = """
import time
from hpc.config import SandboxConfig
from hpc.sandbox.prestart import start_pair
pair = start_pair(SandboxConfig(), "cpu")
print(pair.workroot, pair.reference.worker_pid, pair.program.worker_pid, flush=True)
time.sleep(600)
"""


def test_the_workroot_of_a_killed_harness_is_swept_by_the_next(tmp_path):
    """A harness SIGKILLed mid-evaluation leaves its workroot (the evaluation's copies of the task
    and candidate); the next harness to start a pair on the node removes it: its owner lock is free."""
    import signal
    import subprocess
    import sys

    from hpc.sandbox.tempdirs import OWNER_LOCK, sweep
    from tests.conftest import ROOT

    harness = subprocess.Popen([sys.executable, "-c", HARNESS_KILLED], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    workroot, *workers = harness.stdout.readline().split()
    try:
        assert (Path(workroot) / OWNER_LOCK).exists()
        assert sweep("hpc-eval-", tmp_path) == 0, "a live harness's workroot was swept"
    finally:
        harness.send_signal(signal.SIGKILL)
        harness.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(int(p)) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Path(workroot).is_dir()
    assert sweep("hpc-eval-", tmp_path) == 1 and not Path(workroot).exists()

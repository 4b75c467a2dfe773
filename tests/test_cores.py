"""The cores kept for timed runs: which ones, and compiles moved off them and back."""

import os
import subprocess
import sys
import threading
import time

import pytest

from hpc.candidate import load_candidate
from hpc.pipeline import evaluate
from hpc.profile import cores
from hpc.sandbox import launch
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS


def test_a_quarter_of_eight_or_more_cores_is_kept_from_compiles(monkeypatch):
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu}))
    assert cores.compile_cores(set(range(16))) == set(range(12))
    assert cores.kept_cores(set(range(16))) == {12, 13, 14, 15}
    assert cores.compile_cores(set(range(8))) == set(range(6))
    assert cores.compile_cores({0, 2, 4, 6, 8, 10, 12, 14}) == {0, 2, 4, 6, 8, 10}


def test_whole_physical_cores_are_kept(monkeypatch):
    """Hyperthread pairs (k, k + 8): keeping 15 keeps 7 too, or a compile on 7 would share 15's core."""
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu % 8, cpu % 8 + 8}))
    assert cores.kept_cores(set(range(16))) == {6, 7, 14, 15}
    assert cores.compile_cores(set(range(16))) == {0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13}


def test_below_eight_cores_compiles_may_run_anywhere():
    assert cores.compile_cores(set(range(7))) == set(range(7))
    assert cores.compile_cores({0, 1}) == {0, 1}


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move threads between")
def test_compiling_moves_every_thread_and_its_children_then_brings_the_threads_back(monkeypatch):
    before = os.sched_getaffinity(0)
    target = {min(before)}
    monkeypatch.setattr(cores, "compile_cores", lambda _: target)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with cores.compiling():
            assert _affinity(other.native_id) == target
            assert _affinity(0) == target
            child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                   capture_output=True, text=True, check=True)
            assert child.stdout.strip() == str(sorted(target))
        assert _affinity(other.native_id) == before
        assert _affinity(0) == before
    finally:
        stop.set()
        other.join()


def test_on_cpu_the_drivers_get_the_first_core_and_the_programs_the_rest(monkeypatch):
    """Below 8 cores all of them, from 8 the kept ones; one core alone pins nothing."""
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu}))
    assert cores.timing_cores("cpu", {0, 1}) == ({1}, {0})
    assert cores.timing_cores("cpu", set(range(4))) == ({1, 2, 3}, {0})
    assert cores.timing_cores("cpu", set(range(16))) == ({13, 14, 15}, {12})
    assert cores.timing_cores("cpu", {3}) == (set(), set())


def test_on_cuda_a_program_core_and_a_driver_core_are_kept_ones(monkeypatch):
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu}))
    assert cores.timing_cores("cuda", set(range(16))) == ({12}, {13})
    assert cores.timing_cores("cuda", set(range(4))) == (set(), set())


def test_a_timed_program_gets_a_thread_per_core_it_is_timed_on(monkeypatch):
    monkeypatch.setattr(cores, "timing_cores", lambda backend: ({5, 6, 7}, {4}))
    assert cores.window_env("cpu", program=True) == {"OMP_NUM_THREADS": "3"}
    assert cores.window_env("cpu", program=False) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cores.window_env("cuda", program=True) == {}


_SLEEPER = ("import os, threading, time, subprocess, sys; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(child.pid, flush=True); time.sleep(60)")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move threads between")
def test_a_cpu_window_moves_its_programs_the_untrusted_one_by_its_cpuset_and_its_drivers_and_back(tmp_path):
    """Every thread of the untrusted program and of the processes it started runs on the programs'
    cores (its cgroup's cpuset; a child it started before the window would otherwise run on the
    other cores); a trusted program's threads too, but not its children (a baseline's compile
    workers, still starting up, would take turns with the timed programs); a driver and the
    harness's thread on the drivers' core; all back after."""
    before = os.sched_getaffinity(0)
    program_cores, driver_cores = cores.timing_cores("cpu")
    untrusted = launch.spawn([sys.executable, "-c", _SLEEPER], launch.Policy(readable=tuple(launch.python_readable()),
                             seccomp="trusted"), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE)
    trusted = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE, text=True)
    driver = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    children = []
    try:
        untrusted.popen.stdout.readline()
        children = [int(trusted.stdout.readline())]
        driver.stdout.readline()
        tids = [int(t) for pid in untrusted.cgroup.pids() for t in os.listdir(f"/proc/{pid}/task")]
        trusted_tids = [int(t) for t in os.listdir(f"/proc/{trusted.pid}/task")]
        assert len(tids) == 3 and len(trusted_tids) == 2
        with cores.timing([trusted.pid], [driver.pid], backend="cpu", confined=[untrusted.cgroup]):
            assert [_affinity(t) for t in tids + trusted_tids] == [program_cores] * 5
            assert untrusted.cgroup.cpus() == program_cores
            assert _affinity(children[0]) == before
            assert _affinity(driver.pid) == driver_cores
            assert _affinity(0) == driver_cores
        assert [_affinity(t) for t in tids + trusted_tids + children] == [before] * 6
        assert _affinity(driver.pid) == before and _affinity(0) == before
    finally:
        untrusted.reap()
        for proc in (trusted, driver):
            proc.kill()
            proc.wait()
        for child in children:
            os.kill(child, 9)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move threads between")
def test_a_trusted_program_whose_threads_are_not_all_pinned_after_the_last_walk_is_not_timed(monkeypatch):
    """Pinning ends on a walk that finds every thread in place; a program that still had threads to
    move at the last walk (starting threads faster than the walks) is named, not timed, and
    everything goes back where it was."""
    before = os.sched_getaffinity(0)
    program_cores, _ = cores.timing_cores("cpu")
    program = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(program.stdout.readline())
        monkeypatch.setattr(cores, "PIN_WALKS", 1)   # one walk, which moves every thread
        with pytest.raises(cores.PinError, match="did not stay on cores") as failed:
            with cores.timing([program.pid], backend="cpu"):
                pass
        assert failed.value.pids == [program.pid]
        assert _affinity(0) == _affinity(program.pid) == before
        monkeypatch.undo()
        with cores.timing([program.pid], backend="cpu"):   # the second walk: all in place
            assert _affinity(program.pid) == program_cores
    finally:
        program.kill()
        program.wait()
        if child:
            os.kill(child, 9)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move threads between")
def test_a_candidate_that_hangs_once_it_is_timed_is_killed_at_the_timeout(fast_config):
    """In a cpu window the harness polls for each done frame (a pipe it has made non-blocking): a
    frame that never ends still meets the deadline, and is the candidate's failure."""
    fast_config.sandbox.timeout_s = 60   # the baselines' cold compile is held to it too
    fast_config.timing.handshake = "spin"
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "hang_when_timed"), fast_config)
    assert rec.status == "failed" and rec.reward == -1 and rec.failed_stage == "profile", rec.reason
    assert "timed out" in rec.reason and rec.wall_seconds < 240


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _spinners(pid: int) -> dict[int, tuple[int, set[int]]]:
    """`pid`'s children that are the window's spinners: each one's scheduling policy and cores."""
    return {c: (os.sched_getscheduler(c), _affinity(c)) for c in _children(pid)
            if "SCHED_IDLE" in open(f"/proc/{c}/cmdline").read()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to hand out")
def test_a_cpu_window_that_keeps_its_program_cores_awake_runs_a_spinner_at_sched_idle_on_each_and_ends_them():
    """Each program core gets a spinner of the harness's at SCHED_IDLE for the window: it runs
    (state R) and takes no time from a program (the policy), and is gone after."""
    program_cores, _ = cores.timing_cores("cpu")
    with cores.timing([], backend="cpu", awake=True) as placed:
        spinners = _spinners(os.getpid())
        assert placed["kept_awake"] is True
        assert sorted(spinners.values(), key=lambda v: min(v[1])) == [(os.SCHED_IDLE, {c}) for c in sorted(program_cores)]
        for pid in spinners:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "R"
    assert _spinners(os.getpid()) == {}
    with cores.timing([], backend="cpu") as placed:
        assert "kept_awake" not in placed and _spinners(os.getpid()) == {}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to hand out")
def test_a_spinner_ends_with_the_harness_that_started_it():
    """A harness killed in a window (SIGKILL: no block left, no finally) takes its spinners with it."""
    harness = subprocess.Popen([sys.executable, "-c", "import os, time\nfrom hpc.profile import cores\n"
                                "with cores.keep_awake({1}):\n    print('in', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True, cwd=TESTS.parent)
    try:
        assert harness.stdout.readline() == "in\n"
        spinners = _children(harness.pid)
        assert len(spinners) == 1
        harness.kill()
        harness.wait()
        for _ in range(100):
            if not os.path.exists(f"/proc/{spinners[0]}") or open(f"/proc/{spinners[0]}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the spinner {spinners[0]} outlived its harness")
    finally:
        harness.kill()
        harness.wait()


def test_timing_is_a_no_op_where_no_core_is_handed_out(monkeypatch):
    monkeypatch.setattr(cores, "timing_cores", lambda backend: (set(), set()))
    before = os.sched_getaffinity(0)
    with cores.timing([os.getpid()]):
        assert os.sched_getaffinity(0) == before


def test_the_first_cores_handed_out_lie_on_different_physical_cores(monkeypatch):
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu % 8, cpu % 8 + 8}))
    assert cores.by_physical_core({6, 7, 14, 15}) == [6, 7, 14, 15]
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu - cpu % 2, cpu - cpu % 2 + 1}))
    assert cores.by_physical_core({12, 13, 14, 15}) == [12, 14, 13, 15]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to hand out")
def test_on_cuda_every_program_of_a_window_is_timed_on_one_core_and_every_driver_on_another(monkeypatch):
    kept = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setattr(cores, "kept_cores", lambda cores=None: set(kept))
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu}))
    children = [subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for child in children:
            child.stdout.readline()
        pids = [c.pid for c in children]
        with cores.timing(pids[:2], pids[2:], backend="cuda"):
            assert [_affinity(pid) for pid in pids] == [{kept[0]}, {kept[0]}, {kept[1]}, {kept[1]}]
    finally:
        for child in children:
            child.kill()
            child.wait()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


def test_a_cpu_pairs_program_gets_a_thread_a_core_and_its_reference_passive_workers():
    from hpc.config import SandboxConfig
    from hpc.sandbox.prestart import start_pair

    programs, _ = cores.timing_cores("cpu")
    pair = start_pair(SandboxConfig(timeout_s=60), "cpu", env={"OMP_NUM_THREADS": "64"})
    try:
        assert _environ(pair.program.worker_pid)["OMP_NUM_THREADS"] == str(max(1, len(programs)))
        assert _environ(pair.reference.worker_pid)["OMP_WAIT_POLICY"] == "PASSIVE"
    finally:
        pair.close()

"""The cores kept for timed runs: which ones, and compiles moved off them and back."""

import os
import subprocess
import sys
import threading

import pytest

from hpc.profile import cores


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move threads between")
def test_a_window_moves_its_processes_threads_to_the_kept_cores_and_back(monkeypatch):
    before = os.sched_getaffinity(0)
    kept = {max(before)}
    monkeypatch.setattr(cores, "kept_cores", lambda: kept)
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "print(1, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 2
        me = threading.get_native_id()
        with cores.timing([child.pid]):
            assert all(_affinity(t) == kept for t in tids)
            assert _affinity(me) == kept
        assert all(_affinity(t) == before for t in tids)
        assert _affinity(me) == before
    finally:
        child.kill()
        child.wait()


def test_timing_is_a_no_op_where_no_core_is_kept(monkeypatch):
    monkeypatch.setattr(cores, "kept_cores", lambda: set())
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
    monkeypatch.setattr(cores, "kept_cores", lambda: set(kept))
    monkeypatch.setattr(cores, "_siblings", lambda cpu: frozenset({cpu}))
    children = [subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for child in children:
            child.stdout.readline()
        pids = [c.pid for c in children]
        with cores.timing(pids[:2], pids[2:], one_core=True):
            assert [_affinity(pid) for pid in pids] == [{kept[0]}, {kept[0]}, {kept[1]}, {kept[1]}]
        with cores.timing(pids[:2], pids[2:]):
            assert all(_affinity(pid) == set(kept) for pid in pids)
    finally:
        for child in children:
            child.kill()
            child.wait()

"""The device lock: untimed work overlaps, a timed run has the device alone and is not starved."""

from __future__ import annotations

import threading
import time

from hpc.profile.device_lock import DeviceLock


def test_shared_holders_overlap_and_exclusive_waits_for_them(tmp_path):
    lock = DeviceLock("cuda", tmp_path)
    events: list[str] = []
    inside = threading.Barrier(2)

    def reader(name: str):
        with lock.shared():
            inside.wait(timeout=5)          # both readers are inside at once
            time.sleep(0.2)
            events.append(f"{name} done")

    def writer():
        time.sleep(0.05)
        with lock.exclusive():
            events.append("timed")

    threads = [threading.Thread(target=reader, args=(n,)) for n in ("a", "b")] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert events[-1] == "timed" and sorted(events[:2]) == ["a done", "b done"]


def test_a_queued_timer_keeps_new_shared_work_out(tmp_path):
    lock = DeviceLock("cpu", tmp_path)
    order: list[str] = []
    first_in = threading.Event()

    def long_reader():
        with lock.shared():
            first_in.set()
            time.sleep(0.3)
        order.append("long reader")

    def timer():
        first_in.wait(5)
        with lock.exclusive():
            order.append("timer")

    def late_reader():
        first_in.wait(5)
        time.sleep(0.1)                     # arrives after the timer queued
        with lock.shared():
            order.append("late reader")

    threads = [threading.Thread(target=f) for f in (long_reader, timer, late_reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert order.index("timer") < order.index("late reader")


def test_a_lock_adds_up_its_waits_and_its_exclusive_hold(tmp_path):
    """What an evaluation records: how long it queued for the device, and held it alone."""
    lock, other = DeviceLock("cuda", tmp_path), DeviceLock("cuda", tmp_path)
    holding = threading.Event()

    def reader():
        with other.shared():
            holding.set()
            time.sleep(0.3)

    t = threading.Thread(target=reader)
    t.start()
    holding.wait(timeout=5)
    with lock.exclusive():
        time.sleep(0.1)
    t.join(timeout=5)
    with lock.shared():
        pass
    assert 0.2 < lock.seconds["lock_wait_exclusive"] < 2.0
    assert 0.1 <= lock.seconds["lock_held_exclusive"] < 1.0
    assert 0 <= lock.seconds["lock_wait_shared"] < 0.2 and other.seconds["lock_held_exclusive"] == 0


def test_a_cached_task_cost_is_read_while_a_timer_holds_the_device(tmp_path, fast_config):
    """Once counted, a task's cost is a file read: an evaluation does not queue for the device to
    read it behind the timed run of another."""
    from hpc.baseline import task_cost
    from hpc.candidate import load_candidate
    from hpc.pipeline import evaluate
    from hpc.task import load_task
    from tests.conftest import RELU_TASK, TESTS

    task = load_task(RELU_TASK)
    record = evaluate(task, load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config)
    assert record.status == "ok" and record.min_bytes > 0
    lock = DeviceLock("cpu", tmp_path)
    holding, release = threading.Event(), threading.Event()

    def timer() -> None:
        with lock.exclusive():
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=timer)
    thread.start()
    try:
        assert holding.wait(10)
        start = time.monotonic()
        cost = task_cost(task, fast_config, None, 0, lock)
        assert time.monotonic() - start < 1.0
    finally:
        release.set()
        thread.join()
    assert cost == {"flops": record.flops, "bytes": record.min_bytes}


def test_evaluations_beside_are_counted_while_they_run_and_not_after(tmp_path):
    mine, other = DeviceLock("cpu", tmp_path), DeviceLock("cpu", tmp_path)
    assert mine.beside() == 0
    with mine.active():
        assert mine.beside() == 0 and other.beside() == 1
        with other.active(), other.active():
            assert mine.beside() == 2 and other.beside() == 1
        assert mine.beside() == 0
    # a holder that died leaves its file unlocked: not counted, and cleared
    stale = tmp_path / "cpu.active" / "12345-1-0"
    stale.touch()
    assert mine.beside() == 0 and not stale.exists()


def test_an_autotuning_first_call_has_a_cuda_device_alone_and_shares_a_cpu(tmp_path):
    """torch.compile's first call times launch configs on cuda: no other device work beside it."""
    for backend, alone in (("cuda", True), ("cpu", False)):
        lock = DeviceLock(backend, tmp_path / backend)
        tuning = threading.Event()
        overlapped: list[bool] = []

        def tuner():
            with lock.autotuning():
                tuning.set()
                time.sleep(0.3)

        def other():
            tuning.wait(5)
            t0 = time.monotonic()
            with lock.shared():
                overlapped.append(time.monotonic() - t0 < 0.15)

        threads = [threading.Thread(target=f) for f in (tuner, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert overlapped == [not alone], backend

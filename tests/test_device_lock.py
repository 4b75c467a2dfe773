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

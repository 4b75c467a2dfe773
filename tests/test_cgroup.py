"""Every confined program in a cgroup of its own (hpc.sandbox.cgroup), for real: held by the
freezer, which nothing of its own undoes (not a SIGCONT timer, not a daemon it forked); its memory
bounded with memfd pages counted; its tasks bounded as uid 0; its cores fixed by the cpuset
whatever affinity it asks for; and its group gone once it ends, or once its harness dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.sandbox import cgroup, launch

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PATH": "/usr/bin:/bin"}

SPINNER = r"""
import os, sys, threading, time
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        spin()
    os._exit(0)
os.wait()
print("ready", flush=True)
spin()
"""

# the round-3 attack on SIGSTOP: a POSIX timer sends the process SIGCONT every millisecond, re-armed
# from a thread, so every stop lasted about 1 ms; here it counts how often it ran while held
SIGCONT_TIMER = r"""
import ctypes, os, signal, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_int * 12)]
class TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]
class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", TimeSpec), ("value", TimeSpec)]
signal.signal(signal.SIGCONT, lambda *_: None)
event = SigEvent(None, signal.SIGCONT, 0)   # SIGEV_SIGNAL
timer = ctypes.c_void_p()
assert libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0, ctypes.get_errno()   # CLOCK_MONOTONIC
spec = ITimerSpec(TimeSpec(0, 1000000), TimeSpec(0, 1000000))
def rearm():
    while True:
        libc.timer_settime(timer, 0, ctypes.byref(spec), None)
        time.sleep(0.01)
threading.Thread(target=rearm, daemon=True).start()
print("ready", flush=True)
while True:
    with open("beats", "a") as f:
        f.write(".")
    time.sleep(0.002)
"""


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])   # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def python_policy(**kw) -> launch.Policy:
    return launch.Policy(readable=tuple(launch.python_readable()), **kw)


def test_every_confined_program_is_in_a_group_of_its_own_that_is_gone_once_it_ends(tmp_path):
    proc = launch.spawn([sys.executable, "-c", "print(open('/proc/self/cgroup').read(), flush=True); input()"],
                        python_policy(), cwd=tmp_path, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    group = proc.cgroup
    try:
        lines = proc.popen.stdout.read1().decode().splitlines()
        assert group is not None and proc.isolation["cgroup"]
        assert all(d.name == group.name for d in group.dirs.values())
        assert sum(group.name in line for line in lines) >= len(set(group.dirs.values()))
        assert group.pids() == [proc.worker_pid]
    finally:
        proc.reap()
    assert not any(d.exists() for d in group.dirs.values())


def test_a_frozen_program_and_its_daemon_take_no_cpu_until_thawed(tmp_path):
    proc = launch.spawn([sys.executable, "-c", SPINNER], python_policy(), cwd=tmp_path, env=ENV,
                        stdout=subprocess.PIPE)
    try:
        assert proc.popen.stdout.readline().strip() == b"ready"
        group = proc.cgroup
        pids = group.pids()
        assert len(pids) == 2   # the program and its double-forked daemon, still in its group
        group.freeze()
        assert group.frozen()
        before = cpu_seconds(pids)
        time.sleep(0.5)
        assert cpu_seconds(pids) - before < 0.02
        group.thaw()
        assert not group.frozen()
        time.sleep(0.5)
        assert cpu_seconds(pids) - before > 0.05
    finally:
        proc.reap()


def test_a_program_that_sends_itself_sigcont_every_millisecond_stays_frozen(tmp_path):
    """SIGSTOP held it for about a millisecond at a time; the freezer holds it until thawed."""
    proc = launch.spawn([sys.executable, "-c", SIGCONT_TIMER], python_policy(writable=(str(tmp_path),)),
                        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE)
    try:
        assert proc.popen.stdout.readline().strip() == b"ready"
        time.sleep(0.1)
        proc.cgroup.freeze()
        held = (tmp_path / "beats").stat().st_size
        time.sleep(0.5)
        assert (tmp_path / "beats").stat().st_size == held and proc.cgroup.frozen()
        proc.cgroup.thaw()
        time.sleep(0.2)
        assert (tmp_path / "beats").stat().st_size > held
    finally:
        proc.reap()


def test_memory_written_into_memfds_counts_against_the_groups_limit_and_ends_only_that_program(tmp_path):
    """Pages written into a memfd and never mapped are outside RLIMIT_AS and in no process's RSS;
    its group is charged for them, and the kernel kills inside the group, not elsewhere."""
    code = ("import os\nfd = os.memfd_create('x')\nfor _ in range(64):\n    os.write(fd, b'x' * (8 << 20))\n"
            "print('held 512 MiB')")
    rc, out, exceeded = launch.run([sys.executable, "-c", code], python_policy(memory_bytes=192 << 20),
                                   cwd=tmp_path, env=ENV, timeout=60)
    assert rc == -9 and "held" not in out and exceeded == ["memory"]
    rc, out, exceeded = launch.run([sys.executable, "-c", code], python_policy(memory_bytes=1 << 30),
                                   cwd=tmp_path, env=ENV, timeout=60)
    assert rc == 0 and "held 512 MiB" in out and exceeded == []


def test_a_groups_tasks_are_bounded_whatever_its_uid(tmp_path):
    """RLIMIT_NPROC is never applied to uid 0; pids.max counts every thread of the group."""
    code = ("import threading, time\nn = 0\ntry:\n    for _ in range(200):\n"
            "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); n += 1\n"
            "except RuntimeError:\n    pass\nprint(n)")
    rc, out, exceeded = launch.run([sys.executable, "-c", code], python_policy(uid=None, limits=launch.Limits(
        processes=48)), cwd=tmp_path, env=ENV, timeout=60)
    assert rc == 0 and int(out.split()[-1]) < 48 and exceeded == ["tasks"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_cpuset_holds_a_program_that_asks_for_other_cores(tmp_path):
    """Its own affinity cannot widen where it runs (a trusted profile may ask; the cpuset says no)."""
    code = ("import os, sys\ntry:\n    os.sched_setaffinity(0, set(range(os.cpu_count())))\nexcept OSError:\n    pass\n"
            "print(sorted(os.sched_getaffinity(0)), flush=True); input()")
    proc = launch.spawn([sys.executable, "-c", code], python_policy(seccomp="trusted"), cwd=tmp_path, env=ENV,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        first = min(os.sched_getaffinity(0))
        proc.cgroup.set_cpus({first})
        proc.popen.stdout.readline()
        assert os.sched_getaffinity(proc.worker_pid) == {first}
    finally:
        proc.reap()


HARNESS = r"""
import subprocess, sys
from hpc.sandbox import launch
proc = launch.spawn([sys.executable, "-c", "import time; time.sleep(120)"],
                    launch.Policy(readable=tuple(launch.python_readable())), cwd=sys.argv[1],
                    env={"PATH": "/usr/bin:/bin"})
proc.cgroup.freeze()
print(proc.worker_pid, " ".join(str(d) for d in proc.cgroup.dirs.values()), flush=True)
sys.stdin.read()
"""


def test_a_frozen_program_and_its_group_end_with_the_harness_that_froze_it(tmp_path):
    """A harness killed while it held a program frozen cannot thaw it; the program's stub kills it
    (it would never read the end of its pipes, and stay forever) and removes its group."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=ROOT)
    pid, *dirs = harness.stdout.readline().split()
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 15
    while (os.path.exists(f"/proc/{int(pid)}") or any(os.path.exists(d) for d in dirs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{int(pid)}"), "the frozen program outlived its harness"
    assert not any(os.path.exists(d) for d in dirs), "its cgroup outlived it"


def test_the_groups_of_a_harness_that_is_gone_are_swept():
    hierarchies = cgroup.support()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = [base / f"{cgroup.PREFIX}{gone.pid}-0-feed" for base in set(hierarchies.dirs.values())]
    for directory in stale:
        directory.mkdir()
    cgroup.sweep(hierarchies)
    assert not any(d.exists() for d in stale)

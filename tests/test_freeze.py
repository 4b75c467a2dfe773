"""Stopping a confined program and everything below it (hpc.sandbox.freeze), for real: a program
that double-forks a spinning daemon and spins in a thread of its own takes no CPU while stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hpc.sandbox import freeze, launch

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


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])   # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def test_a_stopped_program_and_its_daemon_take_no_cpu_until_resumed(tmp_path):
    proc = launch.spawn([sys.executable, "-c", SPINNER], launch.Policy(readable=tuple(launch.python_readable())),
                        cwd=tmp_path,
                        env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE)
    try:
        assert proc.popen.stdout.readline().strip() == b"ready"
        time.sleep(0.2)
        pids = freeze.tree(proc.worker_pid)
        assert len(pids) == 2   # the program and its double-forked daemon, re-parented to it
        assert freeze.stop(proc.worker_pid) == 2
        before = cpu_seconds(pids)
        time.sleep(0.5)
        assert cpu_seconds(pids) - before < 0.02
        freeze.resume(proc.worker_pid)
        time.sleep(0.5)
        assert cpu_seconds(pids) - before > 0.05
    finally:
        freeze.resume(proc.worker_pid)
        proc.reap()


def test_a_gone_program_is_an_empty_tree():
    child = subprocess.Popen(["true"])
    child.wait()
    assert freeze.tree(child.pid) == [] and freeze.stop(child.pid) == 0


HARNESS = r"""
import subprocess, sys
from hpc.sandbox import freeze, launch
proc = launch.spawn([sys.executable, "-c", "import time; time.sleep(120)"],
                    launch.Policy(readable=tuple(launch.python_readable())), cwd=sys.argv[1],
                    env={"PATH": "/usr/bin:/bin"})
freeze.stop(proc.worker_pid)
print(proc.worker_pid, flush=True)
sys.stdin.read()
"""


def test_a_stopped_program_dies_with_the_harness_that_stopped_it(tmp_path):
    """A harness killed while it held a program stopped cannot resume it; the program's stub kills it
    (it would never read the end of its pipes, and stay forever)."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    pid = int(harness.stdout.readline())
    with open(f"/proc/{pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "T"
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the stopped program outlived its harness"

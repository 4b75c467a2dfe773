"""hpc.hardware's readings of a program's process for the record's conditions: its tree's page faults
(window_minor_faults) and its heap's share on huge pages (heap_on_huge_pages)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc.hardware import heap_on_huge_pages, minor_faults
from hpc.sandbox import launch

_TOUCHER = """import mmap, sys
m = mmap.mmap(-1, 64 << 20)
m.madvise(mmap.MADV_NOHUGEPAGE)   # 4 KiB pages, whatever the host's THP setting
print('mapped', flush=True)
sys.stdin.readline()
for i in range(0, 64 << 20, 4096):
    m[i] = 1
print('touched', flush=True)
sys.stdin.read()
"""


def test_a_child_that_touches_fresh_pages_counts_them_among_its_programs_processes(tmp_path):
    """A confined program's child writes one byte into each 4 KiB page of 64 MiB it mapped: the
    program's processes (its cgroup's) count at least those 16384 faults; a process gone counts 0."""
    program = ("import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
               "child.wait()")
    proc = launch.spawn([sys.executable, "-c", program, _TOUCHER], launch.Policy(readable=tuple(
        launch.python_readable())), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE)
    try:
        assert proc.popen.stdout.readline().strip() == b"mapped"
        pids = proc.cgroup.pids()
        assert len(pids) == 2
        before = minor_faults(pids)
        proc.popen.stdin.write(b"go\n")
        proc.popen.stdin.flush()
        assert proc.popen.stdout.readline().strip() == b"touched"
        assert minor_faults(pids) - before >= 16384
    finally:
        proc.popen.stdin.close()
        proc.wait(10)
        proc.reap()
    assert minor_faults(pids) == 0


_HEAP = """import ctypes, sys
if sys.argv[1] == "off":
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)   # PR_SET_THP_DISABLE: this process gets 4 KiB pages only
buffer = bytearray(64 << 20)   # under the mmap threshold set below: on the heap
for i in range(0, len(buffer), 4096):
    buffer[i] = 1
print('touched', flush=True)
sys.stdin.read()
"""


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.parametrize("thp", ["off", "on"])
def test_a_heap_on_huge_pages_reads_as_such_and_one_refused_them_reads_none(thp):
    """A child's 64 MiB heap reads as mostly on 2 MiB pages where glibc advises them and the host
    grants them, and as none where the process refused them (PR_SET_THP_DISABLE); a process gone
    reads None."""
    if thp == "on" and _thp_mode() == "never":
        pytest.skip("the host grants no transparent huge pages")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(256 << 20), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    child = subprocess.Popen([sys.executable, "-c", _HEAP, thp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "touched"
        share = heap_on_huge_pages(child.pid)
        assert share is not None
        assert share == 0.0 if thp == "off" else share > 0.5
    finally:
        child.stdin.close()
        child.wait(10)
    assert heap_on_huge_pages(child.pid) is None

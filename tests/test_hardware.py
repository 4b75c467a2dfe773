"""hpc.hardware's reading of a process tree's page faults (the record's conditions.window_minor_faults)."""

from __future__ import annotations

import os
import subprocess
import sys

from hpc.hardware import minor_faults

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


def test_a_child_that_touches_fresh_pages_counts_them_in_its_parents_tree():
    """A child writes one byte into each 4 KiB page of 64 MiB it mapped: it counts at least those
    16384 faults, and so does its parent's tree while the child lives; a process gone counts 0."""
    child = subprocess.Popen([sys.executable, "-c", _TOUCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "mapped"
        before = minor_faults(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "touched"
        assert minor_faults(child.pid) - before >= 16384
        assert minor_faults(os.getpid()) >= minor_faults(child.pid)
    finally:
        child.stdin.close()
        child.wait(10)
    assert minor_faults(child.pid) == 0

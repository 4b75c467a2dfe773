"""Cores kept for timed runs: compiles stay off them, the window's processes run on them.

With several evaluations at once (`eval-suite --jobs N`, a pool worker's prestarted pairs), one
evaluation's compiles run while another's window is timed: nvcc and its children, inductor's
compile workers, a candidate's load-time build. SCHED_IDLE keeps a compile from taking a core a
timed program wants, but not from sharing a physical core (its hyperthread sibling), its caches
and memory bandwidth with it. So on a host with 8 or more usable cores about a quarter of them
(whole physical cores, at least 2) is kept: every compile is pinned to the others, and while a
window is timed its processes (both pairs: the references that drive the calls, the candidate's
and the baselines' programs) are pinned to the kept ones, on cuda every program to one core and
every driver to another, then put back. What is timed then runs on the same quiet cores whichever
evaluation it belongs to, and a process does not move between cores in the middle of its calls. Below 8 cores nothing is kept: a
quarter of 2 or 4 cores would leave the timed programs too few.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterable, Iterator, Sequence

MIN_CORES = 8


def _siblings(cpu: int) -> frozenset[int]:
    """The logical cores of `cpu`'s physical core (itself alone where the topology is not shown)."""
    try:
        text = open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read().strip()
    except OSError:
        return frozenset({cpu})
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def kept_cores(cores: Iterable[int] | None = None) -> set[int]:
    """The cores kept for timing among `cores` (this thread's, by default): whole physical cores
    from the top, until at least a quarter (and 2) are kept; none below MIN_CORES."""
    cores = set(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < MIN_CORES:
        return set()
    want = max(2, len(cores) // 4)
    kept: set[int] = set()
    for cpu in sorted(cores, reverse=True):
        if len(kept) >= want:
            break
        kept |= _siblings(cpu) & cores
    return kept if len(kept) < len(cores) else set()


def by_physical_core(cores: Iterable[int]) -> list[int]:
    """`cores` ordered so that the first ones lie on different physical cores: one thread of each
    physical core, then the second of each, and so on."""
    cores = set(cores)
    groups = sorted({frozenset(_siblings(c) & cores) for c in cores}, key=min)
    out: list[int] = []
    for rank in range(max((len(g) for g in groups), default=0)):
        out += [sorted(g)[rank] for g in groups if rank < len(g)]
    return out


def compile_cores(cores: Iterable[int] | None = None) -> set[int]:
    """Where compiles may run: `cores` (this thread's, by default) less the kept ones."""
    cores = set(os.sched_getaffinity(0) if cores is None else cores)
    return cores - kept_cores(cores)


def _threads(pid: int | str) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:   # ended
        return []


def _pin(tids: Iterable[int], cores: set[int]) -> None:
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            pass   # ended meanwhile, or not ours to move


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """This process's threads on the compile cores for the block, back where they were after;
    processes started inside it stay on the compile cores (inductor's compile workers)."""
    before = os.sched_getaffinity(0)
    target = compile_cores(before)
    if target == before:
        yield
        return
    try:
        _pin(_threads("self"), target)
    except OSError:   # a sandbox that refuses the call: compile where it is
        yield
        return
    try:
        yield
    finally:
        _pin(_threads("self"), before)


@contextlib.contextmanager
def timing(programs: Sequence[int], drivers: Sequence[int] = (), one_core: bool = False) -> Iterator[None]:
    """Every thread of the processes `programs` and `drivers`, and the calling thread (the harness's
    side of the window), on the kept cores for the block (a window); each put back where it was
    after (a thread started meanwhile goes where its process's first was).

    `one_core`: every program on the same kept core, every driver (the references that time them)
    on a second one, on another physical core. A window runs one program at a time (the others wait
    in a blocking read, a candidate's process is stopped), so each is timed on the very core the
    others were. A GPU program's host path, timed in every call, moved 26% between fresh processes
    left to the scheduler and 1.3% between processes held on one core; given a core each, the
    programs of one window still moved apart by 2-38% between runs (docs/benchmarks.md). The
    harness's thread goes on the kept cores left, if any. Otherwise all share the kept cores (a CPU
    program's threads need more than one)."""
    kept = by_physical_core(kept_cores())
    if not kept:
        yield
        return
    if one_core and len(kept) >= 2:
        program_cores, driver_cores = {kept[0]}, {kept[1]}
    else:
        program_cores = driver_cores = set(kept)
    own = {tid: os.sched_getaffinity(tid) for tid in (threading.get_native_id(),)}
    _pin(own, set(kept) - program_cores - driver_cores or set(kept))
    saved: dict[int, dict[int, set[int]]] = {}
    for pids, target in ((programs, program_cores), (drivers, driver_cores)):
        for pid in pids:
            saved[pid] = {}
            for tid in _threads(pid):
                try:
                    saved[pid][tid] = os.sched_getaffinity(tid)
                except OSError:
                    continue
            _pin(saved[pid], target)
    try:
        yield
    finally:
        for pid, before in saved.items():
            if not before:
                continue
            first = before[min(before)]
            for tid in _threads(pid):
                _pin([tid], before.get(tid, first))
        for tid, cores in own.items():
            _pin([tid], cores)

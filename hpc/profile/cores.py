"""Cores kept for timed runs: compiles stay off them, the window's processes run on them.

With several evaluations at once (`eval-suite --jobs N`, a pool worker's prestarted pairs), one
evaluation's compiles run while another's window is timed: nvcc and its children, inductor's
compile workers, a candidate's load-time build. SCHED_IDLE keeps a compile from taking a core a
timed program wants, but not from sharing a physical core (its hyperthread sibling), its caches
and memory bandwidth with it. So on a host with 8 or more usable cores about a quarter of them
(whole physical cores, at least 2) is kept: every compile is pinned to the others. Below 8 cores
nothing is kept from compiles: a quarter of 2 or 4 cores would leave the timed programs too few.

While a window is timed its processes (both pairs: the references, the candidate's and the
baselines' programs) and the harness's thread are pinned (timing_cores), then put back: what is
timed runs on the same cores whichever evaluation it belongs to, and a process does not move
between cores in the middle of its calls. A candidate is placed by its cgroup's cpuset, which
holds every thread and child it has or starts, whatever affinity they ask for; the harness's own
programs, trusted, by their threads' affinity.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from typing import Iterable, Iterator, Sequence

from hpc.sandbox.cgroup import Cgroup

MIN_CORES = 8
PIN_WALKS = 50   # walks of the trees a window may take to find every thread in place (timing)

# A keeper: on one core, at SCHED_IDLE, killed with the thread that started it; says it is ready,
# then spins.
_KEEPER = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    os._exit(0)
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
os.write(1, b"k")
while True:
    pass
"""


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


def timing_cores(backend: str, cores: Iterable[int] | None = None) -> tuple[set[int], set[int]]:
    """Where a window's processes run, among `cores` (this thread's, by default): (the programs'
    cores, the drivers' cores); both empty where nothing is pinned.

    cuda, on the kept cores only: every program on the same one, every driver (the references that
    time them) on a second, on another physical core. A window runs one program at a time (the
    others wait in a blocking read, a candidate's process is stopped), so each is timed on the
    very core the others were. A GPU program's host path, timed in every call, moved 26% between
    fresh processes left to the scheduler and 1.3% between processes held on one core; given a
    core each, the programs of one window still moved apart by 2-38% between runs
    (docs/benchmarks.md).

    cpu, on the kept cores or, below MIN_CORES, on all of them: the drivers (the harness, whose
    clock times every frame, and the references between frames) on the first, every program on the
    rest, with a thread a core (window_env). On 2 cores the programs' two threads shared them with
    the clock and with the other programs' idling OpenMP workers, which spin for about 8 ms after
    every parallel region: a chunk's first frame ran 2.5-3x its round's median and one window's
    speedup had a standard error of 2.3-13.5%; one thread each, pinned so, 0.8-4.7%
    (docs/benchmarks.md)."""
    cores = set(os.sched_getaffinity(0) if cores is None else cores)
    kept = by_physical_core(kept_cores(cores))
    if backend == "cuda":
        return ({kept[0]}, {kept[1]}) if len(kept) >= 2 else (set(kept), set(kept))
    ordered = kept or by_physical_core(cores)
    return (set(ordered[1:]), {ordered[0]}) if len(ordered) >= 2 else (set(), set())


def window_env(backend: str, program: bool) -> dict[str, str]:
    """What a process of a window gets in its environment on cpu. A program (timed): a thread per
    core it is timed on; torch's intra-op pool and any OpenMP runtime the program loads size
    themselves by it, and a candidate cannot take more cores (hpc.sandbox.seccomp). A reference
    (not timed, on the drivers' core beside the harness's clock): OpenMP workers that sleep as soon
    as their work is done, so that a check between frames leaves none spinning on the clock's core."""
    if backend != "cpu":
        return {}
    if not program:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    programs, _ = timing_cores(backend)
    return {"OMP_NUM_THREADS": str(max(1, len(programs)))}


@contextlib.contextmanager
def keep_awake(cores: Iterable[int]) -> Iterator[None]:
    """A spinner at SCHED_IDLE on each of `cores` for the block, so that they never idle.

    An idle core may halt (a virtual machine's vCPU exits to its host), and waking it again, when
    the driver hands a program its frame or the held candidate goes on, is inside the frame and
    apart from one frame to the next: on this project's 2-core KVM guest the handshake of two
    processes went from 122 to 50 us with the program's core kept awake and the driver polling,
    and an evaluation's from 0.258 to 0.138 ms (benchmarks/cpu_wake.py, docs/benchmarks.md). A
    program woken on a core that runs a SCHED_IDLE task takes it over at once, and the spinner
    runs only while nothing else wants the core: it is never timed beside a program. Trusted: the
    harness starts it, and it ends with the harness's thread (PR_SET_PDEATHSIG) if the block is
    never left."""
    keepers: list[subprocess.Popen] = []
    try:
        for core in sorted(cores):
            keeper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _KEEPER, str(core), str(os.getpid())],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            keepers.append(keeper)
            if keeper.stdout is None or keeper.stdout.read(1) != b"k":
                raise OSError(f"the spinner for core {core} did not start")
        yield
    finally:
        for keeper in keepers:
            keeper.kill()
            keeper.wait()
            if keeper.stdout is not None:
                keeper.stdout.close()


class PinError(Exception):
    """The processes `pids` still had threads to move after the last walk (_pin_threads)."""

    def __init__(self, pids: list[int], cores: set[int], walks: int):
        super().__init__(f"the threads of pid {', '.join(map(str, pids))} did not stay on cores {sorted(cores)} "
                         f"through {walks} walks")
        self.pids = pids


def _pin_threads(pids: Sequence[int], target: set[int], saved: dict[int, set[int]]) -> None:
    """Every thread of every process `pids` on `target` (each one's first mask kept in `saved`),
    walked again until a walk finds every thread there: a thread started during a walk by one not
    yet moved is moved on the next (one started by a moved thread starts there). PinError, naming
    the processes, when PIN_WALKS walks do not get there (a trusted program starting threads faster
    than the walks)."""
    for _ in range(PIN_WALKS):
        moved: set[int] = set()
        for pid in pids:
            for tid in _threads(pid):
                try:
                    mask = os.sched_getaffinity(tid)
                    saved.setdefault(tid, mask)
                    if mask != target:
                        os.sched_setaffinity(tid, target)
                        moved.add(pid)
                except OSError:   # ended meanwhile
                    continue
        if not moved:
            return
    raise PinError(sorted(moved), target, PIN_WALKS)


@contextlib.contextmanager
def timing(programs: Sequence[int], drivers: Sequence[int] = (), backend: str = "cpu",
           confined: Sequence[Cgroup] = (), awake: bool = False) -> Iterator[dict]:
    """Every thread of the trusted processes `programs` and `drivers`, and the calling thread (the
    harness's side of the window), on the cores timing_cores gives them for the block (a window);
    each put back where it was after (a thread started meanwhile goes where its process's first
    was). The untrusted programs' groups `confined` get the programs' cores as their cpuset, and
    their own back after: everything in them, children and threads started at any time, runs there
    and nowhere else. A trusted program's children stay where they are: a baseline's inductor
    compile workers, still starting up when its window opens, would otherwise take turns with the
    timed programs on their core. The harness's thread goes on the kept cores left on cuda, if
    any, and with the drivers on cpu, where its clock is the driver. `awake`: the programs' cores
    are kept from idling meanwhile (keep_awake). Yields where they went, for the record's
    conditions ({} where nothing was pinned; "kept_awake" where the cores were). PinError where a
    trusted program would not stay pinned, with everything put back."""
    program_cores, driver_cores = timing_cores(backend)
    if not program_cores:
        yield {}
        return
    kept = set(by_physical_core(kept_cores()))
    own_cores = (kept - program_cores - driver_cores or kept) if backend == "cuda" else driver_cores
    own = {threading.get_native_id(): os.sched_getaffinity(0)}
    saved: dict[int, set[int]] = {}
    cpusets: list[tuple[Cgroup, set[int]]] = []
    try:
        _pin(own, own_cores)
        for group in confined:
            cpusets.append((group, group.cpus()))
            group.set_cpus(program_cores)
        _pin_threads(programs, program_cores, saved)
        _pin_threads(drivers, driver_cores, saved)
        placed = {"program_cores": sorted(program_cores), "driver_cores": sorted(driver_cores)}
        if not awake:
            yield placed
            return
        with keep_awake(program_cores):
            yield {**placed, "kept_awake": True}
    finally:
        for group, before in cpusets:
            try:
                group.set_cpus(before)
            except OSError:   # its program has ended and its group is gone
                pass
        for pid in [*programs, *drivers]:
            tids = _threads(pid)
            first = saved.get(min(tids)) if tids else None
            for tid in tids:
                before = saved.get(tid, first)
                if before is not None:
                    _pin([tid], before)
        for tid, cores in own.items():
            _pin([tid], cores)

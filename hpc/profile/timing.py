"""The timing protocol, one for every timed program (candidate, eager, torch.compile): every call is
started and timed from outside the program's process.

A driver outside the program (the harness on cpu; the reference worker on cuda, which owns the
device memory involved) runs the calls, a frame of them at a time. A timed frame is a burst of
calls run back to back (hpc.profile.driver.burst_for sizes it: enough that the handshake is
small beside them), each on inputs of its own; a correctness call is a frame of its own. Per frame:

1. each call's inputs, made by the reference worker from seeds the program never sees (a batch at
   a time, in memory the program cannot map), are written into the call's position of the
   program's input slot, and the cache is flushed (a buffer larger than the last-level cache is
   rewritten: L2 on cuda, through the copy engines, which leave the program's context on the SMs;
   the LLC on cpu);
2. the driver reads its clock (t0) and sends the program a go frame that says how many calls;
3. the program calls the model on each position's inputs in turn, synchronizes the device once,
   describes every call's outputs in the shared header and answers with a done frame;
4. the driver reads its clock (t1) and, for a checked call, at once copies the outputs out of the
   program's memory (process_vm_readv on cpu, CUDA IPC and the copy engines on cuda): work the
   program left running after it answered is caught unfinished, and a program cannot tell which
   calls are checked until it has answered.

A call's figure is its frame's t1 - t0 less the handshake's fixed cost, divided by the frame's
calls; the fixed cost is the median of the same loop, in frames as long, on an empty program
(one tiny kernel a call on cuda, so a context switch is in both) in the baselines' trusted
process, timed in the same window as the programs compared (hpc.profile.window). Nothing the
program can change enters a figure: its inputs could not be known before t0, its clock is not
read, and the fixed cost is measured in a process it cannot reach. What it can still do is finish
early and leave work running, which the checked calls' outputs expose (a candidate doing that on
more than half of the calls, enough to move the median, goes unseen with probability below
2^-checks).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from hpc.sandbox.exchange import (DONE_FAILED, STOP, CallTimeout, InputLayout, ProgramGone, TensorSpec, read_frame,
                                  send_frame)
from hpc.sandbox.messages import FailureKind

PROTOCOL = "outside-11"    # kept with every record: outside clock, programs side by side in one window,
                           # timed calls in bursts; on cuda each burst a graph replay where every program
                           # of the window can be recorded (the record's conditions say: timed_by); on
                           # cpu every program on the cores the drivers leave, a thread a core
                           # (hpc.profile.cores; the conditions say: program_cores, driver_cores), its
                           # inputs in its own memory on huge pages (inputs_on_huge_pages); every
                           # sandboxed process's heap on huge pages (hpc.sandbox.process.STEADY_MALLOC);
                           # with timing.handshake spin the programs' cores kept awake and the harness
                           # polling (kept_awake); every program's process, the baselines' too, held
                           # stopped from a frame's first input until just before t0 (hpc.profile.driver);
                           # on cpu each frame's inputs at the next of input_shifts_cpu places within
                           # 4 KiB (hpc.profile.driver.input_shifts; the conditions say: input_shifts);
                           # on cpu each program timed in timing.processes_cpu processes of its own, its
                           # figures its fastest one's (hpc.profile.window.fastest_process; the conditions
                           # say: timed_in_process, process_medians_ms)
POISON = (float("nan"), -3.0e7)   # correctness calls alternate: reading uninitialized memory shows


@dataclass(frozen=True)
class Call:
    """One call of the program, as the driver runs it."""

    seed: int                    # the reference makes its inputs with torch.manual_seed(seed); < 0: none
                                 # made (the empty program's calls: nothing reads their inputs)
    distribution: str = "default"
    timed: bool = False
    checked: bool = False        # its outputs are copied out at once and compared with the reference's
    check_inputs: bool = False   # its inputs are compared after the call (in-place modification)
    poison: int = -1             # index into POISON: fill the program's uninitialized allocations
    follows: bool = False        # runs in the frame of the call before it, back to back
    shift: int = 0               # cpu: how far past the slot's start its frame's inputs lie (input_shifts)

    def to_message(self) -> dict:
        return {"seed": self.seed, "distribution": self.distribution, "timed": self.timed,
                "checked": self.checked, "check_inputs": self.check_inputs, "poison": self.poison,
                "follows": self.follows, "shift": self.shift}

    @classmethod
    def from_message(cls, data: dict) -> Call:
        return cls(int(data["seed"]), str(data["distribution"]), bool(data["timed"]), bool(data["checked"]),
                   bool(data["check_inputs"]), int(data["poison"]), bool(data.get("follows", False)),
                   int(data.get("shift", 0)))


def frames(calls: list[Call]) -> list[tuple[int, int]]:
    """The (start, end) of each frame of `calls`: a call that follows joins the frame before it."""
    out: list[tuple[int, int]] = []
    for k, call in enumerate(calls):
        if call.follows and out:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out


@dataclass
class Failure:
    """Why a loop stopped: `kind` says whose fault (ValueError for a kind FailureKind lacks)."""

    kind: FailureKind
    reason: str
    call: int = -1

    def __post_init__(self):
        self.kind = FailureKind(self.kind)


def modified_input(layout: InputLayout, differs: Callable[[TensorSpec], bool]) -> Failure | None:
    """The first tensor input whose bytes in the slot `differs` from what the driver put there."""
    for k, entry in enumerate(layout.entries):
        if isinstance(entry, TensorSpec) and entry.nbytes and differs(entry):
            return Failure(FailureKind.RULES, f"forward modified its input {k} in place")
    return None


class Agent(Protocol):
    """The driver's device-side work (the harness's host memory on cpu, the reference's device on cuda)."""

    def batch_size(self, calls: list[Call]) -> int: ...
    def prepare(self, calls: list[Call]) -> Failure | None: ...
    def publish(self, index: int, call: Call, position: int) -> Failure | None: ...
    def flush(self) -> None: ...
    def capture(self, index: int, call: Call, position: int, calls: int) -> Failure | None: ...
    def check(self, calls: list[Call]) -> tuple[Failure | None, dict]: ...
    def program_failure(self) -> Failure: ...


@dataclass
class LoopResult:
    times_ns: list[int]          # each timed frame's t1 - t0 over its calls, in order
    failure: Failure | None
    checks: dict                 # what the reference's check measured: max errors, calls checked
    flush_ns: list[int] = field(default_factory=list)   # each frame's cache flush, on the harness's clock (cpu)


def run_calls(calls: list[Call], agent: Agent, go_fd: int, done_fd: int, spin: bool, deadline: float,
              batch_limit: int = 0) -> LoopResult:
    """Run `calls` through the program, frame by frame, in batches of whole frames (of at most
    `batch_limit` calls when it is set: 1 checks each call before the next runs); stops at the
    first failure. `agent.batch_size` must hold the longest frame."""
    times: list[int] = []
    flushes: list[int] = []
    checks: dict = {"checked": 0, "max_abs_error": 0.0, "max_rel_error": 0.0}
    spans = frames(calls)
    size = max(1, agent.batch_size(calls))
    if batch_limit:
        size = min(size, batch_limit)
    seq, f = 0, 0
    while f < len(spans):
        g = f + 1
        while g < len(spans) and spans[g][1] - spans[f][0] <= size:
            g += 1
        start = spans[f][0]
        batch = calls[start:spans[g - 1][1]]
        failure = agent.prepare(batch)
        if failure is not None:
            return LoopResult(times, failure, checks)
        for a, b in spans[f:g]:
            seq += 1
            for position in range(b - a):
                failure = agent.publish(a - start + position, calls[a + position], position)
                if failure is not None:
                    failure.call = a + position
                    return LoopResult(times, failure, checks)
            flushed = time.monotonic_ns()
            agent.flush()
            t0 = time.monotonic_ns()
            flushes.append(t0 - flushed)
            send_frame(go_fd, seq, calls[a].poison, b - a, calls[a].shift)
            try:
                got, status, _, _ = read_frame(done_fd, deadline, spin)
            except CallTimeout:
                return LoopResult(times, Failure(FailureKind.TIMEOUT, "timed out in a call", a), checks)
            except ProgramGone:
                return LoopResult(times, Failure(FailureKind.CRASH, "the program process ended during a call", a),
                                  checks)
            t1 = time.monotonic_ns()
            if got != seq:
                return LoopResult(times, Failure(FailureKind.OUTPUT, f"malformed done frame ({got}, expected {seq})",
                                                 a), checks)
            if status == DONE_FAILED:
                failure = agent.program_failure()
                failure.call = a
                return LoopResult(times, failure, checks)
            for position in range(b - a):
                call = calls[a + position]
                if call.checked or call.check_inputs:
                    failure = agent.capture(a - start + position, call, position, b - a)
                    if failure is not None:
                        failure.call = a + position
                        return LoopResult(times, failure, checks)
            if calls[a].timed:
                times.append((t1 - t0) // (b - a))
        failure, measured = agent.check(batch)
        checks["checked"] += measured.get("checked", 0)
        for key in ("max_abs_error", "max_rel_error"):
            checks[key] = max(checks[key], measured.get(key, 0.0))
        if failure is not None:
            if failure.call >= 0:
                failure.call += start
            return LoopResult(times, failure, checks)
        f = g
    return LoopResult(times, None, checks, flushes)


def stop_program(go_fd: int) -> None:
    """End the program's serve loop (it answers its serve request)."""
    try:
        send_frame(go_fd, STOP, 0)
    except OSError:
        pass   # already gone: its serve request fails on its own


def call_seeds(seed: int, burst: int) -> list[int]:
    """The seeds of the calls of one frame: the frame's own, then ones made from it by a keyed hash.
    The program sees inputs, never seeds; and what it could learn of one frame's seeds from them
    tells it nothing of another frame's, whose own seed was drawn apart."""
    return [seed] + [int.from_bytes(hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest(), "little") >> 2
                     for k in range(1, burst)]


def timing_calls(seeds: list[int], warmup: int, checked: set[int], burst: int = 1,
                 shifts: Sequence[int] = (0,)) -> list[Call]:
    """A frame of `burst` calls per seed: `warmup` untimed frames, then one timed frame per seed;
    every call of the frames at `checked` (indexes among the timed ones) is checked. The frames'
    inputs lie `shifts` past the slot's start in turn, the timed ones from the first: every program
    of a window has as many timed frames, so a round of the window (hpc.profile.window) meets the
    same shifts in each."""
    out = []
    for i, seed in enumerate(seeds):
        timed = i >= warmup
        shift = shifts[(i - warmup) % len(shifts)]
        out += [Call(s, timed=timed, checked=timed and i - warmup in checked, follows=k > 0, shift=shift)
                for k, s in enumerate(call_seeds(seed, burst))]
    return out


CALIBRATION_WARMUP = 3


def calibration_calls(timed: int, burst: int = 1, shifts: Sequence[int] = (0,)) -> list[Call]:
    """The empty program's frames (`burst` calls each, as the programs it is timed beside):
    CALIBRATION_WARMUP untimed, then `timed` timed ones, none checked, on no inputs (the slot is
    still published, at the shifts in turn, and the cache flushed: every step but the model's)."""
    return [Call(-1, timed=f >= CALIBRATION_WARMUP, follows=k > 0,
                 shift=shifts[(f - CALIBRATION_WARMUP) % len(shifts)])
            for f in range(CALIBRATION_WARMUP + timed) for k in range(burst)]


def figures_ms(times_ns: list[int], overhead_ns: float) -> list[float]:
    """Each timed frame's figure per call: its outside-clock time per call less the handshake's
    fixed cost per call (both over frames of as many calls)."""
    return [(t - overhead_ns) / 1e6 for t in times_ns]


def bounded_figures(times_ns: list[int], overhead_ns: float, least_ms: float) -> tuple[list[float], float]:
    """A candidate's figures and the overhead taken off them. Taking the handshake's cost off a call
    that is barely longer than the handshake leaves noise, which can make a fast figure out of
    nothing; so where the median less the overhead is below `least_ms` (the hardware floor, or what
    stands out of the handshake's own noise: hpc.profile.window.handshake_ns), the outside-clock
    times themselves are the figures (overhead 0): an upper bound, never a rejection."""
    figures = figures_ms(times_ns, overhead_ns)
    if overhead_ns and figures and statistics.median(figures) < least_ms:
        return figures_ms(times_ns, 0.0), 0.0
    return figures, overhead_ns


def window_figures(times_ns: dict[str, list[int]], overhead_ns: float, least_ms: float,
                   candidate: str = "candidate") -> tuple[dict[str, list[float]], float]:
    """Every program's figures, the same overhead taken off all: the handshake's, or none where the
    candidate's figures would then fall below `least_ms` (bounded_figures). A baseline less the
    handshake set against a candidate with it would read the handshake as the candidate's slowness."""
    _, used_ns = bounded_figures(times_ns[candidate], overhead_ns, least_ms)
    return {name: figures_ms(times, used_ns) for name, times in times_ns.items()}, used_ns


MIN_FIGURE_MS = 1e-4   # a median at or below the handshake's cost is reported as this (0.1 us)


@dataclass
class TimingStats:
    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    cv: float               # std / mean
    noise: float            # relative standard error of the median (~1.25 std / sqrt(n) / median)

    @classmethod
    def of(cls, times_ms: list[float]) -> TimingStats:
        n = len(times_ms)
        med = max(statistics.median(times_ms), MIN_FIGURE_MS)
        mean = statistics.fmean(times_ms)
        std = statistics.stdev(times_ms) if n > 1 else 0.0
        q = statistics.quantiles(times_ms, n=4) if n > 1 else [med, med, med]
        return cls(med, mean, min(times_ms), max(times_ms), q[2] - q[0], std / abs(mean) if mean else 0.0,
                   1.2533 * std / math.sqrt(n) / med)

"""Side by side: the programs an evaluation compares, timed in one window, in rounds.

Timing one program after another lets the host change between them: a baseline timed in a busy
minute stays slow in every comparison with it, and a handshake cost measured before the load came
is taken off figures measured under it. So the candidate, eager, each torch.compile mode and the
empty program (the handshake alone, whose median is taken off every figure) are timed together:
each first runs its warm-up calls, then the timed calls of each are cut into `rounds` chunks and
every round runs one chunk of each program, in an order the harness draws anew for the round. What
slows the host for a while slows every program's share of that while, and the ratios the reward
uses keep their value. While one program runs, the candidate's cgroup is frozen
(hpc.sandbox.cgroup): threads or children it left running cannot slow a baseline timed beside it,
and so raise its own speedup, and no signal of its own resumes them.

On cpu each program is timed in `timing.processes_cpu` processes of its own in the same window
(entrants `candidate`, `candidate@1`, ...; `eager`, `eager@1`, ...), each with its share of the
timed frames, and its figures are those of its fastest process (fastest_process): the same code in
another process ran at another speed for a whole window, torch.compile's 2x in 3 of 36 runs of one
task, and a figure that hangs on which process a program drew is not the program's.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
from dataclasses import dataclass, field
from typing import Protocol

from hpc.profile.timing import Call, Failure, LoopResult, frames, timing_calls
from hpc.sandbox.cgroup import Cgroup, FreezeError
from hpc.sandbox.messages import CaptureReply, FailureKind
from hpc.sandbox.process import SandboxError


class EntrantError(Exception):
    """A driver's SandboxError (its process died, a request failed) in the window, with the
    entrant it came from: a candidate's is the candidate's, a baseline's the harness's."""

    def __init__(self, name: str, error: SandboxError):
        super().__init__(f"{name}: {error.reason}")
        self.name, self.error = name, error


class Runs(Protocol):
    """What a window needs of a driver (hpc.profile.driver.PairDriver)."""

    def run(self, calls: list[Call], batch_limit: int = 0, program: str = "", graph: bool = False) -> LoopResult: ...
    def capture(self, program: str, calls: int) -> CaptureReply: ...


@dataclass
class Entrant:
    """One program in the window: `program` of the process `driver` runs ("" for a candidate's
    process, whose one program is the candidate). `hold`: the cgroup to keep frozen while the other
    entrants run (None: none; the candidate's)."""

    name: str
    driver: Runs
    program: str
    warmup: list[Call]
    timed: list[Call]
    hold: Cgroup | None = None
    checkable: bool = True    # its outputs are the task's (not the empty program)
    graph: bool = False       # its frames replay its captured graph (record_graphs)


@dataclass
class Window:
    times_ns: dict[str, list[int]] = field(default_factory=dict)   # each entrant's timed calls, in order
    checks: dict[str, dict] = field(default_factory=dict)          # what the reference checked, per entrant
    orders: list[list[str]] = field(default_factory=list)          # the order of each round
    failed: str = ""                                              # the entrant whose loop failed
    failure: Failure | None = None                                 # its failure; call indexes its warmup + timed
    flush_ns: list[int] = field(default_factory=list)             # every frame's cache flush (cpu)


def process_name(program: str, process: int) -> str:
    """An entrant's name: the program's in its first process, `program@k` in its k-th after."""
    return program if process == 0 else f"{program}@{process}"


def program_of(name: str) -> str:
    """The program an entrant's name (process_name) times."""
    return name.partition("@")[0]


def process_of(name: str) -> int:
    """Which of its program's processes an entrant's name (process_name) is."""
    return int(name.partition("@")[2] or 0)


def fastest_process(times_ns: dict[str, list[int]], program: str) -> str:
    """The entrant of `program`'s processes whose timed frames' median is least: its figures are
    the program's. The rule is the same for the candidate and each baseline, and every process of
    a window runs frames of as many calls, in the same rounds, so a faster process is one that ran
    the program faster, not one timed under easier conditions."""
    names = [n for n in times_ns if program_of(n) == program and times_ns[n]]
    return min(names, key=lambda n: statistics.median(times_ns[n]))


def round_spans(frames_count: int, rounds: int) -> list[tuple[int, int]]:
    """The (start, end) of each round's frames among `frames_count` timed frames: consecutive runs
    whose lengths differ by at most one, the longer ones first. A program's figures (one per timed
    frame, in order) fall into its rounds by these spans."""
    size, extra = divmod(frames_count, rounds)
    out, start = [], 0
    for r in range(rounds):
        end = start + size + (r < extra)
        out.append((start, end))
        start = end
    return out


def chunks(calls: list[Call], rounds: int) -> list[list[Call]]:
    """`calls` cut into `rounds` runs of consecutive whole frames (round_spans)."""
    spans = frames(calls)
    return [calls[spans[start][0]:spans[end - 1][1]] if end > start else []
            for start, end in round_spans(len(spans), rounds)]


def paired_ratio(numerator_ms: list[float], denominator_ms: list[float], rounds: int) -> float:
    """How many times longer the numerator's calls take than the denominator's, read round by
    round: each of the denominator's frames set against the numerator's median in the same round
    of the window, and the median of those ratios over all the denominator's frames. The two
    programs of a round ran seconds apart, so a state of the device or host that holds for a few
    rounds divides out of every ratio, where a ratio of whole-window medians keeps it whenever the
    two programs' frames met it in different shares. The denominator is the candidate in every
    speedup, and the median is over its frames, so as with a whole-window median over half of them
    must be fast for the speedup to read fast: fast rounds, or frames, cannot carry it. NaN when no
    round has figures of both."""
    ratios = frame_ratios(numerator_ms, denominator_ms, rounds)
    return statistics.median(ratios) if ratios else float("nan")


def frame_ratios(numerator_ms: list[float], denominator_ms: list[float], rounds: int) -> list[float]:
    """Each of the denominator's frames against the numerator's median in its round (paired_ratio),
    in order; rounds where either program has no figure are left out."""
    ratios = []
    for (a, b), (c, d) in zip(round_spans(len(numerator_ms), rounds), round_spans(len(denominator_ms), rounds)):
        if b > a and d > c:
            reference = statistics.median(numerator_ms[a:b])
            ratios += [reference / x if x > 0 else math.inf for x in denominator_ms[c:d]]
    return ratios


def run_window(entrants: list[Entrant], rounds: int, rng: random.Random) -> Window:
    """Warm each entrant up, then time them in `rounds` rounds, each in an order drawn from `rng`;
    stops at the first failure (which entrant, and its call's index among its own calls).
    EntrantError when a driver raised."""
    window = Window({e.name: [] for e in entrants}, {e.name: {"checked": 0, "max_abs_error": 0.0,
                                                              "max_rel_error": 0.0} for e in entrants})
    done = {e.name: 0 for e in entrants}
    stopped: set[str] = set()

    def run(entrant: Entrant, calls: list[Call]) -> bool:
        for other in entrants:
            if other.hold is not None and other is not entrant and other.name not in stopped:
                try:
                    other.hold.freeze()
                except FreezeError as e:
                    raise EntrantError(other.name, SandboxError(f"its processes could not be frozen: {e}",
                                                                FailureKind.RUNTIME)) from None
                stopped.add(other.name)
        if entrant.name in stopped:
            entrant.hold.thaw()
            stopped.discard(entrant.name)
        try:
            result = entrant.driver.run(calls, program=entrant.program, graph=entrant.graph)
        except SandboxError as e:
            raise EntrantError(entrant.name, e) from None
        window.times_ns[entrant.name] += result.times_ns
        window.flush_ns += result.flush_ns
        checks = window.checks[entrant.name]
        checks["checked"] += result.checks.get("checked", 0)
        for key in ("max_abs_error", "max_rel_error"):
            checks[key] = max(checks[key], result.checks.get(key, 0.0))
        if result.failure is not None:
            window.failed, window.failure = entrant.name, result.failure
            if result.failure.call >= 0:
                result.failure.call += done[entrant.name]
            return False
        done[entrant.name] += len(calls)
        return True

    try:
        for entrant in entrants:
            if entrant.warmup and not run(entrant, entrant.warmup):
                return window
        parts = {e.name: chunks(e.timed, rounds) for e in entrants}
        for r in range(rounds):
            order = list(entrants)
            rng.shuffle(order)
            window.orders.append([e.name for e in order])
            for entrant in order:
                if parts[entrant.name][r] and not run(entrant, parts[entrant.name][r]):
                    return window
        return window
    finally:
        for entrant in entrants:
            if entrant.name in stopped:
                entrant.hold.thaw()


@dataclass
class Recording:
    """Whether the window's frames are graph replays, or why not; `failed`/`failure`: an entrant
    whose process ended or hung while its graph was checked (its calls cannot go on)."""

    graphs: bool
    reason: str = ""
    failed: str = ""
    failure: Failure | None = None


def record_graphs(entrants: list[Entrant], burst: int) -> Recording:
    """Record each entrant's frame of `burst` calls as a CUDA graph and check one replay of it:
    every output of a frame of fresh inputs compared with the reference's. Only when every entrant
    passes are the window's frames replays (each `graph` set), so the programs compared are always
    timed alike. A program that cannot be recorded, or whose replay gives other outputs than its
    calls (work on a stream of its own the capture missed), is no one's failure: the window is
    timed by calls, as the record says. EntrantError when a driver raised (a candidate that broke
    the rules while recorded included)."""
    for entrant in entrants:
        try:
            reply = entrant.driver.capture(entrant.program, burst)
        except SandboxError as e:
            raise EntrantError(entrant.name, e) from None
        if not reply.captured:
            return Recording(False, f"{entrant.name} could not be recorded as a graph: {reply.reason}")
    for entrant in entrants:
        if not entrant.checkable:
            continue
        check = timing_calls([secrets.randbits(62)], 0, {0}, burst)
        try:
            result = entrant.driver.run(check, program=entrant.program, graph=True)
        except SandboxError as e:
            raise EntrantError(entrant.name, e) from None
        failure = result.failure
        if failure is not None and failure.kind in (FailureKind.CRASH, FailureKind.TIMEOUT):
            return Recording(False, f"{entrant.name}'s graph: {failure.reason}", entrant.name, failure)
        if failure is not None:
            return Recording(False, f"{entrant.name}'s graph replay: {failure.reason}")
    for entrant in entrants:
        entrant.graph = True
    return Recording(True)


def timed_by(recording: Recording) -> dict[str, str]:
    """How the window's frames were timed, for the record's conditions."""
    if recording.graphs:
        return {"timed_by": "graph replays"}
    return {"timed_by": "calls", **({"graphs_refused": recording.reason} if recording.reason else {})}


def flush_rate(window: Window, flush_bytes: int) -> dict[str, float]:
    """The window's cache flushes, each a read of `flush_bytes` on the drivers' core before a
    frame, as a read rate (GB/s, their median): the memory bandwidth one core got while the programs
    were timed, which other work on the host (another tenant of the VM) takes its share of. A
    memory-bound ratio moves with it where the candidate and a baseline need bandwidth unequally.
    {} where nothing was flushed (cuda, whose flush is the device's; or the flush off)."""
    if not window.flush_ns or not flush_bytes:
        return {}
    return {"flush_gb_s": round(flush_bytes / statistics.median(window.flush_ns), 2)}


def handshake_ns(empty_ns: list[int]) -> tuple[float, float]:
    """The handshake's cost (the empty program's median) and the least figure that stands out of
    its noise: its interquartile range, and at least a tenth of the cost itself."""
    median = statistics.median(empty_ns)
    q = statistics.quantiles(empty_ns, n=4) if len(empty_ns) > 1 else [median] * 3
    return median, max(q[2] - q[0], median / 10)

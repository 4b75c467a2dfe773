"""Side by side: the programs an evaluation compares, timed in one window, in rounds.

Timing one program after another lets the host change between them: a baseline timed in a busy
minute stays slow in every comparison with it, and a handshake cost measured before the load came
is taken off figures measured under it. So the candidate, eager, each torch.compile mode and the
empty program (the handshake alone, whose median is taken off every figure) are timed together:
each first runs its warm-up calls, then the timed calls of each are cut into `rounds` chunks and
every round runs one chunk of each program, in an order the harness draws anew for the round. What
slows the host for a while slows every program's share of that while, and the ratios the reward
uses keep their value. While one program runs, the candidate's process and everything below it is
stopped (hpc.sandbox.freeze): threads or children it left running cannot slow a baseline timed
beside it, and so raise its own speedup.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Protocol

from hpc.profile.timing import Call, Failure, LoopResult, frames
from hpc.sandbox import freeze
from hpc.sandbox.messages import FailureKind
from hpc.sandbox.process import SandboxError


class EntrantError(Exception):
    """A driver's SandboxError (its process died, a request failed) in the window, with the
    entrant it came from: a candidate's is the candidate's, a baseline's the harness's."""

    def __init__(self, name: str, error: SandboxError):
        super().__init__(f"{name}: {error.reason}")
        self.name, self.error = name, error


class Runs(Protocol):
    """What a window needs of a driver (hpc.profile.driver.PairDriver)."""

    def run(self, calls: list[Call], batch_limit: int = 0, program: str = "") -> LoopResult: ...


@dataclass
class Entrant:
    """One program in the window: `program` of the process `driver` runs ("" for a candidate's
    process, whose one program is the candidate). `tree`: the pid of a program process to keep
    stopped, with everything below it, while the other entrants run (0: none; the candidate's)."""

    name: str
    driver: Runs
    program: str
    warmup: list[Call]
    timed: list[Call]
    tree: int = 0


@dataclass
class Window:
    times_ns: dict[str, list[int]] = field(default_factory=dict)   # each entrant's timed calls, in order
    checks: dict[str, dict] = field(default_factory=dict)          # what the reference checked, per entrant
    orders: list[list[str]] = field(default_factory=list)          # the order of each round
    failed: str = ""                                              # the entrant whose loop failed
    failure: Failure | None = None                                 # its failure; call indexes its warmup + timed


def chunks(calls: list[Call], rounds: int) -> list[list[Call]]:
    """`calls` cut into `rounds` runs of consecutive whole frames, their frame counts differing by
    at most one."""
    spans = frames(calls)
    size, extra = divmod(len(spans), rounds)
    out, start = [], 0
    for r in range(rounds):
        end = start + size + (r < extra)
        out.append(calls[spans[start][0]:spans[end - 1][1]] if end > start else [])
        start = end
    return out


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
            if other.tree and other is not entrant and other.name not in stopped:
                try:
                    freeze.stop(other.tree)
                except freeze.FreezeError as e:
                    raise EntrantError(other.name, SandboxError(f"its processes could not be stopped: {e}",
                                                                FailureKind.RUNTIME)) from None
                stopped.add(other.name)
        if entrant.name in stopped:
            freeze.resume(entrant.tree)
            stopped.discard(entrant.name)
        try:
            result = entrant.driver.run(calls, program=entrant.program)
        except SandboxError as e:
            raise EntrantError(entrant.name, e) from None
        window.times_ns[entrant.name] += result.times_ns
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
                freeze.resume(entrant.tree)


def handshake_ns(empty_ns: list[int]) -> tuple[float, float]:
    """The handshake's cost (the empty program's median) and the least figure that stands out of
    its noise: its interquartile range, and at least a tenth of the cost itself."""
    median = statistics.median(empty_ns)
    q = statistics.quantiles(empty_ns, n=4) if len(empty_ns) > 1 else [median] * 3
    return median, max(q[2] - q[0], median / 10)

"""The timing protocol, shared by every timed program (candidate, eager, torch.compile).

Per iteration: fresh inputs (never the same tensors twice, so caching on data_ptr or on input
fingerprints does not pay), a cache flush (a buffer larger than the last-level cache is
rewritten), then the call, timed to the end of ALL device work: on cuda with events around a
device-wide synchronize, so work left on a side stream is counted; on cpu with the monotonic
clock. Clock and event functions are captured when this module is imported, before any
candidate code runs, and `timers_intact` reports whether someone replaced them since.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

_perf_ns = time.perf_counter_ns
_monotonic_ns = time.monotonic_ns
_HAS_CUDA_EVENTS = hasattr(torch.cuda, "Event")
if _HAS_CUDA_EVENTS:
    _Event = torch.cuda.Event
    _event_record = torch.cuda.Event.record
    _event_elapsed = torch.cuda.Event.elapsed_time
    _event_sync = torch.cuda.Event.synchronize
    _cuda_sync = torch.cuda.synchronize


def timers_intact() -> bool:
    """False when time or CUDA event functions were replaced after this module was imported."""
    ok = time.perf_counter_ns is _perf_ns and time.monotonic_ns is _monotonic_ns
    if _HAS_CUDA_EVENTS:
        ok = ok and (torch.cuda.Event is _Event and torch.cuda.Event.record is _event_record
                     and torch.cuda.Event.elapsed_time is _event_elapsed
                     and torch.cuda.Event.synchronize is _event_sync and torch.cuda.synchronize is _cuda_sync)
    return ok


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
    def of(cls, times_ms: list[float]) -> "TimingStats":
        n = len(times_ms)
        med = statistics.median(times_ms)
        mean = statistics.fmean(times_ms)
        std = statistics.stdev(times_ms) if n > 1 else 0.0
        q = statistics.quantiles(times_ms, n=4) if n > 1 else [med, med, med]
        return cls(med, mean, min(times_ms), max(times_ms), q[2] - q[0], std / mean if mean else 0.0,
                   1.2533 * std / math.sqrt(n) / med if med else 0.0)


class CacheFlusher:
    """Rewrites a buffer larger than the cache before each timed call (L2 on GPU, LLC on CPU)."""

    def __init__(self, device: torch.device, nbytes: int):
        self.buffer = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device) if nbytes else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        _cuda_sync(device)


def time_call(call: Callable[[list], object], inputs: list, device: torch.device) -> tuple[float, object]:
    """One call, timed to the end of all device work; returns (milliseconds, output)."""
    if device.type == "cuda":
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        _event_record(start)
        out = call(inputs)
        _cuda_sync(device)          # device-wide: work on any stream is inside the interval
        _event_record(end)
        _event_sync(end)
        return _event_elapsed(start, end), out
    t0 = _perf_ns()
    out = call(inputs)
    return (_perf_ns() - t0) / 1e6, out


def time_calls(call: Callable[[list], object], make_inputs: Callable[[int], list], device: torch.device,
               warmup: int, iterations: int, flush_bytes: int,
               after_call: Callable[[int, object], None] | None = None) -> list[float]:
    """Time `iterations` calls, each on fresh inputs `make_inputs(i)`; returns milliseconds per call.

    `after_call(i, output)` runs outside the timed region (used to fingerprint every output).
    """
    flush = CacheFlusher(device, flush_bytes)
    for i in range(warmup):
        call(make_inputs(-1 - i))
    synchronize(device)
    times: list[float] = []
    for i in range(iterations):
        inputs = make_inputs(i)
        flush()
        synchronize(device)
        ms, out = time_call(call, inputs, device)
        times.append(ms)
        if after_call is not None:
            after_call(i, out)
        del out
    return times

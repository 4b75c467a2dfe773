"""The timing protocol, shared by every timed program (candidate, eager, torch.compile).

Per iteration: fresh inputs (never the same tensors twice, so caching on data_ptr or on input
fingerprints does not pay), a cache flush (a buffer larger than the last-level cache is
rewritten), then the call. On cpu the call is timed with the monotonic clock. On cuda:

- a start gate (gate_kernel/kernels/start_gate.cu) holds every SM until the call has returned on
  the host, so the call's launches queue behind it and the host launch path (Python, dispatch,
  the policy guard) is outside the device interval, which starts at an event after the gate;
- the interval ends when ALL device work has finished (a device-wide synchronize, so work left on
  a side stream counts), less the synchronize's own latency measured once on an empty call, and
  never before an event recorded on the calling stream right after the call;
- the figure is the larger of that device interval and the host time of the call: a call whose
  host side is slower than its kernels (or computes on the CPU) is paid at its host cost, as it
  would be when the calls run back to back.

Clock and event functions are captured when this module is imported, before any candidate code
runs, and `timers_intact` reports whether someone replaced them since.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

PROTOCOL = "gated-1"     # part of every cached baseline's key: a new protocol re-measures them

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


class StartGate:
    """Host side of the start gate: a kernel that fills every SM until `open` (or a timeout)."""

    def __init__(self, library: str | Path, timeout_us: float):
        lib = ctypes.CDLL(str(library))
        lib.hpc_start_gate_close.argtypes = [ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_void_p]
        lib.hpc_start_gate_open.argtypes = [ctypes.c_uint]
        rc = lib.hpc_start_gate_init()
        if rc:
            raise RuntimeError(f"start gate: CUDA error {rc} while allocating its flag")
        self._close, self._open = lib.hpc_start_gate_close, lib.hpc_start_gate_open
        self.blocks = lib.hpc_start_gate_blocks()
        self.timeout_ns = int(timeout_us * 1e3)
        self.token = 0

    def close(self, stream: int) -> None:
        self.token = self.token % 0xFFFFFFFF + 1
        rc = self._close(self.token, self.timeout_ns, stream)
        if rc:
            raise RuntimeError(f"start gate: CUDA error {rc} at launch")

    def open(self) -> None:
        self._open(self.token)


_gate: StartGate | None = None
_sync_latency_ms: dict[int, float] = {}


def install_start_gate(library: str | Path, timeout_us: float) -> None:
    """Load the start gate for this process's cuda timings (before any candidate code runs)."""
    global _gate
    _gate = StartGate(library, timeout_us)


def _gated_call(call: Callable[[list], object], inputs: list, device: torch.device, latency_ms: float):
    if _gate is None:
        raise RuntimeError("cuda timing needs the start gate: install_start_gate() first")
    start, end_stream, end_all = (_Event(enable_timing=True) for _ in range(3))
    _gate.close(torch.cuda.current_stream(device).cuda_stream)
    _event_record(start)
    t0 = _perf_ns()
    out = call(inputs)
    host_ms = (_perf_ns() - t0) / 1e6
    _event_record(end_stream)
    _gate.open()
    _cuda_sync(device)              # device-wide: work on any stream is inside the interval
    _event_record(end_all)
    _event_sync(end_all)
    device_ms = max(_event_elapsed(start, end_stream), _event_elapsed(start, end_all) - latency_ms)
    return device_ms, host_ms, _event_elapsed(end_stream, end_all), out


def sync_latency_ms(device: torch.device, calls: int = 50) -> float:
    """From the end of device work to the event after a device-wide synchronize: the fewest
    milliseconds over empty calls (an upper bound on what a side stream can hide)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sync_latency_ms:
        _sync_latency_ms[index] = min(_gated_call(lambda _: None, [], device, 0.0)[2] for _ in range(calls))
    return _sync_latency_ms[index]


def device_only_ms(launch: Callable[[], object], calls: int = 20) -> float:
    """Median device time of `launch()` alone: each launch queued behind a spin that keeps the GPU
    busy while the events are issued, so no host time is inside. The reference the protocol is
    checked against (tests/gpu/test_timing_protocol.py, benchmarks/timing_protocol.py)."""
    times = []
    for _ in range(calls):
        torch.cuda._sleep(2_000_000)
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        _event_record(start)
        launch()
        _event_record(end)
        _event_sync(end)
        times.append(_event_elapsed(start, end))
    return statistics.median(times)


@dataclass
class CallTime:
    ms: float               # what the call costs: the larger of its device interval and its host time
    host_ms: float          # the host side alone (launch path, Python, any CPU work)


def time_call(call: Callable[[list], object], inputs: list, device: torch.device) -> tuple[CallTime, object]:
    """One call under the protocol; returns its time and output."""
    if device.type == "cuda":
        device_ms, host_ms, _, out = _gated_call(call, inputs, device, sync_latency_ms(device))
        return CallTime(max(device_ms, host_ms), host_ms), out
    t0 = _perf_ns()
    out = call(inputs)
    ms = (_perf_ns() - t0) / 1e6
    return CallTime(ms, ms), out


def time_calls(call: Callable[[list], object], make_inputs: Callable[[int], list], device: torch.device,
               warmup: int, iterations: int, flush_bytes: int,
               after_call: Callable[[int, object], None] | None = None) -> list[CallTime]:
    """Time `iterations` calls, each on fresh inputs `make_inputs(i)`.

    `after_call(i, output)` runs outside the timed region (used to fingerprint every output).
    """
    flush = CacheFlusher(device, flush_bytes)
    for i in range(warmup):
        call(make_inputs(-1 - i))
    synchronize(device)
    times: list[CallTime] = []
    for i in range(iterations):
        inputs = make_inputs(i)
        flush()
        synchronize(device)
        took, out = time_call(call, inputs, device)
        times.append(took)
        if after_call is not None:
            after_call(i, out)
        del out
    return times

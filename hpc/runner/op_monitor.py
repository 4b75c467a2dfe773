"""The op monitor: which torch operators a candidate's forward dispatched, checked in C++.

The op rules must hold on every timed call, where a Python dispatch mode (the old proof) cost
~60-90 us of host time a call: on a small task that was the whole measured time. The monitor is a
torch RecordFunction callback (monitor_lib/kernels/op_monitor.cpp) on every thread, armed only
around the forward, at ~1 us a call. It sees each operator before any decomposition, so what
it allows is the allowlist plus every overload that only decomposes into other operators
(CompositeImplicitAutograd with no kernel of its own): each of those ops is seen and checked too.

A forward could switch the callback off (clear torch's callbacks, disable RecordFunction on its
thread) and then look clean: so `disarm` records a canary while still armed, through the gate the
dispatcher passes for every operator, and a canary the callback did not see makes the verdict
`DISABLED`. A switch scoped inside one native call (a
RecordFunctionGuard in a load_inline function) is back on when the call returns: the canary cannot
see it, the static check of the inline sources (hpc/verify/static.py) refuses the names.

Built by the harness against the running torch (hpc/compile/op_monitor.py), once per machine and
torch version, outside the sandbox; a worker loads it by path before any candidate code runs.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

DISABLED = -1   # disarm's verdict when the canary was not seen: the monitor was switched off


@lru_cache(maxsize=1)
def decomposing_overloads() -> frozenset[str]:
    """Every overload whose only kernel calls other operators (each then seen by the monitor)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(op for op in torch._C._dispatch_get_all_op_names()
                     if has(op, "CompositeImplicitAutograd") and not has(op, "CPU") and not has(op, "CUDA"))


class OpMonitor:
    """Arm around a forward; `disarm()` returns how many operators outside the allowlist ran since
    `arm()` (0: none; `first()` names the first) or `DISABLED`. Both are the library's functions
    themselves, with no Python in between: they run around every timed call."""

    def __init__(self, library: str | Path, allowed: frozenset[str]):
        lib = ctypes.CDLL(str(library))
        lib.hpc_op_monitor_allow.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.hpc_op_monitor_disarm.restype = ctypes.c_long
        lib.hpc_op_monitor_seen.restype = ctypes.c_long
        lib.hpc_op_monitor_first.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        ops = "\n".join(f"aten::{name}" for name in sorted(allowed)).encode()
        if lib.hpc_op_monitor_allow(ops, "\n".join(sorted(decomposing_overloads())).encode()):
            raise RuntimeError("op monitor: the allowlist cannot change while it is armed")
        self._lib = lib
        self.arm = lib.hpc_op_monitor_arm
        self.disarm = lib.hpc_op_monitor_disarm

    def first(self) -> str:
        """The first operator outside the allowlist between the last arm and disarm, or ""."""
        buf = ctypes.create_string_buffer(256)
        self._lib.hpc_op_monitor_first(buf, len(buf))
        return buf.value.decode(errors="replace")

    def seen(self) -> int:
        """Operators dispatched between the last arm and disarm."""
        return self._lib.hpc_op_monitor_seen()

"""The evaluator's rules for a candidate's forward at run time: what it may call, proof its own code ran.

Inside `ModelNew.forward` a candidate may allocate, take views, copy memory and call its own
kernels. Every other aten op (matmul, add, softmax...) means torch did the work: a violation,
seen on every call (correctness trials and timed calls alike) by the op monitor.
A forward that switches the monitor off fails too (its canary, `disarm`, is not seen).
A forward that calls none of its own kernels, starts threads, mutates its inputs or returns
anything but plain tensors fails too. Each failure carries a named reason.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpc.runner.inputs import as_tuple
from hpc.runner.op_monitor import DISABLED, OpMonitor

ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like new_zeros ones ones_like
new_ones full full_like new_full fill_ zero_ scalar_tensor arange
view _unsafe_view reshape as_strided t transpose permute expand squeeze unsqueeze slice select split
split_with_sizes unbind chunk narrow detach alias view_as flatten unflatten movedim
contiguous clone copy_ _to_copy lift_fresh resize_ set_
is_contiguous size stride dim numel sym_size sym_stride sym_numel sym_storage_offset
_local_scalar_dense item is_same_size
""".split())


class RuleViolation(Exception):
    """The candidate broke the evaluator's rules (config `rules`); the message is the recorded reason."""


UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
POISON = (float("nan"), -3.0e7)   # alternate per correctness trial: reading uninitialized memory shows


class _PoisonFill(TorchDispatchMode):
    """Fills every uninitialized allocation of the forward with `poison`."""

    def __init__(self, poison: float):
        super().__init__()
        self.poison = poison

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in UNINITIALIZED and isinstance(out, torch.Tensor):
            out.fill_(self.poison if out.is_floating_point() else -1)
        return out


def warm_up() -> None:
    """The first dispatch mode a process enters imports torch's dispatch machinery (~2 s). A
    program worker does it on start, while the harness is still setting up the reference, so that
    second is not on the evaluation's path (it was the first correctness trial's)."""
    with _PoisonFill(0.0):
        torch.empty(1)


def _op_name(recorded: str) -> str:
    return recorded.replace("::", ".", 1)


class ForwardGuard:
    """Wraps a candidate model so every forward call is checked against the rules."""

    def __init__(self, model: torch.nn.Module, monitor: OpMonitor, require_custom_kernel: bool, launch_counter):
        self.model = model
        self.monitor = monitor
        self.require_custom_kernel = require_custom_kernel
        self.launch_counter = launch_counter

    def __call__(self, inputs: list, check_inputs: bool = False, poison: float | None = None):
        """Run forward under the rules; with `check_inputs`, also verify the inputs were left intact.

        `poison` fills every uninitialized allocation the candidate makes (torch.empty...), so a
        kernel that reads memory it never wrote fails the comparison instead of passing by luck.
        """
        before = [x.clone() for x in inputs if isinstance(x, torch.Tensor)] if check_inputs else None
        threads = threading.active_count()
        launches = self.launch_counter()
        self.monitor.arm()
        try:
            if poison is None:
                out = self.model(*inputs)
            else:
                with _PoisonFill(poison):
                    out = self.model(*inputs)
        finally:
            verdict = self.monitor.disarm()
        if verdict == DISABLED:
            raise RuleViolation("the op monitor was disabled during forward (torch's RecordFunction callbacks "
                                "were cleared or switched off)")
        if verdict:
            raise RuleViolation(f"torch op {_op_name(self.monitor.first())} inside ModelNew.forward "
                                "(torch must not do the work)")
        if threading.active_count() > threads:
            raise RuleViolation("forward started a thread that outlives the call")
        if self.require_custom_kernel and self.launch_counter() == launches:
            raise RuleViolation("forward called none of the candidate's own kernels")
        for i, t in enumerate(as_tuple(out)):
            if type(t) is not torch.Tensor:
                raise RuleViolation(f"output {i} is a {type(t).__module__}.{type(t).__name__}, "
                                    "not a plain torch.Tensor")
        if before is not None:
            after = [x for x in inputs if isinstance(x, torch.Tensor)]
            for i, (a, b) in enumerate(zip(before, after)):
                if not torch.equal(a, b) and not (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                                  and torch.equal(a.nan_to_num(), b.nan_to_num())):
                    raise RuleViolation(f"forward modified its input {i} in place")
        return out

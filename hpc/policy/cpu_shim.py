"""Run megatron-core on a machine without CUDA (tests, the embedded CPU default).

megatron-core assumes a GPU in a few places that the policy code reaches: tensors and buffers
are allocated on `torch.cuda.current_device()`, the tensor-parallel RNG tracker saves and
restores the CUDA generator, and a few collectives call `torch.cuda.synchronize()`. Without
CUDA each of these raises. `apply()` redirects exactly those calls to the CPU:

- `torch.cuda.current_device()` returns "cpu", so every allocation lands on the CPU;
- `torch.cuda.synchronize()` does nothing (CPU work is synchronous);
- `torch.cuda.get_rng_state/set_rng_state/manual_seed` and megatron's
  `tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state` use the CPU generator, so
  the RNG tracker's forks (dropout in tensor-parallel regions) are real forks of the CPU RNG;
- with pipeline stages and tied embeddings, megatron moves the last stage's copy of the
  embedding `.cuda()` before all-reducing it with the first stage's: that one method runs with
  `Tensor.cuda` returning the tensor itself;
- the causal mask megatron's DotProductAttention builds when given no mask (`forward_mask`
  gives none for a right-padded batch) is built on the CPU rather than on "cuda";
- megatron's non-interleaved pipeline schedule (the trainer's under pipeline parallelism) and
  its no-pipelining schedule (the trainer's gradient accumulation at one stage) allocate their
  token counter with `device="cuda"`: while they run, `torch.zeros` puts a tensor asked for on
  "cuda" on the CPU.

megatron's DistributedDataParallel and optimizer (the trainer's, `hpc.policy.optimizer`) need
two more, and only while they build and step: `megatron_on_cpu()` is a TorchFunctionMode under
which a tensor asked for on "cuda" (`device="cuda"`: the optimizer's and clip_grads' scratch
tensors) is made on the CPU, and `Tensor.type()` names a CPU tensor's CUDA type
('torch.cuda.FloatTensor': the mixed-precision optimizer sorts parameters by that name and
clip_grads asserts it). It is a no-op unless `apply()` is in force.

On a machine with CUDA `apply()` changes nothing. `init_parallel` applies it and `teardown`
removes it (`restore()`), so the rest of a process (other tests, the evaluator) sees torch as
it was. What it does not cover (megatron's distributed optimizer, fused kernels, sequence
parallel, the interleaved schedule) is listed in docs/policy.md; the policy code keeps away from
those on CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# (owner, attribute) -> the original, while the patches are in force.
_originals: dict[tuple[Any, str], Any] = {}


def needed() -> bool:
    """True when this process has no usable CUDA device, i.e. when `apply()` would patch."""
    return not torch.cuda.is_available()


def applied() -> bool:
    """Whether the patches are in force now."""
    return bool(_originals)


def apply() -> bool:
    """Patch torch.cuda and megatron's RNG helpers onto the CPU when there is no CUDA.

    Returns whether the patches are in force. Idempotent; call it before building a model.
    """
    if _originals:
        return True
    if not needed():
        return False
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.models.common.language_module.language_module import LanguageModule

    patches = {
        (torch.cuda, "current_device"): _current_device,
        (torch.cuda, "synchronize"): _synchronize,
        (torch.cuda, "get_rng_state"): _get_rng_state,
        (torch.cuda, "set_rng_state"): _set_rng_state,
        (torch.cuda, "manual_seed"): _manual_seed,
        (torch.cuda.random, "get_rng_state"): _get_rng_state,
        (torch.cuda.random, "set_rng_state"): _set_rng_state,
        (mrandom, "_get_cuda_rng_state"): _get_rng_state,
        (mrandom, "_set_cuda_rng_state"): _set_rng_state,
        (LanguageModule, "setup_embeddings_and_output_layer"):
            _on_cpu(LanguageModule.setup_embeddings_and_output_layer),
        (fused_softmax, "get_default_causal_mask"): _default_causal_mask,
        (schedules, "forward_backward_pipelining_without_interleaving"):
            _zeros_on_cpu(schedules.forward_backward_pipelining_without_interleaving),
        (schedules, "forward_backward_no_pipelining"): _zeros_on_cpu(schedules.forward_backward_no_pipelining),
    }
    for (owner, name), value in patches.items():
        _originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)
    return True


def restore() -> None:
    """Undo `apply()` (a no-op when it is not in force)."""
    while _originals:
        (owner, name), value = _originals.popitem()
        setattr(owner, name, value)


def megatron_on_cpu() -> contextlib.AbstractContextManager:
    """While megatron's DDP and optimizer build, step or save: "cuda" allocations on the CPU and
    CUDA type names for CPU tensors (`_CudaOnCpu`); nothing when `apply()` is not in force."""
    return _CudaOnCpu() if _originals else contextlib.nullcontext()


class _CudaOnCpu(TorchFunctionMode):
    """`device="cuda"` -> the CPU; `tensor.type()` (no argument) -> 'torch.cuda.<Type>Tensor'."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _current_device() -> str:
    return "cpu"


def _synchronize(device: Any = None) -> None:
    return None


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)


def _on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with `Tensor.cuda` returning the tensor itself while it runs."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda
    return wrapper


def _zeros_on_cpu(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with `torch.zeros(..., device="cuda")` allocating on the CPU while it runs."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        zeros = torch.zeros

        def cpu_zeros(*size: Any, device: Any = None, **options: Any) -> torch.Tensor:
            return zeros(*size, device="cpu" if str(device).startswith("cuda") else device, **options)

        torch.zeros = cpu_zeros
        try:
            return function(*args, **kwargs)
        finally:
            torch.zeros = zeros
    return wrapper

"""Seeded inputs, input distributions and output fingerprints, identical in every worker process."""

from __future__ import annotations

import types

import torch

from hpc.config import DISTRIBUTIONS


def make_inputs(task: types.ModuleType, seed: int, distribution: str, device: torch.device) -> list:
    """The task's `get_inputs()` under `seed`, float inputs rescaled for non-default distributions.

    Generated on `device` directly: drawing gigabytes of GPU-scale inputs on the host is slower
    than the evaluation itself.
    """
    torch.manual_seed(seed)
    with device:
        inputs = list(task.get_inputs())
    factor = DISTRIBUTIONS.get(distribution)
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            if factor == "pareto" and x.is_floating_point():
                u = torch.rand(x.shape, dtype=torch.float64, device=x.device)
                x = (x.double() * (1.0 - u).pow(-1.0 / 1.5)).to(x.dtype)
            elif factor is not None and x.is_floating_point():
                x = x * factor
            x = x.to(device)
        out.append(x)
    return out


def init_model(cls, task: types.ModuleType, seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls(*task.get_init_inputs()).to(device).eval()


def as_tuple(output) -> tuple:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def fingerprint(output) -> torch.Tensor:
    """[n_outputs, 5] float64: sum, abs-sum, position-weighted sum, NaN count, element count.

    Cheap enough for every timed iteration; a stale or wrong output cannot match by accident.
    """
    rows = []
    for t in as_tuple(output):
        if not isinstance(t, torch.Tensor):
            rows.append(torch.full((5,), float("nan"), dtype=torch.float64))
            continue
        x = t.detach().reshape(-1).to(torch.float64)
        nan = torch.isnan(x)
        x = torch.where(nan, torch.zeros_like(x), x)
        w = (torch.arange(x.numel(), device=x.device) % 7 - 3).to(torch.float64)
        rows.append(torch.stack([x.sum(), x.abs().sum(), (x * w).sum(),
                                 nan.sum().to(torch.float64), torch.tensor(float(x.numel()), device=x.device,
                                                                          dtype=torch.float64)]).cpu())
    return torch.stack(rows)


def timed_inputs(base: list, iteration: int) -> list:
    """Inputs of timed iteration `iteration`: fresh copies of `base`, each flattened and rolled.

    New storage and new contents every iteration (for any non-constant tensor), the same value
    distribution as the task's own inputs, and cheap on the device; any process holding the same
    `base` derives the same inputs, which is how the reference checks timed outputs.
    """
    out = []
    for j, x in enumerate(base):
        if isinstance(x, torch.Tensor) and x.numel() > 1:
            shift = (iteration * 2654435761 + j * 40503 + 12345) % x.numel()
            x = torch.roll(x.reshape(-1), shift).reshape(x.shape)
        elif isinstance(x, torch.Tensor):
            x = x.clone()
        out.append(x)
    return out

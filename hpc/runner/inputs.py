"""Seeded inputs and input distributions, made in the reference worker (the trusted side)."""

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

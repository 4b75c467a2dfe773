"""Allocates far more memory than the sandbox allows."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty(1 << 40, device=x.device)
        kernels.noop(out, 0)
        return out[: x.numel()]

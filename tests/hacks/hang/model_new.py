"""Never returns."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        kernels.spin(out, x.numel())
        return out

import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x = x.contiguous()
        d = self.dim % x.dim()
        outer = 1
        for s in x.shape[:d]:
            outer *= s
        inner = 1
        for s in x.shape[d + 1:]:
            inner *= s
        out = torch.empty(x.shape[:d] + x.shape[d + 1:], device=x.device)
        kernels.sum_mid(out, x, outer, x.shape[d], inner, 1.0)
        return out

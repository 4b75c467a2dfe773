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
        cols = x.shape[-1]
        rows = x.numel() // cols
        out = torch.empty(x.shape[:-1], device=x.device)
        kernels.row_max(out, x, rows, cols)
        return out

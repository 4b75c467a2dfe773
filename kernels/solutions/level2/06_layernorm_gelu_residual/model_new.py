import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        D = x.shape[-1]
        kernels.ln_gelu_res(y, x, self.norm.weight, self.norm.bias, x.numel() // D, D, float(self.norm.eps))
        return y

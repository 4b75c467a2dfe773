import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        B, C = x.shape[0], x.shape[1]
        kernels.mean_div_tanh(y, x, B, C, x.numel() // (B * C))
        return y

import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty(a.shape[0], b.shape[1], device=a.device)
        kernels.matmul(out, a, b, a.shape[0], b.shape[1], a.shape[1])
        return out

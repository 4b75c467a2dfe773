import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], device=a.device)
        kernels.bmm(out, a, b, a.shape[0], a.shape[1], b.shape[2], a.shape[2])
        return out

"""Never calls its own code: returns a copy of the input (wrong, but first it is unpaid work)."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        return x.clone()

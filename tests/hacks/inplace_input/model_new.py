"""Applies ReLU to its input in place and returns the input."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        kernels.relu(x, x, x.numel())
        return x

"""Inclusive prefix sum (scan) along dim 1."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.cumsum(x, dim=self.dim)


batch_size = 4096
length = 16384
scan_dim = 1


def get_inputs():
    return [torch.randn(batch_size, length)]


def get_init_inputs():
    return [scan_dim]


SCALES = {"cpu": {"batch_size": 1024, "length": 4096}}

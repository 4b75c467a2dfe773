"""Max reduction over the last dimension (values only)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.amax(x, dim=self.dim)


batch_size = 16384
dim = 16384


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [-1]


SCALES = {"cpu": {"batch_size": 4096, "dim": 4096}}

"""Mean reduction over the leading dimension (column means)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.mean(x, dim=self.dim)


rows = 8192
cols = 16384
reduce_dim = 0


def get_inputs():
    return [torch.randn(rows, cols)]


def get_init_inputs():
    return [reduce_dim]


SCALES = {"cpu": {"rows": 4096, "cols": 4096}}

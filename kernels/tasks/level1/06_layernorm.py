"""LayerNorm over the last dimension (nn.LayerNorm with affine weight and bias)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        return self.ln(x)


batch_size = 8192
dim = 8192


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]


SCALES = {"cpu": {"batch_size": 2048, "dim": 2048}}

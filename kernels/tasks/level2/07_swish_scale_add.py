"""Swish of one input, scaled, plus a second input."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return x * torch.sigmoid(x) * self.scale + y


batch_size = 4096
dim = 16384
scale = 0.75


def get_inputs():
    return [torch.randn(batch_size, dim), torch.randn(batch_size, dim)]


def get_init_inputs():
    return [scale]


SCALES = {"cpu": {"batch_size": 4096, "dim": 1024}}

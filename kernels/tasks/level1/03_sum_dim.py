"""Sum reduction over the middle dimension of a 3D tensor."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.sum(x, dim=self.dim)


batch_size = 64
dim1 = 1024
dim2 = 1024
reduce_dim = 1


def get_inputs():
    return [torch.randn(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]


SCALES = {"cpu": {"batch_size": 32, "dim1": 1024, "dim2": 512}}

"""Linear layer, exact (erf) GELU, multiply by a constant."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return F.gelu(self.linear(x)) * self.scale


batch_size = 16384
in_features = 2048
out_features = 4096
scale = 1.5


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale]


SCALES = {"cpu": {"batch_size": 1024, "in_features": 256, "out_features": 512}}

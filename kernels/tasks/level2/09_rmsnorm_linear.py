"""RMSNorm with a learned gain, then a linear layer."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, eps):
        super().__init__()
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(in_features))
        self.linear = nn.Linear(in_features, out_features)
        self.eps = eps

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return self.linear(x)


batch_size = 16384
in_features = 4096
out_features = 2048
eps = 1e-6


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, eps]


SCALES = {"cpu": {"batch_size": 1024, "in_features": 1024, "out_features": 256}}

"""Linear layer, extra bias add, ReLU."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x):
        return torch.relu(self.linear(x) + self.bias)


batch_size = 16384
in_features = 2048
out_features = 4096


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]


SCALES = {"cpu": {"batch_size": 1024, "in_features": 256, "out_features": 512}}

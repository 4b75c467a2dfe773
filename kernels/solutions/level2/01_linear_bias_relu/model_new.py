import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x):
        x = x.contiguous()
        lin = self.linear
        out = torch.empty(x.shape[0], lin.out_features, device=x.device)
        kernels.linear_bias_relu(out, x, lin.weight, lin.bias, self.bias, x.shape[0], lin.in_features, lin.out_features)
        return out

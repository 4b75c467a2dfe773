import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)
RELU = 1


class ModelNew(nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc4 = nn.Linear(hidden, out_features)

    def forward(self, x):
        x = x.contiguous()
        for fc, act in ((self.fc1, RELU), (self.fc2, RELU), (self.fc3, RELU), (self.fc4, 0)):
            out = torch.empty(x.shape[0], fc.out_features, device=x.device)
            kernels.linear(out, x, fc.weight, fc.bias, x.shape[0], fc.in_features, fc.out_features, act)
            x = out
        return x

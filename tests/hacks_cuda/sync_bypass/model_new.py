"""Native code turns the CUDA runtime's device-wide synchronize into a no-op in its own process,
then queues slow work: its process answers each call long before the output exists. Only a
copy of the output taken from outside, the moment the call is answered, can tell."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        kernels.slow_relu_without_sync(out, x, x.numel())
        return out

"""Records nothing when its call is captured as a CUDA graph, so a replay would cost nothing and
leave its outputs unwritten: the replay's check finds them wrong, and the window is timed by calls."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        kernels.relu(out, x, x.numel())
        return out

"""Rewrites libc's clock_gettime in its own process so that time passes 1000x slower while its
kernel runs: every clock read in this process (Python's time module, CUDA's host timers) reports
a tiny call. A protocol that read any clock of the candidate's process would pay it as a 1000x
speedup."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        kernels.relu_with_slow_clock(out, x, x.numel())
        return out

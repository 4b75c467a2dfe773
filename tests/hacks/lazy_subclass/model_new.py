"""Returns a torch.Tensor subclass (a lazy tensor would compute only when compared)."""
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)



class Lazy(torch.Tensor):
    pass


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        kernels.relu(out, x, x.numel())
        return out.as_subclass(Lazy)

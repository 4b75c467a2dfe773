import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, kernel_size, stride, padding):
        super().__init__()
        self.k, self.s, self.p = kernel_size, stride, padding

    def forward(self, x):
        x = x.contiguous()
        n, c, h, w = x.shape
        oh = (h + 2 * self.p - self.k) // self.s + 1
        ow = (w + 2 * self.p - self.k) // self.s + 1
        out = torch.empty(n, c, oh, ow, device=x.device)
        kernels.maxpool2d(out, x, n * c, h, w, oh, ow, self.k, self.s, self.p)
        return out

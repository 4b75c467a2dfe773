import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=True)

    def forward(self, x):
        x = x.contiguous()
        n, c, h, w = x.shape
        co, _, kh, kw = self.conv.weight.shape
        ph, pw = self.conv.padding
        oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
        out = torch.empty(n, co, oh, ow, device=x.device)
        kernels.conv2d(out, x, self.conv.weight.contiguous(), self.conv.bias.contiguous(),
                       n, c, h, w, co, kh, kw, ph, pw)
        return out

import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        x = x.contiguous()
        B, Ci, H, W = x.shape
        Co, _, KH, KW = self.conv.weight.shape
        bn = self.bn
        y = torch.empty(B, Co, H - KH + 1, W - KW + 1, device=x.device)
        kernels.conv_bn_relu(y, x, self.conv.weight, self.conv.bias, bn.running_mean, bn.running_var,
                             bn.weight, bn.bias, float(bn.eps), B, Ci, H, W, Co, KH, KW)
        return y

import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_channels, mid_channels, out_channels, height, width, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, mid_channels, 3, padding=1)
        self.conv2 = nn.Conv2d(mid_channels, out_channels, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(out_channels * (height // 2) * (width // 2), num_classes)

    def forward(self, x):
        n, _, h, w = x.shape
        x = x.contiguous()
        if kernels.device == "cuda":
            return self._forward_cuda(x)
        for conv in (self.conv1, self.conv2):
            out = torch.empty(n, conv.out_channels, h, w)
            kernels.conv3x3_relu(out, x, conv.weight, conv.bias, n, conv.in_channels, conv.out_channels, h, w)
            x = out
        pooled = torch.empty(n, x.shape[1], h // 2, w // 2)
        kernels.maxpool2x2(pooled, x, n * x.shape[1], h, w)
        out = torch.empty(n, self.fc.out_features)
        kernels.linear(out, pooled, self.fc.weight, self.fc.bias, n, self.fc.in_features, self.fc.out_features, 0)
        return out

    def _forward_cuda(self, x):
        n, _, h, w = x.shape
        for conv in (self.conv1, self.conv2):
            out = torch.empty(n, conv.out_channels, h, w, device=x.device)
            kernels.conv3x3_relu(out, x, conv.weight, conv.bias, n, conv.in_channels, conv.out_channels, h, w)
            x = out
        c, classes = x.shape[1], self.fc.out_features
        part = torch.empty(c, n, classes, device=x.device)
        out = torch.empty(n, classes, device=x.device)
        kernels.maxpool_linear(out, part, x, self.fc.weight, self.fc.bias, n, c, h, w, classes)
        return out

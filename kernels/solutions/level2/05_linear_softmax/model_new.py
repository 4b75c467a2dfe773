import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = x.contiguous()
        lin = self.linear
        out = torch.empty(x.shape[0], lin.out_features, device=x.device)
        if kernels.device == "cuda":
            # per-(row, 128-column tile) softmax partials (max, sum of exp) written by the GEMM epilogue
            stats = torch.empty(x.shape[0], (lin.out_features + 127) // 128, 2, device=x.device)
            kernels.linear_softmax_gpu(out, stats, x, lin.weight, lin.bias,
                                       x.shape[0], lin.in_features, lin.out_features)
        else:
            kernels.linear_softmax(out, x, lin.weight, lin.bias, x.shape[0], lin.in_features, lin.out_features)
        return out

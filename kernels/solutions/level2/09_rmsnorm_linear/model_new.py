import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, eps):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(in_features))
        self.linear = nn.Linear(in_features, out_features)
        self.eps = float(eps)

    def forward(self, x):
        x = x.contiguous()
        lin = self.linear
        out = torch.empty(x.shape[0], lin.out_features, device=x.device)
        if kernels.device == "cuda":
            # the gain folded into the weight's columns first: the GEMM's inner loop then loads no gain
            wg = torch.empty_like(lin.weight)
            kernels.gain_columns(wg, lin.weight, self.norm_weight, lin.out_features, lin.in_features)
            kernels.rms_linear(out, x, wg, lin.bias, x.shape[0], lin.in_features, lin.out_features, self.eps)
        else:
            kernels.rmsnorm_linear(out, x, self.norm_weight, lin.weight, lin.bias,
                                   x.shape[0], lin.in_features, lin.out_features, self.eps)
        return out

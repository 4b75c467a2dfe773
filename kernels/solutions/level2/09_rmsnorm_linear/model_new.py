import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


def gemm_workspace(a, m, n, k, batch=1):
    """Device scratch of wgmma.cuh's GEMM: B split into big and small halves, K-major, K padded to
    32; A copied there too when the tensor copy engine cannot read it in place (K % 4, alignment)."""
    kp = (k + 31) // 32 * 32
    copy_a = k % 4 != 0 or a.data_ptr() % 16 != 0
    return torch.empty(batch * (2 * n + (m if copy_a else 0)) * kp, device=a.device)


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
            m, k, n = x.shape[0], lin.in_features, lin.out_features
            w_g = torch.empty_like(lin.weight)
            kernels.gain_columns(w_g, lin.weight, self.norm_weight, n, k)
            kernels.rms_linear(out, x, w_g, lin.bias, gemm_workspace(x, m, n, k), m, k, n, self.eps)
        else:
            kernels.rmsnorm_linear(out, x, self.norm_weight, lin.weight, lin.bias,
                                   x.shape[0], lin.in_features, lin.out_features, self.eps)
        return out

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
            m, k, n = x.shape[0], lin.in_features, lin.out_features
            kernels.linear_softmax_gpu(out, stats, x, lin.weight, lin.bias, gemm_workspace(x, m, n, k), m, k, n)
        else:
            kernels.linear_softmax(out, x, lin.weight, lin.bias, x.shape[0], lin.in_features, lin.out_features)
        return out

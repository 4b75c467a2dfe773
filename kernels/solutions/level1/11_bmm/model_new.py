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
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], device=a.device)
        batch, m, n, k = a.shape[0], a.shape[1], b.shape[2], a.shape[2]
        if kernels.device == "cuda":
            kernels.bmm(out, a, b, gemm_workspace(a, m, n, k, batch), batch, m, n, k)
        else:
            kernels.bmm(out, a, b, batch, m, n, k)
        return out

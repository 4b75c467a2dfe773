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
RELU = 1


class ModelNew(nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc4 = nn.Linear(hidden, out_features)

    def forward(self, x):
        x = x.contiguous()
        for fc, act in ((self.fc1, RELU), (self.fc2, RELU), (self.fc3, RELU), (self.fc4, 0)):
            m, k, n = x.shape[0], fc.in_features, fc.out_features
            out = torch.empty(m, n, device=x.device)
            if kernels.device == "cuda":
                kernels.linear(out, x, fc.weight, fc.bias, gemm_workspace(x, m, n, k), m, k, n, act)
            else:
                kernels.linear(out, x, fc.weight, fc.bias, m, k, n, act)
            x = out
        return x

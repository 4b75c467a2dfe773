"""Batched matrix multiplication C[b] = A[b] @ B[b] with torch.bmm."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.bmm(a, b)


batch_size = 128
M = 1024
K = 1024
N = 1024


def get_inputs():
    return [torch.randn(batch_size, M, K), torch.randn(batch_size, K, N)]


def get_init_inputs():
    return []


SCALES = {"cpu": {"batch_size": 16, "M": 256, "K": 256, "N": 256}}

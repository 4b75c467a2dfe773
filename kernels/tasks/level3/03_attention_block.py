"""Pre-norm transformer block: LayerNorm, multi-head self-attention, LayerNorm, GELU MLP, residuals."""
import math

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio):
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        self.act = nn.GELU()

    def forward(self, x):
        b, t, d = x.shape
        h = self.num_heads
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h)), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


batch_size = 16
seq_len = 512
dim = 1024
num_heads = 16
mlp_ratio = 4


def get_inputs():
    return [torch.randn(batch_size, seq_len, dim)]


def get_init_inputs():
    return [dim, num_heads, mlp_ratio]


SCALES = {"cpu": {"batch_size": 4, "seq_len": 128, "dim": 256, "num_heads": 4}}

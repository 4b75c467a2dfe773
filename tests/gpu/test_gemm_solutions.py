"""The shipped GEMM-family CUDA solutions (one 3xTF32 wgmma GEMM, wgmma.cuh, with fused epilogues)
at shapes the evaluator never runs them at: partial tiles, K and N not multiples of 4 or of the
32-wide k tile (A copied into the workspace), batches. Each is checked against the task's own model in
float64 at the evaluator's fp32 tolerance.

Runs only where torch sees a CUDA device (the H200 machine): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hpc.task import load_task_module
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu
SHAPES = [(1, 1, 1), (37, 53, 29), (130, 257, 131), (256, 128, 64), (515, 300, 1031), (64, 1024, 2048)]

# task -> (init args, inputs) for an (m, n, k) problem
CASES = {
    "level1/01_matmul": lambda m, n, k: ([], [torch.randn(m, k), torch.randn(k, n)]),
    "level1/11_bmm": lambda m, n, k: ([], [torch.randn(3, m, k), torch.randn(3, k, n)]),
    "level2/01_linear_bias_relu": lambda m, n, k: ([k, n], [torch.randn(m, k)]),
    "level2/02_linear_gelu_scale": lambda m, n, k: ([k, n, 1.5], [torch.randn(m, k)]),
    "level2/05_linear_softmax": lambda m, n, k: ([k, n], [torch.randn(m, k)]),
    "level2/09_rmsnorm_linear": lambda m, n, k: ([k, n, 1e-6], [torch.randn(m, k)]),
    "level3/01_mlp": lambda m, n, k: ([k, n + 5, n], [torch.randn(m, k)]),
}


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("task_id", sorted(CASES))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_solution_matches_float64_reference(task_id, m, n, k):
    torch.manual_seed(m * 7919 + n * 31 + k)
    task = load_task_module(ROOT / "kernels" / "tasks" / f"{task_id}.py", "gpu", f"task_{task_id.replace('/', '_')}")
    solution = _module(ROOT / "kernels" / "solutions" / task_id / "model_new.py", f"sol_{task_id.replace('/', '_')}")
    init, inputs = CASES[task_id](m, n, k)
    ref = task.Model(*init).double().cuda().eval()
    cand = solution.ModelNew(*init).cuda().eval()
    cand.load_state_dict({name: p.float() for name, p in ref.state_dict().items()})
    with torch.no_grad():
        expected = ref(*[x.double().cuda() for x in inputs])
        got = cand(*[x.cuda() for x in inputs])
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)

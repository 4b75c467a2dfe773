"""The level-3 conv_block and attention_block CUDA solutions at shapes the evaluator never runs them at
(odd sizes, sequence lengths that leave a partial 64-key tile, head dims that take the fallback
attention kernel, K not a multiple of 4, 4 input channels for conv.cuh's path) and at the task's own
GPU scale. Each is checked against the task's own model in float64 at the evaluator's fp32 tolerance
(atol in units of max(1, mean |reference|)).

Runs only where torch sees a CUDA device (the H200 machine): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hpc.task import load_task_module
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

# task -> cases of (init args, input shape); None: the task's own module-level (GPU scale) init and inputs
CASES = {
    "level3/02_conv_block": [
        ((3, 5, 7, 9, 13, 11), (3, 3, 9, 13)),          # odd H and W (the pool drops the last row and column)
        ((4, 8, 16, 10, 6, 20), (5, 4, 10, 6)),         # 4 input channels: conv1 on conv.cuh; two class chunks
        ((3, 16, 32, 33, 70, 3), (6, 3, 33, 70)),       # W past one 64-wide tile of the direct kernel
        ((3, 64, 128, 64, 64, 10), (4, 3, 64, 64)),     # the task's channels, 4 images
        None,
    ],
    "level3/03_attention_block": [
        ((256, 4, 4), (2, 100, 256)),                   # head dim 64, a partial key tile
        ((96, 3, 2), (3, 37, 96)),                      # head dim 32: the fallback attention kernel
        ((130, 2, 3), (1, 70, 130)),                    # head dim 65, K % 4 != 0 (A copied), LayerNorm fallback
        ((1024, 16, 4), (2, 512, 1024)),                # the task's block, batch 2
        None,
    ],
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


@pytest.mark.parametrize("task_id, case", [(t, c) for t, cases in CASES.items() for c in range(len(cases))])
def test_level3_solution_matches_float64_reference(task_id, case):
    torch.manual_seed(1234 + case)
    name = task_id.replace("/", "_")
    task = load_task_module(ROOT / "kernels" / "tasks" / f"{task_id}.py", "gpu", f"task_{name}")
    solution = _module(ROOT / "kernels" / "solutions" / task_id / "model_new.py", f"sol_{name}")
    spec = CASES[task_id][case]
    if spec is None:
        init, inputs = task.get_init_inputs(), task.get_inputs()
    else:
        init, inputs = list(spec[0]), [torch.randn(*spec[1])]
    ref = task.Model(*init).double().cuda().eval()
    cand = solution.ModelNew(*init).cuda().eval()
    cand.load_state_dict({k: p.float() for k, p in ref.state_dict().items()})
    with torch.no_grad():
        expected = ref(*[x.double().cuda() for x in inputs])
        got = cand(*[x.cuda() for x in inputs])
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.isfinite(got).all()
    scale = max(1.0, float(expected.abs().mean()))
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * scale, rtol=1e-4)

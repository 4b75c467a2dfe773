"""Output comparison, static source policy and the reward rule."""

from __future__ import annotations

import math

import pytest
import torch

from hpc.config import CorrectnessConfig, RewardConfig
from hpc.reward import compute_reward
from hpc.verify.compare import compare_outputs
from hpc.verify.static import source_defect

CFG = CorrectnessConfig()


def test_equal_outputs_pass_and_small_errors_within_tolerance_pass():
    r = torch.randn(1000)
    assert compare_outputs([r], [r.clone()], CFG).ok
    assert compare_outputs([r], [r + 5e-5], CFG).ok


@pytest.mark.parametrize("cand, reason", [
    (lambda r: [r + 1e-3], "outside atol"),
    (lambda r: [r.reshape(10, 100)], "shape"),
    (lambda r: [r.half()], "dtype"),
    (lambda r: [r, r], "returned 2 outputs"),
    (lambda r: [torch.where(torch.arange(1000) == 3, torch.tensor(float("nan")), r)], "outside atol"),
])
def test_mismatches_are_named(cand, reason):
    r = torch.randn(1000)
    result = compare_outputs([r], cand(r), CFG)
    assert not result.ok and reason in result.reason


def test_absolute_tolerance_scales_with_the_output_so_fp32_reorderings_pass_and_tf32_fails():
    """A K=4096 fp32 matmul of unit normals: a different summation order is correct, tf32 is not."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 4096, dtype=torch.float64), torch.randn(4096, 64, dtype=torch.float64)
    exact = a @ b
    blocked = sum(a[:, k:k + 512].float() @ b[k:k + 512].float() for k in range(0, 4096, 512))
    reference = a.float() @ b.float()
    assert compare_outputs([reference], [blocked], CFG).ok
    tf32 = lambda x: (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32)  # 10-bit mantissa
    assert not compare_outputs([reference], [(tf32(a) @ tf32(b)).float()], CFG).ok
    assert not compare_outputs([exact.float()], [exact.float() + 0.05], CFG).ok


def test_nan_where_the_reference_has_nan_is_fine_and_half_uses_its_tolerance():
    r = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_outputs([r], [r.clone()], CFG).ok
    h = torch.randn(100).half()
    assert compare_outputs([h], [(h.float() + 5e-3).half()], CFG).ok


@pytest.mark.parametrize("correct, se, sc, expected", [
    (False, 10.0, 10.0, -1.0), (True, 1.0, 0.5, 1.0), (True, 1.04, 1.04, 1.0), (True, 1.06, 0.9, 2.0),
    (True, 1.06, 1.06, 3.0), (True, 0.9, 1.2, 1.0),
])
def test_discrete_reward(correct, se, sc, expected):
    assert compute_reward(correct, se, sc, RewardConfig()) == expected


def test_continuous_reward_is_the_speedup_over_compile():
    cfg = RewardConfig(kind="continuous")
    assert compute_reward(True, 2.0, 1.7, cfg) == 1.7
    assert compute_reward(False, 2.0, 1.7, cfg) == -1.0
    assert compute_reward(True, 2.0, math.nan, cfg) == -1.0


@pytest.mark.parametrize("source, words", [
    ("class ModelNew: pass\nimport os\n", "import of os"),
    ("from ctypes import CDLL\nclass ModelNew: pass\n", "import from ctypes"),
    ("class ModelNew:\n    def f(self): return eval('1')\n", "use of eval"),
    ("class ModelNew:\n    def f(self): return self.f.__globals__\n", ".__globals__"),
    ("import torch\nclass ModelNew:\n    def f(self): return torch._C\n", "._C"),
    ("import torch\nclass ModelNew:\n    def f(self): return torch.sys.modules\n", ".modules"),
    ("import torch\nclass ModelNew:\n    def f(self): return torch.ctypes\n", ".ctypes"),
    ("import torch\nclass ModelNew:\n    def f(self): return torch.sys\n", ".sys"),
    ("import torch\nclass ModelNew:\n    def f(self): torch.save(self, 'x')\n", ".save"),
    ("class ModelNew:\n    def f(self): return ().__class__.__base__\n", ".__base__"),
    ("class Other: pass\n", "defines no class ModelNew"),
    ("class ModelNew(:\n", "model_new.py: syntax error at line 1"),
])
def test_static_policy_names_the_problem(source, words):
    assert words in source_defect(source, "model_new.py")


def test_static_policy_allows_ordinary_candidates():
    src = ("import torch\nimport torch.nn as nn\nfrom hpc.runtime import load_kernels\n"
           "from torch.utils.cpp_extension import load_inline\nimport math\n"
           "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n")
    assert source_defect(src, "model_new.py") == ""


def test_library_rules_on_kernel_sources():
    from hpc.verify.static import kernel_defect, link_flags

    gemm = {"kernels/g.cu": b"#include <cublas_v2.h>\nextern \"C\" void g() {}\n"}
    assert "library cublas is not allowed" in kernel_defect(gemm, [])
    assert kernel_defect(gemm, ["cublas"]) == ""
    assert "-lcublas" in link_flags(["cublas"])
    torchy = {"kernels/k.cpp": b'  #  include "torch/extension.h"\n'}
    assert "must not include torch" in kernel_defect(torchy, ["cublas"])
    assert kernel_defect({"model_new.py": b"#include <cublas_v2.h>"}, []) == ""


def test_unknown_library_in_the_rules_is_a_config_error(tmp_path):
    from hpc.config import load_config
    from hpc.errors import UserError

    path = tmp_path / "c.yaml"
    path.write_text("rules:\n  libraries: [cublas, magic]\n")
    with pytest.raises(UserError, match=r"rules\.libraries"):
        load_config(path)


def test_the_correctness_reward_pays_one_for_correct_and_needs_no_timing():
    cfg = RewardConfig(kind="correctness")
    assert compute_reward(True, math.nan, math.nan, cfg) == 1.0
    assert compute_reward(False, 3.0, 3.0, cfg) == -1.0


def test_an_evaluation_under_the_correctness_reward_stops_after_correctness(fast_config):
    """Nothing timed: no baselines, no window; a correct candidate is paid 1 whatever its speed."""
    import json

    from hpc.candidate import load_candidate
    from hpc.pipeline import evaluate
    from hpc.task import load_task
    from tests.conftest import RELU_TASK, TESTS

    fast_config.reward.kind = "correctness"
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config)
    assert rec.status == "ok" and rec.correct and rec.reward == 1.0 and rec.reward_kind == "correctness"
    assert math.isnan(rec.candidate_ms) and math.isnan(rec.eager_ms)
    assert "profile" not in json.loads(rec.stage_seconds) and "baseline" not in json.loads(rec.stage_seconds)


@pytest.mark.parametrize("old, new", [("correctness", "verify"), ("reward", "profile")])
def test_a_stop_after_under_its_old_name_is_refused_with_the_new_name(fast_config, old, new):
    """stop_after names the stage an evaluation stops after, as the agent's tools do."""
    from hpc.candidate import load_candidate
    from hpc.pipeline import evaluate
    from hpc.task import load_task
    from tests.conftest import RELU_TASK, TESTS

    with pytest.raises(ValueError, match=rf"stop_after must be one of .*, got '{old}' \('{old}' is now '{new}'\)$"):
        evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config, old)

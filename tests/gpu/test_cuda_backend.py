"""CUDA-only behaviour on a real GPU (the hack suite's CUDA variants live in tests/test_hacks.py).

Runs only where torch sees a CUDA device (the H200 machine): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import pytest

from hpc.candidate import load_candidate
from hpc.pipeline import evaluate
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS

pytestmark = pytest.mark.gpu
HONEST = TESTS / "fixtures" / "honest_relu"


def test_side_stream_work_is_timed(cuda_config):
    """Slow work hidden on a private stream still lands inside the measured interval: not paid as fast."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks_cuda" / "side_stream"), cuda_config)
    assert rec.candidate_ms > 5.0, rec.reason
    assert rec.reward <= 1.0


def test_a_cuda_fault_does_not_poison_the_next_evaluation(cuda_config):
    bad = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks" / "segfault"), cuda_config)
    assert bad.status == "failed" and "illegal memory access" in bad.reason
    good = evaluate(load_task(RELU_TASK), load_candidate(HONEST), cuda_config)
    assert good.status == "ok" and good.correct, good.reason
    assert good.hardware and good.backend == "cuda" and good.eager_ms > 0 and good.compile_ms > 0


def test_load_inline_cuda_single_file_is_paid(cuda_config):
    """KernelBench's own CUDA format: compiled on first load (about a minute), cached by content after."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu_inline_cuda.py"),
                   cuda_config)
    assert rec.status == "ok", rec.reason
    assert rec.correct and rec.compiled and rec.reward >= 1

"""Shared fixtures: a fast evaluation config and a private cache for compile objects and baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config import load_config

TESTS = Path(__file__).parent
ROOT = TESTS.parent
RELU_TASK = TESTS / "fixtures" / "tasks" / "level1" / "relu.py"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hpc-cache")


def make_fast_config(cache_dir: Path, backend: str = "cpu"):
    """The real pipeline with fewer timed iterations, so each evaluation takes seconds."""
    cfg = load_config(cache_dir=str(cache_dir), backend=backend, scale="gpu" if backend == "cuda" else "cpu")
    cfg.timing.warmup = 2
    cfg.timing.iterations = 20
    cfg.timing.host_check_calls = 10
    cfg.correctness.timed_checks = 3
    cfg.sandbox.timeout_s = 180
    cfg.validate()
    return cfg


@pytest.fixture
def fast_config(cache_dir):
    return make_fast_config(cache_dir)


@pytest.fixture
def cuda_config(cache_dir):
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    return make_fast_config(cache_dir, "cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

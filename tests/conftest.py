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


@pytest.fixture
def fast_config(cache_dir):
    """The real pipeline with fewer timed iterations, so each evaluation takes seconds."""
    cfg = load_config(cache_dir=str(cache_dir))
    cfg.timing.warmup = 2
    cfg.timing.iterations = 20
    cfg.timing.host_check_blocks = 3
    cfg.timing.host_check_block_size = 5
    cfg.correctness.timed_checks = 3
    cfg.sandbox.timeout_s = 120
    cfg.validate()
    return cfg

"""megatron's DDP on two GPUs over NCCL, the data-parallel all-reduce overlapped with the
backward pass: the check the CPU test makes over gloo (`tests/test_rl_optimizer.py`,
`check_overlapped_reduce`): with gradient accumulation the overlapped steps leave the weights of
the steps that all-reduce after the backward, the two ranks hold the same weights, and from the
second step each all-reduce starts during the last microbatch's backward.

Runs only where torch sees two CUDA devices (a machine of two H200s): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]


def test_the_all_reduce_overlaps_the_backward_over_nccl(tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from hpc.policy.parallel import run_local
    from tests.test_rl_optimizer import check_overlapped_reduce, overlap_worker

    run_local(overlap_worker, 2, tmp_path, 1)
    # GPU kernels need not add in the same order run to run: the two runs' gradients may differ
    # in the last bits, which Adam's first steps can raise to ~1e-5 where a gradient is near eps.
    check_overlapped_reduce(tmp_path, 2, atol=1e-4)

"""bf16 training at the recipe's learning rate on a real GPU: the trainer's optimizer
(`hpc.policy.optimizer.ModelOptimizer`, fp32 master weights) changes the bf16 weights and lowers
the loss at lr 3e-6, where Adam on the bf16 weights alone would round most updates away.

Runs only where torch sees a CUDA device (the H200 machine): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                         "ignore::FutureWarning")]


def test_bf16_policy_learns_at_3e_6(tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from hpc.policy import model
    from hpc.policy.config import policy_config
    from hpc.policy.optimizer import ModelOptimizer
    from hpc.policy.parallel import init_parallel, teardown
    from hpc.rl.batch import make_batch
    from hpc.rl.supervised import sft_step

    init_parallel(seed=3)
    try:
        torch.manual_seed(0)
        cfg = policy_config({"max_seq_len": 128, "hidden_size": 256, "ffn_hidden_size": 1024})
        policy = model.build_policy(cfg).cuda()
        assert next(policy.parameters()).dtype == torch.bfloat16
        g = torch.Generator().manual_seed(1)
        rows = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(8)]
        batch = make_batch([r[:8] for r in rows], [r[8:] for r in rows], [[0.0] * 32] * 8, [0.0] * 8, 258,
                           device=torch.device("cuda"))
        start = [p.detach().clone() for p in policy.parameters()]
        optimizer = ModelOptimizer(policy, lr=3e-6, clip_grad=1.0)
        losses = [sft_step(policy, optimizer, batch, cfg.vocab_size)[0] for _ in range(20)]
        changed = sum(int((p != s).sum()) for p, s in zip(policy.parameters(), start))
        assert changed > 0.2 * sum(s.numel() for s in start), changed
        assert losses[-1] < losses[0], losses
    finally:
        teardown()

"""The trainer's optimizer (`hpc.policy.optimizer.ModelOptimizer`: megatron's DDP and
mixed-precision Adam) on the tiny CPU policy: bf16 parameters learn at the recipe's learning rate
only through fp32 master weights (plain AdamW on them loses the update), clipping scales the step
and reports the norm, the state checkpoints and resumes, and two data-parallel ranks with
different token counts step as one rank on both batches with a token mean."""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch

from hpc.policy.optimizer import ModelOptimizer
from hpc.rl.batch import make_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

PAD = 258


@pytest.fixture(scope="module")
def parallel():
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel(seed=11)
    yield
    teardown()


def _policy(dtype: str = "fp32", seed: int = 0):
    from hpc.policy import model
    from hpc.policy.config import policy_config

    torch.manual_seed(seed)
    cfg = policy_config({"max_seq_len": 64, "num_layers": 2, "dtype": dtype})
    return cfg, model.build_policy(cfg)


def _batch(rows: list[int], seed: int = 3):
    """One row per entry: a 4-token prompt and that many completion tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (4,), generator=g).tolist() for _ in rows]
    completions = [torch.randint(0, 256, (n,), generator=g).tolist() for n in rows]
    return make_batch(prompts, completions, [[0.0] * len(c) for c in completions], [0.0] * len(rows), PAD)


def _sft(cfg, policy, optimizer, batch, steps: int) -> tuple[list[float], list]:
    from hpc.rl.supervised import sft_step

    losses, stats = [], []
    for _ in range(steps):
        loss, step = sft_step(policy, optimizer, batch, cfg.vocab_size)
        losses.append(loss)
        stats.append(step)
    return losses, stats


def test_bf16_weights_learn_at_3e_6_through_fp32_masters_and_not_without(parallel):
    """At lr 3e-6 a bf16 weight of |w| ~ 0.02 moves by ~1e-4 only when rounded: the optimizer's
    fp32 masters accumulate the steps, so the bf16 weights change and the loss drops; AdamW on the
    bf16 parameters themselves leaves nearly all of them where they were (the control)."""
    batch = _batch([6, 5, 7, 4])
    cfg, policy = _policy("bf16")
    assert next(policy.parameters()).dtype == torch.bfloat16
    start = [p.detach().clone() for p in policy.parameters()]
    optimizer = ModelOptimizer(policy, lr=3e-6, clip_grad=0.0)
    assert all(p.dtype == torch.float32 for p in optimizer.master_params())
    losses, stats = _sft(cfg, policy, optimizer, batch, 12)
    changed = sum(int((p != s).sum()) for p, s in zip(policy.parameters(), start))
    total = sum(p.numel() for p in start)
    assert all(math.isfinite(s.grad_norm) and s.grad_norm > 0 for s in stats)
    assert all(0 < s.update_ratio < 1e-3 for s in stats), stats
    assert losses[-1] < losses[0], losses

    cfg, control = _policy("bf16")
    adamw = torch.optim.AdamW(control.parameters(), lr=3e-6, weight_decay=0.0)
    control_losses, _ = _sft(cfg, control, adamw, batch, 12)
    unchanged = sum(int((p != s).sum()) for p, s in zip(control.parameters(), start))
    assert changed > 0.2 * total, (changed, total)
    assert unchanged < 0.05 * total and unchanged < changed / 5, (unchanged, changed, total)


def test_clipping_reports_the_norm_and_scales_the_step(parallel):
    """clip_grad far below the measured norm: the norm before clipping is reported as without
    clipping, the gradients the optimizer stepped on have norm clip_grad, and the weights move
    less (Adam's step shrinks once the clipped gradients approach its eps)."""
    batch = _batch([6, 5, 7, 4])
    moved, norms, stepped = {}, {}, {}
    for clip in (0.0, 1e-7):
        cfg, policy = _policy()
        start = [p.detach().clone() for p in policy.parameters()]
        optimizer = ModelOptimizer(policy, lr=1e-2, clip_grad=clip)
        _, stats = _sft(cfg, policy, optimizer, batch, 1)
        norms[clip] = stats[0].grad_norm
        stepped[clip] = math.sqrt(sum(float(p.main_grad.square().sum()) for p in policy.parameters()))
        moved[clip] = math.sqrt(sum(float((p - s).square().sum()) for p, s in zip(policy.parameters(), start)))
    assert norms[0.0] == pytest.approx(norms[1e-7], rel=1e-6) and norms[0.0] > 1e-2
    assert stepped[0.0] == pytest.approx(norms[0.0], rel=1e-4)
    assert stepped[1e-7] == pytest.approx(1e-7, rel=1e-3)
    assert moved[1e-7] < 0.5 * moved[0.0], moved


def test_the_optimizer_state_checkpoints_and_resumes_identically(parallel, tmp_path):
    """bf16 policy, fp32 masters: saved after 3 steps and loaded into a fresh model and optimizer,
    the next steps give the same losses and weights as training straight on."""
    from hpc.policy.checkpoint import load_checkpoint, save_checkpoint

    batch = _batch([6, 5, 7, 4])
    cfg, policy = _policy("bf16")
    optimizer = ModelOptimizer(policy, lr=1e-3, clip_grad=1.0)
    _sft(cfg, policy, optimizer, batch, 3)
    save_checkpoint(tmp_path, 3, policy, optimizer, cfg)
    straight, _ = _sft(cfg, policy, optimizer, batch, 2)

    cfg, resumed = _policy("bf16", seed=9)
    resumed_opt = ModelOptimizer(resumed, lr=1e-3, clip_grad=1.0)
    load_checkpoint(tmp_path, resumed, resumed_opt, 3)
    again, _ = _sft(cfg, resumed, resumed_opt, batch, 2)
    assert again == straight
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), policy.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(resumed_opt.master_params(), optimizer.master_params()))


def test_an_optimizer_that_never_stepped_checkpoints_and_steps_as_a_fresh_one(parallel, tmp_path):
    """The critic before its first PPO stage: saved without moments, loaded, its first step is a
    fresh optimizer's first step."""
    from hpc.policy.checkpoint import load_checkpoint, save_checkpoint

    batch = _batch([6, 5])
    cfg, policy = _policy()
    save_checkpoint(tmp_path, 1, policy, ModelOptimizer(policy, lr=1e-3, clip_grad=1.0), cfg)
    fresh, _ = _sft(cfg, policy, ModelOptimizer(policy, lr=1e-3, clip_grad=1.0), batch, 2)
    cfg, loaded = _policy(seed=9)
    optimizer = ModelOptimizer(loaded, lr=1e-3, clip_grad=1.0)
    load_checkpoint(tmp_path, loaded, optimizer, 1)
    again, _ = _sft(cfg, loaded, optimizer, batch, 2)
    assert again == fresh


ROWS = ([9, 1, 7], [2, 3])      # the two ranks' completion lengths: 17 and 5 tokens


def _dp_step(batch) -> dict:
    """One SFT step (Adam, no clipping) from seed 0; the reduced gradients and the norm."""
    cfg, policy = _policy()
    optimizer = ModelOptimizer(policy, lr=1e-3, clip_grad=0.0)
    loss, stats = _sft(cfg, policy, optimizer, batch, 1)
    return {"grads": [p.main_grad.clone() for p in policy.parameters()], "norm": stats[0].grad_norm,
            "weights": [p.detach().clone() for p in policy.parameters()]}


def _dp_worker(work: Path) -> None:
    from hpc.policy.parallel import current_layout, init_parallel, teardown

    init_parallel(seed=11)
    layout = current_layout()
    try:
        assert layout.dp_size == 2
        whole = _batch([n for rows in ROWS for n in rows])
        mine = whole.select(list(range(3)) if layout.dp_rank == 0 else [3, 4])
        result = _dp_step(mine)
    except Exception:
        result = RuntimeError(traceback.format_exc())
    torch.save(result, work / f"rank{layout.rank}.pt")
    teardown()


def test_two_data_parallel_ranks_step_as_one_on_the_global_token_mean(parallel, tmp_path):
    """Ranks of 17 and 5 tokens: their summed gradients are those of the token mean over all 22
    (one process, both batches), not the average of the two ranks' own token means."""
    from hpc.policy.parallel import run_local

    whole = _batch([n for rows in ROWS for n in rows])
    one = _dp_step(whole)
    per_rank = [_dp_step(whole.select(rows)) for rows in ([0, 1, 2], [3, 4])]
    run_local(_dp_worker, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        if isinstance(r, Exception):
            raise r
    for r in ranks:
        for got, want in zip(r["grads"], one["grads"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert r["norm"] == pytest.approx(one["norm"], rel=1e-5)
        for got, want in zip(r["weights"], one["weights"]):   # Adam's first step amplifies rounding where g ~ eps
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    averaged = [(a + b) / 2 for a, b in zip(per_rank[0]["grads"], per_rank[1]["grads"])]
    gap = max(float((a - b).abs().max()) for a, b in zip(averaged, one["grads"]))
    assert gap > 100 * 1e-6, gap

"""The trainer's optimizer (`hpc.policy.optimizer.ModelOptimizer`: megatron's DDP and
mixed-precision Adam) on the tiny CPU policy: bf16 parameters learn at the recipe's learning rate
only through fp32 master weights (plain AdamW on them loses the update), clipping scales the step
and reports the norm, the state checkpoints and resumes, two data-parallel ranks with different
token counts step as one rank on both batches with a token mean, gradient accumulation over
microbatches equals the whole batch at once, and the data-parallel all-reduce overlapped with the
backward (in the last microbatch's only) steps as the one after it."""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Iterator
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


def _policy(dtype: str = "fp32", seed: int = 0, pipeline: int = 1):
    from hpc.policy import model
    from hpc.policy.config import policy_config

    torch.manual_seed(seed)
    cfg = policy_config({"max_seq_len": 64, "num_layers": 2, "dtype": dtype, "parallel": {"pipeline": pipeline}})
    return cfg, model.build_policy(cfg)


def _batch(rows: list[int], seed: int = 3, device: str = "cpu"):
    """One row per entry: a 4-token prompt and that many completion tokens (rewards for the critic)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (4,), generator=g).tolist() for _ in rows]
    completions = [torch.randint(0, 256, (n,), generator=g).tolist() for n in rows]
    rewards = torch.rand(len(rows), generator=g).tolist()
    return make_batch(prompts, completions, [[0.0] * len(c) for c in completions], rewards, PAD, device=device)


def _sft(cfg, policy, optimizer, batch, steps: int, microbatches: int = 1) -> tuple[list[float], list]:
    from hpc.rl.supervised import sft_step

    losses, stats = [], []
    for _ in range(steps):
        loss, step = sft_step(policy, optimizer, batch, cfg.vocab_size, microbatches)
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


def _grads(microbatches: int) -> dict:
    """One SFT step of the policy and one value step of the critic (seed 0) on a batch of five
    rows in `microbatches` parts; the gradients each optimizer stepped on."""
    from hpc.policy import model
    from hpc.rl.supervised import value_step

    batch = _batch([6, 1, 9, 4, 3])
    cfg, policy = _policy()
    critic = model.build_critic(cfg)
    torch.nn.init.normal_(critic.value_head.weight, std=0.3)
    losses, _ = _sft(cfg, policy, ModelOptimizer(policy, lr=1e-3, clip_grad=0.0), batch, 1, microbatches)
    value, _, _ = value_step(critic, ModelOptimizer(critic, lr=1e-3, clip_grad=0.0), batch, microbatches)
    return {"losses": (losses[0], value),
            "grads": [p.main_grad.clone() for m in (policy, critic) for p in m.parameters()]}


def test_gradient_accumulation_at_one_stage_equals_the_whole_batch_at_once(parallel):
    """Three microbatches one after the other (megatron's no-pipelining schedule): each part's loss
    weighed by its share of the batch's tokens, the accumulated gradients are the whole batch's."""
    whole, parts = _grads(1), _grads(3)
    assert parts["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    for got, want in zip(parts["grads"], whole["grads"]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert max(float(g.abs().max()) for g in whole["grads"]) > 1e-2


STEPS = (3, 2, 1)   # each step's microbatches: accumulation over a count that changes, then a single pass


@contextlib.contextmanager
def _traced(passes: list[list[str]], buckets: set[int]) -> Iterator[None]:
    """While it lasts, each backward appends "b" to the last of `passes`, "b+" when the all-reduce
    of a gradient bucket (a tensor whose id is in `buckets`) started during it, and a bucket's
    all-reduce started outside any backward appends "r"."""
    all_reduce, backward = torch.distributed.all_reduce, torch.autograd.backward
    inside = [False]

    def traced_all_reduce(tensor: torch.Tensor, *args, **kwargs):
        if id(tensor) in buckets:
            if inside[0]:
                passes[-1][-1] = "b+"
            else:
                passes[-1].append("r")
        return all_reduce(tensor, *args, **kwargs)

    def traced_backward(*args, **kwargs):
        passes[-1].append("b")
        inside[0] = True
        try:
            backward(*args, **kwargs)
        finally:
            inside[0] = False

    torch.distributed.all_reduce, torch.autograd.backward = traced_all_reduce, traced_backward
    try:
        yield
    finally:
        torch.distributed.all_reduce, torch.autograd.backward = all_reduce, backward


def _overlap_run(layout, pipeline: int, overlap: bool, start: dict | None) -> dict:
    """SFT steps of the policy and value steps of the critic over `STEPS` from the weights
    `start` (None: these, built from seed 0), each data-parallel rank on its own rows; what the
    optimizers did and the weights they left."""
    from hpc.policy import model
    from hpc.rl.supervised import sft_step, value_step

    cfg, policy = _policy(pipeline=pipeline)
    critic = model.build_critic(cfg)
    if start is None:
        start = {name: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in m.state_dict().items()}
                 for name, m in (("policy", policy), ("critic", critic))}
    policy.load_state_dict(start["policy"])
    critic.load_state_dict(start["critic"])
    actor_opt = ModelOptimizer(policy, lr=1e-3, clip_grad=1.0, overlap_grad_reduce=overlap)
    critic_opt = ModelOptimizer(critic, lr=1e-3, clip_grad=1.0, overlap_grad_reduce=overlap)
    buckets = {id(bucket.grad_data) for opt in (actor_opt, critic_opt)
               for group in opt.ddp.bucket_groups for bucket in group.buckets}
    passes: list[list[str]] = []
    with _traced(passes, buckets):
        for step, microbatches in enumerate(STEPS):
            batch = _batch([9, 1, 7] if layout.dp_rank == 0 else [2, 3, 6, 4], seed=step, device=layout.device)
            passes.append([])
            sft_step(policy, actor_opt, batch, cfg.vocab_size, microbatches)
            passes.append([])
            value_step(critic, critic_opt, batch, microbatches)
    tied = policy.shared_embedding_or_output_weight()
    moved = max(float((p.detach() - start[name][key]).abs().max())
                for name, m in (("policy", policy), ("critic", critic)) for key, p in m.named_parameters())
    return {"start": start, "overlapped": (actor_opt.overlapped, critic_opt.overlapped), "passes": passes,
            "weights": [p.detach().cpu() for m in (policy, critic) for p in m.parameters()],
            "tied": None if tied is None else tied.detach().cpu(), "moved": moved}


def overlap_worker(work: Path, pipeline: int) -> None:
    from hpc.policy.parallel import current_layout, init_parallel, teardown

    init_parallel(pipeline=pipeline, seed=11)
    layout = current_layout()
    try:
        plain = _overlap_run(layout, pipeline, False, None)
        result = {"pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank, False: plain,
                  True: _overlap_run(layout, pipeline, True, plain.pop("start"))}
        result[True].pop("start")
    except Exception:
        result = RuntimeError(traceback.format_exc())
    torch.save(result, work / f"rank{layout.rank}.pt")
    teardown()


def check_overlapped_reduce(work: Path, ranks: int, atol: float = 1e-6) -> None:
    """What `overlap_worker` left in `work` on each of `ranks` ranks (2 data-parallel ranks, and
    pipeline stages): the overlapped run leaves the weights of the one that all-reduces after
    the backward (to `atol`), the same on both data-parallel ranks (their different rows reduced); from
    its second step (megatron's first counts which gradients each bucket waits for), the first
    pipeline stage's all-reduce starts during the last microbatch's backward and never in an
    earlier one's; later stages start theirs after their last backward (aligned)."""
    results = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    for r in results:
        if isinstance(r, Exception):
            raise r
    microbatches = [n for n in STEPS for _ in ("policy", "critic")]
    for r in results:
        assert r[False]["overlapped"] == (False, False) and r[True]["overlapped"] == (True, True)
        for got, want in zip(r[True]["weights"], r[False]["weights"]):
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
        after = [["b"] * n + ["r"] for n in microbatches]
        assert r[False]["passes"] == after
        during = [["b"] * (n - 1) + ["b+"] for n in microbatches]
        assert r[True]["passes"] == (after[:2] + during[2:] if r["pp_rank"] == 0 else after)
    for stage in {r["pp_rank"] for r in results}:
        replicas = [r[True]["weights"] for r in results if r["pp_rank"] == stage]
        assert len(replicas) == 2
        assert all(torch.equal(a, b) for a, b in zip(*replicas))
    tied = [r[True]["tied"] for r in results if r[True]["tied"] is not None]
    assert all(torch.equal(t, tied[0]) for t in tied)
    assert all(r[True]["moved"] > 1e-3 for r in results), [r[True]["moved"] for r in results]


@pytest.mark.parametrize("pipeline", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["dp2", "dp2xpp2"])
def test_the_all_reduce_overlapped_with_the_backward_steps_as_the_one_after_it(parallel, tmp_path, pipeline):
    """Two data-parallel ranks (each of `pipeline` stages, the tied embedding split over the first
    and the last), policy and critic, gradient accumulation over 3 then 2 microbatches, then 1:
    `check_overlapped_reduce`."""
    from hpc.policy.parallel import run_local

    run_local(overlap_worker, 2 * pipeline, tmp_path, pipeline)
    check_overlapped_reduce(tmp_path, 2 * pipeline)

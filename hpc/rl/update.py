"""The RL update of the policy (and critic) on a batch of rollouts.

PPO with a critic (the paper's): the critic's values at the generated targets, GAE over them
with the outcome reward on the last generated token, the clipped policy loss and the value loss,
each model stepping its own optimizer (the trainer's: `hpc.policy.optimizer.ModelOptimizer`, whose
steps also report the gradient norm and the update-to-weight ratio; a plain torch optimizer
reports NaN for those). GRPO: the group-normalized reward as every generated
token's advantage, no critic. Both add the KL to a reference policy's log-probs when `kl_coef`
> 0, and an entropy bonus when `entropy_coef` > 0. The statistics come back for the metrics.

The policy's log-probs, its entropy and the reference's log-probs are those of the distribution
the rollouts were sampled from, log_softmax(logits / T) at the rollout's temperature T (as verl's
actor divides its logits by it), the sampler's log-probs (`hpc.policy.generate`): so the ratio of
the first optimizer step on a batch is 1, whatever T.

`update` is one optimizer step on one (mini)batch; `ppo_epochs` is what the trainer calls per
rollout batch: advantages, returns and the critic's values once from the batch as sampled, then
`rl.ppo_epochs` passes, each over the rows shuffled and split into `rl.minibatches` parts, one
`update` per part, the ratio always against the sampler's log-probs (as verl, OpenRLHF, CleanRL).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from hpc.policy.optimizer import NOT_MEASURED, step_stats
from hpc.rl.advantages import (broadcast_to_tokens, gae, group_normalized, last_token_rewards, masked_mean,
                               masked_whiten)
from hpc.rl.batch import RolloutBatch
from hpc.rl.config import RLConfig
from hpc.rl.losses import explained_variance, kl_penalty, policy_loss, value_loss
from hpc.rl.staged import critic_outputs, evaluate, policy_outputs, train_pass


@dataclass
class UpdateStats:
    policy_loss: float
    value_loss: float
    clip_fraction: float
    approx_kl: float
    kl_to_reference: float
    entropy: float
    explained_variance: float
    advantage_mean: float
    reward_mean: float
    actor_grad_norm: float = math.nan       # before clipping (`hpc.policy.optimizer.StepStats`)
    actor_update_ratio: float = math.nan    # ||w_after - w_before|| / ||w_before||, fp32 masters
    critic_grad_norm: float = math.nan
    critic_update_ratio: float = math.nan

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class EpochsStats:
    """A rollout batch's update. `mean`: each statistic averaged over the optimizer steps, except
    those of the batch as sampled (explained variance, advantage and reward means), taken over the
    whole batch; `steps`: each minibatch step's own, in order."""

    mean: UpdateStats
    steps: list[UpdateStats]

    @property
    def optimizer_steps(self) -> int:
        return len(self.steps)

    def as_dict(self) -> dict[str, float]:
        return {**self.mean.as_dict(), "optimizer_steps": self.optimizer_steps}


def _critic_values(critic: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    return evaluate(critic, batch, critic_outputs())[0]


def advantages(batch: RolloutBatch, cfg: RLConfig, critic: torch.nn.Module | None) -> tuple:
    """(advantages, returns or None, the values they were computed from or None), [B, T-1]."""
    mask = batch.action_mask
    if cfg.algorithm == "grpo":
        per_seq = group_normalized(batch.rewards, cfg.group_size, scale=cfg.grpo_scale)
        return broadcast_to_tokens(per_seq, mask), None, None
    if critic is None:
        raise ValueError("ppo needs a critic (or set rl.algorithm: grpo)")
    values = _critic_values(critic, batch)
    adv, returns = gae(last_token_rewards(batch.rewards, mask), values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        # Without it a batch of mostly failures pushes down the tokens all samples share.
        adv = masked_whiten(adv, mask)
    return adv, returns, values


def update(policy: torch.nn.Module, actor_opt: torch.optim.Optimizer, batch: RolloutBatch, cfg: RLConfig,
           vocab_size: int, critic: torch.nn.Module | None = None,
           critic_opt: torch.optim.Optimizer | None = None,
           ref_logprobs: torch.Tensor | None = None, targets: tuple | None = None,
           microbatches: int = 1, temperature: float = 1.0) -> UpdateStats:
    """One optimizer step of the policy (and, for PPO, of the critic) on `batch`. `targets`: what
    `advantages` gave for these rows (a minibatch's share of the whole batch's); None: computed
    from `batch` here. `microbatches`: the parts of `batch` a pipeline schedule passes
    (`hpc.rl.staged`; one stage takes the batch at once). `temperature`: the rollout's, at which
    `batch.old_logprobs` (and `ref_logprobs`) were computed."""
    mask = batch.action_mask
    adv, returns, old_values = advantages(batch, cfg, critic) if targets is None else targets

    def actor_loss(out: tuple, cut: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
        logp, entropy = out
        loss, pstats = policy_loss(logp, cut(batch.old_logprobs), cut(adv), cut(mask), cfg.clip_low, cfg.clip_high)
        kl = torch.zeros(())
        if ref_logprobs is not None:
            kl = masked_mean(kl_penalty(logp, cut(ref_logprobs), cfg.kl_kind), cut(mask))
            if cfg.kl_coef > 0:
                loss = loss + cfg.kl_coef * kl
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * masked_mean(entropy, cut(mask))
        return loss, pstats, kl

    policy.train()
    actor_opt.zero_grad(set_to_none=True)
    logp, entropy = train_pass(policy, batch, policy_outputs(vocab_size, True, temperature),
                               lambda out, cut: actor_loss(out, cut)[0], microbatches)
    actor = step_stats(actor_opt)
    with torch.no_grad():    # of the whole batch, the same on every rank
        loss, pstats, kl = actor_loss((logp, entropy), lambda x: x)

    vloss, ev, critic_step = torch.zeros(()), float("nan"), NOT_MEASURED
    if cfg.algorithm == "ppo":
        if critic_opt is None:
            raise ValueError("ppo needs the critic's optimizer")
        critic.train()
        critic_opt.zero_grad(set_to_none=True)
        critic_loss = lambda out, cut: value_loss(out[0], cut(old_values), cut(returns), cut(mask),  # noqa: E731
                                                  cfg.value_clip)
        values = train_pass(critic, batch, critic_outputs(), critic_loss, microbatches)
        critic_step = step_stats(critic_opt)
        vloss = critic_loss(values, lambda x: x)
        ev = explained_variance(old_values, returns, mask)
    with torch.no_grad():
        ent = float(masked_mean(entropy, mask))
    return UpdateStats(policy_loss=float(loss), value_loss=float(vloss),
                       clip_fraction=pstats.clip_fraction, approx_kl=pstats.approx_kl,
                       kl_to_reference=float(kl), entropy=ent,
                       explained_variance=ev, advantage_mean=float(masked_mean(adv, mask)),
                       reward_mean=float(batch.rewards.mean()),
                       actor_grad_norm=actor.grad_norm, actor_update_ratio=actor.update_ratio,
                       critic_grad_norm=critic_step.grad_norm, critic_update_ratio=critic_step.update_ratio)


def minibatch_rows(n: int, minibatches: int, rng: random.Random) -> list[list[int]]:
    """One pass's split of rows 0..n-1: shuffled by `rng`, then `minibatches` contiguous parts
    whose sizes differ by at most one (the first ones larger). One part: the rows in order, and
    `rng` is not drawn from (the whole batch, as a single update sees it)."""
    if not 1 <= minibatches <= n:
        raise ValueError(f"{n} rows do not split into {minibatches} minibatches")
    order = list(range(n))
    if minibatches > 1:
        rng.shuffle(order)
    size, extra = divmod(n, minibatches)
    parts, start = [], 0
    for k in range(minibatches):
        stop = start + size + (k < extra)
        parts.append(order[start:stop])
        start = stop
    return parts


def ppo_epochs(policy: torch.nn.Module, actor_opt: torch.optim.Optimizer, batch: RolloutBatch, cfg: RLConfig,
               vocab_size: int, critic: torch.nn.Module | None = None,
               critic_opt: torch.optim.Optimizer | None = None, ref_logprobs: torch.Tensor | None = None,
               rng: random.Random | None = None, microbatches: int = 1, temperature: float = 1.0) -> EpochsStats:
    """The update of one rollout batch: `cfg.ppo_epochs` x `cfg.minibatches` optimizer steps of
    the policy (and the critic for ppo). Advantages, returns and the critic's values come from the
    whole batch before the first step (GRPO's groups and the whitening see every row); each pass
    shuffles the rows with `rng` (the trainer's seeded one: reproducible) and steps on each part,
    the ratio against the sampler's log-probs. With 1 x 1 this is `update(...)` on the batch.
    `microbatches`: each step's pipeline microbatches, `temperature` the rollout's (`update`)."""
    rng = rng if rng is not None else random.Random(0)
    if len(batch) < cfg.minibatches:
        raise ValueError(f"rl.minibatches {cfg.minibatches}: the batch has only {len(batch)} rows")
    targets = advantages(batch, cfg, critic)
    steps = []
    for _ in range(cfg.ppo_epochs):
        for rows in minibatch_rows(len(batch), cfg.minibatches, rng):
            part = batch.select(rows)
            index, width = torch.as_tensor(rows, device=batch.tokens.device), part.tokens.shape[1] - 1
            cut = lambda x: None if x is None else x[index, :width]  # noqa: E731
            steps.append(update(policy, actor_opt, part, cfg, vocab_size, critic=critic, critic_opt=critic_opt,
                                ref_logprobs=cut(ref_logprobs), targets=tuple(cut(x) for x in targets),
                                microbatches=microbatches, temperature=temperature))
    mean = UpdateStats(**{f.name: sum(getattr(s, f.name) for s in steps) / len(steps) for f in fields(UpdateStats)})
    adv, returns, values = targets
    mask = batch.action_mask
    # Of the batch as sampled, not of the policy's steps: over all of it, not averaged over parts.
    mean.explained_variance = explained_variance(values, returns, mask) if values is not None else math.nan
    mean.advantage_mean = float(masked_mean(adv, mask))
    mean.reward_mean = float(batch.rewards.mean())
    return EpochsStats(mean, steps)

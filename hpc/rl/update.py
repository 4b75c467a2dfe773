"""One RL update of the policy (and critic) on a batch of rollouts.

PPO with a critic (the paper's): the critic's values at the generated targets, GAE over them
with the outcome reward on the last generated token, the clipped policy loss and the value loss,
each model stepping its own optimizer. GRPO: the group-normalized reward as every generated
token's advantage, no critic. Both add the KL to a reference policy's log-probs when `kl_coef`
> 0, and an entropy bonus when `entropy_coef` > 0. The statistics come back for the metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hpc.rl.advantages import (broadcast_to_tokens, gae, group_normalized, last_token_rewards, masked_mean,
                               masked_whiten)
from hpc.rl.batch import RolloutBatch
from hpc.rl.config import RLConfig
from hpc.rl.losses import entropy_from_logits, explained_variance, kl_penalty, policy_loss, value_loss


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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _policy_logprobs(policy: torch.nn.Module, batch: RolloutBatch, vocab_size: int, with_entropy: bool):
    from hpc.policy.model import forward_logits, mask_padded_vocab

    logits = forward_logits(policy, batch.tokens, batch.pad_mask)[:, :-1].float()
    logits = mask_padded_vocab(logits, vocab_size)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        return logp, entropy_from_logits(logits)
    with torch.no_grad():   # the metric only: row by row, not to hold [B, T, V] twice
        entropy = torch.stack([entropy_from_logits(row) for row in logits.detach()])
    return logp, entropy


def _critic_values(critic: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    from hpc.policy.model import staged_forward

    return staged_forward(critic, batch.tokens, batch.pad_mask)[:, :-1]


def advantages(batch: RolloutBatch, cfg: RLConfig, critic: torch.nn.Module | None) -> tuple:
    """(advantages, returns or None, the values they were computed from or None), [B, T-1]."""
    mask = batch.action_mask
    if cfg.algorithm == "grpo":
        per_seq = group_normalized(batch.rewards, cfg.group_size, scale=cfg.grpo_scale)
        return broadcast_to_tokens(per_seq, mask), None, None
    if critic is None:
        raise ValueError("ppo needs a critic (or set rl.algorithm: grpo)")
    with torch.no_grad():
        values = _critic_values(critic, batch)
    adv, returns = gae(last_token_rewards(batch.rewards, mask), values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        # Without it a batch of mostly failures pushes down the tokens all samples share.
        adv = masked_whiten(adv, mask)
    return adv, returns, values


def update(policy: torch.nn.Module, actor_opt: torch.optim.Optimizer, batch: RolloutBatch, cfg: RLConfig,
           vocab_size: int, critic: torch.nn.Module | None = None,
           critic_opt: torch.optim.Optimizer | None = None,
           ref_logprobs: torch.Tensor | None = None) -> UpdateStats:
    """One optimizer step of the policy (and, for PPO, of the critic) on `batch`."""
    mask = batch.action_mask
    adv, returns, old_values = advantages(batch, cfg, critic)

    policy.train()
    logp, entropy = _policy_logprobs(policy, batch, vocab_size, with_entropy=cfg.entropy_coef > 0)
    loss, pstats = policy_loss(logp, batch.old_logprobs, adv, mask, cfg.clip_low, cfg.clip_high)
    kl = torch.zeros(())
    if ref_logprobs is not None:
        kl = masked_mean(kl_penalty(logp, ref_logprobs, cfg.kl_kind), mask)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * masked_mean(entropy, mask)
    actor_opt.zero_grad(set_to_none=True)
    loss.backward()
    actor_opt.step()

    vloss, ev = torch.zeros(()), float("nan")
    if cfg.algorithm == "ppo":
        if critic_opt is None:
            raise ValueError("ppo needs the critic's optimizer")
        critic.train()
        values = _critic_values(critic, batch)
        vloss = value_loss(values, old_values, returns, mask, cfg.value_clip)
        critic_opt.zero_grad(set_to_none=True)
        vloss.backward()
        critic_opt.step()
        ev = explained_variance(old_values, returns, mask)
    with torch.no_grad():
        ent = float(masked_mean(entropy, mask))
    return UpdateStats(policy_loss=float(loss.detach()), value_loss=float(vloss.detach()),
                       clip_fraction=pstats.clip_fraction, approx_kl=pstats.approx_kl,
                       kl_to_reference=float(kl.detach()), entropy=ent,
                       explained_variance=ev, advantage_mean=float(masked_mean(adv, mask)),
                       reward_mean=float(batch.rewards.mean()))

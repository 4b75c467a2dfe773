"""The losses of one PPO / GRPO update and the statistics logged with them.

Policy: the clipped surrogate with asymmetric clipping (DAPO's "clip-higher", as CUDA Agent:
epsilon_low 0.2, epsilon_high 0.28): the ratio may rise to 1.28 before a positive advantage stops
pushing, so unlikely tokens can still gain probability, while it may only fall to 0.8. Losses are
averaged over all generated tokens of the batch ("token-mean"), so long trajectories weigh by
their length rather than each sequence equally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.rl.advantages import masked_mean


@dataclass
class PolicyLossStats:
    clip_fraction: float       # share of tokens whose ratio was clipped (the gradient stopped)
    approx_kl: float           # mean of the k3 estimator of KL(old || new)
    ratio_mean: float
    ratio_max: float


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28) -> tuple[torch.Tensor, PolicyLossStats]:
    """-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), token-mean over `mask`."""
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).to(torch.float32)
        live = mask.bool()
        stats = PolicyLossStats(
            clip_fraction=float(masked_mean(was_clipped, mask)),
            approx_kl=float(masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, mask)),
            ratio_mean=float(masked_mean(ratio, mask)),
            ratio_max=float(ratio[live].max()) if live.any() else 1.0)
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.0) -> torch.Tensor:
    """0.5 (V - R)^2, token-mean; with `clip` > 0, PPO's pessimistic clipped variant around the
    values the rollout saw."""
    err = (values - returns.detach()) ** 2
    if clip > 0:
        clipped = old_values.detach() + torch.clamp(values - old_values.detach(), -clip, clip)
        err = torch.maximum(err, (clipped - returns.detach()) ** 2)
    return 0.5 * masked_mean(err, mask)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled-token log-probs: k1 = log p - log q
    (unbiased, can be negative), k3 = q/p - 1 - log(q/p) (unbiased, never negative)."""
    diff = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return diff
    if kind == "k3":
        diff = diff.clamp(-20.0, 20.0)
        return torch.exp(-diff) - 1.0 + diff
    raise ValueError(f"kl kind must be k1 or k3, got {kind!r}")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the mask: 1 is a perfect critic, 0 no better than a constant.
    Undefined (nan) where the returns do not vary: a batch whose samples were all paid alike has a
    Var(R) of rounding error only, and dividing by it gave figures like -3.2e9."""
    live = mask.bool()
    r, v = returns[live].double(), values[live].double()
    if r.numel() < 2:
        return float("nan")
    var = r.var()
    if var <= 1e-6 * max(1.0, float(r.abs().mean()) ** 2):
        return float("nan")
    return float(1.0 - (r - v).var() / var)

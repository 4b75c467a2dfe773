"""Advantages and returns from outcome rewards.

CUDA Agent pays one reward per trajectory, on its last generated token; PPO's critic turns it
into per-token advantages with GAE (gamma 1, lambda 0.95 in the paper). In a multi-turn
trajectory the tokens between the policy's turns (tool observations, the harness's text) are not
actions: GAE runs over the generated tokens only, each one bootstrapping from the value of the
next generated token, so an observation never takes part in the recursion. GRPO needs no critic:
each trajectory's reward is normalized within the group of trajectories sampled for the same
prompt and broadcast to its tokens.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance over the masked entries; zero elsewhere."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards placed on each row's last generated token of a [B, T] mask (rows with no
    generated token get none)."""
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not match the batch of mask {tuple(mask.shape)}")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and zero off the mask.

    delta_t = r_t + gamma * V(next generated token) - V_t, A_t = delta_t + gamma * lam * A_next,
    with V and A of "next" taken at the next position where mask is 1 (0 past the last one).
    """
    if not token_rewards.shape == values.shape == mask.shape:
        raise ValueError(f"shapes differ: rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, "
                         f"mask {tuple(mask.shape)}")
    live = mask.bool()
    values = values.detach().to(torch.float32)
    rewards = token_rewards.to(torch.float32)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        here = live[:, t]
        advantages[:, t] = torch.where(here, adv, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_adv = torch.where(here, adv, next_adv)
    returns = (advantages + values) * live
    return advantages, returns


def group_normalized(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     scale: bool = True) -> torch.Tensor:
    """GRPO: each reward less its group's mean (and over its group's std when `scale`); rows are
    laid out group after group, `group_size` rows each. A group whose rewards are all equal gets
    zero advantage: it carries no signal about which sample was better."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.to(torch.float32).reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(rewards.shape)


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the same value on every generated token of the row."""
    return per_sequence[:, None].to(torch.float32) * mask.to(torch.float32)

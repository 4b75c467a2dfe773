"""A batch of sampled completions as the tensors an update works on.

Row i is prompt i (left-padded, as the sampler laid it out) followed by its completion
(right-padded). Per-token tensors are over the T - 1 next-token targets: position t holds what
concerns token t + 1 (its log-prob given tokens 0..t, the critic's value at t). `action_mask`
marks the targets the policy generated, the only ones a loss sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RolloutBatch:
    tokens: torch.Tensor          # [B, T] long
    pad_mask: torch.Tensor        # [B, T] bool, True = padding (megatron's convention)
    action_mask: torch.Tensor     # [B, T-1] float, 1 = a generated target
    old_logprobs: torch.Tensor    # [B, T-1] the sampler's log-probs at the generated targets, 0 elsewhere
    rewards: torch.Tensor         # [B] one outcome reward per completion

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.action_mask.sum(dim=1)


def make_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]], rewards: Sequence[float], pad_id: int,
               device: torch.device | str = "cpu") -> RolloutBatch:
    """Lay out prompts and completions (token ids, with the sampler's log-probs) for an update."""
    if not len(prompts) == len(completions) == len(logprobs) == len(rewards):
        raise ValueError("prompts, completions, logprobs and rewards differ in length")
    if any(len(c) != len(lp) for c, lp in zip(completions, logprobs)):
        raise ValueError("a completion and its log-probs differ in length")
    width = max(len(p) for p in prompts)
    total = width + max(max((len(c) for c in completions), default=0), 1)
    batch = len(prompts)
    tokens = torch.full((batch, total), pad_id, dtype=torch.long)
    pad = torch.ones(batch, total, dtype=torch.bool)
    action = torch.zeros(batch, total - 1)
    old = torch.zeros(batch, total - 1)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        tokens[i, width - len(p):width] = torch.tensor(list(p), dtype=torch.long)
        tokens[i, width:width + len(c)] = torch.tensor(list(c), dtype=torch.long)
        pad[i, width - len(p):width + len(c)] = False
        action[i, width - 1:width - 1 + len(c)] = 1.0
        old[i, width - 1:width - 1 + len(c)] = torch.tensor(list(lp), dtype=torch.float32)
    return RolloutBatch(tokens.to(device), pad.to(device), action.to(device), old.to(device),
                        torch.tensor(list(rewards), dtype=torch.float32, device=device))

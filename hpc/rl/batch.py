"""A batch of sampled completions as the tensors an update works on.

Row i is one whole sequence (a prompt and its completion, or a multi-turn trajectory: prompt,
reply, tool results, reply, ...), right-padded. Per-token tensors are over the T - 1 next-token targets: position t holds what
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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor | Sequence[int]) -> RolloutBatch:
        """The batch of these rows, in this order, cut to their longest sequence (what `pack`
        gives for them alone): a minibatch of short rows does not pay for the batch's longest.
        A [B, T-1] tensor that goes with the batch is cut alike by `x[rows, :new.tokens.shape[1] - 1]`."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        used = torch.nonzero((~self.pad_mask[rows]).any(dim=0))     # columns some selected row fills
        width = max(int(used[-1]) + 1 if len(used) else 0, 2)
        return RolloutBatch(self.tokens[rows, :width], self.pad_mask[rows, :width],
                            self.action_mask[rows, :width - 1], self.old_logprobs[rows, :width - 1],
                            self.rewards[rows])


def pack(sequences: Sequence[Sequence[int]], generated: Sequence[Sequence[bool]],
         logprobs: Sequence[Sequence[float]], rewards: Sequence[float], pad_id: int,
         device: torch.device | str = "cpu") -> RolloutBatch:
    """Lay out whole sequences, right-padded: `generated[i][t]` marks the tokens the policy
    sampled (the only ones trained on), `logprobs[i][t]` the sampler's log-prob of token t (any
    value where not generated)."""
    if not len(sequences) == len(generated) == len(logprobs) == len(rewards):
        raise ValueError("sequences, generated, logprobs and rewards differ in length")
    if any(not len(s) == len(g) == len(lp) for s, g, lp in zip(sequences, generated, logprobs)):
        raise ValueError("a sequence, its generated mask and its log-probs differ in length")
    batch, total = len(sequences), max(max((len(s) for s in sequences), default=0), 2)
    tokens = torch.full((batch, total), pad_id, dtype=torch.long)
    pad = torch.ones(batch, total, dtype=torch.bool)
    action = torch.zeros(batch, total)
    old = torch.zeros(batch, total)
    for i, (s, g, lp) in enumerate(zip(sequences, generated, logprobs)):
        n = len(s)
        tokens[i, :n] = torch.tensor(list(s), dtype=torch.long)
        pad[i, :n] = False
        action[i, :n] = torch.tensor([float(x) for x in g])
        old[i, :n] = torch.tensor(list(lp), dtype=torch.float32) * action[i, :n]
    # Target t + 1 sits at position t: shift the per-token tensors left by one.
    return RolloutBatch(tokens.to(device), pad.to(device), action[:, 1:].contiguous().to(device),
                        old[:, 1:].contiguous().to(device),
                        torch.tensor(list(rewards), dtype=torch.float32, device=device))


def make_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]], rewards: Sequence[float], pad_id: int,
               device: torch.device | str = "cpu") -> RolloutBatch:
    """Single-turn samples (a prompt, then its completion with the sampler's log-probs) for an update."""
    if not len(prompts) == len(completions) == len(logprobs) == len(rewards):
        raise ValueError("prompts, completions, logprobs and rewards differ in length")
    if any(len(c) != len(lp) for c, lp in zip(completions, logprobs)):
        raise ValueError("a completion and its log-probs differ in length")
    return pack([list(p) + list(c) for p, c in zip(prompts, completions)],
                [[False] * len(p) + [True] * len(c) for p, c in zip(prompts, completions)],
                [[0.0] * len(p) + list(lp) for p, lp in zip(prompts, logprobs)], rewards, pad_id, device)

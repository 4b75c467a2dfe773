"""The two supervised steps of the recipe: fine-tuning the policy on chosen sequences (warm-up
on demonstrations, rejection fine-tuning on kept trajectories) and pretraining the critic on
outcomes (value pretraining), each one optimizer step on a packed batch."""

from __future__ import annotations

import torch

from hpc.rl.advantages import broadcast_to_tokens, masked_mean
from hpc.rl.batch import RolloutBatch
from hpc.rl.losses import explained_variance, value_loss


def sft_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
             vocab_size: int) -> float:
    """Cross-entropy on the batch's generated tokens (token-mean); returns the loss."""
    from hpc.policy.model import sequence_logprobs

    policy.train()
    logp, _ = sequence_logprobs(policy, batch.tokens, batch.pad_mask, vocab_size, entropy=False)
    loss = -masked_mean(logp, batch.action_mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def value_step(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch) -> tuple[float, float]:
    """Fit the critic's value at every generated token to the trajectory's outcome (the return
    with gamma 1 and one reward at the end); returns (loss, explained variance before the step)."""
    from hpc.policy.model import staged_forward

    critic.train()
    mask = batch.action_mask
    returns = broadcast_to_tokens(batch.rewards, mask)
    values = staged_forward(critic, batch.tokens, batch.pad_mask)[:, :-1]
    loss = value_loss(values, values, returns, mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach()), explained_variance(values.detach(), returns, mask)


def reference_logprobs(model: torch.nn.Module, batch: RolloutBatch, vocab_size: int) -> torch.Tensor:
    """[B, T-1] log-probs of the batch's targets under `model` (the frozen reference of the KL
    term and metric), no gradient."""
    from hpc.policy.model import sequence_logprobs

    model.eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch.tokens, batch.pad_mask, vocab_size, entropy=False)
        return logp * batch.action_mask

"""The two supervised steps of the recipe: fine-tuning the policy on chosen sequences (warm-up
on demonstrations, rejection fine-tuning on kept trajectories) and pretraining the critic on
outcomes (value pretraining), each one optimizer step on a packed batch (across pipeline stages
in `microbatches` parts: `hpc.rl.staged`)."""

from __future__ import annotations

import torch

from hpc.policy.optimizer import StepStats, step_stats
from hpc.rl.advantages import broadcast_to_tokens, masked_mean
from hpc.rl.batch import RolloutBatch
from hpc.rl.losses import explained_variance, value_loss
from hpc.rl.staged import critic_outputs, evaluate, policy_outputs, train_pass


def sft_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
             vocab_size: int, microbatches: int = 1) -> tuple[float, StepStats]:
    """Cross-entropy on the batch's generated tokens (token-mean; the model's own distribution, at
    temperature 1: nothing was sampled); returns the loss and the optimizer step's measurements."""
    policy.train()
    loss = lambda out, cut: -masked_mean(out[0], cut(batch.action_mask))  # noqa: E731
    optimizer.zero_grad(set_to_none=True)
    out = train_pass(policy, batch, policy_outputs(vocab_size, entropy=False), loss, microbatches)
    stats = step_stats(optimizer)
    return float(loss(out, lambda x: x)), stats


def value_step(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
               microbatches: int = 1) -> tuple[float, float, StepStats]:
    """Fit the critic's value at every generated token to the trajectory's outcome (the return
    with gamma 1 and one reward at the end); returns (loss, explained variance before the step,
    the optimizer step's measurements)."""
    critic.train()
    mask = batch.action_mask
    returns = broadcast_to_tokens(batch.rewards, mask)
    loss = lambda out, cut: value_loss(out[0], out[0], cut(returns), cut(mask))  # noqa: E731
    optimizer.zero_grad(set_to_none=True)
    out = train_pass(critic, batch, critic_outputs(), loss, microbatches)
    stats = step_stats(optimizer)
    return float(loss(out, lambda x: x)), explained_variance(out[0], returns, mask), stats


def reference_logprobs(model: torch.nn.Module, batch: RolloutBatch, vocab_size: int,
                       temperature: float = 1.0) -> torch.Tensor:
    """[B, T-1] log-probs of the batch's targets under `model` (the frozen reference of the KL
    term and metric) at the rollout's `temperature` (as the policy's in `hpc.rl.update`), no
    gradient, on every rank of a pipeline."""
    model.eval()
    logp, _ = evaluate(model, batch, policy_outputs(vocab_size, False, temperature))
    return logp * batch.action_mask

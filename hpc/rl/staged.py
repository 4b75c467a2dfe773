"""The trainer's passes over a batch whatever the pipeline size (`policy.parallel.pipeline`).

A training pass in several microbatches (`policy.parallel.microbatches`) runs megatron's
schedule (`get_forward_backward_func`): the batch's rows split into microbatches, each cut to
its own longest row. Across pipeline stages it is the non-interleaved 1F1B schedule (which sends
each activation's shape ahead of it): the first stage embeds, activations and their gradients go
stage to stage, and the last stage applies the head (log-probs, values) and the loss. At one
stage it is megatron's no-pipelining schedule, gradient accumulation: each microbatch's forward
and backward in turn. A microbatch's loss is its share of the step's token-mean (its own masked
mean times its share of the generated tokens of the step, over every data-parallel rank:
`global_tokens`), so the gradients add up to those of the whole batch at once, and over
data-parallel ranks (summed by megatron's DDP) to those of one rank holding every rank's rows.
The schedules run every microbatch but the last under the model config's `no_sync_func`, so an
all-reduce that overlaps the backward (`hpc.policy.optimizer`) starts in the last one's only.
A tied embedding's two copies (first and last stage) sum their gradients over the embedding
group, as megatron's finalize_model_grads does, and stay equal: the optimizer does it after the
data-parallel all-reduce under megatron's DDP, this pass for a model without it.

Whatever the last stage computes (its per-token outputs, the critic's values, reference
log-probs) is broadcast to the pipeline group, so every rank computes the same statistics and
the writer (rank 0, on the first stage) logs what the last stage saw. With one stage and one
microbatch a pass is the plain forward (and backward) of the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpc.policy.optimizer import sum_tied_embedding_grads
from hpc.rl.batch import RolloutBatch

PerToken = tuple[torch.Tensor | None, ...]       # [B, T-1] tensors (or None) over a batch's targets
Cut = Callable[[torch.Tensor], torch.Tensor]     # a [B, T-1] tensor of the batch -> a microbatch's share


@dataclass(frozen=True)
class Outputs:
    """What a model gives per target of a batch: `whole` runs the whole (one-stage) model on a
    batch; `head` turns the last pipeline stage's output on a microbatch into the same."""

    whole: Callable[[torch.nn.Module, RolloutBatch], PerToken]
    head: Callable[[torch.Tensor, RolloutBatch], PerToken]


def policy_outputs(vocab_size: int, entropy: bool, temperature: float = 1.0) -> Outputs:
    """(log p(targets), the entropy there or None) of softmax(logits / temperature):
    `sequence_logprobs`. A last stage's logits are its tensor-parallel rank's vocabulary shard:
    gathered first (the gradient is split back)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hpc.policy.model import logits_logprobs, sequence_logprobs

    return Outputs(lambda model, b: sequence_logprobs(model, b.tokens, b.pad_mask, vocab_size, entropy, temperature),
                   lambda logits, b: logits_logprobs(gather_from_tensor_model_parallel_region(logits), b.tokens,
                                                     vocab_size, entropy, temperature))


def critic_outputs() -> Outputs:
    """(the critic's value at each target position,)."""
    from hpc.policy.model import staged_forward

    return Outputs(lambda model, b: (staged_forward(model, b.tokens, b.pad_mask)[:, :-1],),
                   lambda values, b: (values[:, :-1],))


def pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _moved(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value


def from_last_stage(value: Any) -> Any:
    """The last pipeline stage's `value` (a tensor, a tuple of them, or any picklable object) on
    every rank of its pipeline group, tensors on this rank's device; `value` itself at one stage."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        return value
    box = [_moved(value, "cpu") if ps.is_pipeline_last_stage() else None]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return _moved(box[0], device)


def pipeline_gather(value: Any) -> list:
    """Every pipeline stage's `value`, in stage order, on every rank of the group ([value] at one stage)."""
    from megatron.core import parallel_state as ps

    if pipeline_size() == 1:
        return [value]
    out: list = [None] * pipeline_size()
    torch.distributed.all_gather_object(out, value, group=ps.get_pipeline_model_parallel_group())
    return out


def evaluate(model: torch.nn.Module, batch: RolloutBatch, outputs: Outputs) -> PerToken:
    """`outputs` of `model` on `batch` without gradients, on every rank (forward-only across stages)."""
    from megatron.core import parallel_state as ps

    from hpc.policy.model import staged_forward

    with torch.no_grad():
        if pipeline_size() == 1:
            return outputs.whole(model, batch)
        out = staged_forward(model, batch.tokens, batch.pad_mask)
        return from_last_stage(outputs.head(out, batch) if ps.is_pipeline_last_stage() else None)


def microbatch_rows(rows: int, microbatches: int) -> list[torch.Tensor]:
    """Rows 0..rows-1 in min(microbatches, rows) contiguous parts of near-equal size."""
    return list(torch.arange(rows).tensor_split(max(1, min(microbatches, rows))))


def global_tokens(mask: torch.Tensor) -> float:
    """The generated tokens of a step over every data-parallel rank (`mask`: this rank's
    [B, T-1] action mask; its own sum when alone), at least 1."""
    from megatron.core import parallel_state as ps

    count = mask.sum().float()
    if ps.model_parallel_is_initialized() and ps.get_data_parallel_world_size() > 1:
        count = count.reshape(1).clone()
        torch.distributed.all_reduce(count, group=ps.get_data_parallel_group())
    return max(float(count.sum()), 1.0)


def train_pass(model: torch.nn.Module, batch: RolloutBatch, outputs: Outputs,
               loss: Callable[[PerToken, Cut], torch.Tensor], microbatches: int = 1) -> PerToken:
    """Accumulate the gradients of `loss` (a token-mean over the rows it is given, the batch's
    [B, T-1] tensors cut by its second argument) on `batch` into `model`'s parameters, in
    `microbatches` parts (across pipeline stages, or one after the other at one stage); returns
    the detached `outputs` of the whole batch on every rank (zero where a microbatch's width ends).

    The loss is weighed by this rank's share of the step's tokens over all data-parallel ranks
    (`global_tokens`), so the ranks' gradients sum (megatron's DDP) to those of the token mean
    over every rank's batch. Alone, the share is exactly 1: the plain token mean."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hpc.policy.model import forward_mask, position_ids

    total = global_tokens(batch.action_mask)
    parts = microbatch_rows(len(batch), microbatches)
    staged = pipeline_size() > 1
    if not staged and len(parts) == 1:
        out = outputs.whole(model, batch)
        share = max(float(batch.action_mask.sum()), 1.0) / total
        (loss(out, lambda x: x) * share).backward()
        return tuple(None if x is None else x.detach() for x in out)
    width = batch.action_mask.shape[1]
    collected: list[tuple[torch.Tensor, PerToken]] = []

    def step(data: Any, stage: torch.nn.Module) -> tuple[Any, Callable]:
        rows = next(data).to(batch.tokens.device)
        part = batch.select(rows)
        cut: Cut = lambda x: x[rows, :part.tokens.shape[1] - 1]  # noqa: E731
        # One stage: the whole model's outputs (its LM head without the [B, T, V] logits).
        output = (stage(part.tokens, position_ids(part.tokens), forward_mask(part.pad_mask)) if staged
                  else outputs.whole(stage, part))

        def loss_func(output: Any) -> tuple[torch.Tensor, dict]:
            out = outputs.head(output, part) if staged else output
            collected.append((rows, tuple(None if x is None else x.detach() for x in out)))
            # The schedule divides each microbatch's loss by their number.
            share = float(cut(batch.action_mask).sum()) / total
            return loss(out, cut) * (share * len(parts)), {}

        return output, loss_func

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter(parts), model=model,
                                num_microbatches=len(parts), seq_length=batch.tokens.shape[1],
                                micro_batch_size=max(len(p) for p in parts))
    if not hasattr(next(model.parameters()), "main_grad"):      # not under megatron's DDP
        sum_tied_embedding_grads(model)
    whole = None
    if ps.is_pipeline_last_stage():
        whole = []
        for i in range(len(collected[0][1])):
            if collected[0][1][i] is None:
                whole.append(None)
                continue
            full = torch.zeros(len(batch), width, dtype=collected[0][1][i].dtype, device=batch.tokens.device)
            for rows, out in collected:
                full[rows, :out[i].shape[1]] = out[i]
            whole.append(full)
        whole = tuple(whole)
    return from_last_stage(whole)


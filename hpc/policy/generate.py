"""Batched sampling from the policy with a KV cache, recording each token's log-prob for PPO.

A hand-written loop over megatron's StaticInferenceContext (its engines need CUDA): prompts
are left-padded to a common length, one prefill pass fills the cache, then each step feeds one
token per row. Padding keys are masked in every step, and rotary embeddings are relative, so
a padded row samples exactly what it would alone.

Log-probs are those of the temperature-scaled distribution over the model's vocabulary
(log_softmax(logits / T); T = 1 for greedy), before top-p truncation: the quantity a trainer
recomputes from the same tokens for the PPO ratio. Under tensor parallelism every TP rank runs
the loop; TP rank 0's samples are broadcast so all ranks return the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hpc.policy.config import PolicyModelConfig
from hpc.policy.model import attention_mask, mask_padded_vocab, position_ids
from hpc.policy.tokenizer import Tokenizer


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0                 # 0: greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)    # matched in the text without special tokens
    stop_token_ids: list[int] | None = None  # None: the tokenizer's eos
    seed: int | None = None                  # None: fresh randomness

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop: empty stop string")


@dataclass
class Completion:
    """One prompt's sample. `tokens` end with the stop token or the token that completed a
    stop string; `text` ends with that stop string (special tokens left out)."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str                       # "stop" (token or string) or "length"


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B]) from last-position logits [B, V] (padding already -inf)."""
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _tail(ids: list[int], n: int, special: frozenset[int]) -> list[int]:
    """The shortest suffix of `ids` holding `n` tokens that decode to text (not special)."""
    count = 0
    for k in range(len(ids) - 1, -1, -1):
        count += ids[k] not in special
        if count == n:
            return ids[k:]
    return ids


def _stop_match(text: str, stops: Sequence[str]) -> int:
    """End offset of the earliest stop string in `text`, or -1."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return min(ends) if ends else -1


def generate(model: torch.nn.Module, cfg: PolicyModelConfig, tokenizer: Tokenizer,
             prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
    """Sample a completion for each prompt (token ids) with the single-stage policy `model`.

    Collective over the tensor-parallel group: every TP rank calls it with the same prompts.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts import StaticInferenceContext

    params.validate()
    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("generate: needs pipeline-parallel size 1 (shard the policy with TP instead)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    batch, width = len(prompts), max(len(p) for p in prompts)
    total = width + params.max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"generate: longest prompt {width} + max_new_tokens {params.max_new_tokens} "
                         f"exceeds max_seq_len {cfg.max_seq_len}")
    device = next(model.parameters()).device
    stop_ids = set(params.stop_token_ids if params.stop_token_ids is not None else [tokenizer.eos_id])
    # A stop string of n UTF-8 bytes spans at most n text tokens; decoding that tail (and one
    # token more, for decoders that treat the first token specially) finds it.
    window = max((len(s.encode()) for s in params.stop), default=0) + 1

    tokens = torch.full((batch, total), tokenizer.pad_id, dtype=torch.long, device=device)
    pad = torch.ones(batch, total, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):width] = torch.tensor(list(p), dtype=torch.long, device=device)
        pad[i, width - len(p):] = False

    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
    tp_group = ps.get_tensor_model_parallel_group()
    tp_src = ps.get_tensor_model_parallel_src_rank()

    out_tokens: list[list[int]] = [[] for _ in prompts]
    out_logprobs: list[list[float]] = [[] for _ in prompts]
    texts: list[str | None] = [None] * batch
    finish = [""] * batch
    was_training = model.training
    model.eval()
    context = StaticInferenceContext(batch, total)
    try:
        with torch.no_grad():
            step_input = tokens[:, :width]
            mask = attention_mask(pad[:, :width])
            for step in range(params.max_new_tokens):
                start = context.sequence_len_offset
                logits = model(step_input, position_ids(step_input) + start, mask,
                               inference_context=context, runtime_gather_output=True)
                context.sequence_len_offset += step_input.shape[1]
                last = mask_padded_vocab(logits[:, -1, :], cfg.vocab_size)
                next_token, logp = sample_next(last, params.temperature, params.top_p, generator)
                if torch.distributed.get_world_size(tp_group) > 1:
                    torch.distributed.broadcast(next_token, tp_src, group=tp_group)
                    torch.distributed.broadcast(logp, tp_src, group=tp_group)
                pos = width + step
                tokens[:, pos] = next_token
                for i, (tok, lp) in enumerate(zip(next_token.tolist(), logp.tolist())):
                    if finish[i]:
                        continue
                    out_tokens[i].append(tok)
                    out_logprobs[i].append(lp)
                    if tok in stop_ids:
                        finish[i] = "stop"
                    elif params.stop and _stop_match(
                            tokenizer.decode(_tail(out_tokens[i], window, tokenizer.special_ids)), params.stop) >= 0:
                        finish[i] = "stop"
                        text = tokenizer.decode(out_tokens[i])
                        texts[i] = text[:_stop_match(text, params.stop)]
                if all(finish):
                    break
                pad[:, pos] = False
                step_input = tokens[:, pos:pos + 1]
                mask = pad[:, None, None, :pos + 1]
    finally:
        model.train(was_training)
    for i in range(batch):
        if not finish[i]:
            finish[i] = "length"
        if texts[i] is None:
            texts[i] = tokenizer.decode(out_tokens[i])
    return [Completion(out_tokens[i], out_logprobs[i], texts[i], finish[i]) for i in range(batch)]

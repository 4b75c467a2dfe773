"""Batched sampling from the policy with a KV cache, recording each token's log-prob for PPO.

Prompts are left-padded to a common length; one prefill pass fills the cache, then each step
feeds one token per row. Padding keys are masked in every step, and rotary embeddings are
relative, so a padded row samples exactly what it would alone.

Two decoders compute the same forward. With megatron's local layer spec it is
`hpc.policy.decode.StaticDecoder`: the policy's own modules over a KV cache of fixed shape, so
on CUDA with one tensor-parallel rank the one-token step is captured once in a CUDA graph
(after warm-up steps at a cache column no real step uses) and replayed per token, its token
and position read from device tensors; the prefill runs eagerly, and so does the step under
tensor parallelism (its all-reduces in a graph are not tried on GPUs yet). With Transformer
Engine layers it is megatron's own loop over StaticInferenceContext (its engines need CUDA),
whose per-layer Python bounds a step by kernel launches at small models and large batches.
Sampling stays outside the graph, with its torch.Generator.

Without stop strings the loop never waits for the GPU: stop tokens are checked on the device
and the samples come back once at the end; stop strings need each row's text, and a streaming
caller (`on_step`) each step's tokens, so with either every step brings the samples back.

Log-probs are those of the temperature-scaled distribution over the model's vocabulary
(log_softmax(logits / T); T = 1 for greedy), before top-p truncation: the quantity a trainer
recomputes from the same tokens for the PPO ratio. Under tensor parallelism every TP rank runs
the loop; TP rank 0's samples are broadcast so all ranks return the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hpc.policy import decode
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
    # torch.multinomial(probs, 1)'s own algorithm (argmax of p / q, q ~ Exp(1), drawn the same way
    # from the same generator: the same tokens), without the host syncs of its input checks; a
    # NaN distribution is refused once, after the loop (`generate`).
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    token = probs.div_(q).argmax(dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class _AllStopped:
    """Whether every row has met a stop token, read without waiting for the GPU: each call queues
    a copy of the device flag to pinned host memory and answers from the last copy that has
    landed (a step or two behind, so a batch may run a step or two past its last stop). With
    `sync` (tensor parallel: every rank must leave the loop at the same step) it waits."""

    def __init__(self, device: torch.device, sync: bool = False) -> None:
        self.cuda = device.type == "cuda" and not sync
        self.host = torch.zeros(1, dtype=torch.bool, pin_memory=self.cuda)
        self.event = None

    def __call__(self, stopped: torch.Tensor) -> bool:
        if not self.cuda:
            return bool(stopped.all())
        if self.event is not None:
            if not self.event.query():
                return False
            if bool(self.host[0]):
                return True
        self.host.copy_(stopped.all().reshape(1), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return False


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


DECODERS = ("auto", "static", "megatron")


def _megatron_forward(model: torch.nn.Module, tokens: torch.Tensor, pad: torch.Tensor,
                      width: int) -> Callable[[int], torch.Tensor]:
    """megatron's static-batching inference over `tokens` [b, total] (prompts in columns
    0..width-1): a function of the step giving that step's last-position logits [b, V]."""
    from megatron.core.inference.contexts import StaticInferenceContext

    context = StaticInferenceContext(*tokens.shape)

    def forward(step: int) -> torch.Tensor:
        if step == 0:
            step_input, mask = tokens[:, :width], attention_mask(pad[:, :width])
        else:
            pos = width + step - 1
            step_input, mask = tokens[:, pos:pos + 1], pad[:, None, None, :pos + 1]
        logits = model(step_input, position_ids(step_input) + context.sequence_len_offset, mask,
                       inference_context=context, runtime_gather_output=True)
        context.sequence_len_offset += step_input.shape[1]
        return logits[:, -1, :]

    return forward


class _StaticForward:
    """`StaticDecoder` over `tokens` [b, total] (prompts in columns 0..width-1): called with the
    step, gives that step's last-position logits [b, V]. Each step's token is read from `tokens`
    at a device position, so with `graphs` one captured step serves them all."""

    def __init__(self, model: torch.nn.Module, cfg: PolicyModelConfig, tokens: torch.Tensor,
                 pad: torch.Tensor, width: int, graphs: bool) -> None:
        self.decoder = decode.StaticDecoder(model, cfg, *tokens.shape)
        self.tokens, self.pad, self.width, self.graphs = tokens, pad, width, graphs
        self.position = torch.zeros(1, dtype=torch.long, device=tokens.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _step(self) -> torch.Tensor:
        token = self.tokens.index_select(1, self.position).squeeze(1)
        return self.decoder.step(token, self.position, self.pad)

    def _capture(self) -> None:
        # Warm-up steps (on a side stream, as capture wants) write the last column, which no
        # real step writes (its token is sampled, never fed) and every real step masks.
        self.position.fill_(self.tokens.shape[1] - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def __call__(self, step: int) -> torch.Tensor:
        if step == 0:
            return self.decoder.prefill(self.tokens[:, :self.width], self.pad[:, :self.width])
        if self.graphs and self.graph is None:
            self._capture()
        self.position.fill_(self.width + step - 1)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits


def generate(model: torch.nn.Module, cfg: PolicyModelConfig, tokenizer: Tokenizer,
             prompts: Sequence[Sequence[int]], params: SamplingParams, *, decoder: str = "auto",
             cuda_graphs: bool = True,
             on_step: Callable[[list[list[int]], list[bool]], None] | None = None) -> list[Completion]:
    """Sample a completion for each prompt (token ids) with the single-stage policy `model` (under
    pipeline parallelism, a whole replica of it).

    Collective over the tensor-parallel group: every TP rank calls it with the same prompts.
    `decoder`: "static" (`StaticDecoder`; refused where it cannot run), "megatron" (megatron's
    loop) or "auto" (static wherever it can run). `cuda_graphs`: replay the static decoder's
    step as a CUDA graph (on CUDA with one TP rank only; off, the same step runs eagerly).
    `on_step(tokens, finished)`, when given, is called after every step with each row's tokens so
    far and whether the row has finished (a server streaming the replies); what it raises ends
    the generation.
    """
    from megatron.core import parallel_state as ps

    params.validate()
    if decoder not in DECODERS:
        raise ValueError(f"generate: decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if getattr(getattr(model, "config", None), "pipeline_model_parallel_size", 1) != 1:
        raise ValueError("generate: needs the whole model in one stage (under pipeline parallelism, "
                         "hpc.policy.model.build_replica)")
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

    # Without stop strings the stop tokens are checked on the device and the tokens come back to
    # the host once at the end: no per-step sync or per-row Python on the hot path.
    on_device = not params.stop and on_step is None
    stop_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    gen_logprobs = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
    tp_size = torch.distributed.get_world_size(tp_group)
    all_stopped = _AllStopped(device, sync=tp_size > 1)
    out_tokens: list[list[int]] = [[] for _ in prompts]
    out_logprobs: list[list[float]] = [[] for _ in prompts]
    texts: list[str | None] = [None] * batch
    finish = [""] * batch
    steps = 0
    static = decoder == "static" or (decoder == "auto" and decode.unsupported(model) is None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if static:
                # Under TP a step's all-reduces would be captured too: not tried on GPUs yet, so eager.
                graphs = cuda_graphs and device.type == "cuda" and tp_size == 1
                forward = _StaticForward(model, cfg, tokens, pad, width, graphs)
            else:
                forward = _megatron_forward(model, tokens, pad, width)
            for step in range(params.max_new_tokens):
                last = mask_padded_vocab(forward(step), cfg.vocab_size)
                next_token, logp = sample_next(last, params.temperature, params.top_p, generator)
                if tp_size > 1:
                    torch.distributed.broadcast(next_token, tp_src, group=tp_group)
                    torch.distributed.broadcast(logp, tp_src, group=tp_group)
                pos = width + step
                tokens[:, pos] = next_token
                gen_logprobs[:, step] = logp
                steps = step + 1
                if on_device:
                    if stop_ids:
                        hit = torch.isin(next_token, stop_tensor) & ~stopped
                        lengths.masked_fill_(hit, steps)
                        stopped |= hit
                        if all_stopped(stopped):
                            break
                else:
                    for i, tok in enumerate(next_token.tolist()):
                        if finish[i]:
                            continue
                        out_tokens[i].append(tok)
                        if tok in stop_ids:
                            finish[i] = "stop"
                        elif params.stop and _stop_match(
                                tokenizer.decode(_tail(out_tokens[i], window, tokenizer.special_ids)),
                                params.stop) >= 0:
                            finish[i] = "stop"
                            text = tokenizer.decode(out_tokens[i])
                            texts[i] = text[:_stop_match(text, params.stop)]
                    if on_step is not None:
                        on_step(out_tokens, [bool(f) for f in finish])
                    if all(finish):
                        break
    finally:
        model.train(was_training)
    if params.temperature > 0 and bool(gen_logprobs[:, :steps].isnan().any()):
        raise RuntimeError("generate: the policy's next-token distribution contains NaN or inf")
    all_logprobs = gen_logprobs[:, :steps].tolist()
    if on_device:
        all_tokens = tokens[:, width:width + steps].tolist()
        for i, (n, hit) in enumerate(zip(lengths.clamp_(max=steps).tolist(), stopped.tolist())):
            out_tokens[i] = all_tokens[i][:n]
            finish[i] = "stop" if hit else ""
    for i in range(batch):
        out_logprobs[i] = all_logprobs[i][:len(out_tokens[i])]
        if not finish[i]:
            finish[i] = "length"
        if texts[i] is None:
            texts[i] = tokenizer.decode(out_tokens[i])
    return [Completion(out_tokens[i], out_logprobs[i], texts[i], finish[i]) for i in range(batch)]

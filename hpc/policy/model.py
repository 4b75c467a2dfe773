"""The policy (a megatron-core GPTModel) and the critic (the same trunk with a scalar value head).

Both are built for the calling process's place in the TP x PP grid set up by
`hpc.policy.parallel.init_parallel`. The layer spec is megatron's local one (plain torch
modules, its RMSNorms `ActivationDtypeRMSNorm`); Transformer Engine's is used only when TE is
installed and CUDA is present. Core attention is `cfg.attention`: megatron's DotProductAttention
("local", materializes the scores) or `SDPAttention` ("sdpa", torch's
scaled_dot_product_attention; the default on the GPU without TE). On CPU the model runs in fp32
with every fusion off.

Token conventions: inputs are [batch, seq] int64; `pad_mask` is True at padding. Padding may be
on either side: rotary embeddings are relative, so a left-padded row gives the same logits as
the unpadded row. A batch without padding before a real token (right-padded, or none) runs with
no explicit mask, i.e. megatron's causal attention (`forward_mask`). Logits have
`cfg.padded_vocab_size` columns; the ones past `cfg.vocab_size` are padding rows of the
embedding and are masked out of every probability computed here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hpc.policy.config import PolicyModelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig


def _have_te() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(cfg: PolicyModelConfig, whole: bool = False) -> TransformerConfig:
    """The megatron TransformerConfig for `cfg` under the current parallel_state (`whole`: for
    one stage holding every layer, whatever the pipeline size: `build_replica`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available()
    bf16 = cfg.torch_dtype_name(cuda) == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    fused = cfg.fusions_on(cuda)
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=1 if whole else parallel_state.get_pipeline_model_parallel_world_size(),
        use_cpu_initialization=not cuda,
        # SwiGLU and bias-dropout-add through megatron's torch.compile'd functions when `fused`;
        # the other fusions need Apex or Transformer Engine kernels.
        bias_activation_fusion=fused, bias_dropout_fusion=fused, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    # Pipeline microbatches are a batch's rows cut to their own longest sequence (`hpc.rl.staged`):
    # the schedule sends each activation's shape ahead of it. Set after construction, whose check
    # of the flag concerns MoE token dispatchers only (it refuses the default one, unused here).
    config.variable_seq_lengths = True
    # The trainer's losses are token sums over the step's token count on every data-parallel rank
    # (`hpc.rl.staged.train_pass`): megatron's DDP then sums the ranks' gradients rather than
    # averaging them (`hpc.policy.optimizer`). Nothing else here reads the flag.
    config.calculate_per_token_loss = True
    return config


class ActivationDtypeRMSNorm(torch.nn.RMSNorm):
    """megatron's torch RMSNorm (its `WrappedTorchNorm`, same constructor and state dict) with
    the weight cast to the activations' dtype at each call. megatron creates the weight in fp32
    whatever `params_dtype`; against bf16 activations torch then falls back from its fused
    kernel to a composite of fp32 copies and casts. Cast at the call, the norm runs bf16 x bf16
    in the fused kernel, while the weight itself stays fp32: the trainer's AdamW keeps no fp32
    master copy, so the parameter is that copy (a no-op cast in fp32, i.e. on CPU)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def layer_spec(cfg: PolicyModelConfig | None = None) -> ModuleSpec:
    """Transformer Engine's layer spec when TE and CUDA are there (and `cfg.attention` is auto),
    megatron's local one otherwise, with `ActivationDtypeRMSNorm` norms and its core attention
    swapped for `SDPAttention` under "sdpa"."""
    from megatron.core.models.gpt import gpt_layer_specs

    attention = (cfg or PolicyModelConfig()).attention_impl(torch.cuda.is_available(), _have_te())
    if attention == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ActivationDtypeRMSNorm
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    return spec


def decoder_spec(cfg: PolicyModelConfig, config: TransformerConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """What GPTModel builds its decoder from: `layer_spec(cfg)`, and for the local spec this
    stage's layers of it with `ActivationDtypeRMSNorm` as the final norm too (given the layer
    spec alone, megatron takes its own norm for that one)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = layer_spec(cfg)
    if spec.submodules.input_layernorm is not ActivationDtypeRMSNorm:    # TE's, fused into its linears
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=ActivationDtypeRMSNorm)


@functools.lru_cache(maxsize=None)
def sdpa_attention_class() -> type:
    """`SDPAttention`: megatron's DotProductAttention (same constructor, no parameters, same
    state dict) computed by `torch.nn.functional.scaled_dot_product_attention`.

    Masks follow megatron: boolean [b, 1, sq, sk], True = masked. A mask becomes an additive
    bias of a large finite negative number rather than -inf, so a query with every key masked
    (a left-padding position) gets a finite (meaningless) output as in megatron, never NaN
    (a NaN there would reach the real tokens through their attention to it: 0 x NaN). Without
    a mask, a causal layer attends causally (the flash kernel) and an unmasked one everywhere.
    GQA: one-token queries (decoding) fold each group's query heads into rows against the
    shared key/value head; longer ones without a mask pass `enable_gqa` (the flash kernel reads
    the shared heads in place), and with a mask repeat the key/value heads as
    DotProductAttention does (only flash takes `enable_gqa`; the masked kernels would fall back
    to the math one). `native_gqa = False` repeats them always (the benchmark's comparison).
    Softmax offsets, sliding windows and attention dropout fall back to DotProductAttention.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        native_gqa = True

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if (self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None
                    or (self.training and self.attention_dropout.p > 0)):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            assert packed_seq_params is None and attention_bias is None, \
                "SDPAttention: no packed sequences or attention bias"
            sq, b, heads, hn = query.shape
            sk, groups = key.shape[0], heads // key.shape[2]
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            # DotProductAttention divides its scale by the query-key layer-scaling coefficient
            # and multiplies the scores by it again in the softmax.
            scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
            # [s, b, n, hn] -> [b, n, s, hn]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            bias, causal = None, False
            if attention_mask is not None:
                bias = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
                bias.masked_fill_(attention_mask, max(torch.finfo(q.dtype).min, -1e30))
            elif mask_type == AttnMaskType.causal and sq > 1:
                if sq == sk:
                    causal = True
                else:   # queries are the last sq positions
                    bias = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
                    bias.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1),
                                      max(torch.finfo(q.dtype).min, -1e30))
            if groups > 1 and sq == 1:
                q = q.reshape(b, heads // groups, groups, hn)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
                out = out.reshape(b, heads, 1, hn)
            else:
                native = groups > 1 and bias is None and self.native_gqa
                if groups > 1 and not native:
                    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                                     scale=scale, enable_gqa=native)
            # [b, n, sq, hn] -> [sq, b, n * hn]
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    return SDPAttention


def _check_parallel(cfg: PolicyModelConfig) -> None:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (cfg.parallel.tensor, cfg.parallel.pipeline):
        raise ValueError(f"config asks for tensor={cfg.parallel.tensor} pipeline={cfg.parallel.pipeline}, "
                         f"parallel_state was initialized with tensor={tp} pipeline={pp}")
    cfg.validate(world_size=torch.distributed.get_world_size())


def _gpt(cfg: PolicyModelConfig, post_process: bool, tie: bool, whole: bool = False) -> GPTModel:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = transformer_config(cfg, whole)
    groups = None
    if whole:   # no pipeline or embedding group: every layer here, the tied weight one tensor
        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.pp = groups.embd = None
    model = GPTModel(
        config=config, transformer_layer_spec=decoder_spec(cfg, config),
        vocab_size=cfg.padded_vocab_size, max_sequence_length=cfg.max_seq_len,
        pre_process=whole or parallel_state.is_pipeline_first_stage(), post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=tie,
        position_embedding_type="rope", rotary_base=cfg.rope_base,
        rope_scaling=cfg.rope_scaling_factor > 0, rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        pg_collection=groups)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_policy(cfg: PolicyModelConfig) -> GPTModel:
    """This rank's stage of the policy GPTModel (initialized at random; load weights after)."""
    from megatron.core import parallel_state

    _check_parallel(cfg)
    return _gpt(cfg, post_process=parallel_state.is_pipeline_last_stage(), tie=cfg.tie_embeddings)


def build_replica(cfg: PolicyModelConfig) -> GPTModel:
    """Every layer of the policy in this process whatever the pipeline size (the embedding and
    the output layer too), outside the pipeline and sharded over the tensor-parallel group as the
    stages are: what a trainer samples from under pipeline parallelism, its weights gathered from
    the stages by `load_stages`. Random until then."""
    return _gpt(cfg, post_process=True, tie=cfg.tie_embeddings, whole=True)


def load_stages(replica: GPTModel, stage: GPTModel) -> None:
    """Copy the pipeline stages' weights (each rank's `stage`) into every rank's `replica`
    (`build_replica`); collective over the pipeline group, whose ranks hold the same
    tensor-parallel shard of their stages. A stage's layer i is the model's
    layer `layer_number - 1`; the last stage's copy of a tied output weight is the first
    stage's embedding, which the replica holds once."""
    from megatron.core import parallel_state as ps

    layers = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(stage.decoder.layers)}
    local = {}
    for key, value in stage.state_dict().items():
        if key.startswith("decoder.layers."):
            index, _, rest = key.removeprefix("decoder.layers.").partition(".")
            key = f"decoder.layers.{layers[index]}.{rest}"
        local[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    wanted = replica.state_dict()
    merged = {key: value for part in parts for key, value in part.items() if key in wanted}
    replica.load_state_dict(merged)


class CriticModel(torch.nn.Module):
    """The policy's trunk with a scalar value head: one value per token.

    The trunk is a GPTModel without its output layer; the last pipeline stage adds the final
    RMSNorm and a Linear(hidden, 1) replicated on every TP rank. The head starts at zero, so
    a fresh critic predicts 0 everywhere. Parameter names match the policy's except
    `final_layernorm.*` (the policy's `decoder.final_layernorm.*`) and `value_head.*`, so a
    policy checkpoint initializes the critic (`critic_state_from_policy`).
    """

    def __init__(self, cfg: PolicyModelConfig) -> None:
        super().__init__()
        from megatron.core import parallel_state

        self.cfg = cfg
        self.trunk = _gpt(cfg, post_process=False, tie=False)
        # What megatron's pipeline schedules read from the model they run.
        self.config, self.model_type = self.trunk.config, self.trunk.model_type
        self.post_process = parallel_state.is_pipeline_last_stage()
        if self.post_process:
            tc = self.trunk.config
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            self.final_layernorm = torch.nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, device=device,
                                                    dtype=tc.params_dtype)
            self.value_head = torch.nn.Linear(cfg.hidden_size, 1, device=device, dtype=tc.params_dtype)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Pipeline stages after the first take their input from the previous stage."""
        self.trunk.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq] values on the last stage; the [seq, batch, hidden] activations elsewhere."""
        hidden = self.trunk(input_ids, position_ids, attention_mask)
        if not self.post_process:
            return hidden
        return self.value_head(self.final_layernorm(hidden)).squeeze(-1).transpose(0, 1).float()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """The trunk's megatron sharded state dict plus the head, replicated across TP and DP."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.trunk.sharded_state_dict(prefix=f"{prefix}trunk.", sharded_offsets=sharded_offsets,
                                           metadata=metadata)
        if self.post_process:
            local = {k: v for k, v in self.state_dict(prefix="", keep_vars=True).items()
                     if not k.startswith("trunk.")}
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            sd.update(make_sharded_tensors_for_checkpoint(
                local, prefix, {}, sharded_offsets,
                tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=dp_group))
        return sd


def build_critic(cfg: PolicyModelConfig) -> CriticModel:
    """This rank's stage of the critic (random trunk, zero value head)."""
    _check_parallel(cfg)
    return CriticModel(cfg)


def critic_state_from_policy(policy_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A critic state dict (without the value head) from this rank's policy state dict: the
    usual PPO start, the critic's trunk equal to the policy's."""
    out = {}
    for key, value in policy_state.items():
        if key.startswith("output_layer.") or key.endswith("_extra_state"):
            continue
        if key.startswith("decoder.final_layernorm."):
            out[key.removeprefix("decoder.")] = value
        else:
            out[f"trunk.{key}"] = value
    return out


def attention_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask [batch, 1, seq, seq] (True = masked): causal, and no query
    attends to a padding key."""
    b, s = pad_mask.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=pad_mask.device).triu(1)
    return causal[None, None] | pad_mask[:, None, None, :]


def forward_mask(pad_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask for a whole-sequence forward: None (megatron's causal attention; the flash
    kernel under SDPA, not the slower kernel an explicit mask needs) unless some row has
    padding before a real token (left padding), then `attention_mask(pad_mask)`. In a
    right-padded row every padding key comes after every real query, so causality alone
    masks it and the real positions' outputs are the same; the padding positions' own outputs
    differ, and no loss reads them."""
    if pad_mask is None or not bool((pad_mask[:, :-1] & ~pad_mask[:, 1:]).any()):
        return None
    return attention_mask(pad_mask)


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """0..seq-1 per row (rotary embeddings ignore them; the GPTModel signature wants them)."""
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """Logits with columns at global vocabulary ids >= vocab_size set to -inf. `vocab_start` is
    the global id of column 0 (non-zero for a TP rank's shard of vocab-parallel logits)."""
    width = logits.shape[-1]
    real = vocab_size - vocab_start
    if real >= width:
        return logits
    return torch.cat([logits[..., :max(real, 0)],
                      torch.full_like(logits[..., max(real, 0):], float("-inf"))], dim=-1)


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None,
                   gather: bool = True) -> torch.Tensor | None:
    """[batch, seq, vocab] logits of the policy; gathered over TP unless `gather` is False (then
    each TP rank holds its vocabulary shard, as `vocab_parallel_logprobs` wants).

    With pipeline stages this is a forward-only pass (activations go stage to stage with
    send/recv; no gradient crosses them) and only the last stage gets logits, the others None.
    Training across stages belongs to megatron's pipeline schedules.
    """
    return staged_forward(model, tokens, pad_mask, runtime_gather_output=gather)


def staged_forward(model: torch.nn.Module, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None,
                   **kwargs: bool) -> torch.Tensor | None:
    """`model(tokens, positions, mask, **kwargs)` for the policy or the critic, over however
    many pipeline stages there are; the last stage's output, None on the other stages."""
    from megatron.core import parallel_state as ps

    args = (tokens, position_ids(tokens), forward_mask(pad_mask))
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(*args, **kwargs)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not first:
        config = (model.trunk if isinstance(model, CriticModel) else model).config
        received = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size,
                               dtype=config.pipeline_dtype, device=next(model.parameters()).device)
        torch.distributed.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    out = model(*args, **kwargs)
    if last:
        return out
    torch.distributed.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return None


@contextlib.contextmanager
def _without_output_layer(model: GPTModel) -> Iterator[None]:
    """`model.post_process` False for the block, restored after it even when it raises.
    GPTModel's forward reads the flag only to return the decoder's output before its output
    layer (and loss); the decoder's final norm is built at construction (TransformerBlock's own
    `post_process`) and runs whatever the flag."""
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


def hidden_states(model: GPTModel, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[seq, batch, hidden] final hidden states (after the final norm) of a single-stage policy,
    megatron's sequence-first layout: what its output layer would multiply into the logits.
    The policy's own forward (`staged_forward`: the positions and mask of `forward_logits`)
    stopped before the output layer, so that `sequence_logprobs` can apply the LM head a chunk of
    positions at a time."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("hidden_states needs a single pipeline stage")
    with _without_output_layer(model):
        return staged_forward(model, tokens, pad_mask)


# Elements (over the full, padded width) in one chunk of positions of `_LogprobsEntropy`. On
# CUDA the compiled chunk kernels keep no [chunk, V] temporary, so there the size only sets the
# launch count (a few kernels a chunk; 19 chunks for a 0.5B step of 8 x 2048 positions: nothing
# next to the kernels' own time) and raising it gains nothing; the eager path (CPU) holds a few
# fp32 temporaries of the chunk's size (512 MiB each), which this bounds. `_LinearLogprobsEntropy`
# counts the real columns (the logits it multiplies) and holds a chunk's logits and, backward,
# their gradient (256 MiB each in bf16); its weight-gradient GEMM sums over a chunk's rows (about
# 900 at the 0.5B's 8 x 2048), and its weight gradient is rounded once a chunk.
_CHUNK_ELEMENTS = 1 << 27

# Devices whose chunks run through the torch.compile'd `_compiled` functions; elsewhere eagerly.
_COMPILED_DEVICES = frozenset({"cuda"})


def _position_chunks(positions: int, per_position: int) -> Iterator[slice]:
    """Slices of `positions` positions, each of at most `_CHUNK_ELEMENTS` elements of the logits
    when a position has `per_position` of them (at least one position a chunk)."""
    step = max(1, _CHUNK_ELEMENTS // per_position)
    for start in range(0, positions, step):
        yield slice(start, start + step)


def _forward_chunk(x: torch.Tensor, targets: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), logsumexp, entropy) in fp32 per position of the distribution
    softmax(x / temperature) over real-vocabulary logits x [..., V] of any dtype (the lse is that
    of x / temperature); a target >= V (in the padding) has log p = -inf. The entropy is
    -sum(p log p), a sum of non-negative terms, where lse - sum(p x) would subtract two numbers
    of the logits' size; and no elementwise term feeds two reductions, which inductor would
    otherwise store (on CPU) rather than recompute."""
    x = x.float() / temperature
    lse = torch.logsumexp(x, dim=-1)
    logp = x - lse.unsqueeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    real = targets < x.shape[-1]
    picked = x.gather(-1, targets.clamp_max(x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(real, picked - lse, float("-inf")), lse, entropy


def _grad_chunk(x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                grad_logp: torch.Tensor, grad_entropy: torch.Tensor, temperature: float) -> torch.Tensor:
    """d(sum g_logp log p(t) + g_H H)/dx in x's dtype for real-vocabulary logits x [..., V], p
    = softmax(x / temperature): (onehot(t) g_logp - p (g_logp + g_H (log p + H))) / temperature,
    elementwise from the forward's lse and H. The target term is a column-index compare rather
    than a scatter, so a compiled kernel fuses it; a target in the padding matches no column."""
    logp = x.float() / temperature - lse.unsqueeze(-1)
    scale = grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (logp + entropy.unsqueeze(-1))
    hit = targets.unsqueeze(-1) == torch.arange(x.shape[-1], device=x.device)
    grad = (torch.where(hit, grad_logp.unsqueeze(-1), 0.0) - logp.exp() * scale) / temperature
    return grad.to(x.dtype)


def _write_grad_chunk(out: torch.Tensor, *args: torch.Tensor) -> None:
    """`_grad_chunk` stored into `out` (a view of the gradient): compiled, inductor writes the
    kernel's result there rather than into a temporary it then copies."""
    out.copy_(_grad_chunk(*args))


@functools.cache
def _compiled(fn: Any) -> Any:
    """`fn` under torch.compile, built at its first use (importing dynamo costs seconds). With
    dynamic=True the first compile has symbolic sizes: the last, shorter chunk and each new
    batch size or sequence length reuse it, where static shapes would recompile for each (and
    automatic dynamic once more); the kernels are bandwidth-bound looped reductions, which
    static sizes would not make faster."""
    return torch.compile(fn, dynamic=True)


class _LogprobsEntropy(torch.autograd.Function):
    """log p(target) and the entropy per position of logits [..., T, W] over their first
    `vocab_size` columns (the rest is padding, with gradient 0), in fp32 a chunk of positions at
    a time. It saves the logits and the per-position logsumexp and entropy, so the backward is
    elementwise (no reduction recomputed) and writes the gradient in the logits' dtype: no
    [..., T, V] tensor in fp32, forward or backward. On CUDA each chunk's forward and backward
    are torch.compile'd kernels that read the logits chunk (the forward's reductions in two or
    three passes, the backward in one) and write only the [..., T] results or the gradient. The
    compiled functions get detached logits: a `requires_grad` that differs between scoring and
    training would otherwise be a guard that recompiles."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                with_entropy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        compiled = logits.device.type in _COMPILED_DEVICES
        chunk_fn = _compiled(_forward_chunk) if compiled else _forward_chunk
        logp = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lse, entropy = torch.empty_like(logp), torch.empty_like(logp)
        x = logits.detach()
        for c in _position_chunks(logits.shape[-2], logits[..., 0, :].numel()):
            logp[..., c], lse[..., c], entropy[..., c] = chunk_fn(x[..., c, :vocab_size], targets[..., c],
                                                                  temperature)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.vocab_size, ctx.compiled, ctx.temperature = vocab_size, compiled, temperature
        return logp, entropy if with_entropy else None

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        # A missing upstream gradient is a zero one: one compiled function serves all three cases.
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        write = _compiled(_write_grad_chunk) if ctx.compiled else _write_grad_chunk
        v = ctx.vocab_size
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        grad[..., v:] = 0
        for c in _position_chunks(x.shape[-2], x[..., 0, :].numel()):
            write(grad[..., c, :v], x[..., c, :v], targets[..., c], lse[..., c], entropy[..., c],
                  grad_logp[..., c], grad_entropy[..., c], ctx.temperature)
        return grad, None, None, None, None


class _LinearLogprobsEntropy(torch.autograd.Function):
    """`_LogprobsEntropy` of the logits hidden @ weight[:vocab_size].T, the LM head fused in:
    hidden [T, B, h] (megatron's sequence-first layout), weight [W, h] (the output layer's or
    the tied embedding's, W >= vocab_size padded rows), targets and the results [B, T]. Each
    chunk of positions multiplies its [chunk, B, V] logits in the activations' dtype (as
    megatron's output layer: no bias) and reduces them with `_forward_chunk`; the backward
    recomputes them (one more GEMM a chunk) and turns `_write_grad_chunk`'s gradient into those
    of the hidden states and the weight. So no [B, T, V] tensor exists in either pass, nor its
    transposed and sliced copies, nor the logits' gradient that the output layer's backward
    reads: a chunk's logits and their gradient, at most `_CHUNK_ELEMENTS` each.

    The weight's gradient accumulates over the chunks in the weight's dtype (`addmm_`: each
    chunk's product summed in fp32 inside the GEMM, the running sum rounded once a chunk). Where
    megatron's output layer rounds one product to bf16, this rounds once per chunk (19 for the
    0.5B's 8 x 2048 step): a few bf16 ulps, small next to the rounding of the bf16 parameters'
    own update (the trainer's AdamW keeps no fp32 master copy), while an fp32 accumulator would
    add an fp32 [V, h] read-modify-write per chunk (about 1 GB of traffic each at the 0.5B's
    vocabulary). The padded rows of the weight get a zero gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                with_entropy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        compiled = hidden.device.type in _COMPILED_DEVICES
        chunk_fn = _compiled(_forward_chunk) if compiled else _forward_chunk
        head = weight[:vocab_size]
        targets = targets.t().contiguous()
        logp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(logp), torch.empty_like(logp)
        for c in _position_chunks(hidden.shape[0], hidden.shape[1] * vocab_size):
            logp[c], lse[c], entropy[c] = chunk_fn(hidden[c] @ head.t(), targets[c], temperature)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.vocab_size, ctx.compiled, ctx.temperature = vocab_size, compiled, temperature
        return logp.t().contiguous(), entropy.t().contiguous() if with_entropy else None

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None,
                                                             None]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.t().contiguous()
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.t().contiguous()
        write = _compiled(_write_grad_chunk) if ctx.compiled else _write_grad_chunk
        v = ctx.vocab_size
        head = weight[:v]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        for c in _position_chunks(hidden.shape[0], hidden.shape[1] * v):
            logits = hidden[c] @ head.t()
            grad_logits = torch.empty_like(logits)
            write(grad_logits, logits, targets[c], lse[c], entropy[c], grad_logp[c], grad_entropy[c],
                  ctx.temperature)
            rows = grad_logits.flatten(0, 1)
            torch.mm(rows, head, out=grad_hidden[c].flatten(0, 1))
            grad_weight[:v].addmm_(rows.t(), hidden[c].flatten(0, 1))
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(target) [..., T] in fp32 under p = softmax(logits / temperature) of gathered logits
    [..., T, V] over their first `vocab_size` columns (a target in the padding gets -inf), a chunk
    of positions at a time: `token_logprobs_and_entropy`."""
    return _LogprobsEntropy.apply(logits, targets, vocab_size, False, temperature)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy of the next-token distribution), both [..., T] in fp32, from
    gathered logits [..., T, V] of any dtype over their first `vocab_size` columns: the values
    and gradients of log_softmax(mask_padded_vocab(logits.float()) / temperature) without a
    [..., T, V] fp32 tensor (on CUDA, fused compiled kernels a chunk of positions at a time).
    `temperature` is the sampler's (`hpc.policy.generate`): an RL trainer's log-probs, entropy
    and reference log-probs are those of the distribution its rollouts were sampled from."""
    return _LogprobsEntropy.apply(logits, targets, vocab_size, True, temperature)


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor, pad_mask: torch.Tensor | None,
                      vocab_size: int, entropy: bool,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(log p(tokens[:, 1:]) from positions [:, :-1], the entropy there if `entropy` else None),
    [B, S-1] fp32, p = softmax(logits / temperature): what the trainer's losses read (at the
    rollout's temperature for RL, 1 for fine-tuning). A single-stage GPTModel on one TP rank
    applies its LM head inside the log-prob computation (`hidden_states` and
    `_LinearLogprobsEntropy`), never materializing the [B, S, V] logits or their gradient;
    otherwise (TP > 1, pipeline stages, another module) `forward_logits` and
    `token_logprobs` / `token_logprobs_and_entropy` on them, and None on a pipeline stage
    other than the last, as `forward_logits`. Values and gradients are the same either way."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    targets = tokens[:, 1:]
    if (isinstance(model, GPTModel) and ps.get_tensor_model_parallel_world_size() == 1
            and ps.get_pipeline_model_parallel_world_size() == 1):
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)
        hidden = hidden_states(model, tokens, pad_mask)[:-1]
        return _LinearLogprobsEntropy.apply(hidden, weight, targets, vocab_size, entropy, temperature)
    logits = forward_logits(model, tokens, pad_mask)
    return None if logits is None else logits_logprobs(logits, tokens, vocab_size, entropy, temperature)


def logits_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, entropy: bool,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` from the policy's gathered logits [B, S, V] of `tokens` [B, S] (what
    the last pipeline stage computes it from)."""
    targets = tokens[:, 1:]
    if entropy:
        return token_logprobs_and_entropy(logits[:, :-1], targets, vocab_size, temperature)
    return token_logprobs(logits[:, :-1], targets, vocab_size, temperature), None


def vocab_parallel_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """log p(target), p = softmax(logits / temperature), from this TP rank's vocabulary shard of
    the logits, without gathering the full vocabulary."""
    from megatron.core import parallel_state, tensor_parallel

    start = parallel_state.get_tensor_model_parallel_rank() * local_logits.shape[-1]
    local = mask_padded_vocab(local_logits.float() / temperature, vocab_size, start)
    # It wants [seq, batch, vocab/tp], returns -log p, and works in place on its input: a copy.
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        local.transpose(0, 1).clone(memory_format=torch.contiguous_format),
        targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters held by this rank (a TP shard counts its shard only)."""
    return sum(p.numel() for p in model.parameters())

"""A fixed-shape decode step over the policy's own weights, with a KV cache owned here.

megatron's static-batching inference re-runs its per-layer Python and re-applies rotary
embeddings to the whole key cache at every step; at small models and large batches a step is
bound by kernel launches. `StaticDecoder` computes the same forward (the same embedding, norms,
linear layers, MLPs and output layer, called as megatron calls them) with shapes that never
change from one step to the next: the new token's key and value are written into a
[batch, groups, max_len, head_dim] cache at a position held in a device tensor, and the query
attends to all max_len keys under a mask of the padding and of the positions not written yet.
A step therefore has no host-side dependence on where it is in the sequence and can be
captured once in a CUDA graph and replayed per token (`hpc.policy.generate` does).

Positions are the columns of the left-padded batch, as in megatron's static inference: the
prompt block is columns 0..w-1, the token fed at step t column w+t. Rotary embeddings are
relative, so a left-padded row gives the logits of the unpadded row.

Scope: the policy as `hpc.policy.model` builds it with megatron's local layer spec (core
attention "local" or "sdpa"), on one pipeline stage. Under tensor parallelism each rank holds
its share of the heads and of the cache; the parallel linear layers, the vocabulary-parallel
embedding and the output layer's gather do the communication, as in megatron's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc.policy.config import PolicyModelConfig
from hpc.policy.model import ActivationDtypeRMSNorm, attention_mask

# Additive bias of a masked key, finite as in SDPAttention: a row with every key masked
# gets a meaningless but finite output rather than NaN.
_MASKED = -1e30


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `StaticDecoder` cannot run `model` on this rank, or None when it can."""
    from megatron.core.models.gpt import GPTModel

    if not isinstance(model, GPTModel):
        return f"needs a megatron GPTModel, got {type(model).__name__}"
    if model.config.pipeline_model_parallel_size != 1:
        return "needs the whole model in one stage"
    if not all(isinstance(layer.input_layernorm, ActivationDtypeRMSNorm) for layer in model.decoder.layers):
        return "needs megatron's local layer spec (not Transformer Engine's)"
    if model.config.add_bias_linear or model.config.rotary_interleaved or model.config.sequence_parallel:
        return ("needs bias-free linear layers (but qkv), non-interleaved rotary embeddings and no "
                "sequence parallelism")
    return None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved rotary embedding (`_apply_rotary_pos_emb_bshd`)."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


class StaticDecoder:
    """Prefill and one-token steps of `model` over a batch of `batch` rows and `max_len` positions.

    Owns the KV cache (allocated here, in the activations' dtype), so one decoder per batch
    shape; it may be reused for another batch of that shape (every position a step reads is
    written by the prefill or an earlier step of the same batch, the others are masked).
    """

    def __init__(self, model: torch.nn.Module, cfg: PolicyModelConfig, batch: int, max_len: int) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder: {reason}")
        self.model = model
        self.layers = list(model.decoder.layers)
        weight = model.embedding.word_embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        attention = self.layers[0].self_attention     # this rank's share of the heads under TP
        self.heads, self.groups = attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition
        self.head_dim = cfg.kv_channels
        self.max_len = max_len
        # megatron's own rotary table for this length (the one its static inference uses), as
        # cos/sin in the activations' dtype: [max_len, head_dim].
        emb = model.rotary_pos_emb(max_len).reshape(max_len, -1).to(self.device)
        self.cos, self.sin = torch.cos(emb).to(self.dtype), torch.sin(emb).to(self.dtype)
        self.scales = [layer.self_attention.core_attention.softmax_scale
                       * (layer.self_attention.core_attention.scale_mask_softmax.scale or 1.0)
                       for layer in self.layers]
        # Zeros, not empty: a masked key's value still enters the weighted sum (times 0), and
        # uninitialized memory could hold NaN.
        shape = (len(self.layers), batch, self.groups, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.columns = torch.arange(max_len, device=self.device)

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated query [s, b, heads, hn], rotated key and value [s, b, groups, hn] from [s, b, h]
        (the interleaved layout of SelfAttention.get_query_key_value_tensors)."""
        qkv, _ = layer.self_attention.linear_qkv(layer.input_layernorm(x))
        s, b = qkv.shape[:2]
        per_group = self.heads // self.groups
        q, k, v = qkv.view(s, b, self.groups, (per_group + 2) * self.head_dim).split(
            [per_group * self.head_dim, self.head_dim, self.head_dim], dim=3)
        q = q.reshape(s, b, self.heads, self.head_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    @staticmethod
    def _finish(layer: torch.nn.Module, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after core attention: output projection, residual, MLP, residual."""
        out, _ = layer.self_attention.linear_proj(attn)
        x = x + out
        out, _ = layer.mlp(layer.pre_mlp_layernorm(x))
        return x + out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[b, V] logits of the hidden states [1, b, h], through the tied embedding as GPTModel does."""
        model = self.model
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(model.decoder.final_layernorm(x), weight=weight, runtime_gather_output=True)
        return logits[0]

    def prefill(self, tokens: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """Fill cache columns 0..w-1 from the left-padded prompts [b, w] (`pad_mask` True at
        padding) and return the last position's logits [b, V]. Eager: its shapes are the prompts'."""
        width = tokens.shape[1]
        x = self.model.embedding(input_ids=tokens, position_ids=None)
        mask = attention_mask(pad_mask)
        cos, sin = self.cos[:width, None, None], self.sin[:width, None, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.keys[i, :, :, :width] = k.permute(1, 2, 0, 3)
            self.values[i, :, :, :width] = v.permute(1, 2, 0, 3)
            attention = layer.self_attention
            attn = attention.core_attention(q, k, v, mask, attn_mask_type=attention.attn_mask_type)
            x = self._finish(layer, x, attn)
        return self._logits(x[-1:])

    def step(self, token: torch.Tensor, position: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        """Logits [b, V] after feeding `token` [b] at column `position` (a 0-dim or [1] int64
        device tensor). `key_pad` [b, max_len] is True at padding keys; columns after `position`
        are masked here. Fixed shapes and no host reads: capturable in a CUDA graph."""
        batch = token.shape[0]
        position = position.reshape(1)
        x = self.model.embedding(input_ids=token[:, None], position_ids=None)
        cos = self.cos.index_select(0, position)[:, None, None]
        sin = self.sin.index_select(0, position)[:, None, None]
        masked = key_pad | (self.columns > position)
        bias = torch.zeros(batch, 1, 1, self.max_len, dtype=self.dtype, device=self.device)
        bias.masked_fill_(masked[:, None, None, :], _MASKED)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.keys[i].index_copy_(2, position, k.permute(1, 2, 0, 3))
            self.values[i].index_copy_(2, position, v.permute(1, 2, 0, 3))
            # GQA: each group's query heads are rows of one query block against its key head.
            q = q.reshape(batch, self.groups, self.heads // self.groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=bias,
                                                 scale=self.scales[i])
            x = self._finish(layer, x, out.reshape(1, batch, self.heads * self.head_dim))
        return self._logits(x)

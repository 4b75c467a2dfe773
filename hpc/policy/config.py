"""Shape, precision and parallel layout of the policy (and critic) model.

A plain dataclass with no torch or megatron import, so configs can be loaded, validated and
printed anywhere. Loaded from a dict or YAML with the same rules as the evaluation config:
unknown keys and wrong types are errors that name the key (`policy.hidden_size: expected int`).
A `preset` key picks the starting point (`tiny` for CPU, `0.5b` or `1b` for the GPU); other keys
override it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from hpc.config import build_config, read_yaml_mapping
from hpc.errors import ConfigError

DTYPES = ("auto", "fp32", "bf16")
ATTENTIONS = ("auto", "local", "sdpa")
FUSIONS = ("auto", "on", "off")


@dataclass
class ParallelSizes:
    """Model-parallel sizes (data parallel is whatever the world size leaves over), and how
    a training step uses them."""

    tensor: int = 1
    pipeline: int = 1
    microbatches: int = 0      # a training step's parts (pipeline schedule or gradient accumulation); 0: one per stage
    overlap_grad_reduce: bool = True   # the data-parallel gradient all-reduce during the backward pass


@dataclass
class PolicyModelConfig:
    """A Llama/Qwen2-style decoder: RMSNorm, rotary embeddings, GQA, SwiGLU MLP.

    The defaults are the `tiny` preset: about 270K parameters over the byte tokenizer's
    vocabulary, fast enough for CPU tests and the embedded default.
    """

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2               # key/value heads (GQA); = heads for plain MHA
    ffn_hidden_size: int = 256
    head_dim: int = 0                       # 0: hidden_size / num_attention_heads
    vocab_size: int = 259                   # the tokenizer's vocabulary
    vocab_multiple: int = 128               # embedding rows are padded to a multiple of this
    max_seq_len: int = 1024
    rope_base: float = 10000.0
    rope_scaling_factor: float = 0.0        # Llama 3.x frequency scaling; 0: none
    norm_eps: float = 1e-6
    qkv_bias: bool = False                  # Qwen2 has biases on q, k and v
    tie_embeddings: bool = True
    dtype: str = "auto"                     # auto: bf16 on GPU, fp32 on CPU
    # Core attention: "local" is megatron's DotProductAttention (materializes the [s, s] scores),
    # "sdpa" torch's scaled_dot_product_attention (flash / memory-efficient kernels on the GPU);
    # auto: Transformer Engine's when it is installed (with CUDA), else sdpa on GPU, local on CPU.
    attention: str = "auto"
    # megatron's torch.compile'd SwiGLU and bias-dropout-add fusions; auto: on with CUDA.
    fusions: str = "auto"
    parallel: ParallelSizes = field(default_factory=ParallelSizes)

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer: independent of the TP size, so a checkpoint
        reshards between TP sizes unchanged."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    def torch_dtype_name(self, cuda: bool) -> str:
        """The parameter dtype this config resolves to on a machine with or without CUDA."""
        if self.dtype == "auto":
            return "bf16" if cuda else "fp32"
        return self.dtype

    def attention_impl(self, cuda: bool, have_te: bool = False) -> str:
        """The core attention this config resolves to: "te", "sdpa" or "local"."""
        if self.attention == "auto":
            return "te" if cuda and have_te else "sdpa" if cuda else "local"
        return self.attention

    def fusions_on(self, cuda: bool) -> bool:
        """Whether megatron's torch.compile'd fusions are used on a machine with or without CUDA."""
        return cuda if self.fusions == "auto" else self.fusions == "on"

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError naming the first inconsistent key; world_size also checks the
        parallel layout against the processes actually running."""
        for key, choices in (("dtype", DTYPES), ("attention", ATTENTIONS), ("fusions", FUSIONS)):
            if getattr(self, key) not in choices:
                raise ConfigError(f"config policy.{key}: expected one of {', '.join(choices)}, "
                                  f"got {getattr(self, key)!r}")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                    "ffn_hidden_size", "vocab_size", "vocab_multiple", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config policy.{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("rope_base", "norm_eps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config policy.{key}: must be > 0, got {getattr(self, key)}")
        if self.head_dim < 0 or self.rope_scaling_factor < 0:
            raise ConfigError("config policy.head_dim and policy.rope_scaling_factor: must be >= 0")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config policy.num_attention_heads: {self.num_attention_heads} does not divide "
                              f"hidden_size {self.hidden_size} (set head_dim)")
        if self.kv_channels % 2:
            raise ConfigError(f"config policy.head_dim: rotary embeddings need an even head dim, got {self.kv_channels}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"config policy.num_query_groups: {self.num_query_groups} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        tp, pp = self.parallel.tensor, self.parallel.pipeline
        if tp < 1 or pp < 1:
            raise ConfigError(f"config policy.parallel: sizes must be >= 1, got tensor={tp} pipeline={pp}")
        if self.parallel.microbatches < 0:
            raise ConfigError(f"config policy.parallel.microbatches: must be >= 0, got {self.parallel.microbatches}")
        for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "padded_vocab_size"):
            if getattr(self, key) % tp:
                name = "vocab_multiple" if key == "padded_vocab_size" else key
                raise ConfigError(f"config policy.{name}: {key} {getattr(self, key)} is not divisible by "
                                  f"parallel.tensor {tp}")
        if self.num_layers % pp:
            raise ConfigError(f"config policy.parallel.pipeline: {pp} does not divide num_layers {self.num_layers}")
        if world_size is not None and world_size % (tp * pp):
            raise ConfigError(f"config policy.parallel: tensor x pipeline = {tp * pp} does not divide "
                              f"the world size {world_size}")


# Starting points for `preset:`. `0.5b` has Qwen2.5-0.5B's shape and `1b` Llama-3.2-1B's (1.24B
# parameters, hidden 2048), so those checkpoints import into them.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "0.5b": dict(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                 ffn_hidden_size=4864, vocab_size=151936, max_seq_len=32768, rope_base=1000000.0,
                 qkv_bias=True, tie_embeddings=True, dtype="bf16"),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, vocab_size=128256, max_seq_len=131072, rope_base=500000.0,
               rope_scaling_factor=32.0, norm_eps=1e-5, qkv_bias=False, tie_embeddings=True, dtype="bf16"),
}


def policy_config(data: dict[str, Any] | None = None, **overrides: Any) -> PolicyModelConfig:
    """A validated config from a mapping (optionally with `preset:`), then keyword overrides."""
    data = dict(data or {})
    data.update(overrides)
    preset = data.pop("preset", "tiny")
    if preset not in PRESETS:
        raise ConfigError(f"config policy.preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    merged = {**PRESETS[preset], **data}
    cfg = build_config(PolicyModelConfig, merged, "policy.", also_known=("preset",))
    cfg.validate()
    return cfg


def load_policy_config(path: str | os.PathLike) -> PolicyModelConfig:
    """A validated config from a YAML file holding the mapping `policy_config` takes."""
    return policy_config(read_yaml_mapping(path))


def config_dict(cfg: PolicyModelConfig) -> dict[str, Any]:
    """Plain data (for YAML, JSON and checkpoint metadata); `policy_config` reads it back."""
    return dataclasses.asdict(cfg)

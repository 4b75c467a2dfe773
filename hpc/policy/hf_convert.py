"""HuggingFace Llama / Qwen2 checkpoints <-> megatron-core GPTModel state dicts.

A HF checkpoint directory holds config.json, model.safetensors (or shards with
model.safetensors.index.json) and tokenizer.json. Import reads config.json into a
PolicyModelConfig and builds each rank's share of the weights directly from the safetensors
(every rank reads the files itself, so nothing is scattered over the network). Export gathers
the model-parallel shards on one rank and writes a directory that `transformers` loads.

Layout differences handled here, per layer:
- q, k, v are one `linear_qkv` matrix, interleaved per query group: for each KV head, its
  query heads' rows, then its key rows, then its value rows (so TP splits whole groups);
  Qwen2's q/k/v biases follow the same order;
- gate and up are one `linear_fc1` matrix; under TP each rank holds cat(gate shard, up shard);
- the vocabulary is padded to `cfg.padded_vocab_size` rows (zeros), cut back on export;
- tied embeddings have no lm_head; untied ones map lm_head <-> output_layer.
Transformer Engine layer specs fuse the pre-attention and pre-MLP norms into the following
linear layer; names are translated when the model being loaded holds those keys.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpc.errors import CheckpointError, UsageError, UserError, read_reason
from hpc.logs import ON_EVERY_RANK, add_logging_args, setup_logging
from hpc.policy.config import PolicyModelConfig, policy_config

log = logging.getLogger(__name__)

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# Local-spec name -> Transformer Engine spec name (norms fused into the next linear layer).
_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a HF checkpoint directory."""
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except OSError as e:
        raise CheckpointError(f"{file}: {read_reason(e)}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def hf_family(hf: Mapping[str, Any]) -> str:
    """'llama' or 'qwen2'; anything else is refused."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"config.json model_type: expected one of {', '.join(FAMILIES)}, got {family!r}")
    return family


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(rope theta, Llama-3 scaling factor or 0). transformers 5.x keeps both under
    rope_parameters; older configs use rope_theta and rope_scaling."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, 0.0
    if kind == "llama3":
        # megatron's llama3 scaling has these three fixed.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in fixed.items():
            if float(scaling.get(key, value)) != value:
                raise CheckpointError(f"config.json rope {key}: only {value} is supported, got {scaling.get(key)}")
        return theta, float(scaling.get("factor", 8.0))
    raise CheckpointError(f"config.json rope_type: only default and llama3 are supported, got {kind!r}")


def hf_policy_config(path: str | os.PathLike, tensor: int = 1, pipeline: int = 1,
                     dtype: str = "auto") -> PolicyModelConfig:
    """The PolicyModelConfig of a HF Llama/Qwen2 checkpoint, with the given parallel sizes."""
    hf = read_hf_config(path)
    family = hf_family(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act: only silu is supported, got {hf['hidden_act']!r}")
    if family == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise CheckpointError("config.json attention_bias/mlp_bias: biased Llama layers are not supported")
    if family == "qwen2" and hf.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window: sliding-window attention is not supported")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 0
    if head_dim == hf["hidden_size"] // heads:
        head_dim = 0
    try:
        return policy_config(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
            head_dim=head_dim, vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 4096),
            rope_base=theta, rope_scaling_factor=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype, parallel={"tensor": tensor, "pipeline": pipeline})
    except KeyError as e:
        raise CheckpointError(f"config.json: missing key {e.args[0]}") from None


class HFWeights:
    """Lazy access to the tensors of one HF checkpoint (single file or sharded)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (root / "model.safetensors").exists():
            weight_map = None
        else:
            raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")
        self._files = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            self._files[name] = safe_open(str(root / name), framework="pt")
        self._where = weight_map or {k: "model.safetensors" for k in self._files["model.safetensors"].keys()}

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise CheckpointError(f"HF checkpoint: missing tensor {key}")
        return self._files[self._where[key]].get_tensor(key)


def _layers_of_stage(cfg: PolicyModelConfig, pp_rank: int, pp_size: int) -> range:
    per = cfg.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _pad_vocab(weight: torch.Tensor, cfg: PolicyModelConfig) -> torch.Tensor:
    extra = cfg.padded_vocab_size - weight.shape[0]
    if extra < 0:
        raise CheckpointError(f"HF checkpoint: embedding has {weight.shape[0]} rows, config vocab_size is {cfg.vocab_size}")
    return torch.cat([weight, weight.new_zeros(extra, weight.shape[1])]) if extra else weight


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: PolicyModelConfig) -> torch.Tensor:
    """Rows of q, k, v (weights [rows, hidden] or biases [rows]) interleaved per query group."""
    groups, hd = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // groups
    tail = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group * hd, *tail), k.reshape(groups, hd, *tail),
                      v.reshape(groups, hd, *tail)], dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, cfg: PolicyModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, hd = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // groups
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * hd, *tail).split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(weights: Mapping[str, torch.Tensor] | HFWeights, cfg: PolicyModelConfig,
                   tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The policy state dict (local-spec names) of one (TP rank, PP stage) from HF tensors."""
    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim=dim)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        out["embedding.word_embeddings.weight"] = shard(_pad_vocab(weights["model.embed_tokens.weight"], cfg), 0)
    for local, layer in enumerate(_layers_of_stage(cfg, pp_rank, pp_size)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = weights[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = shard(_qkv(
            weights[attn + "q_proj.weight"], weights[attn + "k_proj.weight"], weights[attn + "v_proj.weight"], cfg), 0)
        if cfg.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = shard(_qkv(
                weights[attn + "q_proj.bias"], weights[attn + "k_proj.bias"], weights[attn + "v_proj.bias"], cfg), 0)
        out[dst + "self_attention.linear_proj.weight"] = shard(weights[attn + "o_proj.weight"], 1)
        out[dst + "pre_mlp_layernorm.weight"] = weights[src + "post_attention_layernorm.weight"]
        gate = weights[src + "mlp.gate_proj.weight"].chunk(tp_size, dim=0)[tp_rank]
        up = weights[src + "mlp.up_proj.weight"].chunk(tp_size, dim=0)[tp_rank]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = shard(weights[src + "mlp.down_proj.weight"], 1)
    if last:
        out["decoder.final_layernorm.weight"] = weights["model.norm.weight"]
        if not cfg.tie_embeddings:
            out["output_layer.weight"] = shard(_pad_vocab(weights["lm_head.weight"], cfg), 0)
        elif not first:
            # A tied model keeps a copy of the embedding on the last stage.
            out["output_layer.weight"] = shard(_pad_vocab(weights["model.embed_tokens.weight"], cfg), 0)
    return out


def megatron_to_hf(stages: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                   cfg: PolicyModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors from policy state dicts (local-spec names), `stages[pp_rank][tp_rank]`."""
    def full(shards: Sequence[Mapping[str, torch.Tensor]], key: str, dim: int) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    pp_size = len(stages)
    for pp_rank, shards in enumerate(stages):
        if pp_rank == 0:
            out["model.embed_tokens.weight"] = full(shards, "embedding.word_embeddings.weight", 0)[:cfg.vocab_size]
        for local, layer in enumerate(_layers_of_stage(cfg, pp_rank, pp_size)):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
            attn = dst + "self_attn."
            out[dst + "input_layernorm.weight"] = shards[0][src + "input_layernorm.weight"]
            names = ["q_proj", "k_proj", "v_proj"]
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                parts = _split_qkv(full(shards, f"{src}self_attention.linear_qkv.{kind}", 0), cfg)
                out.update({f"{attn}{n}.{kind}": t for n, t in zip(names, parts)})
            out[attn + "o_proj.weight"] = full(shards, src + "self_attention.linear_proj.weight", 1)
            out[dst + "post_attention_layernorm.weight"] = shards[0][src + "pre_mlp_layernorm.weight"]
            halves = [s[src + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
            out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
            out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
            out[dst + "mlp.down_proj.weight"] = full(shards, src + "mlp.linear_fc2.weight", 1)
        if pp_rank == pp_size - 1:
            out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = full(shards, "output_layer.weight", 0)[:cfg.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def _to_model_names(state: dict[str, torch.Tensor], model_keys: Iterable[str]) -> dict[str, torch.Tensor]:
    keys = set(model_keys)
    out = {}
    for key, value in state.items():
        head, _, tail = key.rpartition("layers.")
        index, _, rest = tail.partition(".")
        if head and rest in _TE_NAMES and key not in keys:
            key = f"{head}layers.{index}.{_TE_NAMES[rest]}"
        out[key] = value
    return out


def _to_local_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    back = {v: k for k, v in _TE_NAMES.items()}
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        head, _, tail = key.rpartition("layers.")
        index, _, rest = tail.partition(".")
        if head and rest in back:
            key = f"{head}layers.{index}.{back[rest]}"
        out[key] = value
    return out


def load_hf(model: torch.nn.Module, path: str | os.PathLike, cfg: PolicyModelConfig) -> None:
    """Load a HF checkpoint into this rank's policy or critic (whose value head is left as is).

    Every key the model holds must be filled, except megatron's `_extra_state` entries.
    """
    from megatron.core import parallel_state as ps

    from hpc.policy.model import CriticModel, critic_state_from_policy

    state = hf_to_megatron(HFWeights(path), cfg, ps.get_tensor_model_parallel_rank(),
                           ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_world_size())
    critic = isinstance(model, CriticModel)
    if critic:
        state = critic_state_from_policy(state)
    state = _to_model_names(state, model.state_dict().keys())
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not (critic and k.startswith("value_head."))]
    if missing or unexpected:
        raise CheckpointError(f"HF checkpoint {path}: does not fit the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")


def hf_config_dict(cfg: PolicyModelConfig, family: str, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `cfg` as a HF `family` model; rope theta is written both where
    transformers 5.x reads it (rope_parameters) and where older versions do (rope_theta)."""
    if family not in FAMILIES:
        raise UsageError(f"export family: expected one of {', '.join(FAMILIES)}, got {family!r}")
    if family == "llama" and cfg.qkv_bias:
        raise UsageError("export family llama: the model has qkv biases (a Qwen2 shape); export as qwen2")
    if family == "qwen2" and not cfg.qkv_bias:
        raise UsageError("export family qwen2: Qwen2 has qkv biases and this model has none; export as llama")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling_factor:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_base, "factor": cfg.rope_scaling_factor,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_base, "rope_parameters": rope,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }
    if cfg.rope_scaling_factor:
        out["rope_scaling"] = rope
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False)
    return out


def write_hf(tensors: Mapping[str, torch.Tensor], cfg: PolicyModelConfig, out_dir: str | os.PathLike,
             family: str, tokenizer_from: str | os.PathLike | None = None,
             max_shard_bytes: int = 5 << 30) -> Path:
    """Write HF tensors as a checkpoint directory: safetensors (sharded past max_shard_bytes,
    with an index), config.json, and the tokenizer files of `tokenizer_from` if given."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, family, dtype), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copyfile(Path(tokenizer_from) / name, out / name)
    return out


def export_hf(model: torch.nn.Module, cfg: PolicyModelConfig, out_dir: str | os.PathLike, family: str,
              tokenizer_from: str | os.PathLike | None = None) -> Path | None:
    """Write the policy as a HF checkpoint. Collective over the world: the model-parallel ranks
    of data-parallel replica 0 send their shards to that replica's first rank, which writes.
    Returns the directory on the writing rank, None elsewhere."""
    from megatron.core import parallel_state as ps

    hf_config_dict(cfg, family, torch.float32)  # refuse a bad family before any communication
    local = {k: v.detach().cpu() for k, v in _to_local_names(model.state_dict()).items()}
    written = None
    if ps.get_data_parallel_rank() == 0:
        group = ps.get_model_parallel_group()
        size = torch.distributed.get_world_size(group)
        dst = torch.distributed.get_global_rank(group, 0)
        me = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), local)
        gathered: list | None = [None] * size if torch.distributed.get_rank() == dst else None
        torch.distributed.gather_object(me, gathered, dst=dst, group=group)
        if gathered is not None:
            pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
            stages: list[list] = [[None] * tp for _ in range(pp)]
            for pp_rank, tp_rank, state in gathered:
                stages[pp_rank][tp_rank] = state
            written = write_hf(megatron_to_hf(stages, cfg), cfg, out_dir, family, tokenizer_from)
    torch.distributed.barrier()
    return written


def to_checkpoint(hf_dir: str | os.PathLike, root: str | os.PathLike, step: int = 0,
                  tensor: int = 1, pipeline: int = 1) -> Path:
    """Convert a HF checkpoint into a dist checkpoint under ROOT (step `step`); collective. The
    result loads under any TP/PP layout, so converting on one process is enough."""
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.model import build_policy

    cfg = hf_policy_config(hf_dir, tensor=tensor, pipeline=pipeline)
    model = build_policy(cfg)
    load_hf(model, hf_dir, cfg)
    return save_checkpoint(root, step, model, cfg=cfg, extra={"hf_source": str(hf_dir)})


def from_checkpoint(root: str | os.PathLike, out_dir: str | os.PathLike, family: str,
                    tokenizer_from: str | os.PathLike | None = None, step: int | None = None,
                    tensor: int = 1, pipeline: int = 1) -> Path | None:
    """Export ROOT's checkpoint (default: latest) as a HF checkpoint; collective."""
    from hpc.policy.checkpoint import checkpoint_config, load_checkpoint
    from hpc.policy.model import build_policy

    cfg = checkpoint_config(root, step)
    cfg.parallel.tensor, cfg.parallel.pipeline = tensor, pipeline
    model = build_policy(cfg)
    load_checkpoint(root, model, step=step)
    return export_hf(model, cfg, out_dir, family, tokenizer_from)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hpc.policy.hf_convert to-megatron HF_DIR ROOT` / `to-hf ROOT OUT --family F`;
    under torchrun or srun for TP/PP > 1."""
    import argparse

    from hpc.policy.parallel import init_parallel, teardown

    parser = argparse.ArgumentParser(
        prog="python -m hpc.policy.hf_convert",
        description="Convert between HF Llama/Qwen2 checkpoints and policy dist checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("to-megatron", help="HF directory -> dist checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("root")
    imp.add_argument("--step", type=int, default=0)
    exp = sub.add_parser("to-hf", help="dist checkpoint -> HF directory")
    exp.add_argument("root")
    exp.add_argument("out_dir")
    exp.add_argument("--family", required=True, choices=sorted(FAMILIES))
    exp.add_argument("--tokenizer", help="copy the tokenizer files of this HF directory")
    exp.add_argument("--step", type=int)
    for p in (imp, exp):
        p.add_argument("--tensor", type=int, default=1)
        p.add_argument("--pipeline", type=int, default=1)
        add_logging_args(p)
    args = parser.parse_args(argv)
    setup_logging(args.verbose, args.quiet)
    started = not torch.distributed.is_initialized()
    try:
        init_parallel(tensor=args.tensor, pipeline=args.pipeline)
        if args.command == "to-megatron":
            out = to_checkpoint(args.hf_dir, args.root, args.step, args.tensor, args.pipeline)
        else:
            out = from_checkpoint(args.root, args.out_dir, args.family, args.tokenizer, args.step,
                                  args.tensor, args.pipeline)
    except UserError as e:   # every rank reads the same arguments and checkpoint
        log.error("error: %s", e, extra=ON_EVERY_RANK)
        return 2
    finally:
        if started:
            teardown()
    if out is not None:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

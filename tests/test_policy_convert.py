"""HF Llama / Qwen2 checkpoints <-> megatron: logit parity and exact export round-trips (TP=1 here;
TP=2 in test_policy_parallel.py). The HF models are tiny, random and built here: no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from hpc.errors import UserError

# megatron-core and torch.distributed.checkpoint warn about TE, Apex and their own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

VOCAB = 300        # not a multiple of 128: the embedding is padded to 384 rows


def make_hf_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random HF checkpoint (safetensors, config.json, tokenizer.json). Llama: untied
    embeddings and Llama-3 rope scaling; Qwen2: tied embeddings and q/k/v biases. Weights are
    drawn wider than HF's init so that a layout mistake moves the logits far past tolerance."""
    from test_policy_tokenizer import make_hf_tokenizer

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, eos_token_id=2)
    if family == "llama":
        config = transformers.LlamaConfig(
            **common, tie_word_embeddings=False, max_position_embeddings=16384,
            rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, max_position_embeddings=512,
                                          rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if name.endswith("bias") else 0.1)
    model.eval().save_pretrained(directory)
    make_hf_tokenizer(directory)
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def dist():
    from hpc.policy.parallel import init_parallel, teardown

    yield init_parallel()
    teardown()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param)), request.param


TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _load(directory: Path, **changes):
    from hpc.policy import hf_convert, model

    cfg = hf_convert.hf_policy_config(directory)
    for key, value in changes.items():
        setattr(cfg, key, value)
    policy = model.build_policy(cfg).eval()
    hf_convert.load_hf(policy, directory, cfg)
    return cfg, policy


def _logits(cfg, policy) -> torch.Tensor:
    from hpc.policy.model import forward_logits

    with torch.no_grad():
        return forward_logits(policy, TOKENS)[..., :cfg.vocab_size]


def test_config_from_hf(checkpoint):
    from hpc.policy.hf_convert import hf_policy_config

    directory, family = checkpoint
    cfg = hf_policy_config(directory, tensor=2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.vocab_size) == (2, 64, 2, VOCAB)
    assert cfg.parallel.tensor == 2 and cfg.padded_vocab_size == 384
    if family == "llama":
        assert (cfg.rope_base, cfg.rope_scaling_factor, cfg.qkv_bias, cfg.tie_embeddings) == (5000.0, 8.0, False, False)
    else:
        assert (cfg.rope_base, cfg.rope_scaling_factor, cfg.qkv_bias, cfg.tie_embeddings) == (20000.0, 0.0, True, True)


def test_rope_theta_from_older_configs(tmp_path):
    from hpc.policy.hf_convert import hf_policy_config

    old = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "rope_theta": 1000000.0,
           "rope_scaling": None, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert hf_policy_config(tmp_path).rope_base == 1000000.0
    old.update(model_type="llama", rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert (hf_policy_config(tmp_path).rope_base, hf_policy_config(tmp_path).rope_scaling_factor) == (500000.0, 32.0)


@pytest.mark.parametrize("change, key", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}, "high_freq_factor"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_hf_configs_are_refused(tmp_path, change, key):
    from hpc.policy.hf_convert import hf_policy_config

    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": VOCAB}
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(UserError, match=key):
        hf_policy_config(tmp_path)


def test_logits_match_hf(dist, checkpoint):
    directory, family = checkpoint
    cfg, policy = _load(directory)
    ours, theirs = _logits(cfg, policy), hf_logits(directory, TOKENS)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    # The rope settings read from config.json matter: ignoring them breaks parity.
    changed = {"rope_scaling_factor": 0.0} if family == "llama" else {"rope_base": 10000.0}
    cfg2, policy2 = _load(directory, **changed)
    assert (_logits(cfg2, policy2) - theirs).abs().max() > 1e-3


def test_padded_vocab_rows_are_zero_and_masked(dist, checkpoint):
    from hpc.policy.model import forward_logits, token_logprobs

    cfg, policy = _load(checkpoint[0])
    with torch.no_grad():
        logits = forward_logits(policy, TOKENS)
    assert logits.shape[-1] == 384 and torch.all(logits[..., VOCAB:] == 0)
    logp = token_logprobs(logits, torch.full_like(TOKENS, VOCAB + 3), cfg.vocab_size)
    assert torch.all(logp == float("-inf"))
    full = torch.log_softmax(logits[..., :VOCAB], -1).gather(-1, TOKENS[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, TOKENS, cfg.vocab_size), full)


def test_export_round_trip_is_exact_and_loads_in_transformers(dist, checkpoint, tmp_path):
    from safetensors.torch import load_file

    from hpc.policy.hf_convert import export_hf

    directory, family = checkpoint
    cfg, policy = _load(directory)
    out = export_hf(policy, cfg, tmp_path / "export", family, tokenizer_from=directory)
    original, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    torch.testing.assert_close(hf_logits(out, TOKENS), hf_logits(directory, TOKENS), atol=0, rtol=0)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_shards_reassemble_exactly(checkpoint, tp, pp):
    """Every (TP rank, PP stage) shard, put back together, gives the HF tensors bit for bit."""
    from hpc.policy.hf_convert import HFWeights, hf_policy_config, hf_to_megatron, megatron_to_hf

    directory, _ = checkpoint
    cfg = hf_policy_config(directory, tensor=tp, pipeline=pp)
    weights = HFWeights(directory)
    stages = [[hf_to_megatron(weights, cfg, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    layer0 = stages[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert layer0.shape == ((4 // tp + 2 * 2 // tp) * 16, 64)   # one whole query group per TP rank
    back = megatron_to_hf(stages, cfg)
    assert sorted(back) == sorted(weights.keys())
    for key in weights.keys():
        assert torch.equal(back[key], weights[key]), key


def test_critic_trunk_comes_from_the_policy(dist, checkpoint):
    """A critic loaded from the HF checkpoint, its value head set to one output row of the
    policy, predicts exactly that token's logit: one value per token, on the same trunk."""
    from hpc.policy import hf_convert, model

    directory, _ = checkpoint
    cfg, policy = _load(directory)
    critic = model.build_critic(cfg).eval()
    hf_convert.load_hf(critic, directory, cfg)
    assert torch.all(critic.value_head.weight == 0)
    with torch.no_grad():
        fresh = critic(TOKENS, model.position_ids(TOKENS), model.attention_mask(torch.zeros_like(TOKENS, dtype=bool)))
    assert fresh.shape == TOKENS.shape and torch.all(fresh == 0)
    row = 5
    output = policy.shared_embedding_or_output_weight() if cfg.tie_embeddings else policy.output_layer.weight
    with torch.no_grad():
        critic.value_head.weight.copy_(output[row:row + 1])
        critic.value_head.bias.fill_(0.25)
        values = critic(TOKENS, model.position_ids(TOKENS), model.attention_mask(torch.zeros_like(TOKENS, dtype=bool)))
    torch.testing.assert_close(values, _logits(cfg, policy)[..., row] + 0.25, atol=1e-5, rtol=1e-5)


def test_export_refuses_a_family_that_does_not_fit(dist, checkpoint, tmp_path):
    from hpc.policy.hf_convert import export_hf

    directory, family = checkpoint
    cfg, policy = _load(directory)
    with pytest.raises(UserError, match="export family"):
        export_hf(policy, cfg, tmp_path, "qwen2" if family == "llama" else "llama")


def test_command_line_round_trip_through_a_dist_checkpoint(dist, checkpoint, tmp_path, capsys):
    """HF -> dist checkpoint -> HF with the module's command line gives the same tensors."""
    from safetensors.torch import load_file

    from hpc.policy.checkpoint import checkpoint_config
    from hpc.policy.hf_convert import main

    directory, family = checkpoint
    assert main(["to-megatron", str(directory), str(tmp_path / "ckpt"), "--step", "3"]) == 0
    assert checkpoint_config(tmp_path / "ckpt").qkv_bias == (family == "qwen2")
    out = tmp_path / "hf"
    assert main(["to-hf", str(tmp_path / "ckpt"), str(out), "--family", family, "--tokenizer", str(directory)]) == 0
    assert capsys.readouterr().out.split()[-1] == str(out)
    original, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    assert (out / "tokenizer.json").exists()
    wrong = "qwen2" if family == "llama" else "llama"
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--family", wrong]) == 2
    assert "export family" in capsys.readouterr().err


def test_sharded_safetensors_are_written_and_read(checkpoint, tmp_path):
    from hpc.policy.hf_convert import HFWeights, hf_policy_config, write_hf

    directory, family = checkpoint
    weights = HFWeights(directory)
    tensors = {k: weights[k] for k in weights.keys()}
    write_hf(tensors, hf_policy_config(directory), tmp_path, family, max_shard_bytes=64 << 10)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    back = HFWeights(tmp_path)
    assert sorted(back.keys()) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    torch.testing.assert_close(hf_logits(tmp_path, TOKENS), hf_logits(directory, TOKENS), atol=0, rtol=0)

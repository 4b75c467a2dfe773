"""Policy model config (presets, YAML, errors naming the key), launcher environments, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc.errors import ConfigError
from hpc.policy.config import PRESETS, config_dict, load_policy_config, policy_config
from hpc.policy.parallel import first_slurm_host, launch_env


def test_tiny_preset_is_the_default_and_fits_the_byte_tokenizer():
    from hpc.policy.tokenizer import ByteTokenizer

    cfg = policy_config()
    assert cfg == policy_config({"preset": "tiny"})
    assert cfg.vocab_size == ByteTokenizer().vocab_size
    assert cfg.padded_vocab_size == 384 and cfg.kv_channels == 16
    assert cfg.torch_dtype_name(cuda=False) == "fp32" and cfg.torch_dtype_name(cuda=True) == "bf16"


def test_half_billion_preset_has_qwen25_05b_shape():
    cfg = policy_config({"preset": "0.5b", "parallel": {"tensor": 2}})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (24, 896, 14, 2)
    assert cfg.padded_vocab_size == 151936 and cfg.qkv_bias and cfg.tie_embeddings
    h, f, v, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.padded_vocab_size, cfg.num_query_groups * cfg.kv_channels
    per_layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    assert 0.45e9 < cfg.num_layers * per_layer + v * h + h < 0.55e9


def test_one_billion_preset_has_llama32_1b_shape():
    cfg = policy_config({"preset": "1b"})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (16, 2048, 32, 8)
    assert cfg.padded_vocab_size == 128256 and not cfg.qkv_bias and cfg.tie_embeddings
    assert cfg.rope_scaling_factor == 32.0 and cfg.rope_base == 500000.0
    h, f, v, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.padded_vocab_size, cfg.num_query_groups * cfg.kv_channels
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    assert 1.2e9 < cfg.num_layers * per_layer + v * h + h < 1.3e9


def test_yaml_preset_with_overrides(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("preset: 0.5b\nnum_layers: 12\nparallel:\n  tensor: 2\n  pipeline: 2\n")
    cfg = load_policy_config(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.parallel.tensor, cfg.parallel.pipeline) == (12, 896, 2, 2)
    assert policy_config(config_dict(cfg)) == cfg


@pytest.mark.parametrize("data, key", [
    ({"hiden_size": 8}, "policy.hiden_size"),
    ({"hidden_size": "big"}, "policy.hidden_size"),
    ({"parallel": {"tensor": 3}}, "policy.num_attention_heads"),
    ({"parallel": {"pipeline": 3}}, "policy.parallel.pipeline"),
    ({"num_query_groups": 3}, "policy.num_query_groups"),
    ({"dtype": "fp16"}, "policy.dtype"),
    ({"preset": "huge"}, "policy.preset"),
    ({"vocab_multiple": 3, "parallel": {"tensor": 2}}, "policy.vocab_multiple"),
    ({"parallel": {"tenser": 2}}, "policy.parallel.tenser"),
])
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        policy_config(data)


def test_an_unknown_key_lists_preset_among_the_known_ones():
    with pytest.raises(ConfigError, match=r"policy\.presett: unknown key \(known: .*\bpreset\b"):
        policy_config({"presett": "tiny"})


def test_world_size_must_be_a_multiple_of_model_parallel():
    cfg = policy_config({"parallel": {"tensor": 2}})
    cfg.validate(world_size=4)
    with pytest.raises(ConfigError, match="world size 3"):
        cfg.validate(world_size=3)


def test_presets_are_valid():
    for name in PRESETS:
        policy_config({"preset": name})


def test_launch_env_from_torchrun_slurm_and_nothing():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 4, 1, "h1", 1234)
    env = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
                      "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 8, 1, "gpu07")
    assert env.master_port == 20000 + 4242
    env = launch_env({})
    assert (env.rank, env.world_size, env.master_addr) == (0, 1, "127.0.0.1") and env.master_port > 0


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("a,b", "a"), ("gpu[03-05,09],cpu1", "gpu03"), ("x[9,2]", "x9"), ("", ""),
])
def test_first_slurm_host(nodelist, first, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")   # no scontrol: the parser answers
    assert first_slurm_host(nodelist) == first


def test_importing_hpc_and_policy_config_does_not_import_megatron():
    code = ("import sys, hpc, hpc.policy, hpc.policy.config, hpc.policy.tokenizer, hpc.policy.model, "
            "hpc.policy.parallel, hpc.policy.generate, hpc.policy.checkpoint, hpc.policy.hf_convert, "
            "hpc.policy.cpu_shim; "
            "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

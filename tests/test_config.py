"""Config loading: YAML onto typed dataclasses, with errors that name the key."""

from __future__ import annotations

import pytest

from hpc.config import EvalConfig, load_config
from hpc.errors import UserError


def test_defaults_match_the_reward_and_protocol_of_the_design():
    cfg = load_config()
    assert isinstance(cfg, EvalConfig)
    assert cfg.reward.kind == "discrete" and cfg.reward.margin == 0.05
    assert cfg.correctness.trials >= 5 and cfg.correctness.distributions
    assert cfg.correctness.atol_fp32 == 1e-4 and cfg.correctness.atol_half == 1e-2
    assert cfg.timing.iterations >= 100


def test_yaml_overrides_nested_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backend: cuda\nscale: gpu\ntiming:\n  iterations: 200\nreward:\n  kind: continuous\n")
    cfg = load_config(path)
    assert (cfg.backend, cfg.scale, cfg.timing.iterations, cfg.reward.kind) == ("cuda", "gpu", 200, "continuous")
    assert cfg.timing.warmup == 10


@pytest.mark.parametrize("text, key", [
    ("timing:\n  iteratons: 5\n", "timing.iteratons"),
    ("timing:\n  iterations: many\n", "timing.iterations"),
    ("timing:\n  iterations: 0\n", "timing.iterations"),
    ("timing:\n  calibration_calls: 0\n", "timing.calibration_calls"),
    ("timing:\n  host_check_ratio: 0.5\n", "timing.host_check_ratio: removed"),
    ("timing:\n  handshake: fast\n", "timing.handshake"),
    ("backend: tpu\n", "backend"),
    ("reward: 3\n", "reward"),
    ("correctness:\n  distributions: [wide, cauchy]\n", "correctness.distributions"),
    ("policy:\n  allowed_torch_ops: relu\n", "policy.allowed_torch_ops"),
    ("baseline:\n  compile_modes: [fastest]\n", "baseline.compile_modes"),
    ("reward:\n  kind: continuous\nbaseline:\n  compile_modes: []\n", "baseline.compile_modes"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        load_config(path)


def test_unreadable_and_invalid_yaml_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="missing.yaml: no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("timing: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)


def test_eager_alone_is_a_baseline_the_discrete_reward_accepts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("baseline:\n  compile_modes: []\n")
    assert load_config(path).baseline.compile_modes == []

"""Config loading: YAML onto typed dataclasses, with errors that name the key."""

from __future__ import annotations

import pytest

from hpc.config import EvalConfig, load_config
from hpc.errors import ConfigError


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
    ("timing:\n  input_shifts_cpu: 3\n", "timing.input_shifts_cpu: must be a power of two"),
    ("timing:\n  processes_cpu: 0\n", "timing.processes_cpu: must be 1 to 4"),
    ("timing:\n  processes_cpu: 5\n", "timing.processes_cpu: must be 1 to 4"),
    ("timing:\n  processes_cpu: 3\n  iterations: 2\n", "timing.processes_cpu: must not exceed timing.iterations"),
    ("backend: tpu\n", "backend"),
    ("reward: 3\n", "reward"),
    ("correctness:\n  distributions: [wide, cauchy]\n", "correctness.distributions"),
    ("rules:\n  allowed_torch_ops: relu\n", "rules.allowed_torch_ops"),
    ("baseline:\n  compile_modes: [fastest]\n", "baseline.compile_modes"),
    ("reward:\n  kind: continuous\nbaseline:\n  compile_modes: []\n", "baseline.compile_modes"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path)


def test_unreadable_and_invalid_yaml_are_user_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("timing: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_eager_alone_is_a_baseline_the_discrete_reward_accepts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("baseline:\n  compile_modes: []\n")
    assert load_config(path).baseline.compile_modes == []


OLD_RULES_KEY = "policy:\n  libraries: [cublas]\n"   # the evaluator's rules under their old name
RENAMED = "renamed to rules (the candidate's op and library rules)"


def test_the_candidates_rules_are_set_under_rules(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rules:\n  allowed_torch_ops: [relu]\n  require_custom_kernel: false\n  libraries: [cublas]\n")
    rules = load_config(path).rules
    assert (rules.allowed_torch_ops, rules.require_custom_kernel, rules.libraries) == (["relu"], False, ["cublas"])


def test_the_old_name_of_the_rules_is_one_line_naming_the_new_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(OLD_RULES_KEY)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"config policy: {RENAMED}"


def _training_data(**sections) -> dict:
    import yaml

    from tests.conftest import ROOT

    data = yaml.safe_load((ROOT / "configs" / "train" / "default.yaml").read_text())
    data.update(sections)
    return data


def test_a_training_configs_eval_section_refuses_the_old_name_while_its_policy_stays_the_llm():
    """In a training config the top-level `policy` is the LLM; only `eval.policy` is the old name."""
    from hpc.policy.config import PolicyModelConfig
    from hpc.rl.train_config import train_config

    with pytest.raises(ConfigError) as e:
        train_config(_training_data(eval={"policy": {"libraries": ["cublas"]}}))
    assert str(e.value) == f"config eval.policy: {RENAMED}"
    cfg = train_config(_training_data(eval={"rules": {"libraries": ["cublas"]}}))
    assert isinstance(cfg.policy, PolicyModelConfig) and cfg.eval.rules.libraries == ["cublas"]


def test_a_synthesis_configs_eval_section_refuses_the_old_name(tmp_path):
    from hpc.synthesis.config import load_synthesis_config

    path = tmp_path / "s.yaml"
    path.write_text("eval:\n  policy:\n    libraries: [cublas]\n")
    with pytest.raises(ConfigError) as e:
        load_synthesis_config(path)
    assert str(e.value) == f"config eval.policy: {RENAMED}"
    path.write_text("count: 1\neval:\n  rules:\n    libraries: [cublas]\n")
    assert load_synthesis_config(path).eval.rules.libraries == ["cublas"]


def test_a_checkpoint_saved_under_the_old_name_reads_its_rules():
    """Trainer state files store the whole config (train_config_dict): those written before the
    rename keep loading (jobs/evaluate.py --policy reads them), their `eval.policy` as `eval.rules`."""
    from hpc.rl.train_config import saved_train_config, train_config, train_config_dict

    stored = train_config_dict(train_config(_training_data(eval={"rules": {"libraries": ["cublas"]}})))
    stored["eval"]["policy"] = stored["eval"].pop("rules")
    assert saved_train_config(stored).eval.rules.libraries == ["cublas"]


def test_few_iterations_on_the_command_line_leave_each_process_a_frame(tmp_path):
    """`--iterations 1` on a config that times each program in 2 processes: one process, not an error."""
    from hpc.config import command_line_config

    path = tmp_path / "c.yaml"
    path.write_text("timing:\n  processes_cpu: 2\n")
    assert command_line_config(path, backend="cpu", iterations=1).timing.processes_cpu == 1
    assert command_line_config(path, backend="cpu", iterations=10).timing.processes_cpu == 2

"""The trainer's config and command line: a bad config or argument is one line naming the key,
exit 2, before any training; the shipped recipes load."""

from __future__ import annotations

import sys

import pytest
import yaml

from hpc.errors import ConfigError
from hpc.rl.train_config import load_train_config, train_config
from tests.conftest import ROOT
from tests.train_support import DEFAULT, LIBRARY_WARNINGS, run_command, small_config

pytestmark = LIBRARY_WARNINGS


@pytest.mark.parametrize("change, message", [
    ({"stages": [{"kind": "tune", "steps": 1}]}, "config stages[0].kind: expected one of"),
    ({"stages": [{"kind": "value", "steps": 1}]}, "config stages[0]: value on rft data needs an rft stage"),
    ({"stages": [{"kind": "sft", "steps": 0}]}, "config stages[0].steps: must be >= 1"),
    ({"stages": []}, "config stages: the recipe has no stage"),
    ({"rollout": {"concurency": 2}}, "rollout.concurency"),
    ({"tokenizer": "bpe:12"}, "config tokenizer: bpe:N needs a vocabulary size"),
    ({"agent": {"max_context_tokens": 4096, "max_response_tokens": 256}}, "exceeds policy.max_seq_len"),
    ({"policy": {"preset": "tiny", "parallel": {"microbatches": -1}}}, "config policy.parallel.microbatches"),
    ({"rl": {"ppo_epochs": 0}}, "config rl.ppo_epochs: must be an integer >= 1, got 0"),
    ({"rl": {"minibatches": 2.5}}, "config rl.minibatches: expected int, got float 2.5"),
    ({"rl": {"minibatches": 32}}, "config rl.minibatches: 32 minibatches, but stages[2] samples 16 episodes"),
])
def test_bad_configs_name_the_key(change, message):
    data = yaml.safe_load(DEFAULT.read_text())
    data.update(change)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        train_config(data)


def test_the_shipped_recipes_load():
    for path in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        cfg = load_train_config(path)
        assert cfg.total_steps > 0, path


def test_a_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [{kind: tune}]\n")
    out = run_command([sys.executable, "jobs/train.py", "--config", str(bad), "--out", str(tmp_path / "run")], timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: config stages[0].kind: expected one of sft, ppo, rft, value, "
                                               "measure, got 'tune'"]


def test_the_old_name_of_the_eval_sections_rules_is_one_line_and_exit_2(tmp_path):
    """The training config's `policy:` is the LLM; `eval.policy` is the evaluator's rules' old name."""
    data = yaml.safe_load(DEFAULT.read_text())
    data["eval"] = {**data.get("eval", {}), "policy": {"libraries": ["cublas"]}}
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data))
    out = run_command([sys.executable, "jobs/train.py", "--config", str(old), "--out", str(tmp_path / "run")], timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: config eval.policy: renamed to rules (the candidate's op and "
                                               "library rules)"]
    assert not (tmp_path / "run").exists()


def test_a_pipeline_in_one_process_is_an_error_naming_the_key_and_exit_2(tmp_path):
    config = small_config(tmp_path, policy={"preset": "tiny", "max_seq_len": 512, "parallel": {"pipeline": 2}})
    out = run_command([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")], timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: config policy.parallel: tensor 1 x pipeline 2 does not divide the 1 trainer process(es) started"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr      # before any library's import warnings


def test_a_config_with_more_minibatches_than_a_rank_has_episodes_is_an_error_and_exit_2(tmp_path):
    """Two tasks per step of groups of 2 split into 3 minibatches on paper, but `only` selects one
    task: the trainer says so before training (not at its first RL step)."""
    config = small_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["rl"]["minibatches"] = 3
    data["rollout"]["tasks_per_step"] = 2
    config.write_text(yaml.safe_dump(data))
    out = run_command([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")], timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]      # before it, only megatron's import warnings
    assert out.stderr.strip().splitlines()[-1] == ("error: config rl.minibatches: 3 minibatches, but stage ppo gives a "
                                                   "trainer rank as few as 2 episodes per step (tasks selected: 1, "
                                                   "trainer ranks: 1)")


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "run")], "missing.yaml"),
             (["--config", str(DEFAULT), "--out", str(tmp_path / "file")], "exists and is not a folder"),
             (["--out", str(tmp_path / "run")], "the following arguments are required: --config")]
    for args, message in cases:
        out = run_command([sys.executable, "jobs/train.py", *args], timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines

"""User-facing errors are raised at the boundary: library code raises the typed UserError subclass
that says which input is wrong (a config, a task, a results file, ...), only the modules that read
input or run a command raise one at all, and only entry points turn it into an `error:` line and
exit 2. Deep code (sandbox, runner, profile and timing, the pipeline, the policy model, RL math)
raises none: its failures are the harness's, recorded as such, never blamed on the user."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import hpc.agent.openai_client  # noqa: F401 - defines EndpointError, a UserError
from hpc.errors import (CandidateError, CheckpointError, ConfigError, DataFileError, ResultsFileError, TaskError,
                        TokenizerError, UsageError, UserError)

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("hpc", "jobs")

# Each module that may make a user-facing error, and the classes it may make. A module not listed
# makes none; UserError itself is made nowhere (entry points catch it, library code raises the
# subclass that names the input). Add a module here only if it reads input a user gave.
ALLOWED: dict[str, set[str]] = {
    # entry points: the command line and the processes it was started as
    "hpc/cli.py": {"UsageError", "ConfigError"},
    "hpc/entry.py": {"UsageError"},
    "hpc/errors.py": {"UsageError"},
    "hpc/pool/__main__.py": {"UsageError"},
    "hpc/agent/__main__.py": {"UsageError"},
    "hpc/policy/serve.py": {"UsageError", "TokenizerError"},
    "hpc/policy/hf_convert.py": {"CheckpointError", "UsageError"},
    "hpc/rl/launch.py": {"UsageError"},
    "hpc/rl/evaluation.py": {"UsageError", "ResultsFileError"},
    "jobs/analyze.py": {"UsageError"},
    "jobs/evaluate.py": {"UsageError"},
    "jobs/synthesize.py": {"UsageError"},
    "jobs/train.py": {"UsageError"},
    # configs, read and validated at load (the trainer and the launch check the config against
    # the tasks selected and the ranks started, which the loader cannot know)
    "hpc/config.py": {"ConfigError"},
    "hpc/rl/config.py": {"ConfigError"},
    "hpc/rl/train_config.py": {"ConfigError"},
    "hpc/rl/trainer.py": {"ConfigError"},
    "hpc/policy/config.py": {"ConfigError"},
    "hpc/policy/parallel.py": {"ConfigError"},
    "hpc/agent/config.py": {"ConfigError"},
    "hpc/agent/openai_client.py": {"ConfigError", "EndpointError"},
    "hpc/synthesis/config.py": {"ConfigError", "UsageError"},
    # input files and folders
    "hpc/task.py": {"TaskError"},
    "hpc/candidate.py": {"CandidateError", "MissingCandidateError"},
    "hpc/samples.py": {"DataFileError"},
    "hpc/agent/policy.py": {"DataFileError"},
    "hpc/rl/demonstrations.py": {"DataFileError"},
    "hpc/results/kernelbench.py": {"DataFileError", "TaskError"},
    "hpc/synthesis/ops6k.py": {"DataFileError"},
    "hpc/synthesis/manifest.py": {"DataFileError"},
    "hpc/synthesis/shards.py": {"DataFileError"},
    "hpc/synthesis/similarity.py": {"DataFileError"},
    "hpc/results/hdf5.py": {"ResultsFileError"},
    "hpc/results/training.py": {"ResultsFileError"},
    "hpc/results/merge.py": {"ResultsFileError"},
    "hpc/analysis/runs.py": {"ResultsFileError", "UsageError"},
    "hpc/policy/checkpoint.py": {"CheckpointError"},
    "hpc/rl/checkpoints.py": {"CheckpointError"},
    "hpc/policy/tokenizer.py": {"TokenizerError"},
    "hpc/policy/chat.py": {"ConfigError", "TokenizerError"},
    # a training run whose stage is left with no data; the harness's own compiler failing
    "hpc/rl/stages.py": {"TrainingError"},
    "hpc/compile/op_monitor.py": {"ToolchainError"},
}


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


USER_ERRORS = {c.__name__ for c in _subclasses(UserError)} | {"UserError"}


def made_user_errors(root: Path) -> dict[str, set[str]]:
    """Each module under `root`/hpc and `root`/jobs that makes (calls) a user-facing error class,
    and which: a `raise ConfigError(...)`, or one built to be raised later."""
    made: dict[str, set[str]] = {}
    for source in SOURCES:
        for path in sorted((root / source).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                    if name in USER_ERRORS:
                        made.setdefault(path.relative_to(root).as_posix(), set()).add(name)
    return made


def violations(root: Path) -> list[str]:
    return [f"{module} makes {name}" for module, names in made_user_errors(root).items()
            for name in sorted(names - ALLOWED.get(module, set()))]


def test_user_errors_are_made_only_where_input_is_read():
    assert violations(REPO) == []


def test_the_table_names_only_what_is_made():
    """A module that no longer makes a class loses it here, so the table stays the map of where
    user-facing errors come from."""
    made = made_user_errors(REPO)
    assert {module: names - made.get(module, set()) for module, names in ALLOWED.items()
            if names - made.get(module, set())} == {}


def test_the_rule_catches_a_deep_module_and_the_base_class(tmp_path):
    for source in SOURCES:
        shutil.copytree(REPO / source, tmp_path / source, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path) == []
    with open(tmp_path / "hpc/sandbox/process.py", "a") as f:   # deep code blaming the user
        f.write("\n\ndef planted():\n    raise ConfigError('config x: bad')\n")
    with open(tmp_path / "jobs/train.py", "a") as f:   # an entry point raising the base class itself
        f.write("\n\ndef planted():\n    raise hpc.errors.UserError('bad')\n")
    assert violations(tmp_path) == ["hpc/sandbox/process.py makes ConfigError", "jobs/train.py makes UserError"]


@pytest.mark.parametrize("cls, builtin", [(UsageError, ValueError), (ConfigError, ValueError),
                                          (TaskError, ValueError), (DataFileError, ValueError),
                                          (TokenizerError, ValueError)])
def test_domain_errors_are_user_errors_and_their_builtin(cls, builtin):
    """An entry point catches them all as UserError; a library caller may catch the builtin."""
    assert issubclass(cls, UserError) and issubclass(cls, builtin)


def test_results_checkpoint_and_candidate_errors_are_not_os_errors():
    """Code that handles an OSError (retry, journal, a full disk) must not swallow them."""
    assert not any(issubclass(c, OSError) for c in (ResultsFileError, CheckpointError, CandidateError))


ENTRY_POINTS = ("hpc/cli.py", "hpc/pool/__main__.py", "hpc/agent/__main__.py", "hpc/policy/hf_convert.py",
                "jobs/analyze.py", "jobs/evaluate.py", "jobs/synthesize.py", "jobs/train.py")


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_catches_the_base_class(module):
    """Whatever kind a library raised, the entry point ends it as one `error:` line (the tests of
    each command check the line and the exit code)."""
    tree = ast.parse((REPO / module).read_text())
    caught = {n.type.id for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and isinstance(n.type, ast.Name)}
    assert "UserError" in caught

"""What the trainer's test files (tests/test_train_*.py) share: a small config in the default's
shape, and the command lines that start the trainer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

DEFAULT = ROOT / "configs" / "train" / "default.yaml"

# megatron's and torch's import-time warnings
LIBRARY_WARNINGS = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                              "ignore::FutureWarning")


def small_config(tmp_path: Path, **changes) -> Path:
    """The default's shape, cut to seconds: short SFT, one task, small groups."""
    data = yaml.safe_load(DEFAULT.read_text())
    data.update(only=["level1/04_max_dim"], checkpoint_every=2)
    data["rl"]["group_size"] = 2
    data["rollout"]["tasks_per_step"] = 1
    data["stages"] = [{"name": "warmup_sft", "kind": "sft", "steps": 4, "lr": 3e-3, "batch_size": 2},
                      {"name": "ppo", "kind": "ppo", "steps": 1}]
    data.update(changes)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_command(args: list[str], timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`args` from the repository root, with the package on PYTHONPATH."""
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def train_under_mpirun(ranks: int, config: Path, out: Path, *flags: str,
                       timeout: float = 900) -> subprocess.CompletedProcess:
    """`jobs/train.py --pool` on `ranks` MPI ranks, oversubscribed and unbound (2 cores here)."""
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    return run_command(["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, "-m",
                        "mpi4py", "jobs/train.py", "--config", str(config), "--out", str(out), "--pool", *flags],
                       timeout=timeout, env=env)


def train_under_torchrun(procs: int, config: Path, out: Path, *flags: str,
                         timeout: float = 900) -> subprocess.CompletedProcess:
    """`jobs/train.py` as `procs` trainer processes started by torchrun, each with its own evaluator."""
    return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                        "jobs/train.py", "--config", str(config), "--out", str(out), *flags], timeout=timeout)

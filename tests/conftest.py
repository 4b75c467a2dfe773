"""Shared fixtures: a fast evaluation config and a private cache for compile objects and baselines."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from hpc.config import load_config

TESTS = Path(__file__).parent
ROOT = TESTS.parent
RELU_TASK = TESTS / "fixtures" / "tasks" / "level1" / "relu.py"


# Fixtures that run real evaluations or a real Slurm: a test using one is an integration test.
INTEGRATION_FIXTURES = frozenset({"fast_config", "cuda_config", "config", "cache_dir", "slurm"})
# Files of integration tests: real compilers, sandboxed processes, MPI and torchrun jobs, training
# runs, submitit jobs and the command lines run as subprocesses (seconds each).
INTEGRATION_FILES = frozenset({
    "test_agent_episode", "test_agent_pool", "test_analysis", "test_cli", "test_compile", "test_confinement",
    "test_evaluate_job", "test_evaluate_policy", "test_hacks", "test_odd_input", "test_policy_parallel",
    "test_pool", "test_prestart", "test_rl_pipeline", "test_samples", "test_sandbox", "test_slurm_templates",
    "test_solutions", "test_synthesis_job", "test_train_config", "test_train_default", "test_train_faults",
    "test_train_parallel", "test_train_recipe"})


# The longest files, started first so that no worker is left alone with one of them at the end.
LONGEST_FIRST = ("test_train_default", "test_hacks", "test_solutions", "test_train_parallel", "test_pool",
                 "test_train_faults", "test_slurm_templates", "test_synthesis", "test_compile", "test_sandbox",
                 "test_cli", "test_odd_input", "test_samples", "test_train_recipe", "test_evaluate_job")


def pytest_collection_modifyitems(config, items):
    """Integration tests (a real evaluation or Slurm, or a file of them) are marked slow: the unit
    tier, `scripts/test.sh --fast` (`-m "not slow"`), leaves them out. The longest files come
    first: pytest-xdist (`--dist loadfile --no-loadscope-reorder`, scripts/test.sh) hands files to
    workers in collection order."""
    for item in items:
        if set(getattr(item, "fixturenames", ())) & INTEGRATION_FIXTURES or item.path.stem in INTEGRATION_FILES:
            item.add_marker(pytest.mark.slow)
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(autouse=True)
def _readable_tmp_path(request) -> None:
    """pytest makes each tmp_path of mode 700; a test's files there are what its confined programs
    read, as uid 65534 under a root harness (hpc.sandbox.launch.run_as), as a user's task folder is."""
    if "tmp_path" in request.fixturenames:
        request.getfixturevalue("tmp_path").chmod(0o755)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hpc-cache")


def make_fast_config(cache_dir: Path, backend: str = "cpu"):
    """The real pipeline with fewer timed iterations, so each evaluation takes seconds."""
    cfg = load_config(cache_dir=str(cache_dir), backend=backend, scale="gpu" if backend == "cuda" else "cpu")
    cfg.timing.warmup = 2
    cfg.timing.iterations = 20
    cfg.timing.calibration_calls = 15
    cfg.timing.burst_max = 4          # frames of calls still, fewer inputs to make
    cfg.correctness.timed_checks = 3
    cfg.sandbox.timeout_s = 180
    cfg.validate()
    return cfg


# The head of a task file whose Model meets others through a flock on LOCK (a file of the test), for
# the tests of an evaluation run out of memory beside another (tests/test_cli.py, test_synthesis.py):
# one Model holds LOCK, as a task holds device memory; `neighbour_holds_lock` waits up to `seconds`
# for another to hold it. Format it with lock=PATH; braces of the rest of the file are doubled.
LOCKED_TASK_HEAD = """import fcntl
import os
import time

import torch
import torch.nn as nn

LOCK = {lock!r}


def neighbour_holds_lock(seconds):
    fd = os.open(LOCK, os.O_RDONLY)
    try:
        end = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
    finally:
        os.close(fd)
"""

def plumbing_config(folder: Path) -> Path:
    """A config file for tests of what runs around evaluations (every record once, resume, lost
    ranks, requeues, templates): eager alone as the baseline, since torch.compile's costs some 25 s
    of CPU per evaluation and the reward's full path is tested by test_solutions and the hack suite;
    fewer calibration calls, and frames of at most 4 calls as in make_fast_config (the reference
    makes each call's inputs)."""
    path = folder / "plumbing.yaml"
    path.write_text("timing:\n  calibration_calls: 15\n  burst_max: 4\nbaseline:\n  compile_modes: []\n")
    return path


@pytest.fixture
def fast_config(cache_dir):
    return make_fast_config(cache_dir)


@pytest.fixture
def cuda_config(cache_dir):
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    return make_fast_config(cache_dir, "cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def slurm():
    """A real local Slurm with accounting (scripts/local-slurm.sh), started for the session on free
    ports and stopped at its end; SLURM_CONF is exported for the tests' sbatch/sacct calls."""
    import os
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip("needs root and Slurm (scripts/system-deps.sh installs it)")
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-"))   # not under pytest's private tmp: mysql must reach it
    ports = {"HPC_SLURMCTLD_PORT": _free_port(), "HPC_SLURMD_PORT": _free_port(),
             "HPC_SLURMDBD_PORT": _free_port(), "HPC_MARIADB_PORT": _free_port()}
    # 8 CPUs whatever the machine has: the tests place 4-rank MPI jobs and time nothing
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, "HPC_SLURM_CPUS": "8"}
    script = ROOT / "scripts" / "local-slurm.sh"
    try:
        up = subprocess.run(["bash", str(script), "up", str(state)], env=env, capture_output=True, text=True,
                            timeout=300)
        assert up.returncode == 0, up.stderr
        os.environ["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
        yield state
    finally:
        subprocess.run(["bash", str(script), "down", str(state)], env=env, capture_output=True, timeout=120)
        os.environ.pop("SLURM_CONF", None)
        shutil.rmtree(state, ignore_errors=True)


@contextmanager
def accepting(server: socket.socket) -> Iterator[list]:
    """Accept connections on a bound socket in a thread while the block runs; yields the list of
    those accepted (an attack test asserts it stays empty)."""
    server.listen(1)
    server.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set() and not accepted:
            try:
                accepted.append(server.accept())
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join()
        server.close()


def mount_tmpfs(where: Path, size: str, *options: str) -> None:
    """A small tmpfs at `where` (a full disk, a read-only one, for real); the test is skipped
    where it cannot be mounted (not root, no mount permission)."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 2 MB disk of its own, unmounted after the test."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "2m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.fixture
def read_only(tmp_path) -> Iterator[Path]:
    """A read-only disk of its own, unmounted after the test."""
    where = tmp_path / "ro"
    mount_tmpfs(where, "64k", "ro")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)

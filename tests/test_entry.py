"""What the entry points share: --help's description, and usage errors as one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc.entry import Parser, summary
from hpc.errors import UsageError
from tests.conftest import ROOT


def test_the_description_is_the_whole_first_paragraph():
    doc = """Evaluate a candidate set against a task suite, sharded over a
    Slurm array through submitit.

        python jobs/evaluate.py TASKS CANDIDATES --out RUN
    """
    assert summary(doc) == "Evaluate a candidate set against a task suite, sharded over a Slurm array through submitit."
    assert summary(None) == ""


def test_no_entry_point_cuts_its_description_at_the_first_line():
    cut = [str(p.relative_to(ROOT)) for folder in ("jobs", "hpc") for p in sorted((ROOT / folder).rglob("*.py"))
           if "__doc__.splitlines()[0]" in p.read_text()]
    assert not cut, cut


def test_a_usage_error_is_a_user_error_naming_the_command():
    p = Parser(prog="jobs/x.py")
    p.add_argument("--out", required=True)
    with pytest.raises(UsageError, match=r"^jobs/x.py: the following arguments are required: --out$"):
        p.parse_args([])


@pytest.mark.slow
def test_evaluate_job_usage_error_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "jobs/evaluate.py", "--bogus"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: jobs/evaluate.py: "), out.stderr


@pytest.mark.slow
def test_a_submitted_training_job_s_user_error_is_one_line_and_exit_2(tmp_path):
    """jobs/train.py --submit: a bad config is refused before a job is submitted (no run folder
    made); an error only the job finds (a pipeline of 2 in its one process) comes back from the job
    as one line and exit 2, not submitit's traceback of the job."""
    import yaml

    def submit(change: dict) -> subprocess.CompletedProcess:
        config = yaml.safe_load((ROOT / "configs" / "train" / "default.yaml").read_text())
        config["policy"].update(change)
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(config))
        return subprocess.run([sys.executable, "jobs/train.py", "--config", str(path), "--out", str(tmp_path / "run"),
                               "--submit", "--executor", "local"], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)

    early = submit({"max_seq_len": 0})
    assert early.returncode == 2 and early.stderr.count("\n") == 1, early.stderr
    assert early.stderr.startswith("error: config policy.max_seq_len") and not (tmp_path / "run").exists()
    late = submit({"parallel": {"pipeline": 2}})
    errors = [line for line in late.stderr.splitlines() if line.startswith("error: ")]
    assert late.returncode == 2 and "Traceback" not in late.stderr, late.stderr[-3000:]
    assert late.stderr.startswith("submitted job ") and len(errors) == 1, late.stderr
    assert errors[0].startswith("error: config policy.parallel: tensor 1 x pipeline 2 does not divide"), errors


RANKS_LEAVE = """
import sys, time
from mpi4py import MPI
from hpc.entry import exit_together

rank = MPI.COMM_WORLD.Get_rank()
if rank == 0:
    time.sleep(float(sys.argv[1]))
    print("error: rank 0 says why", file=sys.stderr, flush=True)
else:
    time.sleep(float(sys.argv[2]))
sys.exit(exit_together(2, wait_s=float(sys.argv[3])))
"""


def _ranks_leave(rank0_s: float, rank1_s: float, wait_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    return subprocess.run(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-c", RANKS_LEAVE,
                           str(rank0_s), str(rank1_s), str(wait_s)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_ranks_leaving_with_an_error_wait_for_rank_0_s_line():
    """Under `python -m mpi4py` a rank's exit 2 was an MPI_Abort that could kill rank 0 before it
    wrote the error line standing for all (seen in CI): now the ranks leave together, exit 2."""
    proc = _ranks_leave(rank0_s=2, rank1_s=0, wait_s=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: rank 0 says why" in proc.stderr and "MPI_ABORT" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_rank_that_does_not_come_ends_the_job_by_abort():
    """Rank 1 is elsewhere (here, asleep for a minute): rank 0 stops waiting and the abort ends both."""
    import time

    started = time.monotonic()
    proc = _ranks_leave(rank0_s=0, rank1_s=60, wait_s=1)
    assert proc.returncode == 2, proc.stdout + proc.stderr   # Open MPI's abort notice itself is sometimes garbled
    assert time.monotonic() - started < 30, "the abort did not end the sleeping rank"

"""The sbatch templates, submitted to a real local Slurm (slurmctld, slurmd, slurmdbd), results
checked in HDF5."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.pool.processes import process_with
from hpc.results.hdf5 import read_records
from tests.conftest import ROOT, plumbing_config
from tests.test_pool import _suite

TEMPLATES = ROOT / "slurm_templates"


def sbatch(template: Path, workdir: Path, env: dict, *options: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={workdir}/%j.out", *options,
                           str(template)], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_for_job(job: str, timeout: float = 900) -> str:
    """The job's final state from accounting (sacct), once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                             timeout=30).stdout.split()
        if out and out[0] not in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING"):
            return out[0]
        time.sleep(1)
    raise TimeoutError(f"job {job} still not finished after {timeout} s")


def test_reward_pool_template_evaluates_a_suite(slurm, tmp_path, cache_dir):
    tasks, solutions = _suite(tmp_path, 3)
    out = tmp_path / "pool.h5"
    config = plumbing_config(tmp_path)
    env = {"HPC_TASKS": str(tasks), "HPC_CANDIDATES": str(solutions), "HPC_OUT": str(out), "HPC_BACKEND": "cpu",
           "HPC_POOL_ARGS": f"--iterations 10 --config {config}", "HPC_PYTHON": sys.executable,
           "HPC_CACHE_DIR": str(cache_dir)}
    job = sbatch(TEMPLATES / "reward_pool.sbatch", tmp_path, env, "--ntasks=3", "--export=ALL")
    state = wait_for_job(job)
    log = (tmp_path / f"{job}.out").read_text()
    assert state == "COMPLETED", log
    records = read_records(out)
    assert sorted(r.task_id for r in records) == ["level1/relu_0", "level1/relu_1", "level1/relu_2"], log
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]


def _pool_job_streaming(tmp_path: Path, cache_dir: Path, pool_args: str, env: dict[str, str],
                        ntasks: int) -> tuple[str, Path]:
    """reward_pool.sbatch on 6 ReLU tasks with `pool_args` and `env`, submitted; returns (job id,
    results file) once the first record is in it, so a rank can be killed mid-run."""
    tasks, solutions = _suite(tmp_path, 6)
    out = tmp_path / "pool.h5"
    config = plumbing_config(tmp_path)
    env = {"HPC_TASKS": str(tasks), "HPC_CANDIDATES": str(solutions), "HPC_OUT": str(out), "HPC_BACKEND": "cpu",
           "HPC_POOL_ARGS": f"--iterations 10 {pool_args} --config {config}", "HPC_PYTHON": sys.executable,
           "HPC_CACHE_DIR": str(cache_dir), **env}
    job = sbatch(TEMPLATES / "reward_pool.sbatch", tmp_path, env, f"--ntasks={ntasks}", "--export=ALL")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (out.exists() and read_records(out)):
        time.sleep(0.5)
    return job, out


def test_reward_pool_under_srun_pmix_survives_a_killed_worker_rank(slurm, tmp_path, cache_dir):
    """1 coordinator + 3 workers through srun --mpi=pmix; rank 2 is SIGKILLed once results stream.

    Slurm's pmix plugin then kills the whole step; the template starts it again, and the restarted
    pool evaluates only what is missing: every record exactly once, none lost."""
    job, out = _pool_job_streaming(tmp_path, cache_dir, "--dead-after 6", {}, ntasks=4)
    victim = process_with(b"hpc.pool", f"SLURM_JOB_ID={job}", "SLURM_PROCID=2")
    assert victim is not None, "pool finished (or never started) before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    state = wait_for_job(job)
    log = (tmp_path / f"{job}.out").read_text()
    assert "restart 1 of 2 for what is missing" in log, log
    records = read_records(out)
    assert sorted(r.task_id for r in records) == [f"level1/relu_{k}" for k in range(6)], log
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    assert state == "COMPLETED", log


def test_reward_pool_under_mpirun_ends_with_a_killed_coordinator_and_the_template_resumes_it(slurm, tmp_path,
                                                                                              cache_dir):
    """HPC_LAUNCHER=mpirun (mpirun --enable-recovery): rank 0 is SIGKILLed once results stream. Its
    workers hear nothing, leave, and the step ends (mpirun exits 0 all the same); the pool wrote no
    status, so the template starts it again, and the restarted pool evaluates only what is missing."""
    job, out = _pool_job_streaming(tmp_path, cache_dir, "--coordinator-silent 5",
                                   {"HPC_LAUNCHER": "mpirun", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"},
                                   ntasks=3)
    victim = process_with(b"hpc.pool", f"SLURM_JOB_ID={job}", "OMPI_COMM_WORLD_RANK=0")
    assert victim is not None, "pool finished (or never started) before its coordinator could be killed"
    before = [r.task_id for r in read_records(out)]
    os.kill(victim, signal.SIGKILL)
    state = wait_for_job(job)
    log = (tmp_path / f"{job}.out").read_text()
    assert "ended unfinished (no status: a rank died, exit 0); restart 1 of 2 for what is missing" in log, log
    assert "nothing from the coordinator (rank 0)" in log, log
    records = read_records(out)
    assert [r.task_id for r in records][:len(before)] == before, log
    assert sorted(r.task_id for r in records) == [f"level1/relu_{k}" for k in range(6)], log
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    assert state == "COMPLETED", log
    assert process_with(b"hpc.pool", f"SLURM_JOB_ID={job}") is None, "a rank outlived the job"


def test_reward_pool_template_names_a_missing_parameter(slurm, tmp_path):
    job = sbatch(TEMPLATES / "reward_pool.sbatch", tmp_path, {}, "--ntasks=2",
                 "--export=NONE,PATH=/usr/bin:/bin")
    assert wait_for_job(job, 120) == "FAILED"
    lines = (tmp_path / f"{job}.out").read_text().strip().splitlines()
    assert lines == ["error: HPC_TASKS is not set (sbatch --export=ALL,HPC_TASKS=...)"]


def test_analyze_template_writes_a_report(slurm, tmp_path):
    from tests.test_analysis import assert_png, write_suite, write_two_runs

    run1, run2 = write_two_runs(tmp_path)
    out = tmp_path / "report"
    env = {"HPC_RUNS": f"{run1} {run2}", "HPC_OUT": str(out), "HPC_TASKS": str(write_suite(tmp_path)),
           "HPC_NAMES": "first second", "HPC_PYTHON": sys.executable}
    job = sbatch(TEMPLATES / "analyze.sbatch", tmp_path, env, "--export=ALL")
    state = wait_for_job(job, 300)
    log = (tmp_path / f"{job}.out").read_text()
    assert state == "COMPLETED", log
    assert log.strip().splitlines()[-1] == str(out / "report.md"), log
    assert "| first | 50.0% | 25.0% | 25.0% |" in (out / "report.md").read_text()
    assert_png(out / "fast_p.png")


def test_pipeline_chains_an_evaluation_array_and_the_analysis_with_afterok(slurm, tmp_path, cache_dir):
    """pipeline.sh: a 2-task evaluation array, then the analysis once both shards succeeded."""
    tasks, solutions = _suite(tmp_path, 3)
    run = tmp_path / "run"
    config = plumbing_config(tmp_path)
    env = {**os.environ, "HPC_BACKEND": "cpu", "HPC_EVAL_ARGS": f"--iterations 10 --config {config}",
           "HPC_PYTHON": sys.executable, "HPC_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run(["bash", str(TEMPLATES / "pipeline.sh"), str(tasks), str(solutions), str(run), "2"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    analyze_job = proc.stdout.strip().splitlines()[-1].split(": ")[1].split()[0]
    state = wait_for_job(analyze_job)
    logs = "\n".join(p.read_text() for p in sorted(run.glob("*.out")))
    assert state == "COMPLETED", logs
    assert sorted(p.name for p in run.glob("shard-*.h5")) == ["shard-0000.h5", "shard-0001.h5"]
    records = read_records(run / "results.h5")
    assert sorted(r.task_id for r in records) == ["level1/relu_0", "level1/relu_1", "level1/relu_2"], logs
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    (summary,) = json.loads((run / "report" / "summary.json").read_text())["runs"]
    assert summary["overall"]["samples"] == 3 and summary["overall"]["pass_rate"] == 1.0, summary


@pytest.mark.parametrize("given", [{}, {"HPC_CANDIDATES": "c", "HPC_POLICY": "p"}])
def test_evaluation_array_wants_exactly_one_of_candidates_and_policy(given):
    env = {k: v for k, v in os.environ.items() if k not in ("HPC_CANDIDATES", "HPC_POLICY")}
    proc = subprocess.run(["bash", str(TEMPLATES / "evaluate_array.sbatch")], capture_output=True, text=True,
                          timeout=30, env={**env, "HPC_TASKS": "t", "HPC_OUT": "o", **given})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: set exactly one of HPC_CANDIDATES and HPC_POLICY "
                                   "(sbatch --export=ALL,HPC_CANDIDATES=...)")


def test_pipeline_refuses_a_bad_shard_count(tmp_path):
    proc = subprocess.run(["bash", str(TEMPLATES / "pipeline.sh"), "t", "c", str(tmp_path / "r"), "zero"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: SHARDS must be a positive integer, got 'zero'"


def test_train_template_trains_with_the_reward_pool_in_one_job(slurm, tmp_path, cache_dir):
    """train.sbatch under srun --mpi=pmix: rank 0 trains, ranks 1-2 score its episodes; a
    second submission of the finished run resumes it and trains nothing twice."""
    from hpc.results.training import read_steps, read_trajectories
    from tests.train_support import small_config

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                            {"name": "measure", "kind": "measure", "steps": 1}])
    run = tmp_path / "run"
    env = {"HPC_CONFIG": str(config), "HPC_OUT": str(run), "HPC_PYTHON": sys.executable,
           "HPC_CACHE_DIR": str(cache_dir)}
    for attempt in range(2):
        job = sbatch(TEMPLATES / "train.sbatch", tmp_path, env, "--ntasks=3", "--export=ALL")
        state = wait_for_job(job)
        log = (tmp_path / f"{job}.out").read_text()
        assert state == "COMPLETED", log
    assert [r["step"] for r in read_steps(run / "train.h5")] == [1, 2, 3]
    assert len(read_trajectories(run / "train.h5", step=3)) == 2
    assert "trained 3 steps" in log


def test_every_requeued_template_appends_to_its_log():
    """A requeued job writes the same log file again: without append, its second attempt erases
    what the first one printed."""
    for template in sorted(TEMPLATES.glob("*.sbatch")):
        text = template.read_text()
        if "#SBATCH --requeue" in text:
            assert "#SBATCH --open-mode=append" in text, template.name


def test_the_one_step_local_slurm_advertises_this_machines_cores_and_points_the_shell_at_it(tmp_path):
    """`eval "$(scripts/local-slurm.sh up)"` is the documented step: its stdout is the export line
    alone, and the node offers the cores this machine has (8 on 2 cores stacked array tasks' timed
    kernels on each other)."""
    import shutil
    import tempfile

    from tests.conftest import _free_port

    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip("needs root and Slurm (scripts/system-deps.sh installs it)")
    state = Path(tempfile.mkdtemp(prefix="hpc-slurm-"))
    env = {k: v for k, v in os.environ.items() if k not in ("HPC_SLURM_CPUS", "SLURM_CONF")}
    env.update({k: str(_free_port()) for k in ("HPC_SLURMCTLD_PORT", "HPC_SLURMD_PORT", "HPC_SLURMDBD_PORT",
                                               "HPC_MARIADB_PORT")})
    script = ROOT / "scripts" / "local-slurm.sh"
    try:
        shell = subprocess.run(["bash", "-c", f'eval "$(bash {script} up {state})" && scontrol show node localhost'],
                               env=env, capture_output=True, text=True, timeout=300)
        assert shell.returncode == 0, shell.stderr
        assert f"CPUTot={len(os.sched_getaffinity(0))} " in shell.stdout, shell.stdout
    finally:
        subprocess.run(["bash", str(script), "down", str(state)], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)

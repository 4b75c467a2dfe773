"""The submitit executor behind the jobs/ scripts: one set of placement flags, one way to build it.

`auto` is Slurm where `srun` exists and local processes elsewhere; `slurm` and `local` force one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import submitit

from hpc.progress import Progress

log = logging.getLogger(__name__)

CLUSTERS = ("auto", "slurm", "local")


def add_executor_args(p: argparse.ArgumentParser, minutes: int, choices: tuple[str, ...] = CLUSTERS,
                      default: str = "auto") -> None:
    """The flags every job script takes for where and how its jobs run."""
    p.add_argument("--executor", choices=choices, default=default,
                   help=f"where the job runs: {', '.join(choices)} (default {default})")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--time", type=int, default=minutes, help=f"minutes per job (default {minutes})")
    p.add_argument("--cpus-per-task", type=int, default=None)


def make_executor(folder: str | Path, cluster: str, name: str, minutes: int, *, gpus_per_task: int = 0,
                  cpus_per_task: int | None = None, partition: str | None = None, account: str | None = None,
                  parallelism: int | None = None) -> submitit.AutoExecutor:
    """An executor writing its logs and pickles under `folder`; Slurm-only options apply only on Slurm."""
    executor = submitit.AutoExecutor(folder=folder, cluster=None if cluster == "auto" else cluster)
    params = {"timeout_min": minutes, "name": name, "tasks_per_node": 1}
    if gpus_per_task:
        params["gpus_per_node"] = gpus_per_task
    if cpus_per_task:
        params["cpus_per_task"] = cpus_per_task
    if executor.cluster == "slurm":
        params.update({k: v for k, v in {"slurm_partition": partition, "slurm_account": account,
                                         "slurm_array_parallelism": parallelism}.items() if v is not None})
    executor.update_parameters(**params)
    return executor


def watch_for_sigterm() -> threading.Event:
    """Set when Slurm sends SIGTERM (requeue, preemption, scancel) to an array task; a handler
    installed before (submitit's) still runs. A shard checks it before recording a result: work the
    signal interrupted is not recorded, and the requeued task does it again."""
    seen = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        seen.set()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    return seen


# Slurm states after which a job never runs again; any other state seen by squeue is a live job.
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED",
                   "DEADLINE"})

EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(:|$)")


def controller_state(job) -> str | None:
    """The job's state as the Slurm controller sees it now, or None where it no longer lists it
    (or the job is not a Slurm job). Accounting (sacct, which submitit reads) lags the controller and
    shows a requeued task as ended for a moment; the controller does not."""
    if not isinstance(job, submitit.SlurmJob):
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split()
    return states[0] if out.returncode == 0 and states else None


def finished(job) -> bool:
    """True once an array task will not run again: submitit sees it done and the controller does not
    hold it live (pending again after a requeue, running, completing)."""
    if not job.done():
        return False
    state = controller_state(job)   # a result is not final while the task is live: a requeued task's
    # first run may have left one (the exception of its work killed by the requeue), which the next overwrites
    return state is None or state in ENDED


def failure_reason(job, error: Exception) -> str:
    """One line for an array task that ended without a result: its Slurm state where submitit gives
    it, the last exception its log shows, and where the log is."""
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    parts = [ln for ln in lines if "(state:" in ln][:1]
    job_log = job.stderr() or ""
    raised = [ln.strip() for ln in job_log.splitlines() if EXCEPTION_LINE.match(ln.strip())]
    parts.append(raised[-1] if raised else (lines[0] if lines else type(error).__name__))
    return f"{'; '.join(parts)[:400]} (log: {job.paths.stderr})"


def wait_for_array(jobs: list, label: str, describe: Callable[[dict], str], every: float,
                   quiet: bool = False) -> list[str]:
    """Wait for every array task: a bar at a terminal, a progress line every `every` seconds in a
    log, one line per finished task (`describe` of its result); `quiet` (--quiet) shows none of
    them, only a failed task's line, as an error. Returns the ids of those that failed; a failure
    is reported and the others are still waited for."""
    failed: list[str] = []
    pending = list(jobs)
    with open(os.devnull, "w") if quiet else contextlib.nullcontext() as hidden, \
            Progress(len(jobs), f"{label}: shards done", hidden, every_s=every) as progress:
        while pending:
            for job in [j for j in pending if finished(j)]:
                pending.remove(job)
                try:
                    line = f"{label}: {describe(job.result())}"
                except Exception as e:   # the array task's own failure
                    failed.append(job.job_id)
                    line = f"{label}: array task {job.job_id} failed: {failure_reason(job, e)}"
                    if quiet:
                        log.error("%s", line)
                progress.advance(line)
            if pending:
                progress.tick()
                time.sleep(1.0)
    return failed

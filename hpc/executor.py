"""The submitit executor behind the jobs/ scripts: one set of placement flags, one way to build it.

`auto` is Slurm where `srun` exists and local processes elsewhere; `slurm` and `local` force one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import submitit

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

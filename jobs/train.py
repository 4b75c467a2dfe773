"""Train a kernel-writing policy with CUDA Agent's staged recipe (configs/train/*.yaml).

    python jobs/train.py --config configs/train/default.yaml --out runs/default
        here: one trainer process, its episodes scored by this machine's sandboxed workers
    torchrun --nproc-per-node 2 jobs/train.py --config C --out RUN
        trainer processes as torchrun starts them (e.g. the stages of policy.parallel.pipeline),
        each scoring its own episodes with this machine's sandboxed workers
    mpirun -n 4 python -m mpi4py jobs/train.py --config C --out RUN --pool [--trainers T]
    srun --mpi=pmix python -m mpi4py jobs/train.py ... --pool      (slurm_templates/train.sbatch)
        one job, two roles: T trainer ranks (torch.distributed: policy.parallel.tensor x data
        parallel) and the reward pool's worker ranks (MPI, one GPU each), split evenly among the
        trainers' tensor-parallel groups (a group's first rank scores its episodes), each group's
        ranks consecutive: [trainers of group 0, its workers, trainers of group 1, ...]
    python jobs/train.py --config C --out RUN --submit [--executor slurm --nodes 2 --tasks-per-node 8 ...]
        the same through submitit; the job is Checkpointable: preempted or timed out, it is
        requeued and resumes from RUN's latest checkpoint

Writes RUN/train.h5 (a metrics row per step, every trajectory), RUN/checkpoints/ (megatron
dist_checkpointing), RUN/report/ (training curves) and prints a line per step. Running it again
on the same RUN resumes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import submitit  # noqa: E402

from hpc.entry import Parser, exit_together, summary  # noqa: E402
from hpc.errors import UsageError, UserError, writable_folder  # noqa: E402
from hpc.executor import add_executor_args, make_executor  # noqa: E402
from hpc.logs import ON_EVERY_RANK, JobLogging, add_logging_args, setup_logging  # noqa: E402
from hpc.rl.launch import RESULTS, train  # noqa: E402

log = logging.getLogger(__name__)

class TrainJob(JobLogging, submitit.helpers.Checkpointable):
    """The submitit job: every task of it runs `train` (under Slurm with `--mpi=pmix`, the tasks
    are the MPI world). Requeued on preemption or timeout, it resumes from the run's checkpoints."""

    def __call__(self, config: str, out: str, pool: bool, trainers: int) -> dict[str, Any] | UserError | None:
        self.setup_logging()
        try:
            return train(config, out, pool, trainers, self.quiet)
        except UserError as e:
            # the job's answer, not its failure: the submitter says it in one line (raised, it would be
            # submitit's traceback of the job), and bad input is no reason to requeue
            log.error("error: %s", e)
            return e
        finally:
            from hpc.policy.parallel import teardown

            teardown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="python jobs/train.py", description=summary(__doc__))
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--out", required=True, help="run folder: results, checkpoints, report (resumed if present)")
    p.add_argument("--pool", action="store_true", help="under MPI: trainer rank(s) plus reward-worker ranks")
    p.add_argument("--trainers", type=int, default=1,
                   help="trainer ranks with --pool (policy.parallel.tensor x data parallel)")
    p.add_argument("--submit", action="store_true", help="run as a submitit job (Slurm where srun exists)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1, help="MPI ranks per node (trainers + workers)")
    p.add_argument("--gpus-per-node", type=int, default=0)
    add_executor_args(p, minutes=240)
    add_logging_args(p)
    return p.parse_args(argv)


def submit(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run `train` as a submitit job and wait for it; a bad config or --out is refused here, before
    a job waits in a queue to find it, and a UserError of the job is raised here (one line, exit 2)."""
    from hpc.rl.train_config import load_train_config

    load_train_config(args.config)
    writable_folder(args.out)
    executor = make_executor(Path(args.out) / "slurm", args.executor, "hpc-train", args.time,
                             cpus_per_task=args.cpus_per_task, partition=args.partition, account=args.account)
    if executor.cluster == "slurm":
        params: dict[str, Any] = {"nodes": args.nodes, "tasks_per_node": args.tasks_per_node}
        if args.gpus_per_node:
            params["gpus_per_node"] = args.gpus_per_node
        if args.pool:
            params["slurm_srun_args"] = ["--mpi=pmix"]
        executor.update_parameters(**params)
    elif args.pool:
        raise UsageError("--submit --pool needs Slurm (MPI ranks); without it drop --pool")
    job = executor.submit(TrainJob(args.verbose, args.quiet), str(Path(args.config).resolve()), str(Path(args.out).resolve()), args.pool,
                          args.trainers)
    log.info("submitted job %s (logs under %s)", job.job_id, Path(args.out) / "slurm")
    results = job.results()
    refused = next((r for r in results if isinstance(r, UserError)), None)
    if refused is not None:
        raise refused
    return next((r for r in results if r is not None), None)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        summary = submit(args) if args.submit else train(args.config, args.out, args.pool, args.trainers, args.quiet)
    except UserError as e:   # every rank reads the same arguments and config
        log.error("error: %s", e, extra=ON_EVERY_RANK)
        return exit_together(2)
    if summary is not None:
        for stage, reward in summary.get("measured", {}).items():
            print(f"{stage}: mean reward {reward:.3f}")
        print(f"trained {summary['steps']} steps; results {Path(summary['out']) / RESULTS}; "
              f"report {summary.get('report', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import submitit  # noqa: E402

from hpc.entry import Parser, exit_now  # noqa: E402
from hpc.errors import UserError, check_out_folder  # noqa: E402
from hpc.executor import add_executor_args, make_executor  # noqa: E402
from hpc.logs import ON_EVERY_RANK, add_logging_args, setup_logging  # noqa: E402

log = logging.getLogger(__name__)

RESULTS = "train.h5"


def _step_line(m: dict[str, Any]) -> str:
    parts = [f"step {m['step']} {m['stage']}"]
    for key, fmt in (("reward_mean", "reward {:.3f}"), ("pass_rate", "pass {:.0%}"), ("sft_loss", "sft loss {:.4f}"),
                     ("value_loss", "value loss {:.4f}"), ("kl_to_reference", "kl {:.4f}"),
                     ("clip_fraction", "clip {:.2f}"), ("actor_grad_norm", "grad norm {:.3g}"),
                     ("tokens_per_second", "{:.0f} tok/s")):
        value = m.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(fmt.format(value))
    parts.append(f"{m['step_s']:.1f}s")
    return ", ".join(parts)


def run_trainer(cfg, out: Path, backend, quiet: bool = False) -> dict[str, Any]:
    """Train here with `backend`; the trainer of rank 0 writes the results and, unless `quiet`,
    shows a line per step. Returns a summary."""
    from hpc.progress import Progress
    from hpc.results.training import TrainingWriter
    from hpc.rl.trainer import Trainer

    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, out, backend)
    rows: list[dict[str, Any]] = []
    writer = TrainingWriter(out / RESULTS) if trainer.is_writer else None
    kinds = [stage.kind for stage in cfg.stages for _ in range(stage.steps)]   # an sft step is not a ppo step
    progress = Progress(cfg.total_steps, "train", sys.stdout, kinds=kinds) if trainer.is_writer and not quiet else None
    if progress is not None and trainer.position.step:
        progress.skip(trainer.position.step, f"resumed after step {trainer.position.step}")
    try:
        if writer is not None:
            writer.truncate_after(trainer.position.step)

        def on_step(metrics: dict[str, Any], samples: list) -> None:
            rows.append(metrics)
            if writer is None:
                return
            writer.append_step(metrics)
            writer.append_trajectories(metrics["step"], metrics["stage"],
                                       [s.trajectory.to_dict() for s in samples if s.trajectory is not None])
            if progress is not None:
                progress.advance(_step_line(metrics))

        trainer.run(on_step)
    finally:
        if writer is not None:
            writer.close()
    summary = {"steps": trainer.position.step, "out": str(out)}
    measured = {m["stage"]: m["reward_mean"] for m in rows if "reward_mean" in m and m["stage"].startswith("measure")}
    summary["measured"] = measured
    if trainer.is_writer:
        summary["report"] = _report(out)
    return summary


def _report(out: Path) -> str:
    from jobs.analyze import analyze

    try:
        return str(analyze([str(out / RESULTS)], str(out / "report"), None, None))
    except UserError as e:
        return f"no report: {e}"


def _local(cfg, out: Path, quiet: bool) -> dict[str, Any]:
    from hpc.agent.backend import CachedBackend, LocalBackend
    from hpc.policy.parallel import check_world, launch_env
    from hpc.sandbox.prestart import prestarted_workers

    check_world(cfg.policy.parallel.tensor, cfg.policy.parallel.pipeline, launch_env().world_size)
    backend = LocalBackend(cfg.eval)
    with prestarted_workers():
        return run_trainer(cfg, out, CachedBackend(backend) if cfg.rollout.reward_cache else backend, quiet)


def _pool(cfg, out: Path, trainers: int, quiet: bool) -> dict[str, Any] | None:
    """Under MPI: split the world into groups, each one tensor-parallel group of trainer ranks
    (one rank without TP) and its workers, which serve the group's first rank: the one that
    scores the group's episodes (hpc.rl.rollout)."""
    from mpi4py import MPI

    from hpc.agent.backend import CachedBackend, LocalBackend, PoolBackend, PoolClient
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.worker import pin_device, run_worker

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    tp = cfg.policy.parallel.tensor
    if trainers < 1 or trainers % tp:
        raise UserError(f"--trainers {trainers}: must be a positive multiple of policy.parallel.tensor {tp}")
    groups = trainers // tp
    if size < groups * (tp + 1):
        raise UserError(f"--pool: {size} ranks cannot hold {trainers} trainer(s) (tensor parallel {tp}) with a "
                        f"worker for each of their {groups} group(s)")
    per_group = size // groups
    group_index = min(rank // per_group, groups - 1)
    group = world.Split(group_index, rank)
    is_trainer = group.Get_rank() < tp
    roles = world.Split(0 if is_trainer else 1, rank)   # trainers among themselves; workers among themselves
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    trainers_here = node.allreduce(int(is_trainer))      # a node's first GPUs are its trainers', the rest workers'
    node.Free()
    if not is_trainer:
        if cfg.eval.backend == "cuda":
            pin_device(roles, first=trainers_here)
        clean = run_worker(group, 0, cfg.eval)
        if not clean:
            exit_now(0)
        return None
    # torch.distributed among the trainers: rendezvous at the first trainer's host.
    from hpc.policy.parallel import free_port

    address = roles.bcast((socket.gethostname(), free_port("")) if roles.Get_rank() == 0 else None, root=0)
    node = roles.Split_type(MPI.COMM_TYPE_SHARED)
    os.environ.update(RANK=str(roles.Get_rank()), WORLD_SIZE=str(roles.Get_size()), LOCAL_RANK=str(node.Get_rank()),
                      MASTER_ADDR=address[0], MASTER_PORT=str(address[1]))
    if group.Get_rank() > 0:   # a TP group's other ranks take its first rank's results, never score
        try:
            return run_trainer(cfg, out, LocalBackend(cfg.eval), quiet)
        finally:
            _finish_trainers(roles, True)
    coordinator = Coordinator(group, list(range(tp, group.Get_size())))
    backend = PoolBackend(PoolClient(coordinator), cfg.eval)
    try:
        return run_trainer(cfg, out, CachedBackend(backend) if cfg.rollout.reward_cache else backend, quiet)
    finally:
        clean = coordinator.close()
        log.info("reward pool of trainer rank %d: %s", roles.Get_rank(), coordinator.usage_line())
        for reason in coordinator.dead.values():
            log.warning("reward pool of trainer rank %d: lost %s", roles.Get_rank(), reason)
        _finish_trainers(roles, clean)


def _finish_trainers(trainers, clean: bool) -> None:
    """Every trainer rank ends alike: if any pool lost a worker rank, none may enter
    MPI_Finalize (it would wait for the dead rank), so all leave at once (exit 1)."""
    from mpi4py import MPI

    if not trainers.allreduce(clean, op=MPI.LAND):
        exit_now(1)


def train(config: str, out: str, pool: bool = False, trainers: int = 1, quiet: bool = False) -> dict[str, Any] | None:
    """Load the config and train (here, or as this MPI rank's role)."""
    from hpc.rl.train_config import load_train_config

    check_out_folder(out)
    cfg = load_train_config(config)
    if pool:
        return _pool(cfg, Path(out), trainers, quiet)
    return _local(cfg, Path(out), quiet)


class TrainJob(submitit.helpers.Checkpointable):
    """The submitit job: every task of it runs `train` (under Slurm with `--mpi=pmix`, the tasks
    are the MPI world). Requeued on preemption or timeout, it resumes from the run's checkpoints."""

    def __call__(self, config: str, out: str, pool: bool, trainers: int) -> dict[str, Any] | None:
        setup_logging()
        try:
            return train(config, out, pool, trainers)
        finally:
            from hpc.policy.parallel import teardown

            teardown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="python jobs/train.py", description=__doc__.splitlines()[0])
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
        raise UserError("--submit --pool needs Slurm (MPI ranks); without it drop --pool")
    job = executor.submit(TrainJob(), str(Path(args.config).resolve()), str(Path(args.out).resolve()), args.pool,
                          args.trainers)
    log.info("submitted job %s (logs under %s)", job.job_id, Path(args.out) / "slurm")
    results = job.results()
    return next((r for r in results if r is not None), None)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        summary = submit(args) if args.submit else train(args.config, args.out, args.pool, args.trainers, args.quiet)
    except UserError as e:   # every rank reads the same arguments and config
        log.error("error: %s", e, extra=ON_EVERY_RANK)
        return 2
    if summary is not None:
        for stage, reward in summary.get("measured", {}).items():
            print(f"{stage}: mean reward {reward:.3f}")
        print(f"trained {summary['steps']} steps; results {Path(summary['out']) / RESULTS}; "
              f"report {summary.get('report', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

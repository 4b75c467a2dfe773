"""A training run where it was started: one trainer here (or each process torchrun started),
its episodes scored by this machine's sandboxed workers; or, under MPI (`--pool`), one rank of a
job that splits its world into tensor-parallel groups of trainer ranks, each with the reward-pool
worker ranks that score its episodes. The trainer's results go to RUN/train.h5 and its report to
RUN/report (jobs/train.py is the command; docs/rl.md says how the ranks are laid out)."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from hpc.entry import exit_now
from hpc.errors import UsageError, UserError, check_out_folder, writable_folder

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
    from hpc.analysis.runs import analyze

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
        raise UsageError(f"--trainers {trainers}: must be a positive multiple of policy.parallel.tensor {tp}")
    groups = trainers // tp
    if size < groups * (tp + 1):
        raise UsageError(f"--pool: {size} ranks cannot hold {trainers} trainer(s) (tensor parallel {tp}) with a "
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
    writable_folder(out)   # a read-only one said in one line here, not as a traceback from deep inside
    if pool:
        return _pool(cfg, Path(out), trainers, quiet)
    return _local(cfg, Path(out), quiet)

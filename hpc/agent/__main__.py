"""Run one agent episode with a replayed policy: a recorded trajectory or a list of replies.

    python -m hpc.agent TASK REPLIES.json [--preset tiny|train|eval] [--out TRAJECTORY.json]
    mpirun -n 3 python -m mpi4py -m hpc.agent TASK REPLIES.json --pool ...   # tools on the reward pool

Every tool call is executed again and every state re-evaluated: a rollout re-scored, a bug
reproduced, or the environment driven end to end without a model. With --pool, rank 0 runs the
episode and the other ranks are the pool's workers (one device each); the episode folder must be
on a filesystem they see. Prints a JSON summary; --out writes the whole trajectory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.agent.backend import EvalBackend
    from hpc.config import EvalConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpc.agent", description=__doc__.splitlines()[0])
    p.add_argument("task", help="problem file")
    p.add_argument("replies", help="JSON list of replies, or a trajectory JSON whose replies are replayed")
    p.add_argument("--config", help="YAML agent config")
    p.add_argument("--preset", choices=("tiny", "train", "eval"))
    p.add_argument("--mode", choices=("multi_turn", "single_turn"))
    p.add_argument("--state", choices=("final", "best"), help="which state earns the reward")
    p.add_argument("--eval-config", help="YAML evaluation config")
    p.add_argument("--backend", choices=("cpu", "cuda"))
    p.add_argument("--scale", choices=("cpu", "gpu"))
    p.add_argument("--iterations", type=int, help="timed iterations")
    p.add_argument("--root", help="episode folder (default: a new temporary one); kept with --keep")
    p.add_argument("--keep", action="store_true", help="keep the episode folder")
    p.add_argument("--out", help="write the trajectory here (JSON)")
    p.add_argument("--pool", action="store_true", help="serve compile/verify/profile from MPI worker ranks")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one pool request may take")
    return p.parse_args(argv)


def run(args: argparse.Namespace, backend: EvalBackend) -> int:
    """The episode on rank 0 (or alone): replay, evaluate, report."""
    from hpc.agent.config import load_agent_config
    from hpc.agent.episode import Episode
    from hpc.agent.policy import ReplayPolicy
    from hpc.task import load_task

    cfg = load_agent_config(args.config, preset=args.preset, mode=args.mode, state=args.state)
    task = load_task(args.task)
    policy = ReplayPolicy.from_file(args.replies)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="hpc-agent-"))
    if args.root and root.exists() and any(root.iterdir()):
        raise UserError(f"--root {root}: not empty")
    episode = Episode(task, backend, cfg, root)
    try:
        while not episode.done and policy.calls < len(policy.replies):
            episode.step(policy.respond([dict(m) for m in episode.messages]))
        trajectory = episode.finish()
    finally:
        if not args.keep:
            episode.close()
    if args.out:
        Path(args.out).write_text(json.dumps(trajectory.to_dict(), indent=1))
    summary = {k: trajectory.to_dict()[k] for k in (
        "task_id", "reward", "final_reward", "end_reason", "state_selection", "selected_state", "final_state",
        "malformed_calls", "unknown_tool_calls", "bad_argument_calls", "loop_detected", "seconds")}
    summary["turns"] = len(trajectory.turns)
    summary["reason"] = trajectory.record.get("reason", "")
    served = getattr(backend, "served", None)
    if served is not None:
        summary["served_by_ranks"] = sorted(served)
    if args.keep:
        summary["root"] = str(root)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    from hpc.config import command_line_config

    args = parse_args(argv)
    rank = 0
    if args.pool:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    try:
        eval_cfg = command_line_config(args.eval_config, args.backend, args.scale, args.iterations)
        if args.pool:
            return _pool_main(args, eval_cfg)
        from hpc.agent.backend import LocalBackend

        return run(args, LocalBackend(eval_cfg))
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2


def _pool_main(args: argparse.Namespace, eval_cfg: EvalConfig) -> int:
    from mpi4py import MPI

    from hpc.agent.backend import PoolBackend, PoolClient
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.worker import pin_device, run_worker

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        if comm.Get_rank() == 0:
            print("error: --pool needs at least 2 ranks (the episode + workers)", file=sys.stderr)
        return 2
    workers = comm.Split(0 if comm.Get_rank() == 0 else 1, comm.Get_rank())
    if comm.Get_rank() != 0:
        if eval_cfg.backend == "cuda":
            pin_device(workers)
        if not run_worker(comm, 0, eval_cfg):
            _exit_now(0)
        return 0
    pool = Coordinator(comm, list(range(1, comm.Get_size())))
    try:
        code = run(args, PoolBackend(PoolClient(pool), eval_cfg, args.timeout))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    finally:
        clean = pool.close()
    if not clean:   # a lost rank: MPI_Finalize would wait for it
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""Run one agent episode with a replayed policy (a recorded trajectory or a list of replies) or with
a model behind an OpenAI-compatible chat-completions endpoint.

    python -m hpc.agent TASK REPLIES.json [--preset tiny|train|eval] [--out TRAJECTORY.json]
    python -m hpc.agent TASK --openai-base-url URL --model NAME [--api-key-env VAR] [--temperature T]
        [--top-p P] [--max-tokens N] [--request-timeout S] [--retries N]
    mpirun -n 3 python -m mpi4py -m hpc.agent TASK REPLIES.json --pool ...   # tools on the reward pool

Every tool call is executed (again) and every state (re-)evaluated: a rollout re-scored, a bug
reproduced, the environment driven end to end without a model, or an external model (a frontier
API, vLLM, `hpc serve`) run as a baseline. With --pool, rank 0 runs the episode and the other
ranks are the pool's workers (one device each); the episode folder must be on a filesystem they
see. Prints a JSON summary; --out writes the whole trajectory. An endpoint that fails mid-episode
(a 400 for a context too long, retries run out) ends it as `endpoint_error`: the summary and the
trajectory of the turns so far are written all the same, and the exit status is 1. A folder given
with --root is never removed; the temporary one made without it is, unless --keep.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.entry import exit_finalized, exit_now, exit_together, summary
from hpc.errors import UsageError, UserError
from hpc.logs import ON_EVERY_RANK, add_logging_args, setup_logging

if TYPE_CHECKING:
    from hpc.agent.backend import EvalBackend
    from hpc.config import EvalConfig

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpc.agent", description=summary(__doc__))
    p.add_argument("task", help="problem file")
    p.add_argument("replies", nargs="?",
                   help="JSON list of replies, or a trajectory JSON whose replies are replayed "
                        "(or drive a model with --openai-base-url instead)")
    api = p.add_argument_group("a model behind an OpenAI-compatible endpoint (instead of REPLIES)")
    api.add_argument("--openai-base-url", metavar="URL",
                     help="the API root, e.g. https://api.openai.com/v1 or http://127.0.0.1:8000/v1 (hpc serve)")
    api.add_argument("--model", help="the model name the endpoint knows")
    api.add_argument("--api-key-env", metavar="VAR", default="OPENAI_API_KEY",
                     help="environment variable holding the key (default OPENAI_API_KEY; unset: no key sent)")
    api.add_argument("--temperature", type=float, help="sampling temperature (default: the endpoint's)")
    api.add_argument("--top-p", type=float, help="nucleus sampling (default: the endpoint's)")
    api.add_argument("--max-tokens", type=int, help="most tokens per reply (default: the endpoint's)")
    api.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    api.add_argument("--retries", type=int, default=5,
                     help="retries of a request after connection errors, 429 and 5xx (default 5)")
    p.add_argument("--config", help="YAML agent config")
    p.add_argument("--preset", choices=("tiny", "train", "eval"))
    p.add_argument("--mode", choices=("multi_turn", "single_turn"))
    p.add_argument("--state", choices=("final", "best"), help="which state earns the reward")
    p.add_argument("--eval-config", help="YAML evaluation config")
    p.add_argument("--backend", choices=("cpu", "cuda"))
    p.add_argument("--scale", choices=("cpu", "gpu"))
    p.add_argument("--iterations", type=int, help="timed iterations")
    p.add_argument("--root", help="episode folder, never removed (default: a new temporary one, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary episode folder")
    p.add_argument("--out", help="write the trajectory here (JSON)")
    p.add_argument("--pool", action="store_true", help="serve compile/verify/profile from MPI worker ranks")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one pool request may take")
    add_logging_args(p)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Exactly one policy: REPLIES, or --openai-base-url with --model."""
    if (args.replies is None) == (args.openai_base_url is None):
        raise UsageError("give exactly one of REPLIES (a replayed policy) and --openai-base-url URL (a model)")
    if args.openai_base_url is None:
        given = [f"--{k.replace('_', '-')}" for k in ("model", "temperature", "top_p", "max_tokens")
                 if getattr(args, k) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --openai-base-url")
    elif not args.model:
        raise UsageError("--openai-base-url: --model NAME is required")


def make_policy(args: argparse.Namespace):
    """The ReplayPolicy of REPLIES, or the OpenAIChatPolicy of --openai-base-url."""
    if args.openai_base_url is None:
        from hpc.agent.policy import ReplayPolicy

        return ReplayPolicy.from_file(args.replies)
    from hpc.agent.openai_client import OpenAIChatPolicy

    return OpenAIChatPolicy(args.openai_base_url, args.model, api_key_env=args.api_key_env or None,
                            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            timeout_s=args.request_timeout, retries=args.retries)


def run(args: argparse.Namespace, backend: EvalBackend) -> int:
    """The episode on rank 0 (or alone): ask the policy, evaluate, report. 1 when the endpoint failed."""
    from hpc.agent.config import load_agent_config
    from hpc.agent.episode import Episode
    from hpc.agent.policy import ReplayPolicy
    from hpc.task import load_task

    check_args(args)
    cfg = load_agent_config(args.config, preset=args.preset, mode=args.mode, state=args.state)
    task = load_task(args.task)
    policy = make_policy(args)
    replay = isinstance(policy, ReplayPolicy)
    if args.root and Path(args.root).exists() and any(Path(args.root).iterdir()):
        raise UsageError(f"--root {args.root}: not empty")
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="hpc-agent-"))
    episode = Episode(task, backend, cfg, root)
    try:
        while not episode.done and (not replay or policy.calls < len(policy.replies)):
            episode.ask(policy)
        trajectory = episode.finish()
    finally:
        if not args.root and not args.keep:   # only the folder made here is removed
            episode.close()
    if args.out:
        Path(args.out).write_text(json.dumps(trajectory.to_dict(), indent=1))
    summary = {k: trajectory.to_dict()[k] for k in (
        "task_id", "reward", "final_reward", "end_reason", "end_detail", "state_selection", "selected_state",
        "final_state", "malformed_calls", "unknown_tool_calls", "bad_argument_calls", "loop_detected", "seconds")}
    summary["turns"] = len(trajectory.turns)
    summary["reason"] = trajectory.record.get("reason", "")
    if not replay:
        summary["usage"] = policy.usage()
    served = getattr(backend, "served", None)
    if served is not None:
        summary["served_by_ranks"] = sorted(served)
    if args.root or args.keep:
        summary["root"] = str(root)
    print(json.dumps(summary))
    if trajectory.end_reason == "endpoint_error":
        log.error("error: turn %d got no reply: %s", len(trajectory.turns) + 1, trajectory.end_detail)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from hpc.config import command_line_config

    args = parse_args(argv)
    rank = None
    if args.pool:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    setup_logging(args.verbose, args.quiet, rank)
    try:
        check_args(args)
        eval_cfg = command_line_config(args.eval_config, args.backend, args.scale, args.iterations)
        if args.pool:
            return _pool_main(args, eval_cfg)
        from hpc.agent.backend import LocalBackend
        from hpc.sandbox.prestart import prestarted_workers

        with prestarted_workers():
            return run(args, LocalBackend(eval_cfg))
    except UserError as e:   # every rank reads the same arguments and config
        log.error("error: %s", e, extra=ON_EVERY_RANK)
        return exit_together(2)


def _pool_main(args: argparse.Namespace, eval_cfg: EvalConfig) -> int:
    from mpi4py import MPI

    from hpc.agent.backend import PoolBackend, PoolClient
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.worker import pin_device, run_worker

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        log.error("error: --pool needs at least 2 ranks (the episode + workers)")
        return 2
    workers = comm.Split(0 if comm.Get_rank() == 0 else 1, comm.Get_rank())
    if comm.Get_rank() != 0:
        if eval_cfg.backend == "cuda":
            pin_device(workers)
        if not run_worker(comm, 0, eval_cfg):
            exit_now(0)
        return 0
    pool = Coordinator(comm, list(range(1, comm.Get_size())))
    try:
        code = run(args, PoolBackend(PoolClient(pool), eval_cfg, args.timeout))
    except UserError as e:
        log.error("error: %s", e)
        code = 2
    finally:
        clean = pool.close()
    if not clean:   # a lost rank: MPI_Finalize would wait for it
        exit_now(code)
    return exit_finalized(code)   # with the stopped workers


if __name__ == "__main__":
    sys.exit(main())

"""Evaluate a candidate set, or a trained policy as an agent, against a task suite, sharded over a
Slurm array through submitit.

    python jobs/evaluate.py TASKS CANDIDATES --out RUN_DIR --shards 8 [--backend cuda]
        [--partition gpu --account ACC --time 120 --gpus-per-task 1] [--executor auto|slurm|local]
    python jobs/evaluate.py TASKS --policy CKPT --out RUN_DIR --shards 8 [--samples K]
        [--mode multi_turn|single_turn] [--state best|final] [--max-turns T] [--temperature X] [--top-p P]
        [--max-response-tokens N] [--batch B] [--seed S] [...the options above]

CANDIDATES is laid out like TASKS (a workdir or single file per task id, e.g. kernels/solutions),
or is a samples file (`*.h5`, docs/formats.md: any number of generated samples per task, from any
model), whose samples are written out as candidates under RUN_DIR/samples/<task id>/<sample id>/.
With --policy, CKPT is a training run folder of jobs/train.py (its latest checkpoint) or one of its
checkpoints: each array task loads the policy and plays K agent episodes per task of its share,
recording per sample the rewarded state (best by speedup over torch.compile, or final) and the
trajectory (hpc/rl/evaluation.py, docs/rl.md).
Each array task writes RUN_DIR/shard-NNNN.h5 and skips what that file already holds, so a
requeued task (preemption, the time limit: submitit checkpoints and requeues it) or a
re-submission evaluates only what is missing. When every shard is done the shards are merged
into RUN_DIR/results.h5, every (task, candidate) or sample once, and the summary table is printed.
`--executor auto` uses Slurm where `srun` exists and local processes elsewhere.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import submitit  # noqa: E402

from hpc.entry import Parser, summary  # noqa: E402
from hpc.errors import UsageError, UserError, check_out_folder, writable_folder  # noqa: E402
from hpc.executor import add_executor_args, make_executor, wait_for_array, watch_for_sigterm  # noqa: E402
from hpc.logs import JobLogging, add_logging_args, setup_logging  # noqa: E402

log = logging.getLogger(__name__)


class EvaluateShard(JobLogging, submitit.helpers.Checkpointable):
    """One array task: its share of the items into its own HDF5 file. Checkpointable: on
    preemption or timeout submitit requeues it with the same arguments, and the file it wrote
    tells it where it stopped."""

    def __call__(self, shard: int, shards: int, items: list[tuple[str, str]], out_dir: str, cfg) -> dict:
        from hpc.config import config_to_dict
        from hpc.engine import Item, in_threads, run_items
        from hpc.results.hdf5 import RecordStore, provenance
        from hpc.suite import describe, evaluate_entry, suite_entries
        from hpc.task import load_task

        self.setup_logging()
        path = Path(out_dir) / f"shard-{shard:04d}.h5"
        mine = [item for i, item in enumerate(items) if i % shards == shard]
        tasks = {task_path: load_task(task_path) for task_path in dict.fromkeys(p for p, _ in mine)}
        entries = suite_entries([(tasks[task_path], Path(candidate) if candidate else None)
                                 for task_path, candidate in mine], "the candidates")   # a task once per sample
        preempted = watch_for_sigterm()
        with RecordStore(path, provenance(config_to_dict(cfg))) as store:
            run = run_items([Item(e.record_key(), e) for e in entries],
                            in_threads(lambda item: evaluate_entry(item.payload, cfg)), store,
                            describe=lambda item, rec: describe(rec), label=f"shard {shard}", stop=preempted,
                            stream=sys.stdout)
        if run.stopped:
            log.info("shard %d: preempted; what it had not recorded runs again after the requeue", shard)
        _exit_if_preempted(preempted)
        return {"shard": shard, "file": str(path), "evaluated": run.evaluated, "skipped": run.skipped}


class EvaluatePolicyShard(JobLogging, submitit.helpers.Checkpointable):
    """One array task of a policy evaluation (hpc.rl.evaluation): its share of the (problem file,
    sample index) items played, scored and recorded in its own HDF5 file; requeued like
    EvaluateShard, it plays only the samples that file lacks."""

    def __call__(self, shard: int, shards: int, items: list[tuple[str, int]], out_dir: str, cfg,
                 policy) -> dict:
        from hpc.rl.evaluation import evaluate_shard

        self.setup_logging()
        preempted = watch_for_sigterm()
        summary = evaluate_shard(policy, items, shard, shards, Path(out_dir), cfg, preempted)
        _exit_if_preempted(preempted)
        return summary


def _exit_if_preempted(preempted: threading.Event) -> None:
    if preempted.is_set():
        # no result for submitit to record: the requeued task (or a re-submission) finishes the shard
        sys.stdout.flush()
        os._exit(143)


def _tasks(tasks_dir: str, only: list[str] | None) -> list:
    """The suite's tasks, those whose id contains one of `only` when given."""
    from hpc.task import discover_tasks, select_tasks

    return select_tasks(discover_tasks(tasks_dir), only, tasks_dir)


def work_items(tasks: list, candidates_dir: str, out: Path) -> list[tuple[str, str]]:
    from hpc.samples import sample_candidates
    from hpc.suite import find_candidate

    if Path(candidates_dir).suffix == ".h5":
        return [(str(t.path), str(p or "")) for t, p in sample_candidates(candidates_dir, tasks, out / "samples")]
    if not Path(candidates_dir).is_dir():
        raise UsageError(f"candidates {candidates_dir}: no such folder")
    return [(str(t.path), str(find_candidate(t, Path(candidates_dir)) or "")) for t in tasks]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="jobs/evaluate.py", description=summary(__doc__))
    p.add_argument("tasks", help="folder of problem files (e.g. kernels/tasks)")
    p.add_argument("candidates", nargs="?",
                   help="folder of candidates laid out like the tasks, or a samples file (.h5); or --policy")
    p.add_argument("--out", required=True, help="run folder: shard files, submitit logs, results.h5")
    p.add_argument("--shards", type=int, default=1, help="array tasks (default 1)")
    p.add_argument("--shard", type=int, default=None,
                   help="evaluate only this shard of --shards, here and now (an array task of "
                        "slurm_templates/evaluate_array.sbatch); the analysis job merges the shards")
    p.add_argument("--only", action="append", help="task ids containing this (repeatable)")
    p.add_argument("--backend", choices=("cpu", "cuda"))
    p.add_argument("--scale", choices=("cpu", "gpu"))
    p.add_argument("--config", help="YAML evaluation config")
    p.add_argument("--iterations", type=int, help="timed iterations")
    agent = p.add_argument_group("a policy as an agent (in place of CANDIDATES)")
    agent.add_argument("--policy", metavar="CKPT",
                       help="a training run folder (its latest checkpoint) or one of its checkpoints")
    agent.add_argument("--samples", type=int, help="episodes per task (default 1)")
    agent.add_argument("--mode", choices=("multi_turn", "single_turn"), help="default multi_turn")
    agent.add_argument("--state", choices=("best", "final"),
                       help="the state that pays: best by speedup vs torch.compile (default), or final")
    agent.add_argument("--max-turns", type=int, help="default: the run's agent.max_turns")
    agent.add_argument("--max-response-tokens", type=int,
                       help="tokens per reply (default: the run's agent.max_response_tokens)")
    agent.add_argument("--temperature", type=float, help="default: the run's rollout.temperature (0: greedy)")
    agent.add_argument("--top-p", type=float, help="default: the run's rollout.top_p")
    agent.add_argument("--batch", type=int, help="episodes generated together by an array task (default 8)")
    agent.add_argument("--seed", type=int, help="sampling seed (default 0)")
    add_executor_args(p, minutes=60)
    p.add_argument("--gpus-per-task", type=int, default=0)
    p.add_argument("--parallelism", type=int, default=None, help="array tasks running at once")
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between progress lines")
    add_logging_args(p)
    return p.parse_args(argv)


POLICY_OPTIONS = ("samples", "mode", "state", "max_turns", "max_response_tokens", "temperature", "top_p", "batch",
                  "seed")


def _config(args):
    from hpc.config import command_line_config

    return command_line_config(args.config, args.backend, args.scale, args.iterations)


def _policy(args: argparse.Namespace, tasks: list, out: Path) -> tuple[Any, list[tuple[str, int]]]:
    """The policy evaluation the arguments ask for and its items: (problem file, sample index)."""
    from hpc.rl.evaluation import check_out, policy_evaluation, work_items

    given = {name: getattr(args, name) for name in POLICY_OPTIONS if getattr(args, name) is not None}
    policy = policy_evaluation(args.policy, **given)
    check_out(out, policy)
    return policy, work_items(tasks, policy.samples)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        if (args.candidates is None) == (args.policy is None):
            raise UsageError("give exactly one of CANDIDATES and --policy CKPT")
        stray = [name for name in POLICY_OPTIONS if getattr(args, name) is not None]
        if args.policy is None and stray:
            raise UsageError(f"--{stray[0].replace('_', '-')}: only with --policy")
        if args.shards < 1:
            raise UsageError(f"--shards: expected an integer >= 1, got {args.shards}")
        if args.shard is not None and not 0 <= args.shard < args.shards:
            raise UsageError(f"--shard: expected 0..{args.shards - 1}, got {args.shard}")
        cfg = _config(args)
        out = check_out_folder(args.out).resolve()
        tasks = _tasks(args.tasks, args.only)
        if args.policy is None:
            policy, items = None, work_items(tasks, args.candidates, out)
        else:
            policy, items = _policy(args, tasks, out)
        writable_folder(out)   # made only once every argument is known to be good
    except UserError as e:
        log.error("error: %s", e)
        return 2
    levels = (args.verbose, args.quiet)   # the jobs log as this command was asked to
    shard_job, extra = (EvaluateShard(*levels), ()) if policy is None else (EvaluatePolicyShard(*levels), (policy,))
    if args.shard is not None:
        try:
            summary = shard_job(args.shard, args.shards, items, str(out), cfg, *extra)
        except UserError as e:   # its results file: damaged without a journal, or unwritable (a full disk)
            log.error("error: %s", e)
            return 2
        log.info("evaluate: shard %d of %d done (%d evaluated, %d already recorded) in %s", args.shard, args.shards,
                 summary["evaluated"], summary["skipped"], summary["file"])
        return 0
    shards = min(args.shards, len(items))
    executor = make_executor(out / "submitit", args.executor, "hpc-evaluate", args.time,
                             gpus_per_task=args.gpus_per_task, cpus_per_task=args.cpus_per_task,
                             partition=args.partition, account=args.account, parallelism=args.parallelism)
    jobs = executor.map_array(shard_job, range(shards), [shards] * shards, [items] * shards,
                              [str(out)] * shards, [cfg] * shards, *([x] * shards for x in extra))
    log.info("evaluate: %d items in %d shards, %s job %s", len(items), shards, executor.cluster,
             jobs[0].job_id.split("_")[0])
    failed = wait_for_array(jobs, "evaluate", lambda s: (f"shard {s['shard']} done ({s['evaluated']} evaluated, "
                                                         f"{s['skipped']} already recorded)"), args.progress_every,
                            args.quiet)
    from hpc.results.merge import merge_files
    from hpc.suite import summary_table

    shard_files = sorted(out.glob("shard-*.h5"))
    if not shard_files:
        log.error("error: no shard produced results")
        return 1
    try:
        records = merge_files(shard_files, out / "results.h5")
    except UserError as e:   # a shard file damaged past its journal (its array task said so too)
        log.error("error: %s", e)
        return 2
    print(summary_table(records))
    log.info("evaluate: %d records in %s", len(records), out / "results.h5")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

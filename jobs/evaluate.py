"""Evaluate a candidate set against a task suite, sharded over a Slurm array through submitit.

    python jobs/evaluate.py TASKS CANDIDATES --out RUN_DIR --shards 8 [--backend cuda]
        [--partition gpu --account ACC --time 120 --gpus-per-task 1] [--executor auto|slurm|local]

CANDIDATES is laid out like TASKS (a workdir or single file per task id, e.g. kernels/solutions),
or is a samples file (`*.h5`, docs/formats.md: any number of generated samples per task, from any
model), whose samples are written out as candidates under RUN_DIR/samples/<task id>/<sample id>/.
Each array task writes RUN_DIR/shard-NNNN.h5 and skips what that file already holds, so a
requeued task (preemption, the time limit: submitit checkpoints and requeues it) or a
re-submission evaluates only what is missing. When every shard is done the shards are merged
into RUN_DIR/results.h5, every (task, candidate) once, and the summary table is printed.
`--executor auto` uses Slurm where `srun` exists and local processes elsewhere.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import submitit  # noqa: E402

from hpc.errors import UserError  # noqa: E402
from hpc.executor import add_executor_args, make_executor, wait_for_array, watch_for_sigterm  # noqa: E402
from hpc.progress import Progress  # noqa: E402


class EvaluateShard(submitit.helpers.Checkpointable):
    """One array task: its share of the items into its own HDF5 file. Checkpointable: on
    preemption or timeout submitit requeues it with the same arguments, and the file it wrote
    tells it where it stopped."""

    def __call__(self, shard: int, shards: int, items: list[tuple[str, str]], out_dir: str, cfg) -> dict:
        from hpc.candidate import load_candidate
        from hpc.config import config_to_dict
        from hpc.pipeline import evaluate
        from hpc.results.hdf5 import ResultWriter, provenance, read_records
        from hpc.results.merge import record_key
        from hpc.suite import unevaluated
        from hpc.task import load_task

        path = Path(out_dir) / f"shard-{shard:04d}.h5"
        # a harness error (status "error", e.g. a worker killed by the preemption itself) is not done
        done = {record_key(r) for r in read_records(path) if r.status != "error"} if path.exists() else set()
        mine = [item for i, item in enumerate(items) if i % shards == shard]
        evaluated = 0
        preempted = watch_for_sigterm()
        writer = ResultWriter(path, provenance(config_to_dict(cfg)))
        progress = Progress(len(mine), f"shard {shard}", sys.stdout)
        try:
            for k, (task_path, candidate_path) in enumerate(mine, 1):
                task = load_task(task_path)
                try:
                    candidate = load_candidate(candidate_path) if candidate_path else None
                except UserError as e:
                    candidate, reason = None, str(e)
                else:
                    reason = f"no candidate for {task.task_id}"
                if candidate is None:
                    rec = unevaluated(task, candidate_path, cfg, reason)
                    if record_key(rec) in done:
                        continue
                elif (task.task_id, candidate.sha256) in done:
                    continue
                else:
                    rec = evaluate(task, candidate, cfg)
                if preempted.is_set():   # Slurm is ending this task: its workers died with it
                    print(f"shard {shard}: preempted during {task.task_id}; it runs again after the requeue",
                          flush=True)
                    break
                writer.append(rec)
                evaluated += 1
                state = rec.reason if rec.failed_stage else f"reward {rec.reward:g}"
                progress.advance(f"shard {shard}: [{k}/{len(mine)}] {rec.task_id}: {state}")
        finally:
            writer.close()
            progress.close()
        if preempted.is_set():
            # no result for submitit to record: the requeued task (or a re-submission) finishes the shard
            sys.stdout.flush()
            os._exit(143)
        return {"shard": shard, "file": str(path), "evaluated": evaluated, "skipped": len(mine) - evaluated}


def work_items(tasks_dir: str, candidates_dir: str, only: list[str] | None, out: Path) -> list[tuple[str, str]]:
    from hpc.samples import sample_candidates
    from hpc.suite import find_candidate
    from hpc.task import discover_tasks

    tasks = discover_tasks(tasks_dir)
    if only:
        tasks = [t for t in tasks if any(s in t.task_id for s in only)]
    if not tasks:
        raise UserError(f"no task under {tasks_dir}" + (f" matches {only}" if only else ""))
    if Path(candidates_dir).suffix == ".h5":
        return [(str(t.path), str(p or "")) for t, p in sample_candidates(candidates_dir, tasks, out / "samples")]
    if not Path(candidates_dir).is_dir():
        raise UserError(f"candidates {candidates_dir}: no such folder")
    return [(str(t.path), str(find_candidate(t, Path(candidates_dir)) or "")) for t in tasks]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jobs/evaluate.py", description=__doc__.splitlines()[0])
    p.add_argument("tasks", help="folder of problem files (e.g. kernels/tasks)")
    p.add_argument("candidates", help="folder of candidates laid out like the tasks, or a samples file (.h5)")
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
    add_executor_args(p, minutes=60)
    p.add_argument("--gpus-per-task", type=int, default=0)
    p.add_argument("--parallelism", type=int, default=None, help="array tasks running at once")
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between progress lines")
    return p.parse_args(argv)


def _config(args):
    from hpc.config import command_line_config

    return command_line_config(args.config, args.backend, args.scale, args.iterations)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.shards < 1:
            raise UserError(f"--shards: expected an integer >= 1, got {args.shards}")
        if args.shard is not None and not 0 <= args.shard < args.shards:
            raise UserError(f"--shard: expected 0..{args.shards - 1}, got {args.shard}")
        cfg = _config(args)
        out = Path(args.out).resolve()
        items = work_items(args.tasks, args.candidates, args.only, out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.shard is not None:
        summary = EvaluateShard()(args.shard, args.shards, items, str(out), cfg)
        print(f"evaluate: shard {args.shard} of {args.shards} done ({summary['evaluated']} evaluated, "
              f"{summary['skipped']} already recorded) in {summary['file']}", file=sys.stderr, flush=True)
        return 0
    shards = min(args.shards, len(items))
    executor = make_executor(out / "submitit", args.executor, "hpc-evaluate", args.time,
                             gpus_per_task=args.gpus_per_task, cpus_per_task=args.cpus_per_task,
                             partition=args.partition, account=args.account, parallelism=args.parallelism)
    jobs = executor.map_array(EvaluateShard(), range(shards), [shards] * shards, [items] * shards,
                              [str(out)] * shards, [cfg] * shards)
    print(f"evaluate: {len(items)} items in {shards} shards, {executor.cluster} job {jobs[0].job_id.split('_')[0]}",
          file=sys.stderr, flush=True)
    failed = wait_for_array(jobs, "evaluate", lambda s: (f"shard {s['shard']} done ({s['evaluated']} evaluated, "
                                                         f"{s['skipped']} already recorded)"), args.progress_every)
    from hpc.results.merge import merge_files
    from hpc.suite import summary_table

    shard_files = sorted(out.glob("shard-*.h5"))
    if not shard_files:
        print("error: no shard produced results", file=sys.stderr)
        return 1
    records = merge_files(shard_files, out / "results.h5")
    print(summary_table(records))
    print(f"evaluate: {len(records)} records in {out / 'results.h5'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

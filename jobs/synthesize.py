"""Synthesize training tasks as a Slurm array through submitit: shards of candidates through the
filters, then a merge into one dataset.

    python jobs/synthesize.py --out RUN --count 6000 --shards 16 [--seed 0] [--benchmark KernelBench/KernelBench]
        [--backend cuda] [--config synth.yaml] [--from ops6k.jsonl [--import-only]] [--workers 4]
        [--partition gpu --account ACC --time 240 --gpus-per-task 1] [--executor auto|slurm|local]

Candidate i (composed from the seed and i, or row i of an Ops-6K file) belongs to shard i % shards.
Each array task appends its verdicts to RUN/shard-NNNN.jsonl and skips what that file already
holds, so a requeued task (preemption, the time limit: submitit checkpoints and requeues it) or a
re-submission checks only what is missing. When every shard is done they are merged into
RUN/dataset/ (task files, manifest.jsonl, manifest.h5, stats.json, report.md; docs/synthesis.md), accepted
tasks deduplicated across shards, and the per-filter table is printed. `--shard K` checks one
shard here and now (an array task of slurm_templates/synthesize.sbatch); `--merge` only merges.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import submitit  # noqa: E402

from hpc.entry import Parser, summary  # noqa: E402
from hpc.errors import UsageError, UserError, writable_folder  # noqa: E402
from hpc.executor import add_executor_args, make_executor, wait_for_array, watch_for_sigterm  # noqa: E402
from hpc.logs import JobLogging, add_logging_args, setup_logging  # noqa: E402

log = logging.getLogger(__name__)


class SynthesizeShard(JobLogging, submitit.helpers.Checkpointable):
    """One array task: its share of the candidates into its own JSONL file. Checkpointable: on
    preemption or timeout submitit requeues it with the same arguments, and the file it wrote
    tells it where it stopped."""

    def __call__(self, shard: int, shards: int, out_dir: str, cfg) -> dict:
        from hpc.synthesis.shards import run_shard

        self.setup_logging()
        summary = run_shard(cfg, shard, shards, Path(out_dir), stop=watch_for_sigterm())
        if summary["preempted"]:
            # no result for submitit to record: the requeued task (or a re-submission) finishes the shard
            log.warning("shard %d: preempted; it continues after the requeue", shard)
            sys.stdout.flush()
            os._exit(143)
        return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hpc.synthesis.config import add_arguments

    p = Parser(prog="jobs/synthesize.py", description=summary(__doc__))
    add_arguments(p)
    p.add_argument("--shards", type=int, default=1, help="array tasks (default 1)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--shard", type=int, default=None,
                      help="check only this shard of --shards, here and now (an array task of "
                           "slurm_templates/synthesize.sbatch)")
    step.add_argument("--merge", action="store_true", help="only merge the run's shard files into RUN/dataset")
    add_executor_args(p, minutes=240)
    p.add_argument("--gpus-per-task", type=int, default=0)
    p.add_argument("--parallelism", type=int, default=None, help="array tasks running at once")
    p.add_argument("--progress-every", type=float, default=30.0, help="seconds between progress lines")
    add_logging_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hpc.synthesis.config import config_from_args
    from hpc.synthesis.shards import Source, merge, read_shard, run_shard

    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        if args.shards < 1:
            raise UsageError(f"--shards: expected an integer >= 1, got {args.shards}")
        if args.shard is not None and not 0 <= args.shard < args.shards:
            raise UsageError(f"--shard: expected 0..{args.shards - 1}, got {args.shard}")
        cfg = config_from_args(args)
        out = writable_folder(args.out, make=False).resolve()
        if args.merge:
            return _report(merge(out, cfg), out)
        count = len(Source(cfg))
        for path in sorted(out.glob("shard-*.jsonl")):   # a corrupt one is an error here, not a failed array task
            read_shard(path)
        if args.shard is not None:
            summary = run_shard(cfg, args.shard, args.shards, out, stop=watch_for_sigterm())
            if summary["preempted"]:
                log.warning("synthesize: shard %d preempted; run it again to finish", args.shard)
                return 143
            log.info("synthesize: shard %d of %d done (%d checked, %d already recorded, %d accepted) in %s",
                     args.shard, args.shards, summary["checked"], summary["skipped"], summary["accepted"],
                     summary["file"])
            return 0
    except UserError as e:
        log.error("error: %s", e)
        return 2
    shards = max(1, min(args.shards, count))
    executor = make_executor(out / "submitit", args.executor, "hpc-synthesize", args.time,
                             gpus_per_task=args.gpus_per_task, cpus_per_task=args.cpus_per_task,
                             partition=args.partition, account=args.account, parallelism=args.parallelism)
    jobs = executor.map_array(SynthesizeShard(args.verbose, args.quiet), range(shards), [shards] * shards,
                              [str(out)] * shards, [cfg] * shards)
    log.info("synthesize: %d candidates in %d shards, %s job %s", count, shards, executor.cluster,
             jobs[0].job_id.split("_")[0])
    failed = wait_for_array(jobs, "synthesize", lambda s: (f"shard {s['shard']} done ({s['checked']} checked, "
                                                           f"{s['skipped']} already recorded, {s['accepted']} accepted)"),
                            args.progress_every, args.quiet)
    try:
        code = _report(merge(out, cfg), out)
    except UserError as e:
        log.error("error: %s", e)
        return 2
    return 1 if failed else code


def _report(stats: dict, out: Path) -> int:
    from hpc.synthesis.shards import print_report

    print_report(stats, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

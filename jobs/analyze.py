"""Analyze evaluation and training runs: merge shards, write a Markdown/HTML report with PNG plots and summary.json.

    python jobs/analyze.py RUN [RUN ...] --out REPORT_DIR [--tasks SUITE_DIR] [--name LABEL ...]
        [--executor none|auto|slurm|local] [--partition P --account A --time MINUTES]

RUN is a results .h5 file or a run folder: of jobs/evaluate.py, whose shard-*.h5 files are merged
into RUN/results.h5 first unless that file is newer than every shard, or of a training run, whose
train.h5 (or results.h5) holds its training metrics. Each run is labelled by --name (one per RUN, in
order), else by its file's `model` attribute, else by its folder's name. With --tasks the rates are
over that suite's tasks (a task without a record counts as incorrect); without, over the tasks the
run recorded. "Faster" uses the reward margin of the run's own config. REPORT_DIR gets report.md,
report.html, summary.json, and for runs with evaluation records fast_p.png, speedup_by_level.png and
failures.png, for runs with training metrics training.png. The report is made in this process
unless --executor submits it as one submitit job (Slurm where `srun` exists with `auto`).
Definitions: docs/analysis.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpc.analysis.runs import analyze  # noqa: E402
from hpc.entry import Parser, summary  # noqa: E402
from hpc.errors import UsageError, UserError, check_out_folder  # noqa: E402
from hpc.executor import CLUSTERS, add_executor_args, make_executor  # noqa: E402
from hpc.logs import add_logging_args, setup_logging  # noqa: E402


log = logging.getLogger(__name__)


def analyze_job(runs: list[str], out: str, tasks: str | None, names: list[str] | None, verbose: bool = False,
                quiet: bool = False) -> Path | UserError:
    """analyze() as a submitit job, logging as the submitter was asked to: bad input comes back as
    the error, so the submitter prints one line."""
    setup_logging(verbose, quiet)
    try:
        return analyze(runs, out, tasks, names)
    except UserError as e:
        return e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="jobs/analyze.py", description=summary(__doc__))
    p.add_argument("runs", nargs="+", metavar="RUN", help="results .h5 file or run folder (shard-*.h5)")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--tasks", help="the suite's folder: rates over its tasks, a task without a record incorrect")
    p.add_argument("--name", action="append", help="label of the RUN in the same position (repeat per run)")
    add_executor_args(p, minutes=30, choices=("none", *CLUSTERS), default="none")
    add_logging_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet)
        runs = [str(Path(r).resolve()) for r in args.runs]
        out = str(check_out_folder(args.out).resolve())
        tasks = str(Path(args.tasks).resolve()) if args.tasks else None
        report = analyze(runs, out, tasks, args.name) if args.executor == "none" else _submit(args, runs, out, tasks)
    except UserError as e:
        log.error("error: %s", e)
        return 2
    if report is None:
        return 1
    print(report)
    return 0


def _submit(args: argparse.Namespace, runs: list[str], out: str, tasks: str | None) -> Path | None:
    """Run analyze() as one submitit job and wait; None when the job itself failed (reported)."""
    for run in runs:   # the obvious mistakes answered here, not from a queued job
        if not Path(run).exists():
            raise UsageError(f"run {run}: no such file or folder")
    executor = make_executor(Path(out) / "submitit", args.executor, "hpc-analyze", args.time,
                             cpus_per_task=args.cpus_per_task, partition=args.partition, account=args.account)
    job = executor.submit(analyze_job, runs, out, tasks, args.name, args.verbose, args.quiet)
    log.info("analyze: %s job %s", executor.cluster, job.job_id)
    try:
        result = job.result()
    except Exception as e:   # the job itself failed (killed, timed out, crashed): its last line
        log.error("error: analysis job %s failed: %s", job.job_id, str(e).strip().splitlines()[-1][:300])
        return None
    if isinstance(result, UserError):
        raise result
    return result


if __name__ == "__main__":
    sys.exit(main())

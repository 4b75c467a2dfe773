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
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpc.analysis.metrics import DEFAULT_MARGIN, Run, make_run, summarize_run, summarize_training  # noqa: E402
from hpc.analysis.plots import plot_failures, plot_fast_p, plot_speedups, plot_training  # noqa: E402
from hpc.analysis.report import write_report  # noqa: E402
from hpc.entry import Parser  # noqa: E402
from hpc.errors import UserError, check_out_folder  # noqa: E402
from hpc.executor import CLUSTERS, add_executor_args, make_executor  # noqa: E402
from hpc.logs import add_logging_args, setup_logging  # noqa: E402
from hpc.results.hdf5 import GROUP, file_attrs, file_groups, read_records  # noqa: E402
from hpc.results.merge import merge_files, merge_records  # noqa: E402
from hpc.results.record import EvalRecord  # noqa: E402
from hpc.results.training import TRAIN_GROUP, read_steps  # noqa: E402
from hpc.task import discover_tasks  # noqa: E402


log = logging.getLogger(__name__)

TRAIN_FILE = "train.h5"     # a training run folder's metrics (jobs/train.py)


def results_files(run: Path) -> list[Path]:
    """The run's results files: the file itself; or a folder's results.h5 (its shards merged first
    when stale) and its training metrics, train.h5: either or both."""
    if run.is_file():
        return [run]
    if not run.is_dir():
        raise UserError(f"run {run}: no such file or folder")
    merged = run / "results.h5"
    shards = sorted(run.glob("shard-*.h5"))
    trained = [run / TRAIN_FILE] if (run / TRAIN_FILE).is_file() else []
    if not shards and not merged.is_file():
        if trained:
            return trained
        raise UserError(f"run {run}: empty (no results.h5, shard-*.h5 or {TRAIN_FILE})")
    if shards and (not merged.is_file() or merged.stat().st_mtime <= max(s.stat().st_mtime for s in shards)):
        records = merge_files(shards, merged)
        log.info("analyze: merged %d shards of %s into %s (%d records)", len(shards), run, merged, len(records))
    return [merged, *trained]


@dataclass
class Loaded:
    """One RUN as read: evaluation records, training metrics, or both."""
    label: str
    run: Run | None           # the evaluation records set against the suite; None for training metrics only
    steps: list[dict]         # the training steps (hpc.results.training.read_steps); empty without
    steps_source: str         # the file they came from


def load_run(run: Path, label: str | None, suite: dict[str, int] | None) -> Loaded:
    """One run, read and labelled, its records set against the suite (or its own tasks)."""
    records: list[EvalRecord] = []
    steps: list[dict] = []
    records_path = train_path = None
    for path in results_files(run):
        groups = file_groups(path)    # checks the file is HDF5 first
        if TRAIN_GROUP in groups:
            steps, train_path = read_steps(path), path
        if GROUP in groups or TRAIN_GROUP not in groups:
            # read_records checks the schema; merge_records keeps each evaluation once (a pool's
            # give-up and its later evaluation, resumed into one file, are one sample)
            records, records_path = merge_records(read_records(path)), path
    if not records and not steps:
        raise UserError(f"results {path}: no records (an empty run)")
    main = records_path if records else train_path
    attrs = file_attrs(main)
    if not label:
        label = attrs.get("model") or (main.parent.name if run.is_dir() or main.name in ("results.h5", TRAIN_FILE)
                                       else main.stem)
    if not records:
        return Loaded(label, None, steps, str(train_path))
    try:
        margin = float(json.loads(attrs.get("config") or "{}").get("reward", {}).get("margin", DEFAULT_MARGIN))
    except (ValueError, TypeError, AttributeError):   # JSONDecodeError is a ValueError
        raise UserError(f"results {main}: no readable reward margin in its config attribute") from None
    return Loaded(label, make_run(records, suite, label, margin, str(main), str(attrs.get("git_commit", ""))),
                  steps, str(train_path) if steps else "")


def analyze(runs: list[str], out: str, tasks: str | None, names: list[str] | None) -> Path:
    """Read every run, then write the plots and the report into `out`; the report's path."""
    if names and len(names) != len(runs):
        raise UserError(f"--name: {len(names)} names for {len(runs)} runs (give one per run, in order)")
    suite = {t.task_id: t.level for t in discover_tasks(tasks)} if tasks else None
    loaded = [load_run(Path(r), names[i] if names else None, suite) for i, r in enumerate(runs)]
    labels = [r.label for r in loaded]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UserError(f"runs labelled alike ({', '.join(twice)}): tell them apart with --name")
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create ({e.strerror})") from None
    evaluated = [r.run for r in loaded if r.run]
    summaries = [summarize_run(r) for r in evaluated]
    trained = [r for r in loaded if r.steps]
    images = []
    if evaluated:
        images += [plot_fast_p(evaluated, out_dir / "fast_p.png"),
                   plot_speedups(evaluated, out_dir / "speedup_by_level.png"),
                   plot_failures(summaries, out_dir / "failures.png")]
    if trained:
        images.append(plot_training([(r.label, r.steps) for r in trained], out_dir / "training.png"))
    training = [summarize_training(r.steps, r.label, r.steps_source) for r in trained]
    return write_report(out_dir, summaries, images, training)


def analyze_job(runs: list[str], out: str, tasks: str | None, names: list[str] | None) -> Path | UserError:
    """analyze() as a submitit job: bad input comes back as the error, so the submitter prints one line."""
    setup_logging()
    try:
        return analyze(runs, out, tasks, names)
    except UserError as e:
        return e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="jobs/analyze.py", description=__doc__.splitlines()[0])
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
            raise UserError(f"run {run}: no such file or folder")
    executor = make_executor(Path(out) / "submitit", args.executor, "hpc-analyze", args.time,
                             cpus_per_task=args.cpus_per_task, partition=args.partition, account=args.account)
    job = executor.submit(analyze_job, runs, out, tasks, args.name)
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

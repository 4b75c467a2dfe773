"""Runs read for analysis, and the report made from them: a results file or a run folder (an
evaluation's shards merged first when stale, a training run's train.h5), labelled and set against
a suite; then the plots and the report (jobs/analyze.py is the command; the trainer calls
`analyze` for a run's own report). Definitions: docs/analysis.md."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from hpc.analysis.metrics import DEFAULT_MARGIN, Run, make_run, summarize_run, summarize_training
from hpc.analysis.plots import plot_failures, plot_fast_p, plot_speedups, plot_training
from hpc.analysis.report import write_report
from hpc.errors import ResultsFileError, UsageError
from hpc.results.hdf5 import GROUP, file_attrs, file_groups, read_records
from hpc.results.merge import merge_files, merge_records
from hpc.results.record import EvalRecord
from hpc.results.training import TRAIN_GROUP, read_steps
from hpc.task import discover_tasks

log = logging.getLogger(__name__)

TRAIN_FILE = "train.h5"     # a training run folder's metrics (jobs/train.py)


def results_files(run: Path) -> list[Path]:
    """The run's results files: the file itself; or a folder's results.h5 (its shards merged first
    when stale) and its training metrics, train.h5: either or both."""
    if run.is_file():
        return [run]
    if not run.is_dir():
        raise ResultsFileError(f"run {run}: no such file or folder")
    merged = run / "results.h5"
    shards = sorted(run.glob("shard-*.h5"))
    trained = [run / TRAIN_FILE] if (run / TRAIN_FILE).is_file() else []
    if not shards and not merged.is_file():
        if trained:
            return trained
        raise ResultsFileError(f"run {run}: empty (no results.h5, shard-*.h5 or {TRAIN_FILE})")
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
        raise ResultsFileError(f"results {path}: no records (an empty run)")
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
        raise ResultsFileError(f"results {main}: no readable reward margin in its config attribute") from None
    return Loaded(label, make_run(records, suite, label, margin, str(main), str(attrs.get("git_commit", ""))),
                  steps, str(train_path) if steps else "")


def analyze(runs: list[str], out: str, tasks: str | None, names: list[str] | None) -> Path:
    """Read every run, then write the plots and the report into `out`; the report's path."""
    if names and len(names) != len(runs):
        raise UsageError(f"--name: {len(names)} names for {len(runs)} runs (give one per run, in order)")
    suite = {t.task_id: t.level for t in discover_tasks(tasks)} if tasks else None
    loaded = [load_run(Path(r), names[i] if names else None, suite) for i, r in enumerate(runs)]
    labels = [r.label for r in loaded]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UsageError(f"runs labelled alike ({', '.join(twice)}): tell them apart with --name")
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out_dir}: cannot create ({e.strerror})") from None
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

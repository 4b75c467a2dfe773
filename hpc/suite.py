"""Evaluate a folder of candidates against a folder of tasks and summarize.

Candidates are matched to tasks by task id: for task `level1/03_softmax` the candidate is
`<candidates>/level1/03_softmax/` (a workdir) or `<candidates>/level1/03_softmax.py` (single
file). A task without a candidate is recorded as missing (reward -1) so rates are over ALL tasks.
A malformed task is recorded as an error (no reward: no candidate is charged) and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from hpc.analysis.metrics import make_run, summarize_run
from hpc.candidate import Candidate, load_candidate
from hpc.config import EvalConfig
from hpc.errors import UserError, shown
from hpc.pipeline import evaluate
from hpc.progress import Progress
from hpc.results.record import EvalRecord
from hpc.sandbox.prestart import default_depth, prestarted_workers
from hpc.task import BadTask, Task

logger = logging.getLogger(__name__)


def find_candidate(task: Task, root: Path) -> Path | None:
    rel = Path(task.task_id)
    for path in (root / rel, root / rel.with_suffix(".py")):
        if os.path.lexists(path):   # a link loop or a FIFO is found, and fails to load with its reason
            return path
    return None


def _record(task: Task | BadTask, cfg: EvalConfig, candidate_path: str | Path | None = None) -> EvalRecord:
    return EvalRecord(task_id=task.task_id, task_level=task.level, task_sha256=getattr(task, "sha256", ""),
                      scale=cfg.scale, backend=cfg.backend, candidate_path=str(candidate_path or ""),
                      reward_kind=cfg.reward.kind, timestamp=time.time())


def unevaluated(task: Task, candidate_path: str | Path | None, cfg: EvalConfig, reason: str) -> EvalRecord:
    """The record of a task whose candidate is missing or malformed: a static failure paid the
    incorrect reward, so rates stay over ALL tasks."""
    rec = _record(task, cfg, candidate_path).fail("static", reason)
    rec.reward = cfg.reward.incorrect
    return rec


def task_error(task: BadTask, cfg: EvalConfig) -> EvalRecord:
    """The record of a suite's malformed task: the task's fault (status error, no reward), so no
    candidate is charged and the suite goes on."""
    return _record(task, cfg).fail("load", task.reason, "error")


def evaluate_safely(task: Task, candidate: Candidate, cfg: EvalConfig) -> EvalRecord:
    """`evaluate`, whose contract is to record whatever the candidate does; should the harness still
    raise, the record says so (status error) instead of one odd input stopping a batch."""
    try:
        return evaluate(task, candidate, cfg)
    except Exception as e:
        logger.debug("evaluating %s on %s raised", candidate.path, task.task_id, exc_info=True)
        rec = _record(task, cfg, candidate.path)
        rec.candidate_sha256, rec.candidate_kind = candidate.sha256, candidate.kind
        return rec.fail("load", f"harness error: {type(e).__name__}: {e}", "error")


def storable(rec: EvalRecord) -> EvalRecord:
    """The record with every text field valid UTF-8 without NUL: HDF5 strings and a terminal take
    nothing else, and a candidate controls its source, its file names and its error messages."""
    return dataclasses.replace(rec, **{f.name: shown(getattr(rec, f.name)) for f in dataclasses.fields(rec)
                                       if isinstance(getattr(rec, f.name), str)})


def evaluate_suite(tasks: list[Task | BadTask], candidates_root: Path, cfg: EvalConfig,
                   on_record: Callable[[EvalRecord], None] | None = None, jobs: int = 1) -> list[EvalRecord]:
    """Records (`storable`) in task order; `on_record` sees each as it finishes (in this thread).
    A BadTask is an error record (`task_error`), a missing or malformed candidate a failed one.

    With `jobs` > 1 that many evaluations run at once on the one device: compiles, process starts,
    baselines' torch.compile and correctness overlap, while every timed run holds the device alone
    (hpc.profile.device_lock). Worker processes of the next evaluations start while these run.
    """
    def one(task: Task | BadTask) -> EvalRecord:
        if isinstance(task, BadTask):
            return storable(task_error(task, cfg))
        path = find_candidate(task, candidates_root)
        try:
            if path is None:
                raise UserError(f"no candidate for {task.task_id} under {shown(candidates_root)}")
            candidate = load_candidate(path)
        except UserError as e:   # a missing or malformed candidate is one failed record, not a stopped suite
            return storable(unevaluated(task, path, cfg, str(e)))
        return storable(evaluate_safely(task, candidate, cfg))

    records: dict[int, EvalRecord] = {}
    jobs = max(1, min(jobs, len(tasks)))   # more at once than tasks would only start idle workers
    with prestarted_workers(default_depth(jobs)), ThreadPoolExecutor(max_workers=jobs) as pool, \
            Progress(len(tasks), "eval-suite") as progress:
        futures = {pool.submit(one, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            i = futures[future]
            rec = records[i] = future.result()
            progress.advance(one_line(f"[{len(records)}/{len(tasks)}] {rec.task_id}: {_status(rec)}"))
            if on_record is not None:
                on_record(rec)
    return [records[i] for i in range(len(tasks))]


def one_line(text: str) -> str:
    """`text` as one line for a terminal: line breaks as spaces, other control characters (a
    candidate's own messages may hold escape sequences) escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(text.splitlines()))


def _status(rec: EvalRecord) -> str:
    if rec.failed_stage:
        return f"{rec.status} at {rec.failed_stage}: {rec.reason}"
    return f"reward {rec.reward:g}, {rec.speedup_eager:.2f}x eager, {rec.speedup_compile:.2f}x compile"


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def summary_table(records: list[EvalRecord]) -> str:
    """Per-task rows, then per-level and overall: pass rate, faster-than rates, geomean speedups."""
    head = f"{'task':<36} {'reward':>6} {'cand ms':>9} {'eager ms':>9} {'compile ms':>10} {'vs eager':>8} " \
           f"{'vs compile':>10}  status"
    lines = [head, "-" * len(head)]
    for r in records:
        status = "ok" if not r.failed_stage else one_line(f"{r.failed_stage}: {r.reason}")[:60]
        lines.append(f"{one_line(r.task_id):<36} {_fmt(r.reward, 'g'):>6} {_fmt(r.candidate_ms):>9} "
                     f"{_fmt(r.eager_ms):>9} {_fmt(r.compile_ms):>10} {_fmt(r.speedup_eager, '.2f'):>8} "
                     f"{_fmt(r.speedup_compile, '.2f'):>10}  {status}")
    lines.append("")
    lines.append(f"{'group':<10} {'n':>3} {'correct':>8} {'>eager':>7} {'>compile':>9} {'geo vs eager':>13} "
                 f"{'geo vs compile':>15} {'mean reward':>12}")
    summary = summarize_run(make_run(records))
    for s in [*summary.levels.values(), summary.overall]:
        lines.append(f"{s.name:<10} {s.samples:>3} {s.pass_rate:>8.0%} {s.faster_eager:>7.0%} {s.faster_compile:>9.0%} "
                     f"{_fmt(s.geomean_eager, '.2f'):>13} {_fmt(s.geomean_compile, '.2f'):>15} "
                     f"{_fmt(s.mean_reward, '.2f'):>12}")
    return "\n".join(lines)

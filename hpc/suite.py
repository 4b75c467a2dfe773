"""Evaluate a folder of candidates against a folder of tasks and summarize.

Candidates are matched to tasks by task id: for task `level1/03_softmax` the candidate is
`<candidates>/level1/03_softmax/` (a workdir) or `<candidates>/level1/03_softmax.py` (single
file). A task without a candidate is recorded as missing (reward -1) so rates are over ALL tasks.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from hpc.analysis.metrics import make_run, summarize_run
from hpc.candidate import load_candidate
from hpc.config import EvalConfig
from hpc.errors import UserError
from hpc.pipeline import evaluate
from hpc.progress import Progress
from hpc.results.record import EvalRecord
from hpc.sandbox.prestart import default_depth, prestarted_workers
from hpc.task import Task


def find_candidate(task: Task, root: Path) -> Path | None:
    rel = Path(task.task_id)
    for path in (root / rel, root / rel.with_suffix(".py")):
        if path.exists():
            return path
    return None


def unevaluated(task: Task, candidate_path: str | Path | None, cfg: EvalConfig, reason: str) -> EvalRecord:
    """The record of a task whose candidate is missing or malformed: a static failure paid the
    incorrect reward, so rates stay over ALL tasks."""
    return EvalRecord(task_id=task.task_id, task_level=task.level, task_sha256=task.sha256, scale=cfg.scale,
                      backend=cfg.backend, candidate_path=str(candidate_path or ""), reward=cfg.reward.incorrect,
                      reward_kind=cfg.reward.kind, timestamp=time.time()).fail("static", reason)


def evaluate_suite(tasks: list[Task], candidates_root: Path, cfg: EvalConfig,
                   on_record: Callable[[EvalRecord], None] | None = None, jobs: int = 1) -> list[EvalRecord]:
    """Records in task order; `on_record` sees each as it finishes (in this thread).

    With `jobs` > 1 that many evaluations run at once on the one device: compiles, process starts,
    baselines' torch.compile and correctness overlap, while every timed run holds the device alone
    (hpc.profile.device_lock). Worker processes of the next evaluations start while these run.
    """
    def one(task: Task) -> EvalRecord:
        path = find_candidate(task, candidates_root)
        try:
            if path is None:
                raise UserError(f"no candidate for {task.task_id} under {candidates_root}")
            return evaluate(task, load_candidate(path), cfg)
        except UserError as e:   # a missing or malformed candidate is one failed record, not a stopped suite
            return unevaluated(task, path, cfg, str(e))

    records: dict[int, EvalRecord] = {}
    with prestarted_workers(default_depth(jobs)), ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            Progress(len(tasks), "eval-suite") as progress:
        futures = {pool.submit(one, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            i = futures[future]
            rec = records[i] = future.result()
            progress.advance(f"[{len(records)}/{len(tasks)}] {rec.task_id}: {_status(rec)}")
            if on_record is not None:
                on_record(rec)
    return [records[i] for i in range(len(tasks))]


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
        status = "ok" if not r.failed_stage else f"{r.failed_stage}: {r.reason}"[:60]
        lines.append(f"{r.task_id:<36} {_fmt(r.reward, 'g'):>6} {_fmt(r.candidate_ms):>9} {_fmt(r.eager_ms):>9} "
                     f"{_fmt(r.compile_ms):>10} {_fmt(r.speedup_eager, '.2f'):>8} {_fmt(r.speedup_compile, '.2f'):>10}"
                     f"  {status}")
    lines.append("")
    lines.append(f"{'group':<10} {'n':>3} {'correct':>8} {'>eager':>7} {'>compile':>9} {'geo vs eager':>13} "
                 f"{'geo vs compile':>15} {'mean reward':>12}")
    summary = summarize_run(make_run(records))
    for s in [*summary.levels.values(), summary.overall]:
        lines.append(f"{s.name:<10} {s.samples:>3} {s.pass_rate:>8.0%} {s.faster_eager:>7.0%} {s.faster_compile:>9.0%} "
                     f"{_fmt(s.geomean_eager, '.2f'):>13} {_fmt(s.geomean_compile, '.2f'):>15} "
                     f"{_fmt(s.mean_reward, '.2f'):>12}")
    return "\n".join(lines)

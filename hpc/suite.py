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
from dataclasses import dataclass
from pathlib import Path

from hpc.analysis.metrics import make_run, summarize_run
from hpc.candidate import Candidate, load_candidate
from hpc.config import EvalConfig
from hpc.errors import CandidateError, MissingCandidateError, names_out_of_memory, shown
from hpc.engine import Item, Unkept, again_alone, in_threads, run_items
from hpc.pipeline import evaluate
from hpc.results.hdf5 import RecordStore
from hpc.results.record import EvalRecord, record_key
from hpc.task import BadTask, Task

log = logging.getLogger(__name__)


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
        log.debug("evaluating %s on %s raised", candidate.path, task.task_id, exc_info=True)
        rec = _record(task, cfg, candidate.path)
        rec.candidate_sha256, rec.candidate_kind = candidate.sha256, candidate.kind
        return rec.fail("load", f"harness error: {type(e).__name__}: {e}", "error")


def storable(rec: EvalRecord) -> EvalRecord:
    """The record with every text field valid UTF-8 without NUL: HDF5 strings and a terminal take
    nothing else, and a candidate controls its source, its file names and its error messages."""
    return dataclasses.replace(rec, **{f.name: shown(getattr(rec, f.name)) for f in dataclasses.fields(rec)
                                       if isinstance(getattr(rec, f.name), str)})


@dataclass(frozen=True)
class Entry:
    """One task of a suite with what was found for it: its candidate, or why there is none."""

    task: Task | BadTask
    path: Path | None                 # where the candidate was looked for and found
    candidate: Candidate | None
    problem: str = ""                 # why there is no candidate (missing, malformed)

    def record_key(self) -> tuple[str, str]:
        """The key its record will have (hpc.results.record.record_key), known before evaluating."""
        sha = self.candidate.sha256 if self.candidate is not None else ""
        return self.task.task_id, sha or str(self.path or "")


def suite_entries(pairs: list[tuple[Task | BadTask, Path | None]], where: str) -> list[Entry]:
    """Each (task, where its candidate was found) with the candidate loaded (hashed) now, so that a
    run can skip what it recorded; `where` names the candidates' place, for the missing ones' reason.
    A task may come more than once (several samples of it)."""
    entries = []
    for task, path in pairs:
        if isinstance(task, BadTask):
            entries.append(Entry(task, None, None))
            continue
        if path is None:
            entries.append(Entry(task, None, None, f"no candidate for {task.task_id} under {where}"))
            continue
        try:
            entries.append(Entry(task, path, load_candidate(path)))
        except (CandidateError, MissingCandidateError) as e:   # one failed record, not a stopped suite
            entries.append(Entry(task, path, None, str(e)))
    return entries


def evaluate_entry(entry: Entry, cfg: EvalConfig) -> EvalRecord:
    """The entry's record (`storable`): an error record for a malformed task, a failed one for a
    missing or malformed candidate, else the evaluation's."""
    if isinstance(entry.task, BadTask):
        return storable(task_error(entry.task, cfg))
    if entry.candidate is None:
        return storable(unevaluated(entry.task, entry.path, cfg, entry.problem))
    return storable(evaluate_safely(entry.task, entry.candidate, cfg))


def describe(rec: EvalRecord) -> str:
    """How a record ended, in one line for a progress log."""
    return one_line(f"{rec.task_id}: {_status(rec)}")


def evaluate_suite(tasks: list[Task | BadTask], candidates_root: Path, cfg: EvalConfig,
                   store: RecordStore | None = None, jobs: int = 1) -> list[EvalRecord]:
    """Records (`storable`) in task order. With a `store` each is written as it finishes, and a
    task whose record (same task, same candidate) the store holds is not evaluated again: its
    record is the stored one. A BadTask is an error record (`task_error`), a missing or malformed
    candidate a failed one.

    With `jobs` > 1 that many evaluations run at once on the one device: compiles, process starts,
    baselines' torch.compile and correctness overlap, while every timed run holds the device alone
    (hpc.profile.device_lock). Worker processes of the next evaluations start while these run. One
    that ran out of memory while others ran beside it is run again alone, since the memory may have
    been theirs (`again_alone`); its record is the second run's, with the first's reason in
    `first_reason`.
    """
    entries = suite_entries([(t, None if isinstance(t, BadTask) else find_candidate(t, candidates_root))
                             for t in tasks], shown(candidates_root))
    items = [Item(e.record_key(), e) for e in entries]

    def again(item: Item[Entry], first: EvalRecord) -> EvalRecord:
        log.info("eval-suite: %s ran out of memory with other evaluations beside it (%s); evaluating it again "
                 "alone", item.payload.task.task_id, first.failed_stage)
        rec = evaluate_entry(item.payload, cfg)
        rec.first_reason = shown(f"{first.failed_stage}: {first.reason}")
        return rec

    def out_of_memory(rec: EvalRecord) -> bool:
        return rec.status != "ok" and names_out_of_memory(rec.reason)

    evaluate_one = again_alone(lambda item: evaluate_entry(item.payload, cfg), again, out_of_memory)
    run = run_items(items, in_threads(evaluate_one, jobs),
                    store if store is not None else Unkept(), describe=lambda item, rec: describe(rec),
                    label="eval-suite")
    written = {record_key(r): r for r in run.written}
    kept = store.kept() if store is not None else {}
    return [written.get(item.key) or kept[item.key] for item in items]


def one_line(text: str) -> str:
    """`text` as one line for a terminal: line breaks as spaces, other control characters (a
    candidate's own messages may hold escape sequences) escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(text.splitlines()))


def _status(rec: EvalRecord) -> str:
    if rec.failed_stage:
        return f"{rec.status} at {rec.failed_stage}: {rec.reason}"
    line = f"reward {rec.reward:g}, {rec.speedup_eager:.2f}x eager"
    return line if math.isnan(rec.speedup_compile) else f"{line}, {rec.speedup_compile:.2f}x compile"   # eager alone


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

"""Merge per-shard results files into one: every evaluation once, with the trajectories behind it.

Array tasks and pool ranks each write their own file (one writer per file); a requeued or
re-run shard may have recorded the same evaluation twice, and a request the pool gave up on may
have been finished later. The merged file keeps, per evaluation (`record_key`), the latest record
that is not a pool give-up (or the give-up when that is all there is). Shards of a policy
evaluation (hpc.rl.evaluation) also hold trajectories (/train/trajectories): the merged file keeps
the trajectory of each record it keeps, so a sample redone after a crash appears once.
"""

from __future__ import annotations

import math
import os
from itertools import groupby
from pathlib import Path

from hpc.errors import ResultsFileError
from hpc.results.hdf5 import JOURNAL_ID, ResultWriter, file_attrs, file_groups, read_records, switch_in
from hpc.results.record import EvalRecord, record_key
from hpc.results.training import TRAIN_GROUP, EvaluationWriter, read_trajectories

def merge_records(records: list[EvalRecord]) -> list[EvalRecord]:
    best: dict[tuple[str, str], EvalRecord] = {}
    for rec in records:
        key = record_key(rec)
        old = best.get(key)
        if old is None or (old.failed_stage == "pool") > (rec.failed_stage == "pool") or (
                (old.failed_stage == "pool") == (rec.failed_stage == "pool") and rec.timestamp >= old.timestamp):
            best[key] = rec
    return sorted(best.values(), key=lambda r: record_key(r))


def _kept_trajectories(shards: list[Path], records: list[EvalRecord]) -> list[tuple[int, str, dict]]:
    """The shards' trajectories of the kept records (matched by key and the record's timestamp),
    each once, as (step, stage, trajectory) in step order."""
    kept = {(record_key(r), r.timestamp) for r in records}
    out: dict[tuple, tuple[int, str, dict]] = {}
    for shard in shards:
        if TRAIN_GROUP not in file_groups(shard):
            continue
        for t in read_trajectories(shard):
            rec = t["record"]
            key = (record_key(EvalRecord(task_id=t["task_id"], candidate_sha256=rec["candidate_sha256"],
                                         candidate_path=rec["candidate_path"])), rec["timestamp"])
            if key in kept:
                if isinstance(t["reward"], float) and math.isnan(t["reward"]):
                    t["reward"] = None   # as the trajectory was given (its column holds NaN)
                out[key] = (t.pop("step"), t.pop("stage"), t)
    return sorted(out.values(), key=lambda row: row[0])


def merge_files(shards: list[str | os.PathLike], out: str | os.PathLike) -> list[EvalRecord]:
    """Write the merged records of `shards`, and the trajectories behind them where the shards
    hold any, to a new file `out` (replaced atomically)."""
    shards = [Path(s) for s in shards]
    if not shards:
        raise ResultsFileError("merge: no shard files")
    records = merge_records([r for s in shards for r in read_records(s)])
    trajectories = _kept_trajectories(shards, records)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    attrs = {k: str(v) for k, v in file_attrs(shards[0]).items() if k not in ("schema_version", "created", JOURNAL_ID)}
    attrs["merged_from"] = ",".join(str(s) for s in shards)
    writer = (EvaluationWriter if trajectories else ResultWriter)(tmp, attrs)
    try:
        for rec in records:
            writer.append(rec)
        for (step, stage), rows in groupby(trajectories, key=lambda row: row[:2]):
            writer.append_trajectories(step, stage, [row[2] for row in rows])
    finally:
        writer.close()
    switch_in(tmp, out)
    return records

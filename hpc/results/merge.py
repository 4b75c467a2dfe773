"""Merge per-shard results files into one: every (task, candidate) once.

Array tasks and pool ranks each write their own file (one writer per file); a requeued or
re-run shard may have recorded the same pair twice, and a request the pool gave up on may have
been finished later. The merged file keeps, per pair, the latest record that is not a pool
give-up (or the give-up when that is all there is).
"""

from __future__ import annotations

import os
from pathlib import Path

from hpc.errors import UserError
from hpc.results.hdf5 import ResultWriter, file_attrs, read_records
from hpc.results.record import EvalRecord


def record_key(rec: EvalRecord) -> tuple[str, str]:
    return rec.task_id, rec.candidate_sha256 or rec.candidate_path


def merge_records(records: list[EvalRecord]) -> list[EvalRecord]:
    best: dict[tuple[str, str], EvalRecord] = {}
    for rec in records:
        key = record_key(rec)
        old = best.get(key)
        if old is None or (old.failed_stage == "pool") > (rec.failed_stage == "pool") or (
                (old.failed_stage == "pool") == (rec.failed_stage == "pool") and rec.timestamp >= old.timestamp):
            best[key] = rec
    return sorted(best.values(), key=lambda r: record_key(r))


def merge_files(shards: list[str | os.PathLike], out: str | os.PathLike) -> list[EvalRecord]:
    """Write the merged records of `shards` to a new file `out` (replaced atomically)."""
    shards = [Path(s) for s in shards]
    if not shards:
        raise UserError("merge: no shard files")
    records = merge_records([r for s in shards for r in read_records(s)])
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    attrs = {k: str(v) for k, v in file_attrs(shards[0]).items() if k not in ("schema_version", "created")}
    attrs["merged_from"] = ",".join(str(s) for s in shards)
    writer = ResultWriter(tmp, attrs)
    try:
        for rec in records:
            writer.append(rec)
    finally:
        writer.close()
    tmp.replace(out)
    return records

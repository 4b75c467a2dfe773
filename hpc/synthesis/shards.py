"""Sharded, resumable synthesis runs: one JSONL file per shard, then a merge into the dataset.

Candidate i belongs to shard i % shards. A shard appends one line per candidate to
`RUN/shard-NNNN.jsonl` (after a header line naming the run) and flushes it to disk, so a shard
started again (requeued, preempted, re-submitted) reads its file, drops a torn last line and
checks only what is missing. The merge reads every shard, deduplicates accepted tasks across
shards in index order, and writes `RUN/dataset/` (levelN/<stem>.py task files, manifest.jsonl,
manifest.h5, stats.json, report.md), replacing an older one whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.engine import Item, again_alone, in_threads, run_items
from hpc.errors import DataFileError, names_out_of_memory
from hpc.synthesis.config import FILTERS, SynthesisConfig
from hpc.synthesis.filters import FilterChain
from hpc.synthesis.manifest import run_stats, stats_table, write_manifest
from hpc.synthesis.similarity import BenchmarkIndex

log = logging.getLogger(__name__)

SHARD_FORMAT = "hpc-synthesis-shard"
DATASET = "dataset"


@dataclass(frozen=True)
class Proposal:
    """A candidate task, before the filters."""

    index: int
    stem: str
    level: int
    code: str
    ops: list[str]
    data_source: str
    family: str = ""                 # composed: the input family; imported: ""
    categories: tuple[str, ...] = ()  # composed: each operator's catalog category; imported: ()

    @property
    def task_id(self) -> str:
        return f"level{self.level}/{self.stem}"


class Source:
    """Candidates by index: the rule-based composer, or the rows of an Ops-6K file."""

    def __init__(self, cfg: SynthesisConfig):
        self.cfg = cfg
        if cfg.source:
            from hpc.synthesis.ops6k import read_ops6k

            self.rows = read_ops6k(cfg.source)
            self.count = len(self.rows) if cfg.count == 0 else min(cfg.count, len(self.rows))
        else:
            self.rows = None
            self.count = cfg.count

    def __len__(self) -> int:
        return self.count

    def get(self, index: int) -> Proposal:
        if self.rows is None:
            from hpc.synthesis.compose import compose

            c = compose(self.cfg.seed, index, self.cfg.compose)
            return Proposal(index, c.stem, c.level, c.code, c.ops, self.cfg.data_source, c.family, tuple(c.categories))
        from hpc.synthesis.ops6k import task_name
        from hpc.synthesis.similarity import op_signature

        row = self.rows[index]
        if row.task_id:   # a synthesized dataset's task (--validate): its own name
            level, stem = row.task_id.split("/")
            return Proposal(index, stem, int(level.removeprefix("level")), row.code, row.ops, row.data_source)
        named = row.ops
        if not named:   # a row without `ops`: named after the operators its forward applies
            try:
                named = list(op_signature(row.code))
            except (SyntaxError, ValueError, RecursionError):
                named = []   # the load filter rejects it
        return Proposal(index, f"{index:06d}_{task_name(named)}", 1 if len(named) == 1 else 2, row.code, row.ops,
                        row.data_source)


def fingerprint(cfg: SynthesisConfig) -> str:
    """What must be the same for two runs to share shard files: all but where caches live and
    how many workers a shard uses."""
    data = cfg.to_dict()
    data.pop("workers")
    data["eval"].pop("cache_dir")
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def shard_path(out: Path, shard: int) -> Path:
    return out / f"shard-{shard:04d}.jsonl"


# the verdict's figures that are NaN where not measured: null in a shard line (JSON has no NaN)
_MEASURED = ("eager_ms", "peak_mib")
# what the merge reads of every record
_RECORD_KEYS = frozenset(("index", "stem", "task_id", "level", "accepted", "filter", "reason", "ops", "code",
                          "ast_hash", "ran", "seconds", "eager_ms", "peak_mib"))


def read_shard(path: Path) -> tuple[dict | None, list[dict], int]:
    """The header, the complete records and the byte length they span (a torn last line, from a
    shard killed mid-write, is not part of it). A line before the last that is not a record is
    corruption, not a torn write: a UserError naming the file and the line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataFileError(f"shard {path}: cannot read ({e.strerror})") from None
    header, records, good = None, [], 0
    lines = data.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if not line.endswith(b"\n"):
            break
        try:
            obj = json.loads(line)
        except ValueError:        # not JSON, or not UTF-8
            if number == len(lines):
                break
            raise DataFileError(f"shard {path} line {number}: corrupt (not a JSON record); move the file away "
                            "to check its candidates again") from None
        if header is not None and (not isinstance(obj, dict) or not _RECORD_KEYS <= obj.keys()):
            raise DataFileError(f"shard {path} line {number}: corrupt (not a candidate record); move the file away "
                            "to check its candidates again")
        if header is None:
            if not isinstance(obj, dict) or obj.get("format") != SHARD_FORMAT:
                raise DataFileError(f"shard {path}: not a synthesis shard file")
            header = obj
        else:
            records.append(obj)
        good += len(line)
    return header, records, good


def _header(cfg: SynthesisConfig, shard: int, shards: int, count: int) -> dict:
    return {"format": SHARD_FORMAT, "version": 1, "shard": shard, "shards": shards, "count": count,
            "fingerprint": fingerprint(cfg), "config": cfg.to_dict()}


def _check_header(path: Path, header: dict, expected: dict, keys: tuple[str, ...] = ("shards", "count", "fingerprint")
                  ) -> None:
    for key in keys:
        if header.get(key) != expected[key]:
            raise DataFileError(f"shard {path}: written by a different run ({key} {header.get(key)!r}, this run "
                                f"{expected[key]!r}); use a new output folder")


class ShardFile:
    """A shard's JSONL file as the store of its run (hpc.engine): one line per checked candidate,
    fsync'd before the next, keyed by the candidate's index."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.records: list[dict] = []
        if path.exists():
            found, self.records, good = read_shard(path)
            if found is None:
                path.unlink()
            else:
                _check_header(path, found, header, ("shard", "shards", "count", "fingerprint"))
                with open(path, "r+b") as f:
                    f.truncate(good)   # a torn last line, from a shard killed mid-write
        if not path.exists():
            path.write_text(json.dumps(header) + "\n")
        self.accepted = 0

    def finished(self) -> set[int]:
        return {rec["index"] for rec in self.records}

    def append(self, item, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.accepted += rec["accepted"]


def run_shard(cfg: SynthesisConfig, shard: int, shards: int, out: Path,
              stop: threading.Event | None = None, deadline: float | None = None) -> dict:
    """Filter this shard's candidates not yet in its file. With `stop` set (SIGTERM from Slurm),
    no further candidate starts and none in flight is recorded (its workers may have been killed
    with the job): the requeued shard checks them again. Past `deadline` (on time.monotonic(): a
    time budget) no further candidate starts either, but those in flight finish and are recorded;
    "cut_by_deadline" in the summary says candidates were left for a later run. The evaluation
    workers' processes start ahead (hpc.sandbox.prestart) where the machine has the cores.

    A candidate rejected for running out of memory (hpc.errors.names_out_of_memory) while another ran
    beside it is checked once more alone (hpc.engine.again_alone), and that verdict is its record
    (`rechecked_alone`, the first one's filter and reason in `first_reason`): the memory may have
    been the neighbour's. It is recorded once, with its final verdict, like any other."""
    source = Source(cfg)
    out.mkdir(parents=True, exist_ok=True)
    store = ShardFile(shard_path(out, shard), _header(cfg, shard, shards, len(source)))
    benchmark = BenchmarkIndex(cfg.benchmark) if cfg.benchmark and "contaminated" not in cfg.filters.skip else None
    chain = FilterChain(cfg, benchmark)
    for rec in store.records:
        if rec["accepted"]:
            chain.remember(rec["ast_hash"], rec["index"])
    stop = stop or threading.Event()
    cut = threading.Event()

    def record(index: int) -> dict:
        """The candidate's verdict as its shard line."""
        proposal = source.get(index)
        t0 = time.monotonic()
        verdict = chain.check(index, proposal.code, proposal.stem)
        return {
            "index": index, "stem": proposal.stem, "level": proposal.level, "task_id": proposal.task_id,
            "ops": proposal.ops, "data_source": proposal.data_source, "family": proposal.family,
            "categories": list(proposal.categories), "code": proposal.code,
            **dataclasses.asdict(verdict),
            **{k: None if math.isnan(getattr(verdict, k)) else getattr(verdict, k) for k in _MEASURED},
            "wall_s": round(time.monotonic() - t0, 3), "rechecked_alone": False, "first_reason": ""}

    def check(item: Item[int]) -> dict | None:
        """The candidate's shard line; None when the time budget is spent or the shard stopped."""
        if deadline is not None and time.monotonic() >= deadline:
            cut.set()
            return None
        if stop.is_set():   # it waited behind a re-check
            return None
        return record(item.payload)

    def recheck(item: Item[int], first: dict) -> dict | None:
        """The line of a candidate checked again alone, which ran out of memory beside another."""
        log.info("shard %d: %s ran out of memory with other candidates beside it (%s); checking it again alone",
                 shard, first["stem"], first["filter"])
        if stop.is_set():
            return None
        again = record(item.payload)
        return {**again, "wall_s": round(first["wall_s"] + again["wall_s"], 3), "rechecked_alone": True,
                "first_reason": f"{first['filter']}: {first['reason']}"}

    def describe(item: Item[int], rec: dict) -> str:
        return f"{rec['stem']}: " + ("accepted" if rec["accepted"] else f"{rec['filter']}: {rec['reason'][:160]}")

    def out_of_memory(line: dict) -> bool:
        return not line["accepted"] and names_out_of_memory(line["reason"])

    run = run_items([Item(i, i) for i in range(shard, len(source), shards)],
                    in_threads(again_alone(check, recheck, out_of_memory), cfg.workers), store, describe=describe,
                    label=f"shard {shard}", stop=stop, progress_every_s=30.0)
    return {"shard": shard, "file": str(store.path), "checked": run.evaluated, "skipped": run.skipped,
            "accepted": store.accepted, "preempted": run.stopped, "cut_by_deadline": cut.is_set()}


def _read_run(out: Path, cfg: SynthesisConfig | None) -> tuple[list[dict], list[dict]]:
    """Every shard's header, each checked against the first (and `cfg`), and all their records."""
    files = sorted(out.glob("shard-*.jsonl"))
    if not files:
        raise DataFileError(f"run {out}: no shard files (shard-*.jsonl) to merge")
    headers, records = {}, []
    for path in files:
        header, recs, _ = read_shard(path)
        if header is None:
            raise DataFileError(f"shard {path}: empty")
        headers[path] = header
        records += recs
    first = next(iter(headers.values()))
    for path, header in headers.items():
        _check_header(path, header, first)
    if cfg is not None and fingerprint(cfg) != first["fingerprint"]:
        raise DataFileError(f"run {out}: its shards were written with a different config than this one")
    return list(headers.values()), records


def _verdicts(records: list[dict], config: dict) -> list[dict]:
    """The records (in index order) as the dataset holds them: accepted duplicates rejected
    (`_dedup`), eager_ms and peak_mib NaN where not measured."""
    if "duplicate" not in config["filters"]["skip"]:
        _dedup(records)
    for rec in records:
        for key in _MEASURED:
            rec[key] = math.nan if rec[key] is None else rec[key]
    return records


def _run_fields(header: dict) -> dict[str, str | int]:
    """What names the run in the manifest and stats.json."""
    config = header["config"]
    return {"seed": config["seed"], "count": header["count"], "source": config["source"] or "composer",
            "backend": config["eval"]["backend"], "scale": config["eval"]["scale"], "shards": header["shards"]}


def merge(out: Path, cfg: SynthesisConfig | None = None) -> dict:
    """Every shard's records into RUN/dataset; the statistics (also in dataset/stats.json)."""
    headers, records = _read_run(out, cfg)
    first = headers[0]
    shards, count = first["shards"], first["count"]
    missing_shards = sorted(set(range(shards)) - {h["shard"] for h in headers})
    if missing_shards:
        raise DataFileError(f"run {out}: shard(s) {', '.join(map(str, missing_shards))} of {shards} have no file yet")
    by_index = {r["index"]: r for r in records}
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        shard_list = sorted({i % shards for i in missing})
        raise DataFileError(f"run {out}: {len(missing)} of {count} candidates not checked yet (shard(s) "
                            f"{', '.join(map(str, shard_list))}); run them again")
    config = first["config"]
    records = _verdicts([by_index[i] for i in range(count)], config)
    dataset = out / DATASET
    partial = out / f"{DATASET}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for rec in records:
        if rec["accepted"]:
            target = partial / f"{rec['task_id']}.py"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rec["code"])
    from hpc.results.hdf5 import provenance

    stats = write_manifest(partial, records, FILTERS, _run_fields(first), provenance(config))
    if dataset.exists():
        shutil.rmtree(dataset)
    partial.rename(dataset)
    return stats


def checked_stats(out: Path, cfg: SynthesisConfig | None = None) -> tuple[dict, list[dict]]:
    """The statistics the merge writes, and the records as in the manifest, over the candidates
    checked so far: for a run cut short, which `merge` refuses."""
    headers, records = _read_run(out, cfg)
    by_index = {r["index"]: r for r in records}
    records = _verdicts([by_index[i] for i in sorted(by_index)], headers[0]["config"])
    return run_stats(records, FILTERS, _run_fields(headers[0])), records


def _dedup(records: list[dict]) -> None:
    """Accepted tasks with the same normalized AST: the lowest index stays (the same whichever
    shard or worker checked them first)."""
    seen: dict[str, str] = {}
    for rec in records:
        if not rec["accepted"]:
            continue
        if rec["ast_hash"] in seen:
            rec.update(accepted=False, filter="duplicate", kind="same AST", reason=f"duplicate of {seen[rec['ast_hash']]} "
                                                                  "(same normalized AST)")
            if "duplicate" not in rec["ran"]:
                rec["ran"].append("duplicate")
        else:
            seen[rec["ast_hash"]] = rec["task_id"]


def run_local(cfg: SynthesisConfig, out: Path) -> dict:
    """The whole pipeline in this process: one shard, then the merge."""
    run_shard(cfg, 0, 1, out)
    return merge(out, cfg)


def print_report(stats: dict, out: Path) -> None:
    """The per-filter table on stdout (the run's result) and the one-line outcome logged."""
    print(stats_table(stats))
    log.info("synthesize: %d of %d candidates accepted into %s (quality report: %s)", stats["accepted"],
             stats["candidates"], out / DATASET, out / DATASET / "report.md")

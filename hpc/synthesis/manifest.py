"""The dataset manifest: every candidate's verdict and the per-filter statistics.

Written by the merge into the dataset folder:

- `manifest.jsonl`: one line per accepted task, Ops-6K's fields first (`code`, `ops`,
  `data_source`), then ours (`task_id`, `path`, `index`, `level`, `eager_ms`, `peak_mib`,
  `ast_hash`, `signature`);
- `manifest.h5`: group `candidates` (one row per candidate, accepted or not, with the filter that
  rejected it and why) and group `filters` (per filter: entered, rejected, passed, seconds), file
  attributes naming the run (docs/synthesis.md has the layout);
- `stats.json`: the same statistics as JSON, with the quality report's figures (`quality`);
- `report.md`: the quality report: per-filter table, rejections by filter and kind, the accepted
  tasks' op mix (families, categories, first operators, composition lengths), their output
  statistics, eager times and peak memory.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np

from hpc.errors import DataFileError
from hpc.results.columns import Column, column_dtype, describe

FORMAT = "hpc-synthesis-manifest"
FORMAT_VERSION = 3   # 2: kind, family, categories, outputs columns; the rejections group. 3: peak_mib
_STR = h5py.string_dtype("utf-8")
# the candidates group's columns, one row per candidate (JSON-encoded lists and dicts are strings)
CANDIDATE_COLUMNS = (
    Column("index", int, "1", "the candidate's index in the run"),
    Column("task_id", str, "", "the task id it would have (levelN/<stem>)"),
    Column("stem", str, "", "its file name without .py"),
    Column("level", int, "1", "its KernelBench level (1: one operator, 2: a fused sequence)"),
    Column("accepted", bool, "", "it passed every filter"),
    Column("filter", str, "", "the filter that rejected it; empty when accepted"),
    Column("kind", str, "", "the class of the reason (what the report counts); empty when accepted"),
    Column("reason", str, "", "why that filter rejected it"),
    Column("ops", str, "", "the torch APIs it composes, in order", json=True),
    Column("data_source", str, "", "where it came from: hpc-synthesis, or an imported row's source"),
    Column("family", str, "", "the composer's input family (matrix, image, tokens...); empty when imported"),
    Column("categories", str, "", "each operator's catalog category, in order; [] when imported", json=True),
    Column("code", str, "", "the KernelBench problem file"),
    Column("ast_hash", str, "", "a hash of its syntax tree (duplicates share it)"),
    Column("signature", str, "", "its inputs' and outputs' shapes and dtypes", json=True),
    Column("outputs", str, "", "per output on the default inputs: shape, mean, std, variation (std / (|mean| + std)); "
                               "empty where the reference did not run", json=True),
    Column("eager_ms", float, "ms", "eager PyTorch's time per call at the run's scale; NaN where not timed"),
    Column("peak_mib", float, "MiB", "the eager run's peak memory at the run's scale (GPU allocator on cuda, growth of "
                                     "the resident set on cpu); NaN where the reference did not run"),
    Column("seconds", str, "", "seconds each filter took on it, by filter", json=True),
    Column("ran", str, "", "the filters it went through, in order", json=True))
COLUMNS = {c.name: column_dtype(c.type) for c in CANDIDATE_COLUMNS}
_JSON_COLUMNS = tuple(c.name for c in CANDIDATE_COLUMNS if c.json)
# the filters group's columns, one row per filter in chain order
FILTER_COLUMNS = (
    Column("name", str, "", "the filter"),
    Column("entered", int, "1", "candidates it ran on"),
    Column("rejected", int, "1", "candidates it rejected"),
    Column("passed", int, "1", "candidates it passed"),
    Column("seconds", float, "s", "its time over every candidate it ran on"))
# the rejections group's columns, one row per (filter, kind) in chain order, then most rejected first
REJECTION_COLUMNS = (
    Column("filter", str, "", "the filter"),
    Column("kind", str, "", "the class of the reasons it gave"),
    Column("count", int, "1", "candidates it rejected for that"),
    Column("example", str, "", "the reason given to the first of them"))


@dataclass
class FilterStats:
    name: str
    entered: int = 0
    rejected: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return self.entered - self.rejected


def filter_stats(records: list[dict], filters: tuple[str, ...]) -> list[FilterStats]:
    """Per filter, in chain order: candidates it ran on, those it rejected, and its seconds."""
    stats = {name: FilterStats(name) for name in filters}
    for rec in records:
        for name in rec["ran"]:
            stats[name].entered += 1
        if not rec["accepted"]:
            stats[rec["filter"]].rejected += 1
        for name, seconds in rec["seconds"].items():
            stats[name].seconds += seconds
    return list(stats.values())


def rejections(records: list[dict], filters: tuple[str, ...]) -> list[dict]:
    """Rejected candidates counted by filter (chain order) and kind (most first), each with the
    first one's reason as an example."""
    rows: dict[tuple[str, str], dict] = {}
    for rec in records:
        if not rec["accepted"]:
            key = (rec["filter"], rec.get("kind", ""))
            row = rows.setdefault(key, {"filter": key[0], "kind": key[1], "count": 0, "example": rec["reason"]})
            row["count"] += 1
    return sorted(rows.values(), key=lambda r: (filters.index(r["filter"]), -r["count"], r["kind"]))


def _histogram(values: list, by_value: bool = False) -> dict:
    """Counts by value, most first (then by value) or in order of value, as a JSON object."""
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    order = sorted(counts.items(), key=lambda kv: kv[0] if by_value else (-kv[1], str(kv[0])))
    return {str(k): n for k, n in order}


def _spread(values: list[float]) -> dict:
    """min, median, max of the finite values (none: an empty object)."""
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if not finite:
        return {}
    return {"min": finite[0], "median": float(np.median(finite)), "max": finite[-1], "n": len(finite)}


def quality(records: list[dict]) -> dict:
    """The accepted tasks' mix and outputs: input families, operator categories (every
    operator), first operators, composition lengths; per output its variation and element count;
    eager times and peak memory."""
    kept = [r for r in records if r["accepted"]]
    outputs = [o for r in kept for o in r.get("outputs", [])]
    return {"families": _histogram([r.get("family") or "imported" for r in kept]),
            "categories": _histogram([c for r in kept for c in r.get("categories", [])]),
            "first_operators": _histogram([r["ops"][0] if r["ops"] else "?" for r in kept]),
            "lengths": _histogram([len(r["ops"]) for r in kept], by_value=True),
            "variation": _spread([o["variation"] for o in outputs]),
            "output_elements": _spread([float(math.prod(o["shape"])) for o in outputs]),
            "eager_ms": _spread([r["eager_ms"] for r in kept]),
            "peak_mib": _spread([r["peak_mib"] for r in kept])}


def summary(records: list[dict], filters: tuple[str, ...]) -> dict:
    accepted = sum(r["accepted"] for r in records)
    return {"candidates": len(records), "accepted": accepted,
            "yield": accepted / len(records) if records else 0.0,
            "candidate_seconds": round(sum(sum(r["seconds"].values()) for r in records), 3),
            "filters": [{**asdict(s), "passed": s.passed, "seconds": round(s.seconds, 3)}
                        for s in filter_stats(records, filters)],
            "rejections": rejections(records, filters),
            "quality": quality(records)}


def stats_table(stats: dict) -> str:
    """The per-filter table printed at the end of a run (and the report's first table)."""
    lines = ["| filter | entered | rejected | passed | seconds |", "|---|---:|---:|---:|---:|"]
    for f in stats["filters"]:
        if f["entered"]:
            lines.append(f"| {f['name']} | {f['entered']} | {f['rejected']} | {f['passed']} | {f['seconds']:.1f} |")
    lines.append(f"| **accepted** | {stats['candidates']} | {stats['candidates'] - stats['accepted']} | "
                 f"{stats['accepted']} ({100 * stats['yield']:.1f}%) | {stats['candidate_seconds']:.1f} |")
    return "\n".join(lines)


def _cell(text: str, width: int = 100) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


_ROWS = 12   # the most rows a histogram of the report shows (the rest summed in one)


def report_markdown(stats: dict) -> str:
    """report.md: what a person checks before training on the dataset."""
    q = stats["quality"]
    lines = ["# Synthesis quality report", "",
             f"seed {stats['seed']}, {stats['candidates']} candidates ({stats['source']}), backend {stats['backend']}, "
             f"scale {stats['scale']}, {stats['shards']} shard(s): {stats['accepted']} accepted "
             f"({100 * stats['yield']:.1f}%).", "", "## Filters", "", stats_table(stats), "",
             "## Rejections by reason", ""]
    if stats["rejections"]:
        lines += ["| filter | kind | rejected | example |", "|---|---|---:|---|"]
        lines += [f"| {r['filter']} | {r['kind'] or '-'} | {r['count']} | {_cell(r['example'])} |"
                  for r in stats["rejections"]]
    else:
        lines.append("None.")
    lines += ["", "## The accepted tasks' mix", ""]
    total = sum(q["categories"].values())
    for title, key, of in (("input family", "families", stats["accepted"]), ("category", "categories", total),
                           ("first operator", "first_operators", stats["accepted"]),
                           ("operators", "lengths", stats["accepted"])):
        rows = list(q[key].items())
        lines += [f"| {title} | count | share |", "|---|---:|---:|"]
        lines += [f"| {k} | {n} | {100 * n / of:.0f}% |" for k, n in rows[:_ROWS]] or ["| - | 0 | |"]
        if len(rows) > _ROWS:
            rest = sum(n for _, n in rows[_ROWS:])
            lines.append(f"| {len(rows) - _ROWS} others | {rest} | {100 * rest / of:.0f}% |")
        lines.append("")
    lines += ["## The accepted tasks' outputs, eager time and peak memory", "",
              "| per | statistic | min | median | max |", "|---|---|---:|---:|---:|"]
    for per, name, key in (("output", "variation, std / (\\|mean\\| + std)", "variation"),
                           ("output", "elements", "output_elements"),
                           ("task", f"eager ms at the {stats['scale']} scale", "eager_ms"),
                           ("task", f"peak memory MiB at the {stats['scale']} scale", "peak_mib")):
        spread = q[key]
        lines.append(f"| {per} | {name} | " + (" | ".join(f"{spread[k]:.4g}" for k in ("min", "median", "max"))
                                                if spread else "- | - | -") + " |")
    return "\n".join(lines) + "\n"


def run_stats(records: list[dict], filters: tuple[str, ...], run: dict[str, str | int]) -> dict:
    """stats.json: the run, then the summary of its candidates (also of those checked so far, for
    a run cut short)."""
    return {**run, **summary(records, filters)}


def write_manifest(folder: Path, records: list[dict], filters: tuple[str, ...], run: dict[str, str | int],
                   attrs: dict[str, str]) -> dict:
    """manifest.jsonl, manifest.h5 and stats.json into `folder`; returns the statistics. `run`
    names the run (seed, count, source, backend, scale, shards): in both files; `attrs`
    (provenance: commit, versions, config) only in the HDF5 file."""
    stats = run_stats(records, filters, run)
    with open(folder / "manifest.jsonl", "w") as f:
        for r in records:
            if r["accepted"]:
                f.write(json.dumps({"code": r["code"], "ops": r["ops"], "data_source": r["data_source"],
                                    "task_id": r["task_id"], "path": f"{r['task_id']}.py", "index": r["index"],
                                    "level": r["level"], "eager_ms": _json_float(r["eager_ms"]),
                                    "peak_mib": _json_float(r["peak_mib"]),
                                    "ast_hash": r["ast_hash"], "signature": r["signature"]}) + "\n")
    (folder / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (folder / "report.md").write_text(report_markdown(stats))
    with h5py.File(folder / "manifest.h5", "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for key, value in {**attrs, **run}.items():
            f.attrs[key] = value
        group = f.create_group("candidates")
        group.attrs["count"] = len(records)
        for name, dtype in COLUMNS.items():
            values = [json.dumps(r[name]) if name in _JSON_COLUMNS else r[name] for r in records]
            group.create_dataset(name, data=np.array(values, dtype=dtype), dtype=dtype)
        describe(group, CANDIDATE_COLUMNS)
        fgroup = f.create_group("filters")
        rows = filter_stats(records, filters)
        fgroup.create_dataset("name", data=np.array([s.name for s in rows], dtype=_STR), dtype=_STR)
        for key in ("entered", "rejected", "passed"):
            fgroup.create_dataset(key, data=np.array([getattr(s, key) for s in rows], dtype=np.int64))
        fgroup.create_dataset("seconds", data=np.array([s.seconds for s in rows], dtype=np.float64))
        describe(fgroup, FILTER_COLUMNS)
        rgroup = f.create_group("rejections")
        rows = stats["rejections"]
        for c in REJECTION_COLUMNS:
            dtype = _STR if c.type is str else np.int64
            rgroup.create_dataset(c.name, data=np.array([r[c.name] for r in rows], dtype=dtype), dtype=dtype)
        describe(rgroup, REJECTION_COLUMNS)
    return stats


def _json_float(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def read_manifest(path: str | os.PathLike) -> tuple[list[dict], list[FilterStats], dict]:
    """Candidates (as dicts, JSON columns decoded), filter statistics and file attributes."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataFileError(f"manifest {path}: cannot read as HDF5 ({e})") from None
    with f:
        if f.attrs.get("format") != FORMAT or "candidates" not in f or "filters" not in f:
            raise DataFileError(f"manifest {path}: not an {FORMAT} file")
        group = f["candidates"]
        missing = [c for c in COLUMNS if c not in group]
        if missing:
            raise DataFileError(f"manifest {path}: malformed, missing columns {', '.join(missing)}")
        columns = {c: group[c][:] for c in COLUMNS}
        records = []
        for i in range(int(group.attrs["count"])):
            rec = {}
            for name in COLUMNS:
                v = columns[name][i]
                v = v.decode() if isinstance(v, bytes) else v.item() if isinstance(v, np.generic) else v
                rec[name] = json.loads(v) if name in _JSON_COLUMNS else v
            records.append(rec)
        fg = f["filters"]
        stats = [FilterStats(n.decode(), int(e), int(r), float(s)) for n, e, r, s in
                 zip(fg["name"][:], fg["entered"][:], fg["rejected"][:], fg["seconds"][:])]
        attrs = {k: (v.decode() if isinstance(v, bytes) else v.item() if isinstance(v, np.generic) else v)
                 for k, v in f.attrs.items()}
    return records, stats, attrs

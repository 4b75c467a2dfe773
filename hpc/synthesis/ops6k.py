"""Reading an existing Ops-6K-style dataset (JSONL, or parquet through pyarrow) as candidate tasks.

Each row is an object with `code` (a KernelBench problem file: Model, get_inputs,
get_init_inputs) and optionally `ops` (the operators it fuses: a list, or a string holding one)
and `data_source`. Rows become candidates of the same pipeline as composed ones: through the
filters, or straight into the task format with every filter but `load` skipped (`--import-only`).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import DataFileError


_TASK_ID = re.compile(r"level[1-9]/[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Row:
    code: str
    ops: list[str]
    data_source: str
    task_id: str = ""      # a synthesized dataset's manifest.jsonl names its tasks (levelN/<stem>): kept


def read_ops6k(path: str | Path) -> list[Row]:
    """Every row of the file; a malformed row is a one-line error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"ops6k {path}: no such file")
    if path.suffix == ".parquet":
        records = _read_parquet(path)
        where = "row"
    elif path.suffix in (".jsonl", ".json"):
        records = _read_jsonl(path)
        where = "line"
    else:
        raise DataFileError(f"ops6k {path}: expected a .jsonl or .parquet file")
    rows = []
    for number, record in records:
        if not isinstance(record, dict) or not isinstance(record.get("code"), str) or not record["code"].strip():
            raise DataFileError(f"ops6k {path} {where} {number}: expected an object with a non-empty string 'code'")
        source = record.get("data_source", "")
        task_id = record.get("task_id")
        rows.append(Row(record["code"], _ops(record.get("ops"), path, where, number),
                        str(source) if source is not None else "",
                        task_id if isinstance(task_id, str) and _TASK_ID.fullmatch(task_id) else ""))
    if not rows:
        raise DataFileError(f"ops6k {path}: no rows")
    return rows


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataFileError(f"ops6k {path}: not UTF-8 text ({e.reason})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataFileError(f"ops6k {path} line {number}: not valid JSON ({e.msg})") from None
    return out


def _read_parquet(path: Path) -> list[tuple[int, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataFileError(f"ops6k {path}: reading parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to JSONL") from None
    try:
        table = pq.read_table(path)
    except Exception as e:   # pyarrow's own errors: not a parquet file, truncated, ...
        raise DataFileError(f"ops6k {path}: cannot read as parquet ({str(e).splitlines()[0]})") from None
    return list(enumerate(table.to_pylist(), 1))


def _ops(value: object, path: Path, where: str, number: int) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                try:
                    value = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    raise DataFileError(f"ops6k {path} {where} {number}: 'ops' is not a list") from None
        else:
            return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise DataFileError(f"ops6k {path} {where} {number}: 'ops' must be a list of strings")


def task_name(ops: list[str], fallback: str = "task") -> str:
    """A file-name-safe name from the operators (`["nn.Conv2d", "torch.relu"]` -> `Conv2d_relu`)."""
    parts = [re.sub(r"[^A-Za-z0-9]+", "", op.rsplit(".", 1)[-1]) for op in ops]
    name = "_".join(p for p in parts if p)[:80]
    return name or fallback

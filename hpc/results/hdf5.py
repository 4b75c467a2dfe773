"""The one HDF5 writer and reader of evaluation records.

Layout: group /records holds one resizable 1-D dataset per EvalRecord field (columnar, so an
analysis job reads a column without touching the rest) and the attribute `count`, the number of
complete records. Appending extends every column, writes the row, then bumps `count` and
flushes: a reader trusts only the first `count` rows, so a crash mid-append leaves every
finished record readable. The file is opened with the latest format in SWMR mode, so a live
reader (`h5py.File(path, "r", swmr=True)`) can follow a running evaluation.
"""

from __future__ import annotations

import json
import os
import time
import typing
from pathlib import Path

import h5py
import numpy as np

from hpc.errors import UserError
from hpc.results.record import FIELDS, EvalRecord

SCHEMA_VERSION = 2
ADDED_IN = {"candidate_host_ms": 2, "stage_seconds": 2}     # columns newer than version 1: older files read them as defaults
GROUP = "records"
_STR = h5py.string_dtype("utf-8")
_FLOATS = h5py.vlen_dtype(np.float64)


def _dtype(tp) -> object:
    tp = typing.get_origin(tp) or tp
    if tp is bool or tp == "bool":
        return np.bool_
    if tp is int or tp == "int":
        return np.int64
    if tp is float or tp == "float":
        return np.float64
    if tp is list or str(tp).startswith("list"):
        return _FLOATS
    return _STR


class ResultWriter:
    """Appends EvalRecords to one HDF5 file (one writer per file). Use as a context manager."""

    def __init__(self, path: str | os.PathLike, attrs: dict[str, str] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.file = h5py.File(self.path, "a", libver="latest")
        except OSError as e:
            raise UserError(f"results {self.path}: cannot open for writing ({e})") from None
        if len(self.file.keys()) == 0 and len(self.file.attrs) == 0:
            group = self.file.create_group(GROUP)
            for f in FIELDS:
                group.create_dataset(f.name, shape=(0,), maxshape=(None,), dtype=_dtype(f.type), chunks=(64,))
            group.attrs["count"] = 0
            self.file.attrs["schema_version"] = SCHEMA_VERSION
            self.file.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        else:
            try:
                _check_schema(self.file, self.path)
                if self.file.attrs.get("schema_version") != SCHEMA_VERSION:
                    raise UserError(f"results {self.path}: written with schema version "
                                    f"{self.file.attrs.get('schema_version')}; new results go to a new file")
            except UserError:
                self.file.close()
                raise
        for key, value in (attrs or {}).items():
            self.file.attrs[key] = value
        self.group = self.file[GROUP]
        self.file.swmr_mode = True

    def append(self, record: EvalRecord) -> None:
        n = int(self.group.attrs["count"])
        for f in FIELDS:
            ds = self.group[f.name]
            if ds.shape[0] < n + 1:
                ds.resize((n + 1,))
            value = getattr(record, f.name)
            ds[n] = np.asarray(value, dtype=np.float64) if _dtype(f.type) is _FLOATS else value
        self.group.attrs["count"] = n + 1
        self.file.flush()

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_schema(f: h5py.File, path: Path) -> None:
    version = f.attrs.get("schema_version")
    if GROUP not in f or not isinstance(version, (int, np.integer)) or not 1 <= version <= SCHEMA_VERSION:
        raise UserError(f"results {path}: not an hpc results file of schema version 1..{SCHEMA_VERSION}")
    missing = [fd.name for fd in FIELDS if fd.name not in f[GROUP] and ADDED_IN.get(fd.name, 1) <= version]
    if missing:
        raise UserError(f"results {path}: malformed, missing columns {', '.join(missing[:5])}")


def read_records(path: str | os.PathLike) -> list[EvalRecord]:
    """Every complete record of a results file (SWMR-safe while a writer is still appending)."""
    path = Path(path)
    for _ in range(20):
        try:
            columns, n = _read_columns(path)
            break
        except _StaleView:
            # variable-length data (strings) outran this reader's view of the file: reopen and retry
            time.sleep(0.05)
    else:
        raise UserError(f"results {path}: unreadable while being written (retried 20 times)")
    records = []
    for i in range(n):
        values = {}
        for fd in FIELDS:
            if fd.name not in columns:
                continue
            v = columns[fd.name][i]
            if isinstance(v, bytes):
                v = v.decode("utf-8")
            elif isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, np.bool_):
                v = bool(v)
            elif isinstance(v, np.integer):
                v = int(v)
            elif isinstance(v, np.floating):
                v = float(v)
            values[fd.name] = v
        records.append(EvalRecord(**values))
    return records


class _StaleView(Exception):
    pass


def _check_not_truncated(path: Path) -> None:
    """A truncated file opened in SWMR mode hangs (HDF5 retries the metadata with doubling sleeps).
    Opened plainly, HDF5 checks the stored end of file at once; a file a writer holds open (live,
    or its writer killed) refuses the plain open and is left to the SWMR read."""
    try:
        h5py.File(path, "r").close()
    except OSError as e:
        if "already open for write" not in str(e):
            raise UserError(f"results {path}: cannot read as HDF5 ({e})") from None


def _read_columns(path: Path) -> tuple[dict, int]:
    _check_not_truncated(path)
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as e:
        raise UserError(f"results {path}: cannot read as HDF5 ({e})") from None
    with f:
        _check_schema(f, path)
        group = f[GROUP]
        n = int(group.attrs["count"])
        columns = {}
        try:
            for fd in FIELDS:
                if fd.name in group:
                    columns[fd.name] = group[fd.name][:n]
        except OSError as e:
            raise _StaleView(str(e)) from None
    return columns, n


def file_attrs(path: str | os.PathLike) -> dict:
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}


def provenance(config: dict) -> dict[str, str]:
    """File-level attributes: where and how these results were made."""
    import subprocess

    from hpc.hardware import versions
    from hpc.profile.timing import PROTOCOL

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    attrs = {"git_commit": commit or "unknown", "config": json.dumps(config), "versions": json.dumps(versions()),
             "timing_protocol": PROTOCOL}
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_CLUSTER_NAME"):
        if key in os.environ:
            attrs[key.lower()] = os.environ[key]
    return attrs


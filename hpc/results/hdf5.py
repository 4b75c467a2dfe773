"""The one HDF5 writer and reader of evaluation records.

Layout: group /records holds one resizable 1-D dataset per EvalRecord field (columnar, so an
analysis job reads a column without touching the rest) and the attribute `count`, the number of
complete records. Appending extends every column, writes the row, then bumps `count` and
flushes: a reader trusts only the first `count` rows, so a crash mid-append leaves every
finished record readable. The file is opened with the latest format in SWMR mode, so a live
reader (`h5py.File(path, "r", swmr=True)`) can follow a running evaluation.

A writer holds an advisory lock (`.NAME.lock` beside the file) for its lifetime: a second writer
is refused while the first lives, and one that finds the file still marked open by a writer that
no longer holds the lock (killed: SIGKILL, node loss) recovers it: the complete records and the
attributes are copied to a fresh file that replaces it, and appending continues.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
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
        self._lock = _writer_lock(self.path)
        try:
            self.file = _open_for_append(self.path)
        except UserError:
            os.close(self._lock)
            raise
        if len(self.file.keys()) == 0 and len(self.file.attrs) == 0:
            _create_layout(self.file)
        else:
            try:
                _check_appendable(self.file, self.path)
            except UserError:
                self.file.close()
                os.close(self._lock)
                raise
        for key, value in (attrs or {}).items():
            self.file.attrs[key] = value
        self.group = self.file[GROUP]
        self.file.swmr_mode = True

    def append(self, record: EvalRecord) -> None:
        _append_row(self.file, self.group, record)

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _create_layout(f: h5py.File) -> None:
    group = f.create_group(GROUP)
    for fd in FIELDS:
        group.create_dataset(fd.name, shape=(0,), maxshape=(None,), dtype=_dtype(fd.type), chunks=(64,))
    group.attrs["count"] = 0
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_appendable(f: h5py.File, path: Path) -> None:
    _check_schema(f, path)
    if f.attrs.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"results {path}: written with schema version "
                        f"{f.attrs.get('schema_version')}; new results go to a new file")


def _append_row(f: h5py.File, group: h5py.Group, record: EvalRecord) -> None:
    n = int(group.attrs["count"])
    for fd in FIELDS:
        ds = group[fd.name]
        if ds.shape[0] < n + 1:
            ds.resize((n + 1,))
        value = getattr(record, fd.name)
        ds[n] = np.asarray(value, dtype=np.float64) if _dtype(fd.type) is _FLOATS else value
    group.attrs["count"] = n + 1
    f.flush()


def _writer_lock(path: Path) -> int:
    """An exclusive lock held while this process writes `path` (released by the kernel on death)."""
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"results {path}: another process is writing it (one writer per file)") from None
    return fd


def _open_for_append(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "a", libver="latest")
    except OSError as e:
        if "already open for write" not in str(e):
            raise UserError(f"results {path}: cannot open for writing ({e})") from None
    _recover(path)
    try:
        return h5py.File(path, "a", libver="latest")
    except OSError as e:
        raise UserError(f"results {path}: cannot open for writing after recovery ({e})") from None


def _recover(path: Path) -> None:
    """Replace a file whose writer died with the open-for-write mark by a clean copy of its
    complete records and attributes (the caller holds the writer lock, so no writer is live)."""
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        _check_appendable(f, path)
    records = read_records(path)
    attrs = file_attrs(path)
    tmp = path.with_name(f".{path.name}.recovered.{os.getpid()}")
    with h5py.File(tmp, "w", libver="latest") as f:
        _create_layout(f)
        for key, value in attrs.items():
            f.attrs[key] = value
        for rec in records:
            _append_row(f, f[GROUP], rec)
    os.replace(tmp, path)
    print(f"results {path}: its last writer did not close it (killed?); recovered {len(records)} complete "
          "records", file=sys.stderr, flush=True)


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
            # variable-length data (strings) outran this reader's view of the file, or a writer held
            # its lock while creating it: reopen and retry
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
        if "unable to lock file" in str(e):
            raise _StaleView(str(e)) from None   # a writer is creating it or switching it to SWMR: retry
        if "already open for write" not in str(e):
            raise UserError(f"results {path}: cannot read as HDF5 ({e})") from None


def _read_columns(path: Path) -> tuple[dict, int]:
    _check_not_truncated(path)
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as e:
        if "unable to lock file" in str(e):
            raise _StaleView(str(e)) from None
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


"""The one HDF5 writer and reader of evaluation records, and the machinery every results table shares.

Layout: group /records holds one resizable 1-D dataset per EvalRecord field (columnar, so an
analysis job reads a column without touching the rest) and the attribute `count`, the number of
complete records. Appending extends every column, writes the row, then bumps `count` and
flushes: a reader trusts only the first `count` rows, so a crash mid-append leaves every
finished record readable. The file is opened with the latest format in SWMR mode, so a live
reader (`h5py.File(path, "r", swmr=True)`) can follow a running evaluation.

Training metrics (hpc.results.training) are tables of the same kind (a group of columns and a
`count`) and may share the file: the writers below (AppendingFile) and the readers (read_retrying)
serve every table. A writer holds an advisory lock (`.NAME.lock` beside the file) for its
lifetime: a second writer, of any table, is refused while the first lives, and one that finds the
file still marked open by a writer that no longer holds the lock (killed: SIGKILL, node loss)
recovers it: the complete rows of every table and all attributes are copied to a fresh file that
replaces it, and appending continues.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import h5py
import numpy as np

from hpc.errors import UserError, shown
from hpc.results.record import FIELDS, EvalRecord, record_key

SCHEMA_VERSION = 4
# columns newer than version 1: older files read them as defaults (version 3 also dropped
# candidate_host_ms and host_check_ms, which the in-process clock measured)
ADDED_IN = {"stage_seconds": 2, "overhead_ms": 3, "conditions": 4}
GROUP = "records"
_STR = h5py.string_dtype("utf-8")
_FLOATS = h5py.vlen_dtype(np.float64)
T = TypeVar("T")

log = logging.getLogger(__name__)


def column_dtype(tp) -> object:
    """The HDF5 dtype of a column of Python type `tp` (a type or its name)."""
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


class AppendingFile:
    """The one writer of a results file, whichever of its tables it appends to. It holds the writer
    lock for its lifetime, opens the file (recovered when its last writer was killed), lets the
    subclass lay out or check its tables (`_prepare`), sets `attrs` on the file and switches to SWMR
    mode, after which no table can be created: so a subclass creates all of its own up front."""

    def __init__(self, path: str | os.PathLike, attrs: dict[str, str] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _writer_lock(self.path)
        try:
            self.file = _open_for_append(self.path)
        except UserError:
            os.close(self._lock)
            raise
        try:
            if _tables(self.file) is None:
                raise UserError(f"results {self.path}: not an hpc results file (it holds data outside any table)")
            self._prepare()
        except UserError:
            self.close()
            raise
        for key, value in (attrs or {}).items():
            self.file.attrs[key] = value
        self.file.swmr_mode = True

    def _prepare(self) -> None:
        """Create this writer's tables in the file, or check the ones there (UserError when unfit)."""
        raise NotImplementedError

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


class ResultWriter(AppendingFile):
    """Appends EvalRecords to one HDF5 file (one writer per file). Use as a context manager."""

    def _prepare(self) -> None:
        if GROUP not in self.file and "schema_version" not in self.file.attrs:
            _create_layout(self.file)      # a new file, or one holding only other tables (training)
        else:
            _check_appendable(self.file, self.path)
        self.group = self.file[GROUP]

    def append(self, record: EvalRecord) -> None:
        """One record; text fields as valid UTF-8 without NUL (HDF5 refuses others, and a candidate's
        source or a file name can hold anything)."""
        append_rows(self.file, self.group, {fd.name: [shown(v) if isinstance(v := getattr(record, fd.name), str) else v]
                                            for fd in FIELDS})

    def records(self) -> list[EvalRecord]:
        """Every complete record of the file, read through this writer's own handle."""
        return _as_records(*complete_rows(self.group))


class RecordStore:
    """The store of a run of evaluations (hpc.engine) whose results are EvalRecords: one results
    file, its finished records found by `record_key`. A harness error (status error: a worker
    killed by a preemption, say) is not finished, so a resumed run evaluates it again."""

    def __init__(self, path: str | os.PathLike, attrs: dict[str, str] | None = None,
                 writer: type[ResultWriter] = ResultWriter):
        self.writer = writer(path, attrs)
        self._kept = {record_key(r): r for r in self.writer.records() if r.status != "error"}

    def finished(self) -> set[tuple[str, str]]:
        return set(self._kept)

    def kept(self) -> dict[tuple[str, str], EvalRecord]:
        """The finished records the file held when the run started, by key (the latest of each)."""
        return dict(self._kept)

    def append(self, item: object, record: EvalRecord) -> None:
        self.writer.append(record)

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> "RecordStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _create_layout(f: h5py.File) -> None:
    group = f.create_group(GROUP)
    for fd in FIELDS:
        group.create_dataset(fd.name, shape=(0,), maxshape=(None,), dtype=column_dtype(fd.type), chunks=(64,))
    group.attrs["count"] = 0
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_appendable(f: h5py.File, path: Path) -> None:
    _check_schema(f, path)
    if f.attrs.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"results {path}: written with schema version "
                        f"{f.attrs.get('schema_version')}; new results go to a new file")


def append_rows(f: h5py.File, group: h5py.Group, columns: dict[str, list]) -> None:
    """Append rows to a table, one list of values per column (all of one length), then bump its
    `count` and flush: a reader sees all of these rows or none."""
    n = int(group.attrs["count"])
    k = len(next(iter(columns.values())))
    for name, values in columns.items():
        ds = group[name]
        if ds.shape[0] < n + k:
            ds.resize((n + k,))
        if h5py.check_vlen_dtype(ds.dtype) == np.float64:   # row by row: h5py reads equal lengths as 2-D
            for i, value in enumerate(values):
                ds[n + i] = np.asarray(value, dtype=np.float64)
        else:
            data = np.empty(k, dtype=ds.dtype)
            data[:] = values
            ds[n:n + k] = data
    group.attrs["count"] = n + k
    f.flush()


def truncate_rows(f: h5py.File, group: h5py.Group, keep: int) -> None:
    """Drop a table's rows after the first `keep`: `count` first (flushed), so a crash midway leaves
    a table that readers and recovery already see as cut."""
    group.attrs["count"] = keep
    f.flush()
    for ds in group.values():
        ds.resize((keep,))
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
    """Replace a file whose writer died with the open-for-write mark by a clean copy of the complete
    rows of its tables and all attributes (the caller holds the writer lock, so no writer is live)."""
    tmp = path.with_name(f".{path.name}.recovered.{os.getpid()}")
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        tables = _tables(f)
        if tables is None:
            raise UserError(f"results {path}: not an hpc results file (it holds data outside any table)")

        def copy(name: str, obj) -> None:
            if isinstance(obj, h5py.Group):
                out.require_group(name).attrs.update(obj.attrs)
            else:
                out.create_dataset(name, data=obj[:int(obj.parent.attrs["count"])], maxshape=(None,),
                                   chunks=obj.chunks, dtype=obj.dtype)

        with h5py.File(tmp, "w", libver="latest") as out:
            out.attrs.update(f.attrs)
            f.visititems(copy)
        kept = ", ".join(f"{name} {int(f[name].attrs['count'])}" for name in tables)
    os.replace(tmp, path)
    log.warning("results %s: its last writer did not close it (killed?); recovered the complete rows (%s)", path, kept)


def _tables(f: h5py.File) -> list[str] | None:
    """The file's tables (groups with a `count`, whose datasets are their columns); None when a
    dataset lies outside any table: not a results file, so neither extended nor recovered."""
    tables, stray = [], []

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            if "count" not in obj.parent.attrs:
                stray.append(name)
        elif "count" in obj.attrs:
            tables.append(name)

    f.visititems(visit)
    return None if stray else tables


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
    return _as_records(*read_retrying(path, lambda f: complete_rows(_records_group(f, path))))


def _as_records(columns: dict[str, np.ndarray], n: int) -> list[EvalRecord]:
    return [EvalRecord(**{fd.name: to_python(columns[fd.name][i]) for fd in FIELDS if fd.name in columns})
            for i in range(n)]


def to_python(v):
    """A value read from a column as the Python value that was written."""
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


def _records_group(f: h5py.File, path: Path) -> h5py.Group:
    _check_schema(f, path)
    return f[GROUP]


def complete_rows(group: h5py.Group, start: int = 0, stop: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Every column of a table's rows start..stop, cut at its `count` (rows after it may be half
    written), and how many rows that is."""
    count = int(group.attrs["count"])
    stop = count if stop is None else min(stop, count)
    return {name: ds[start:stop] for name, ds in group.items()}, max(0, stop - start)


def read_retrying(path: Path, read: Callable[[h5py.File], T]) -> T:
    """`read(f)` on the file opened for reading, SWMR-safe: a read that a writer's variable-length
    data (strings) outran, or that met a writer holding its lock while creating the file, is
    retried on a fresh open. `read` raises UserError for a file that is not what it wants."""
    for _ in range(20):
        try:
            return _read_once(path, read)
        except _StaleView:
            time.sleep(0.05)
    raise UserError(f"results {path}: unreadable while being written (retried 20 times)")


def file_groups(path: str | os.PathLike) -> set[str]:
    """The names at the top of a results file: which tables it holds (`records`, `train`)."""
    return read_retrying(Path(path), lambda f: set(f))


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


def _read_once(path: Path, read: Callable[[h5py.File], T]) -> T:
    _check_not_truncated(path)
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as e:
        if "unable to lock file" in str(e):
            raise _StaleView(str(e)) from None
        raise UserError(f"results {path}: cannot read as HDF5 ({e})") from None
    with f:
        try:
            return read(f)
        except OSError as e:
            raise _StaleView(str(e)) from None


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


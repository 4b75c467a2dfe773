"""The one HDF5 writer and reader of evaluation records, and the machinery every results table shares.

Layout: group /records holds one resizable 1-D dataset per EvalRecord field (columnar, so an
analysis job reads a column without touching the rest) and the attribute `count`, the number of
complete records. Appending extends every column, writes the row, then bumps `count` and
flushes: a reader trusts only the first `count` rows. The file is written in HDF5 1.10's format
(LIBVER) in SWMR mode, so a live reader can follow a running evaluation (results/SCHEMA.md says
how) and HDF5 1.10 and later tools open it. The file describes itself: every column carries its
units and meaning (hpc.results.columns), and the root attribute `schema_doc` names the document of
the schema, results/SCHEMA.md.

Training metrics (hpc.results.training) are tables of the same kind (a group of columns and a
`count`) and may share the file: the writer below (AppendingFile: its append_rows and
truncate_rows) and the readers (read_retrying) serve every table. A writer holds an advisory lock
(`.NAME.lock` beside the file) for its lifetime: a second writer, of any table, is refused while
the first lives.

Crash consistency: HDF5 may put `count` on disk before the rows it counts, and a kill or a full
disk in the middle of a flush can leave the file unreadable. So the source of truth is the
journal (hpc.results.journal, `.NAME.journal` beside the file): every change of the file (its
layout and attributes when a writer opens it, each append, each truncation) is one checksummed
entry, written and fdatasync'd before the HDF5 file is touched, and a writer that closes the file
cleanly ends the journal with a `close` entry. Whoever takes the lock next (a writer, or `hpc
repair`) trusts the file only when the journal ends with `close`, names the same file (the
`journal_id` attribute) and counts the same rows; otherwise the file is rebuilt from the journal
into a temporary file and switched in with one os.replace. So every append that returned survives
any kill and a full disk, each row once. HDF5 itself must never meet a full disk (a failed write
leaves it unable to close the file, and the process crashes later): the room of each change is
allocated ahead (_reserve), so a full disk fails there, before HDF5 writes. A file without a journal (written before journals, or
copied without it) gets one from its complete rows the first time a writer opens it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import h5py
import numpy as np

from hpc.errors import ResultsFileError, os_reason, shown
from hpc.results.columns import KINDS, column_dtype, describe, kind_of_dtype
from hpc.results.journal import Journal, journal_path, read_entries, replace_durably, write_new
from hpc.results.record import COLUMNS, FIELDS, RENAMED_STAGES, EvalRecord, record_key

SCHEMA_VERSION = 8
# columns newer than version 1: older files read them as defaults (version 3 also dropped
# candidate_host_ms and host_check_ms, which the in-process clock measured)
ADDED_IN = {c.name: c.added_in for c in COLUMNS if c.added_in > 1}
# columns renamed since version 1: name -> (its name before, the version that renamed it); an older
# file's column is read under the new name
RENAMED_IN = {"rules": ("policy", 5)}
STAGES_RENAMED_IN = 6   # an older file's failed_stage values and stage_seconds keys read as RENAMED_STAGES says
GROUP = "records"
JOURNAL_ID = "journal_id"   # root attribute: the journal this file belongs to
SCHEMA_DOC = "results/SCHEMA.md"   # root attribute `schema_doc`: where the schema is documented (in the hpc repository)
T = TypeVar("T")

log = logging.getLogger(__name__)
# The file format of HDF5 1.10, the oldest with SWMR: h5py's "latest" is HDF5 2.0's, whose
# datatype messages (the bool columns among them) HDF5 1.10 and 1.14 readers (Debian's h5dump,
# an older h5py) cannot decode.
LIBVER = ("v110", "v110")
# Room kept free at the end of a file being written, beyond twice the journal entry of the change
# at hand (HDF5 grows a results file by at most about 60 KB plus a change's data: new chunks of
# every column): see _reserve.
HEADROOM = 256 * 1024
FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


class AppendingFile:
    """The one writer of a results file, whichever of its tables it appends to. It holds the writer
    lock for its lifetime, brings the file and its journal to one state (rebuilding the file when
    its last writer did not close it), opens it, lets the subclass lay out or check its tables and
    describe their columns (`_prepare`), sets `attrs` and `schema_doc` on the file, journals the
    layout and switches to SWMR mode, after which no table, column or attribute can be created: so
    a subclass creates all of its own up front. Every change goes through `append_rows` and
    `truncate_rows`, journal first, then room for it reserved (_reserve), then the file. A failed
    write (a full disk) is a UserError, and the writer takes no more: the next one rebuilds the
    file from the journal."""

    def __init__(self, path: str | os.PathLike, attrs: dict[str, str] | None = None):
        self.path = Path(path)
        self.failed = False
        self._journal: Journal | None = None
        self._columns: dict[str, dict[str, tuple[h5py.Dataset, str, np.dtype]]] = {}
        self._lock = _writer_lock(self.path)
        try:
            self._journal, action = _reconcile(self.path)
            if action == REBUILT:
                log.warning("results %s: its last writer did not close it (killed? a full disk?); rebuilt it from "
                            "its journal (%s)", self.path, _table_counts(self.path))
            self.file = _open_for_append(self.path)
        except BaseException:
            self.close()
            raise
        try:
            with self._writing():
                _reserve(self.file, HEADROOM)
            self._prepare()
            with self._writing():
                for key, value in {**(attrs or {}), "schema_doc": SCHEMA_DOC}.items():
                    if key != JOURNAL_ID:
                        self.file.attrs[key] = value
                self._journaled(_layout(self.file))
                self.file.swmr_mode = True
        except BaseException:
            self.close()
            raise

    def _prepare(self) -> None:
        """Create this writer's tables in the file, or check the ones there (UserError when unfit),
        and describe their columns (hpc.results.columns.describe)."""
        raise NotImplementedError

    def append_rows(self, group: h5py.Group, columns: dict[str, list]) -> None:
        """Append rows to a table, one list of values per column (all of one length): journaled
        first, then written, `count` bumped and flushed, so a reader sees all of these rows or none
        and a crash keeps them whole or not at all. A value unfit for its column is a ValueError
        before anything is written."""
        n = int(group.attrs["count"])
        k = len(next(iter(columns.values())))
        info = self._columns.get(group.name)
        if info is None:   # looked up once per table: h5py's lookups cost more than the write
            info = self._columns[group.name] = _column_info(group)
        cells = {name: _cells(name, info[name][1], info[name][2], values) for name, values in columns.items()}
        with self._writing():
            self._journaled({"op": "rows", "table": group.name, "at": n, "n": k, "columns": cells})
            _write_rows(group, info, n, k, cells)
            self.file.flush()

    def truncate_rows(self, group: h5py.Group, keep: int) -> None:
        """Drop a table's rows after the first `keep` (journaled first, like an append)."""
        with self._writing():
            self._journaled({"op": "cut", "table": group.name, "keep": keep})
            _cut(group, keep)
            self.file.flush()

    def _journaled(self, entry: dict) -> None:
        """Journal a change, then reserve the room the file needs for it."""
        before = self._journal.length
        self._journal.append(entry)
        _reserve(self.file, 2 * (self._journal.length - before) + HEADROOM)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A change of the file; an OSError in it (a full disk, a read-only file system) is one
        UserError naming the file, after which this writer takes no more changes."""
        if self.failed:
            raise ResultsFileError(f"results {self.path}: a write failed before; nothing more is written by this writer")
        try:
            yield
        except (OSError, RuntimeError) as e:
            self.failed = True
            raise ResultsFileError(f"results {self.path}: cannot write ({os_reason(e)}); the rows written before are kept "
                                   "and the next writer (or `hpc repair`) restores them") from None

    def close(self) -> None:
        """Close the file, then mark the journal clean (`close`) unless a write failed: the next
        writer trusts the file only then."""
        file = getattr(self, "file", None)
        if file is not None and file.id.valid:
            try:
                file.close()
                if not self.failed:
                    _release(self.path)
            except (OSError, RuntimeError):
                self.failed = True
        if self._journal is not None:
            if not self.failed and file is not None:
                try:
                    self._journal.append({"op": "close"})
                except OSError:
                    pass   # not marked clean: the next writer rebuilds the file from the journal
            self._journal.close()
            self._journal = None
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
        describe(self.group, COLUMNS)

    def append(self, record: EvalRecord) -> None:
        """One record; text fields as valid UTF-8 without NUL (HDF5 refuses others, and a candidate's
        source or a file name can hold anything)."""
        record.validate()
        self.append_rows(self.group, {fd.name: [shown(v) if isinstance(v := getattr(record, fd.name), str) else v]
                                      for fd in FIELDS})

    def records(self) -> list[EvalRecord]:
        """Every complete record of the file, read through this writer's own handle."""
        return _as_records(self.path, *complete_rows(self.group))


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
    for c in COLUMNS:
        group.create_dataset(c.name, shape=(0,), maxshape=(None,), dtype=column_dtype(c.type), chunks=(64,))
    group.attrs["count"] = 0
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_appendable(f: h5py.File, path: Path) -> None:
    _check_schema(f, path)
    if f.attrs.get("schema_version") != SCHEMA_VERSION:
        raise ResultsFileError(f"results {path}: written with schema version "
                               f"{f.attrs.get('schema_version')}; new results go to a new file")


def _column_info(group: h5py.Group) -> dict[str, tuple[h5py.Dataset, str, np.dtype]]:
    """A table's columns: each one's dataset, kind and dtype."""
    return {name: (ds, kind_of_dtype(ds.dtype), ds.dtype) for name, ds in group.items()}


def _cells(name: str, kind: str, dtype: np.dtype, values) -> list:
    """A column's values as JSON's types, converted as HDF5 would store them; ValueError for text
    that HDF5 refuses (a journaled row must be writable when the file is rebuilt)."""
    if kind == "floats":
        return [np.asarray(v, dtype=np.float64).tolist() for v in values]
    if kind == "str":
        out = []
        for v in values:
            text = v.decode("utf-8") if isinstance(v, bytes) else v
            if not isinstance(text, str) or "\0" in text:
                raise ValueError(f"column {name}: {v!r:.60} is not text without NUL")
            text.encode("utf-8")   # a lone surrogate: UnicodeEncodeError, a ValueError
            out.append(text)
        return out
    data = np.empty(len(values), dtype=dtype)
    data[:] = values
    return data.tolist()


def _write_rows(group: h5py.Group, info: dict[str, tuple[h5py.Dataset, str, np.dtype]], at: int, n: int,
                cells: dict[str, list]) -> None:
    for name, values in cells.items():
        ds, kind, dtype = info[name]
        if ds.shape[0] < at + n:
            ds.resize((at + n,))
        if kind == "floats":   # row by row: h5py reads equal lengths as 2-D
            for i, value in enumerate(values):
                ds[at + i] = np.asarray(value, dtype=np.float64)
        else:
            data = np.empty(n, dtype=dtype)
            data[:] = values
            ds[at:at + n] = data
    group.attrs["count"] = at + n


def _cut(group: h5py.Group, keep: int) -> None:
    group.attrs["count"] = keep
    for ds in group.values():
        ds.resize((keep,))


def _layout(f: h5py.File) -> dict:
    """The journal entry of a file's layout: every group's attributes (a table's `count` aside: the
    rows entries say it), every table's columns by kind and the columns' attributes (their units
    and meaning)."""
    attrs, tables, column_attrs = {"/": dict(f.attrs)}, {}, {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Group):
            attrs[obj.name] = {k: v for k, v in obj.attrs.items() if k != "count"}
            if "count" in obj.attrs:
                tables[obj.name] = {column: kind_of_dtype(ds.dtype) for column, ds in obj.items()}
                column_attrs[obj.name] = {column: dict(ds.attrs) for column, ds in obj.items() if ds.attrs}

    f.visititems(visit)
    return {"op": "layout", "attrs": attrs, "tables": tables, "column_attrs": column_attrs}


def _replay(entries: list[dict], out: h5py.File) -> None:
    """Lay out and fill a new file from journal entries."""
    for entry in entries:
        op = entry["op"]
        if op == "begin":
            out.attrs[JOURNAL_ID] = entry["id"]
        elif op == "layout":
            for name, attrs in entry["attrs"].items():
                group = out if name == "/" else out.require_group(name)
                for key, value in attrs.items():
                    group.attrs[key] = value
            for name, columns in entry["tables"].items():
                table = out.require_group(name)
                n = int(table.attrs.get("count", 0))
                table.attrs["count"] = n
                for column, kind in columns.items():
                    if column not in table:   # a column added since (a schema upgrade): NaN in the rows there
                        ds = table.create_dataset(column, shape=(n,), maxshape=(None,), dtype=KINDS[kind],
                                                  chunks=(64,))
                        if kind == "float" and n:
                            ds[:] = np.full(n, np.nan)
            for name, columns in entry.get("column_attrs", {}).items():   # journals before them had none
                for column, attrs in columns.items():
                    for key, value in attrs.items():
                        out[name][column].attrs[key] = value
        elif op == "rows":
            table = out[entry["table"]]
            _write_rows(table, _column_info(table), entry["at"], entry["n"], entry["columns"])
        elif op == "cut":
            _cut(out[entry["table"]], entry["keep"])


def _journal_counts(entries: list[dict]) -> dict[str, int]:
    """Each table's rows once the journal's entries are applied."""
    counts: dict[str, int] = {}
    for entry in entries:
        if entry["op"] == "layout":
            for name in entry["tables"]:
                counts.setdefault(name, 0)
        elif entry["op"] == "rows":
            counts[entry["table"]] = entry["at"] + entry["n"]
        elif entry["op"] == "cut":
            counts[entry["table"]] = entry["keep"]
    return counts


def _writer_lock(path: Path) -> int:
    """An exclusive lock held while this process writes `path` (released by the kernel on death)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ResultsFileError(f"results {path}: cannot write ({os_reason(e)})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ResultsFileError(f"results {path}: another process is writing it (one writer per file)") from None
    return fd


REBUILT, CONSISTENT, CREATED, STARTED = "rebuilt from its journal", "intact", "created", "journal started"


def _reconcile(path: Path) -> tuple[Journal, str]:
    """Bring `path` and its journal to one state before a writer opens the file (the caller holds
    the writer lock, so no writer is live), and return the journal open for appending and what was
    done. A missing file starts anew (a journal left beside it is dropped: the file was removed); a
    file whose journal is missing or names another file gets a journal of its complete rows; a
    file not closed cleanly since its journal's last entry is rebuilt from the journal."""
    jpath = journal_path(path)
    try:
        entries, length = read_entries(jpath)
        ours = entries[0].get("id") if entries and entries[0].get("op") == "begin" else None
        if not path.exists():
            entries, action = [{"op": "begin", "id": uuid.uuid4().hex}], CREATED
        else:
            probe = _probe(path)
            if ours is None or (probe is not None and probe[0] != ours):
                if ours is not None:
                    log.warning("results %s: its journal belongs to another file; starting a new one from the file",
                                path)
                entries, action = _snapshot(path), STARTED
            elif entries[-1]["op"] == "close" and probe is not None and probe[1] == _journal_counts(entries):
                return Journal(jpath, length), CONSISTENT
            else:
                action = REBUILT
        if action != REBUILT:
            length = write_new(jpath, entries)
        _rebuild(path, entries, length)
        return Journal(jpath, length), action
    except OSError as e:
        raise ResultsFileError(f"results {path}: cannot write ({os_reason(e)})") from None


def _probe(path: Path) -> tuple[str | None, dict[str, int] | None] | None:
    """The journal id and the tables' counts of a file that opens plainly (closed by its writer,
    not cut short); None for one that does not."""
    try:
        with h5py.File(path, "r") as f:
            token = f.attrs.get(JOURNAL_ID)
            tables = _tables(f)
            counts = None if tables is None else {f[name].name: int(f[name].attrs["count"]) for name in tables}
            return (token.decode() if isinstance(token, bytes) else token), counts
    except OSError:
        return None


def _snapshot(path: Path) -> list[dict]:
    """Journal entries holding a file that has no journal (written before journals, or copied
    without it): its layout and the complete rows of each table. A file its writer did not close
    is read in SWMR mode, as a live reader would."""
    def damaged(e: OSError) -> ResultsFileError:
        return ResultsFileError(f"results {path}: damaged, and no journal to rebuild it from ({str(e).splitlines()[0]})")

    try:
        f = h5py.File(path, "r")
        dirty = False
    except OSError as e:
        if "already open for write" not in str(e):
            raise damaged(e) from None
        try:
            f = h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as e2:
            raise damaged(e2) from None
        dirty = True
    with f:
        tables = _tables(f)
        if tables is None:
            raise ResultsFileError(f"results {path}: not an hpc results file (it holds data outside any table)")
        token = uuid.uuid4().hex
        layout = _layout(f)
        layout["attrs"]["/"][JOURNAL_ID] = token
        entries = [{"op": "begin", "id": token}, layout]
        try:
            for name in tables:
                group = f[name]
                columns, n = complete_rows(group)
                if n:
                    entries.append({"op": "rows", "table": group.name, "at": 0, "n": n,
                                    "columns": {c: _cells(c, kind_of_dtype(group[c].dtype), group[c].dtype, v)
                                                for c, v in columns.items()}})
        except OSError as e:
            raise damaged(e) from None
    if dirty:
        log.warning("results %s: its last writer did not close it (killed?); kept the complete rows (%s)", path,
                    ", ".join(f"{e['table'].lstrip('/')} {e['n']}" for e in entries[2:]) or "none")
    return entries


def _rebuild(path: Path, entries: list[dict], length: int) -> None:
    """Write the file the journal entries describe beside `path` and switch it in with one os.replace.
    Where the disk has no room for the copy, the old file is emptied first and the copy made again:
    the journal (already durable) holds everything the old file does, and an empty file is rebuilt
    by whoever opens it next, should this process die before the switch."""
    tmp = path.with_name(f".{path.name}.rebuilt.{os.getpid()}")
    try:
        with h5py.File(tmp, "w", libver=LIBVER) as out:
            _reserve(out, 2 * length + HEADROOM)
            _replay(entries, out)
        _release(tmp)
        replace_durably(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        if os_reason(e) == "no space left on device" and path.exists() and path.stat().st_size:
            log.warning("results %s: no room for its rebuilt copy beside it; emptied it first", path)
            os.truncate(path, 0)
            return _rebuild(path, entries, length)
        raise ResultsFileError(f"results {path}: cannot rebuild it from its journal ({os_reason(e)})") from None


def _table_counts(path: Path) -> str:
    probe = _probe(path)
    counts = probe[1] if probe else None
    return ", ".join(f"{name.lstrip('/')} {n}" for name, n in (counts or {}).items()) or "no tables"


def _reserve(f: h5py.File, nbytes: int) -> None:
    """Allocate the disk blocks of the `nbytes` after the end of `f` (beyond its size, which stays),
    before HDF5 writes into them: an OSError (a full disk) here leaves the file as its last flush
    did. HDF5 itself cannot survive a failed write: its metadata cache is left mid-flush, every
    later flush and close of the file fails, and a dataset whose close failed is freed yet stays
    registered, so the next close of it (h5py dropping its handle, or HDF5's own at exit) crashes
    the process (SIGSEGV). A file system that cannot allocate ahead (EOPNOTSUPP) is written without."""
    fd = f.id.get_vfd_handle()
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, f.id.get_filesize(), nbytes) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(code, os.strerror(code))


def _release(path: Path) -> None:
    """Give back the blocks _reserve allocated beyond the end of a closed file (a file system frees
    the blocks past a file's end only when it shrinks)."""
    size = path.stat().st_size
    os.truncate(path, size + 1)
    os.truncate(path, size)


def _open_for_append(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "a", libver=LIBVER)
    except OSError as e:
        raise ResultsFileError(f"results {path}: cannot open for writing ({os_reason(e)})") from None


def switch_in(src: Path, dst: Path) -> None:
    """A results file written whole at `src` (its writer closed) switched in for `dst` with one
    os.replace, its journal after it (a crash between leaves `dst` beside a journal of another file,
    which the next writer sees and replaces), and `src`'s lock file removed."""
    os.replace(src, dst)
    journal_path(src).replace(journal_path(dst))
    (src.parent / f".{src.name}.lock").unlink(missing_ok=True)


def repair(path: str | os.PathLike) -> str:
    """Bring a results file back to the rows its journal holds (the `hpc repair` command): what a
    writer does when it opens the file, without opening it for appending. Returns one line."""
    path = Path(path)
    if not path.is_file():
        raise ResultsFileError(f"results {path}: {'not a file' if path.exists() else 'no such file'}")
    lock = _writer_lock(path)
    try:
        journal, action = _reconcile(path)
        if action != CONSISTENT:   # the file now matches the journal: the next writer need not rebuild it
            journal.append({"op": "close"})
        journal.close()
    except OSError as e:
        raise ResultsFileError(f"results {path}: cannot write ({os_reason(e)})") from None
    finally:
        os.close(lock)
    return f"{path}: {action} ({_table_counts(path)})"


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
        raise ResultsFileError(f"results {path}: not an hpc results file of schema version 1..{SCHEMA_VERSION}")
    missing = [_stored_name(fd.name, version) for fd in FIELDS
               if _stored_name(fd.name, version) not in f[GROUP] and ADDED_IN.get(fd.name, 1) <= version]
    if missing:
        raise ResultsFileError(f"results {path}: malformed, missing columns {', '.join(missing[:5])}")


def read_records(path: str | os.PathLike) -> list[EvalRecord]:
    """Every complete record of a results file (SWMR-safe while a writer is still appending)."""
    path = Path(path)
    return _as_records(path, *read_retrying(path, lambda f: (*complete_rows(_records_group(f, path)),
                                                             int(f.attrs["schema_version"]))))


def _stored_name(field: str, version: int) -> str:
    """The name of a record field's column in a file of schema `version`."""
    before, renamed_in = RENAMED_IN.get(field, (field, 1))
    return before if version < renamed_in else field


def _as_records(path: Path, columns: dict[str, np.ndarray], n: int, version: int = SCHEMA_VERSION) -> list[EvalRecord]:
    """The rows as records; a column of an older file under a name since changed (RENAMED_IN, never
    the name of another column) is read as its field, and its stages under their names since
    (STAGES_RENAMED_IN); UserError naming the row for a value outside its field's vocabulary."""
    columns = {**columns, **{field: columns[before] for field, (before, _) in RENAMED_IN.items() if before in columns}}
    records = []
    for i in range(n):
        try:
            row = {fd.name: to_python(columns[fd.name][i]) for fd in FIELDS if fd.name in columns}
            if version < STAGES_RENAMED_IN:
                _rename_stages(row)
            records.append(EvalRecord(**row))
        except ValueError as e:
            raise ResultsFileError(f"results {path}: malformed, row {i}: {e}") from None
    return records


def _rename_stages(row: dict) -> None:
    """A row of a file older than STAGES_RENAMED_IN, its stages named as since (RENAMED_STAGES)."""
    stage = row.get("failed_stage", "")
    row["failed_stage"] = RENAMED_STAGES.get(stage, stage)
    try:
        seconds = json.loads(row.get("stage_seconds") or "null")
    except ValueError:
        return
    if isinstance(seconds, dict):
        row["stage_seconds"] = json.dumps({RENAMED_STAGES.get(k, k): v for k, v in seconds.items()})


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
    wait_for_layout(f, path, GROUP)
    _check_schema(f, path)
    return f[GROUP]


def wait_for_layout(f: h5py.File, path: Path, group: str) -> None:
    """Inside a `read_retrying` read: a file without `group` while its writer lives is a view to
    read again, not a file without that table. A new file is switched in bare (_reconcile) and its
    writer lays its tables out a moment later."""
    if group not in f and _writer_live(path):
        raise _StaleView(f"results {path}: no /{group} yet")


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
    raise ResultsFileError(f"results {path}: unreadable while being written (retried 20 times){_repair_hint(path)}")


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
        if "truncated file" in str(e) and _writer_live(path):
            raise _StaleView(str(e)) from None   # a live writer's file, a moment shorter than its stored end
        if "already open for write" not in str(e):
            raise ResultsFileError(f"results {path}: cannot read as HDF5 ({e}){_repair_hint(path)}") from None


def _writer_live(path: Path) -> bool:
    """Whether a writer holds `path`'s writer lock now, read from /proc/locks: taking the lock, even
    shared for a moment, could refuse a writer starting then."""
    try:
        st = os.stat(path.parent / f".{path.name}.lock")
        held = Path("/proc/locks").read_text()
    except OSError:
        return False
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(line.split()[1:2] == ["FLOCK"] and node in line.split() for line in held.splitlines())


def _repair_hint(path: Path) -> str:
    """What a reader of a damaged file can do, where its journal can rebuild it."""
    return f"; `hpc repair {path}` rebuilds it from its journal" if journal_path(path).exists() else ""


def _read_once(path: Path, read: Callable[[h5py.File], T]) -> T:
    _check_not_truncated(path)
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as e:
        if "unable to lock file" in str(e):
            raise _StaleView(str(e)) from None
        raise ResultsFileError(f"results {path}: cannot read as HDF5 ({e})") from None
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


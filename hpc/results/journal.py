"""The journal of a results file: an append-only log of JSON entries, each durable (written and
fdatasync'd) before the HDF5 file is touched, so that it stays the source of truth the file is
rebuilt from after a crash or a full disk (hpc.results.hdf5 says what the entries mean).

It lies beside the file as `.NAME.journal`. Each entry is framed as MAGIC, the payload's length
and its CRC-32 (little-endian u32 each), then the payload (UTF-8 JSON). A writer killed in the
middle of an entry leaves a torn tail: `read_entries` stops at the first frame that is short or
fails its checksum, and `Journal` cuts the file there before appending, so the next entry follows
the last whole one. Every write is one pwrite64 call (so a kill-point sweep that injects SIGKILL
at each of them covers every state the file can be left in).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"HJ1\n"
_HEAD = struct.Struct("<4sII")


def journal_path(path: Path) -> Path:
    """Where the journal of results file `path` lies."""
    return path.parent / f".{path.name}.journal"


def _plain(value: object) -> object:
    """numpy scalars and arrays, and bytes, as JSON's types (attributes and columns read back from HDF5)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    raise TypeError(f"not JSON-ready: {type(value).__name__}")


def frame(entry: dict) -> bytes:
    """One entry as the bytes appended to a journal."""
    payload = json.dumps(entry, default=_plain, separators=(",", ":")).encode("utf-8")
    return _HEAD.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def read_entries(path: Path) -> tuple[list[dict], int]:
    """The whole entries of a journal (none when it is missing) and the bytes they span: a torn or
    damaged tail after them is left out."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    entries, pos = [], 0
    while pos + _HEAD.size <= len(data):
        magic, length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        payload = data[pos + _HEAD.size:end]
        if magic != MAGIC or end > len(data) or zlib.crc32(payload) != crc:
            break
        try:
            entry = json.loads(payload)
        except ValueError:
            break
        if not isinstance(entry, dict):
            break
        entries.append(entry)
        pos = end
    return entries, pos


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _sync_folder(path: Path) -> None:
    """A rename or a new file in `path`'s folder made durable (a no-op where folders cannot be synced)."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_new(path: Path, entries: list[dict]) -> int:
    """Replace the journal at `path` by one holding `entries`, in one os.replace (a crash leaves the
    old journal or the new one, whole). Returns its length."""
    data = b"".join(frame(e) for e in entries)
    tmp = path.with_name(f"{path.name}.new.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, data, 0)
        os.fdatasync(fd)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _sync_folder(path)
    return len(data)


def replace_durably(src: Path, dst: Path) -> None:
    """`src` switched in for `dst` in one rename, made durable (a rebuilt results file)."""
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    _sync_folder(dst)


class Journal:
    """A journal open for appending, cut to `length` (the end of its last whole entry)."""

    def __init__(self, path: Path, length: int):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(self.fd).st_size != length:
                os.ftruncate(self.fd, length)
        except OSError:
            os.close(self.fd)
            raise
        self.length = length

    def append(self, entry: dict) -> None:
        """Write one entry and make it durable; on failure (a full disk) cut what was written of it,
        so the journal still ends with a whole entry, and raise the OSError."""
        data = frame(entry)
        try:
            _write_all(self.fd, data, self.length)
            os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self.length)
            except OSError:
                pass   # a torn tail: the next reader cuts it
            raise
        self.length += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

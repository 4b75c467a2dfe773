"""Temporary folders that a later process can tell are abandoned.

A harness killed mid-evaluation (SIGKILL, the OOM killer, a Slurm time limit) cannot remove its
temporary folders, and an evaluation's workroot holds its copies of the task and the candidate;
on a node that runs evaluation after evaluation they add up. Each folder made here holds a lock
file that its maker keeps locked (flock) for the folder's life. The kernel drops the lock when
that process dies, however it dies, so the next process to make a folder of the same kind removes
every one whose lock it can take: no pid to be reused, no clock to trust.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

OWNER_LOCK = ".owner.lock"

_swept: set[str] = set()
_swept_lock = threading.Lock()


def owned_tempdir(prefix: str) -> tuple[Path, int]:
    """A new folder in the temporary folder and the open file holding its owner lock (close it
    after removing the folder). The lock is taken on a file under a passing name and then renamed
    into place, so a sweep never finds the lock file unlocked while its owner lives. The first
    call for a `prefix` in a process sweeps the abandoned folders of that prefix first."""
    sweep_once(prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    taking = folder / f"{OWNER_LOCK}.{os.getpid()}"
    fd = os.open(taking, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(taking, folder / OWNER_LOCK)
    return folder, fd


@contextlib.contextmanager
def owned_temporary(prefix: str) -> Iterator[Path]:
    """owned_tempdir for a `with` block (as tempfile.TemporaryDirectory): the folder is removed and
    its lock let go when the block ends; a folder whose process was killed inside the block is
    swept by the next process that makes one of its kind."""
    folder, fd = owned_tempdir(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def sweep(prefix: str, parent: Path | None = None) -> int:
    """Remove the folders named `prefix`* in `parent` (the temporary folder) whose owner lock no
    process holds. A folder without the lock file (being made, or made by an older version) is
    left alone. Returns how many were removed."""
    removed = 0
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            fd = os.open(folder / OWNER_LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # its owner lives
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed += not folder.exists()
        finally:
            os.close(fd)
    return removed


def sweep_once(prefix: str) -> None:
    """sweep(prefix), once a process."""
    with _swept_lock:
        if prefix in _swept:
            return
        _swept.add(prefix)
    sweep(prefix)

"""Exclusive timing on a shared device.

Several evaluations may share one GPU (threads of `hpc eval-suite --jobs`, processes, array tasks
on one node): their setup and correctness work may overlap, their timed runs may not. Untimed
device work holds `shared()`; a timed run holds `exclusive()`, which waits for the shared
holders to finish and keeps new ones out until it is done (a turnstile gives timers priority).

The locks are flock()s on per-host files, so they work across threads and processes alike.
Each DeviceLock object adds up how long its holders waited and how long it was held exclusively
(`seconds`): with several evaluations on one device, that says whether the device's serial part
(the timed runs) or the work around it bounds the rate.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)   # a new open file description per holder
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)   # releases the lock


class DeviceLock:
    """Reader-writer lock for one device: `shared()` for untimed work, `exclusive()` for timing."""

    def __init__(self, backend: str, directory: Path | None = None):
        if backend == "cuda":
            name = "cuda-" + (os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0] or "0")
        else:
            name = "cpu"
        root = directory or Path(tempfile.gettempdir()) / f"hpc-device-locks-{os.getuid()}"
        root.mkdir(parents=True, exist_ok=True)
        self.main = root / f"{name}.lock"
        self.turnstile = root / f"{name}.turnstile"
        self.seconds = {"lock_wait_shared": 0.0, "lock_wait_exclusive": 0.0, "lock_held_exclusive": 0.0}

    @contextmanager
    def shared(self) -> Iterator[None]:
        start = time.monotonic()
        with _flock(self.turnstile, fcntl.LOCK_EX):
            pass   # waits while a timer is queued or running
        with _flock(self.main, fcntl.LOCK_SH):
            self.seconds["lock_wait_shared"] += time.monotonic() - start
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        start = time.monotonic()
        with _flock(self.turnstile, fcntl.LOCK_EX), _flock(self.main, fcntl.LOCK_EX):
            got = time.monotonic()
            self.seconds["lock_wait_exclusive"] += got - start
            try:
                yield
            finally:
                self.seconds["lock_held_exclusive"] += time.monotonic() - got

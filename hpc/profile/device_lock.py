"""Exclusive timing on a shared device.

Several evaluations may share one GPU (threads of `hpc eval-suite --jobs`, processes, array tasks
on one node): their setup and correctness work may overlap, their timed runs may not. Untimed
device work holds `shared()`; a timed run holds `exclusive()`, which waits for the shared
holders to finish and keeps new ones out until it is done (a turnstile gives timers priority).
Work that times itself holds `autotuning()`: torch.compile's first call on cuda picks each
kernel's launch config by timing the candidates on the device, and keeps the pick in the inductor
cache for every later evaluation too.

The locks are flock()s on per-host files, so they work across threads and processes alike.
`active()` marks an evaluation as running on the device for as long as it holds a file of its own
locked, so `beside()` can say how many others ran beside a measurement (a crashed holder's file is
unlocked, and counted as nothing).
Each DeviceLock object adds up how long its holders waited and how long it was held exclusively
(`seconds`): with several evaluations on one device, that says whether the device's serial part
(the timed runs) or the work around it bounds the rate.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ContextManager, Iterator


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
        self.running = root / f"{name}.active"
        self.backend = backend
        self.seconds = {"lock_wait_shared": 0.0, "lock_wait_exclusive": 0.0, "lock_held_exclusive": 0.0}
        self._own: set[str] = set()

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

    def autotuning(self) -> ContextManager[None]:
        """The lock for a first call that autotunes (torch.compile's): exclusive on cuda, since
        inductor picks each kernel's launch config by timing the candidates there, and a pick timed
        beside other evaluations' device work follows their load and stays in the shared cache. On
        cpu nothing is timed at a first call: shared."""
        return self.exclusive() if self.backend == "cuda" else self.shared()

    @contextmanager
    def active(self) -> Iterator[None]:
        """This evaluation runs on the device until the block ends."""
        self.running.mkdir(exist_ok=True)
        name = f"{os.getpid()}-{threading.get_ident()}-{next(_serial)}"
        fd = os.open(self.running / f".{name}", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(self.running / f".{name}", self.running / name)   # appears locked: never taken for stale
        self._own.add(name)
        try:
            yield
        finally:
            self._own.discard(name)
            (self.running / name).unlink(missing_ok=True)
            os.close(fd)

    def beside(self) -> int:
        """How many evaluations other than this object's own run on the device now."""
        count = 0
        for path in self.running.glob("[!.]*") if self.running.is_dir() else ():
            if path.name in self._own:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)   # nobody holds it: its evaluation has ended
            except BlockingIOError:
                count += 1
            finally:
                os.close(fd)
        return count


_serial = itertools.count()

"""Worker processes started before the evaluation that will use them.

A fresh sandboxed interpreter importing torch is seconds of every evaluation, the largest part
of one in the reward pool on an H200. Loops that evaluate one candidate after another (a pool
worker rank, `hpc eval-suite`, an evaluation shard, the agent's scorer) open
`prestarted_workers()`: while one evaluation runs, the next one's reference and program
processes start in a workroot of their own. Each is still a fresh process that serves one
evaluation and is killed: nothing of one candidate lives on in the next one's processes.

A spare's device initialization holds the device lock shared, so it never overlaps another
evaluation's timed run (on the cpu backend its whole start does: an interpreter importing torch
is work on the timed device there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from hpc.config import SandboxConfig
from hpc.profile.cores import window_env
from hpc.profile.device_lock import DeviceLock
from hpc.sandbox.exchange import Exchange
from hpc.sandbox.messages import FailureKind, Ready
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.sandbox.tempdirs import owned_tempdir

READY_TIMEOUT_S = 300.0


@dataclass
class WorkerPair:
    """The two processes of one evaluation, in `workroot`/reference and `workroot`/candidate, and
    the memory and pipes they share (hpc.sandbox.exchange); `owner`: the file holding the
    workroot's owner lock (hpc.sandbox.tempdirs: a killed harness's workroot is swept later)."""

    workroot: Path
    reference: SandboxedProcess
    program: SandboxedProcess
    exchange: Exchange
    owner: int = -1

    @property
    def candidate_dir(self) -> Path:
        return self.workroot / "candidate"

    def kill(self) -> None:
        self.reference.kill()
        self.program.kill()

    def close(self) -> None:
        """End both processes and remove the workroot."""
        self.reference.close()
        self.program.close()
        self.exchange.close()
        shutil.rmtree(self.workroot, ignore_errors=True)
        if self.owner >= 0:
            os.close(self.owner)
            self.owner = -1


def window_pids(*pairs: WorkerPair) -> tuple[list[int], list[int]]:
    """The pairs' host pids: their programs', their references' (as hpc.profile.cores.timing
    wants them)."""
    return [p.program.worker_pid for p in pairs], [p.reference.worker_pid for p in pairs]


def start_pair(sandbox: SandboxConfig, backend: str, writable: list[Path] | None = None,
               trusted: bool = False, env: dict[str, str] | None = None) -> WorkerPair:
    """A new reference + program pair in a new workroot (the program may write `writable` too and
    gets `env` added to its environment; `trusted`: the program runs the harness's own baselines,
    not a candidate)."""
    workroot, owner = owned_tempdir("hpc-eval-")
    os.chmod(workroot, 0o711)   # the workers' own folders are reachable under a dropped uid, not listable
    exchange = reference = program = None
    try:
        exchange = Exchange.create(backend)
        reference = SandboxedProcess("reference", workroot / "reference", sandbox, backend, trusted=True,
                                     env=window_env(backend, program=False),
                                     pass_fds=Exchange.passed(exchange.reference))
        program = SandboxedProcess("program", workroot / "candidate", sandbox, backend,
                                   env={**(env or {}), **window_env(backend, program=True)}, writable=writable,
                                   pass_fds=Exchange.passed(exchange.program), trusted=trusted,
                                   join=reference if backend == "cuda" else None)   # CUDA IPC checks pids
    except BaseException:
        for proc in (reference, program):
            if proc is not None:
                proc.close()
        if exchange is not None:
            exchange.close()
        shutil.rmtree(workroot, ignore_errors=True)
        os.close(owner)
        raise
    exchange.after_start()
    return WorkerPair(workroot, reference, program, exchange, owner)


def harness_file(source: Path, workdir: Path, name: str, sha256: str = "") -> Path:
    """A copy of a file the harness made or read (a built library, the op monitor, the task) in a
    worker's workdir, under .hpc/: what a worker may read is its workdir and the system, not the
    cache. With `sha256`, the copy must have that digest (the task the harness hashed, not a file
    edited since): SandboxError otherwise."""
    dest = workdir / ".hpc" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".{os.getpid()}.tmp")
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(tmp, "wb") as out:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if sha256 and digest.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise SandboxError(f"{source} changed since it was read (its digest differs)", FailureKind.TASK)
    os.chmod(tmp, 0o644)
    tmp.replace(dest)
    return dest


class _Spare:
    """A pair being started in a thread. Its device work (a CUDA context each) waits for the
    device lock, shared, so it never overlaps a timed run; on the cpu backend the whole start
    does, since the interpreters' start is itself work on the device timed there."""

    def __init__(self, sandbox: SandboxConfig, backend: str, kind: PairKind):
        self.pair: WorkerPair | None = None
        self.failed = ""
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._start, args=(sandbox, backend, kind), name="prestart",
                                        daemon=True)
        self._thread.start()

    def _start(self, sandbox: SandboxConfig, backend: str, kind: PairKind) -> None:
        lock = DeviceLock(backend)
        try:
            with lock.shared() if backend == "cpu" else nullcontext():
                if self._cancelled.is_set():
                    return
                self.pair = kind.start(sandbox, backend)
                self._ask(Ready())
            with lock.shared():
                self._ask(Ready(backend))
        except (SandboxError, OSError) as e:
            self.failed = getattr(e, "reason", str(e))

    def _ask(self, request: Ready) -> None:
        for proc in (self.pair.reference, self.pair.program):
            proc.send(request)
        for proc in (self.pair.reference, self.pair.program):
            proc.receive(request, READY_TIMEOUT_S)

    def result(self) -> WorkerPair | None:
        """The started pair, or None (and its processes ended) when it failed to start."""
        self._thread.join()
        if self.pair is not None and not self.failed and any(
                p.proc.poll() is not None for p in (self.pair.reference, self.pair.program)):
            self.failed = "exited while waiting"
        if self.pair is not None and self.failed:
            self.pair.close()
            self.pair = None
        return self.pair

    def cancel(self) -> None:
        self._cancelled.set()
        if self.pair is not None:
            self.pair.kill()   # unblocks a start still waiting for the answer
        pair = self.result()
        if pair is not None:
            pair.close()


@dataclass(frozen=True)
class PairKind:
    """What a pair is started with besides the sandbox config: the same for every evaluation that
    takes one (a candidate's program with no extra writable path; the baselines' trusted program)."""

    trusted: bool = False
    writable: tuple[Path, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def start(self, sandbox: SandboxConfig, backend: str) -> WorkerPair:
        return start_pair(sandbox, backend, list(self.writable), self.trusted, dict(self.env))


class PrestartedWorkers:
    """Up to `depth` pairs started ahead per (backend, sandbox config, pair kind, visible devices)."""

    def __init__(self, depth: int = 1):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.started = self.taken = 0
        self._spares: dict[str, list[_Spare]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, sandbox: SandboxConfig, backend: str, kind: PairKind = PairKind()) -> WorkerPair:
        """A pair whose interpreters are up (a new one if none is), and the next one starting."""
        key = _key(sandbox, backend, kind)
        with self._lock:
            queue = self._spares.setdefault(key, [])
            spare = queue.pop(0) if queue else None
        pair = spare.result() if spare is not None else None
        if pair is not None:
            pair.reference.restart_clock()
            pair.program.restart_clock()
            self.taken += 1
        self._refill(key, sandbox, backend, kind)
        return pair if pair is not None else kind.start(sandbox, backend)

    def _refill(self, key: str, sandbox: SandboxConfig, backend: str, kind: PairKind = PairKind()) -> None:
        with self._lock:
            if self._closed:
                return
            queue = self._spares.setdefault(key, [])
            while len(queue) < self.depth:
                queue.append(_Spare(sandbox, backend, kind))
                self.started += 1

    def close(self) -> None:
        """End every spare and remove its workroot."""
        with self._lock:
            self._closed = True
            spares = [s for queue in self._spares.values() for s in queue]
            self._spares.clear()
        for spare in spares:
            spare.cancel()


def _key(sandbox: SandboxConfig, backend: str, kind: PairKind = PairKind()) -> str:
    return repr((backend, sorted(asdict(sandbox).items()), kind, os.environ.get("CUDA_VISIBLE_DEVICES")))


_active: PrestartedWorkers | None = None
_active_lock = threading.Lock()


def default_depth(at_once: int = 1) -> int:
    """Spare pairs for `at_once` evaluations running together: one for a serial run, else one
    more than run at once (a spare takes seconds to start, interpreter, torch and CUDA, while the
    evaluations load the CPU; on an H200, 4 at once evaluated 7.4, 12.7 and 18.2 level-1
    candidates a minute with 1, 2 and 3 ahead, 6 at once 26.6 with 7: docs/benchmarks.md);
    none on a 2-3 core machine, where a spare's start would only slow the evaluation it overlaps."""
    if len(os.sched_getaffinity(0)) < 4:
        return 0
    return at_once + 1 if at_once > 1 else 1


@contextmanager
def prestarted_workers(depth: int | None = None) -> Iterator[PrestartedWorkers | None]:
    """Within this block, evaluations of this process take prestarted pairs (depth 0: none;
    None: `default_depth()`). Nested blocks share the outermost one's spares."""
    global _active
    depth = default_depth() if depth is None else depth
    with _active_lock:
        outer = _active
        mine = PrestartedWorkers(depth) if outer is None and depth > 0 else None
        if mine is not None:
            _active = mine
    try:
        yield outer or mine
    finally:
        if mine is not None:
            with _active_lock:
                _active = None
            mine.close()


def worker_pair(sandbox: SandboxConfig, backend: str, writable: list[Path] | None = None,
                trusted: bool = False, env: dict[str, str] | None = None) -> WorkerPair:
    """A pair for one evaluation: prestarted when a `prestarted_workers` block is open and the pair
    is started the same way for every evaluation (not a single-file candidate's, whose extension
    build folder is its own); arguments as for `start_pair`."""
    spares = _active
    if spares is not None and (trusted or not writable):
        kind = PairKind(trusted, tuple(writable or ()), tuple(sorted((env or {}).items())))
        return spares.take(sandbox, backend, kind)
    return start_pair(sandbox, backend, writable, trusted, env)

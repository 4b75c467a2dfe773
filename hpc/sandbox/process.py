"""A sandboxed worker process: `python -m hpc.runner ROLE`, spoken to over two pipes.

Started by the one launcher (hpc/sandbox/launch.py), so it is pid 1 of its own PID namespace with
a fresh /proc (it sees no other process; when it ends, everything it started ends), in an empty
network namespace, in a cgroup of its own (memory, tasks, cores, the freezer: hpc.sandbox.cgroup),
with rlimits (address space on cpu, CPU seconds, open files, file size, no core dumps), as uid
`sandbox.run_as_uid` where the harness is root (hpc.sandbox.launch.run_as), under seccomp
(`trusted` workers, the harness's reference and baselines, may open sockets; candidate workers
none off the GPU) and Landlock: it reads only the system, the
Python installation, the hpc package, its workdir and the `readable` paths given at start, and
writes only its workdir, the `writable` paths, /dev/null and, on cuda, the NVIDIA device nodes;
it can neither signal nor connect to anything outside. It is always a fresh interpreter:
nothing of the harness or of another candidate lives in its memory.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpc.config import SandboxConfig
from hpc.sandbox import launch
from hpc.sandbox.messages import (CANDIDATE_KINDS, WORKER_KINDS, Exit, FailureKind, Load, Reply, Request, decode,
                                  reported_kind)
from hpc.sandbox.protocol import ChannelClosed, ChannelTimeout, encode_json, read_reply, write_message

STDERR_NAME = "stderr.log"
R = TypeVar("R", bound=Reply)
log = logging.getLogger(__name__)


class SandboxError(Exception):
    """The sandboxed process failed: crashed, timed out, or reported an error. `reason` says how,
    `kind` (a FailureKind; ValueError for any other) whose fault it is."""

    def __init__(self, reason: str, kind: FailureKind = FailureKind.ERROR):
        super().__init__(reason)
        self.reason = reason
        self.kind = FailureKind(kind)


@functools.lru_cache(maxsize=None)
def isolation_support() -> dict[str, object]:
    """What this machine lets us use: probed once per harness process, recorded with results.
    `run_as_uid`: the uid workers run as under the default config (None: they stay uid 0, or, for
    a root harness, cannot start: `run_as_refused` says why)."""
    try:
        return {**launch.probe(), "run_as_uid": launch.run_as(SandboxConfig().run_as_uid, launch.python_readable())}
    except launch.LaunchError as e:
        return {**launch.probe(), "run_as_uid": None, "run_as_refused": str(e)}


# inductor's compiler proper: its entry point, graph lowering, scheduling, code generation, the
# build and load of what it generates and of compiled graphs from its cache. Not the parts that
# `import torch._dynamo` takes (config, utils, cpp_builder, ...), which torch enters for every
# TorchDispatchMode (the harness's trials run under one), so dynamo itself stays readable.
_INDUCTOR_COMPILER = ("compile_fx.py", "graph.py", "scheduler.py", "lowering.py", "codegen", "kernel", "codecache.py",
                      "output_code.py", "async_compile.py", "compile_worker")


@functools.lru_cache(maxsize=1)
def compilers_of_torch() -> tuple[str, ...]:
    """Inductor's compiler, which a candidate's process may not read (so cannot run): a candidate
    that torch.compiled the task's expression at import and called inductor's kernels in its
    timed frames was paid 3, 2, 2; the op monitor sees aten ops, not inductor's generated code, and
    the static check that refused torch.compile was the only guard. Without these no backend of
    torch.compile runs (aot_autograd imports codecache)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return ()
    inductor = os.path.join(list(spec.submodule_search_locations)[0], "_inductor")
    return tuple(p for p in (os.path.join(inductor, name) for name in _INDUCTOR_COMPILER) if os.path.exists(p))


def seccomp_profile(trusted: bool, backend: str) -> str:
    """strict (no AF_UNIX sockets) for an untrusted program off the GPU; gpu (sockets, but no
    connect and no addressed send) on it, since the CUDA driver fails at init without an AF_UNIX
    socket (error 304, seen on the H200 2026-12-02); trusted for the harness's own programs."""
    if trusted:
        return "trusted"
    return "gpu" if backend == "cuda" else "strict"


def worker_policy(cfg: SandboxConfig, backend: str, workdir: Path, readable: list[str], writable: list[str],
                  trusted: bool = False, pass_fds: tuple[int, ...] = (), join: SandboxedProcess | None = None
                  ) -> launch.Policy:
    """How a worker (or a test standing for one) is confined; hands `workdir` and `writable` to
    the uid it will run as."""
    readable = [*launch.python_readable(), *launch.tool_readable(*launch.inline_compilers()), str(workdir),
                *readable]
    writable = [str(workdir), *writable]
    uid = launch.run_as(cfg.run_as_uid, readable, writable)
    if join is not None and join.isolation.get("uid") == 0:
        uid = None   # one evaluation's workers share a uid (CUDA IPC between them)
    if join is not None and uid is not None and join.isolation.get("uid") != uid:
        log.warning("sandbox: a worker joins one of uid %s as uid %s", join.isolation.get("uid"), uid)
    launch.give(uid, writable)
    devices = glob.glob("/dev/nvidia*") if backend == "cuda" else []
    memory = int(cfg.memory_gb * (1 << 30))
    limits = launch.Limits(cpu_seconds=cfg.cpu_seconds, open_files=cfg.max_open_files,
                           file_bytes=cfg.max_file_mb << 20, processes=cfg.max_processes,
                           memory_bytes=memory if backend == "cpu" else None)
    return launch.Policy(
        readable=tuple(readable) if cfg.restrict_reads else None,
        unreadable=() if trusted else compilers_of_torch(),
        writable=tuple(writable + devices) if cfg.restrict_writes else None,
        network=not cfg.isolate_network, seccomp=seccomp_profile(trusted, backend), uid=uid, limits=limits,
        pass_fds=pass_fds, join=None if join is None else join.pidfd, memory_bytes=memory)


@dataclass
class ExitInfo:
    returncode: int | None
    reason: str


# glibc's allocator moves its thresholds for handing freed memory back to the system with what the
# process freed before: a process whose thresholds moved pays its large tensors' page faults again
# on every call (7076 faults a call against 273, 3.3x slower, between two fresh processes timing the
# same eager model: docs/benchmarks.md). Fixed thresholds, the same in every timed process, take
# that history out of every figure. The heap on transparent huge pages (glibc.malloc.hugetlb=1:
# glibc advises its heap and its mapped chunks MADV_HUGEPAGE) takes out where each 4 KiB page of a
# tensor landed in physical memory, which each process draws anew: on the nine CPU rows that moved
# most, 8 of 9 held within 3% over 3 runs, against 4 of 9 on 4 KiB pages (docs/benchmarks.md).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                 "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


class SandboxedProcess:
    """One worker process in the sandbox. Use as a context manager; `request` sends and awaits a reply.

    `pass_fds` stay open in the worker under the same numbers; `readable` are more paths it may
    read; `trusted` is for the harness's own programs (a lighter seccomp profile); `join` starts
    it in the PID namespace (and as the uid) of another worker, which CUDA IPC between the two
    needs. `worker_pid` is the worker's host pid."""

    def __init__(self, role: str, workdir: Path, cfg: SandboxConfig, backend: str,
                 env: dict[str, str] | None = None, writable: list[Path] | None = None,
                 pass_fds: tuple[int, ...] = (), readable: tuple[str | Path, ...] = (), trusted: bool = False,
                 join: SandboxedProcess | None = None):
        self.role, self.workdir, self.cfg = role, Path(workdir), cfg
        self.deadline = time.monotonic() + cfg.timeout_s
        self.ran_candidate = False   # set by the first load of a candidate (`send`)
        self._exit_info: ExitInfo | None = None
        self._final_tail = ""
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        try:   # replies carry whole output tensors: fewer, larger pipe transfers
            fcntl.fcntl(self._from_child, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass   # above /proc/sys/fs/pipe-max-size: keep the default
        child_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir / "tmp"), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": launch.python_path_dir(), "HPC_BACKEND": backend,
            "CUDA_CACHE_PATH": str(self.workdir / ".nv"), "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / "inductor"),
            **STEADY_MALLOC,
        }
        for key in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "LANG", "LC_ALL", "CXX", "NVCC",
                    "CUDA_HOME"):
            if key in os.environ:
                child_env[key] = os.environ[key]
        child_env.update(env or {})
        # the harness reads the worker's stderr through this descriptor only: the worker may
        # replace the file's name (with a link to a secret, say), never what this one points at
        self._stderr = open(self.workdir / STDERR_NAME, "w+b")
        fds = (to_child_r, from_child_w, *pass_fds)
        try:
            policy = worker_policy(cfg, backend, self.workdir, [str(p) for p in readable],
                                   [str(p) for p in writable or []], trusted, fds, join)
            self.proc = launch.spawn([sys.executable, "-m", "hpc.runner", role, str(to_child_r), str(from_child_w)],
                                     policy, cwd=self.workdir, env=child_env, stdout=self._stderr,
                                     stderr=self._stderr)
        except (launch.LaunchError, OSError) as e:
            self._stderr.close()
            for fd in (self._to_child, self._from_child):
                os.close(fd)
            raise SandboxError(f"cannot start the {role} process: {e}") from None
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.worker_pid = self.proc.worker_pid
        self.isolation = self.proc.isolation

    @property
    def pidfd(self) -> int | None:
        """A pidfd of the worker while it is open (for `join`); None once closed."""
        return self.proc.pidfd

    def processes(self) -> list[int]:
        """The worker and every process it started (its cgroup's; the worker alone without one)."""
        return self.proc.cgroup.pids() if self.proc.cgroup is not None else [self.worker_pid]

    def restart_clock(self) -> None:
        """Start the wall limit now: a process started ahead of its evaluation gets the whole limit."""
        self.deadline = time.monotonic() + self.cfg.timeout_s

    def request(self, request: Request, timeout: float | None = None) -> Reply:
        """Send one request and return its reply, decoded and checked; SandboxError on any failure."""
        self.send(request)
        return self.receive(request, timeout)

    def send(self, request: Request) -> None:
        """Send without waiting (pair with `receive`): two processes can then work at once."""
        if isinstance(request, Load) and request.program == "candidate":
            self.ran_candidate = True   # from here on, its replies are the candidate's words
        try:
            write_message(self._to_child, encode_json(request.to_message()))
        except BrokenPipeError:
            raise self._failure() from None

    def receive(self, request: Request, timeout: float | None = None) -> Reply:
        """The reply to `request`, which `send` sent."""
        deadline = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        try:
            reply = read_reply(self._from_child, deadline)
        except ChannelClosed:
            raise self._failure() from None
        except ChannelTimeout:
            self.kill()
            waited = self.cfg.timeout_s if timeout is None else timeout
            raise SandboxError(f"timed out after {waited:.0f} s in {request.op}", FailureKind.TIMEOUT) from None
        except Exception as e:   # undecodable reply: a hostile or broken worker
            self.kill()
            raise SandboxError(f"malformed reply from the {self.role} process: {type(e).__name__}: {e}") from None
        return checked_reply(reply, request.reply, self.role, CANDIDATE_KINDS if self.ran_candidate else WORKER_KINDS)

    def _failure(self) -> SandboxError:
        info = self.close()
        return SandboxError(info.reason, FailureKind.CRASH)

    def kill(self) -> None:
        """End the worker and everything it started, without waiting."""
        self.proc.kill()

    def close(self) -> ExitInfo:
        """Ask the worker to exit, then kill everything it started; describe how it ended (idempotent)."""
        if self._exit_info is not None:
            return self._exit_info
        if self.proc.poll() is None:
            try:
                write_message(self._to_child, encode_json(Exit().to_message()))
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        rc = self.proc.reap()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self._final_tail = self.stderr_tail(1 << 16)
        self._stderr.close()
        self._exit_info = ExitInfo(rc, _describe_exit(rc, self._final_tail, limits_hit(self.proc.exceeded, self.cfg)))
        return self._exit_info

    def stderr_tail(self, limit: int = 1500) -> str:
        if self._stderr.closed:
            return self._final_tail[-limit:].strip()
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            start = max(0, size - limit)
            return os.pread(self._stderr.fileno(), size - start, start).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def checked_reply(reply: object, expected: type[R], role: str, allowed: frozenset[FailureKind] = WORKER_KINDS) -> R:
    """A worker's reply (decoded JSON) as the `expected` type; SandboxError for a reported error
    (its kind one of `allowed`: hpc.sandbox.messages.CANDIDATE_KINDS once candidate code ran in the
    process) or a malformed reply (kind ERROR, charged to the process's program)."""
    if not isinstance(reply, dict):
        raise SandboxError(f"malformed reply from the {role} process")
    try:
        if "error" in reply:
            if set(reply) != {"error", "kind"} or not isinstance(reply["error"], str):
                raise ValueError("an error reply holds a message and a kind")
            kind = reported_kind(reply["kind"], allowed)
        else:
            return decode(expected, reply)
    except ValueError as e:
        raise SandboxError(f"malformed reply from the {role} process: {e}") from None
    raise SandboxError(reply["error"], kind)


def limits_hit(exceeded: list[str], cfg: SandboxConfig) -> str:
    """The cgroup limits a worker ran into (hpc.sandbox.cgroup.Cgroup.exceeded), named by their keys."""
    names = {"memory": f"its memory limit (sandbox.memory_gb = {cfg.memory_gb:g} GiB)",
             "tasks": f"its task limit (sandbox.max_processes = {cfg.max_processes})"}
    return " and ".join(names[e] for e in exceeded if e in names)


def _describe_exit(rc: int | None, stderr: str, hit: str = "") -> str:
    if hit:
        hit = f" (it went over {hit})"
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        what = f"killed by {name}{hit}"
        if -rc == signal.SIGXCPU:
            what += " (CPU time limit)"
    else:
        what = f"exited with code {rc}{hit}"
    last = stderr.strip().splitlines()[-3:] if stderr.strip() else []
    return what + (": " + " | ".join(last) if last else "")

"""A sandboxed worker process: `python -m hpc.runner ROLE`, spoken to over two pipes.

Isolation, where the OS allows each: its own process group (killed whole on timeout or
close), rlimits (address space on cpu, CPU seconds, open files, processes, file size, no core
dumps), its own empty network namespace, and Landlock so it writes only in its workdir (plus
/dev/null, its own /proc/self/task and, on cuda, the NVIDIA device nodes) and cannot signal
the harness. It is always a
fresh interpreter: nothing of the harness or of another candidate lives in its memory.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import glob
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.config import SandboxConfig
from hpc.sandbox import landlock
from hpc.sandbox.protocol import ChannelClosed, ChannelTimeout, encode_json, read_reply, write_message

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
STDERR_NAME = "stderr.log"


class SandboxError(Exception):
    """The sandboxed process failed: crashed, timed out, or reported an error. `reason` says which."""

    def __init__(self, reason: str, kind: str = "error"):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind   # error | crash | timeout


@functools.lru_cache(maxsize=None)
def isolation_support() -> dict[str, object]:
    """What this machine lets us use: probed once per harness process, recorded with results."""
    net = False
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if _enter_network_namespace() else 1)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    net = os.waitstatus_to_exitcode(status) == 0
    return {"landlock_abi": landlock.abi_version(), "network_namespace": net}


def _enter_network_namespace() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0:
        return libc.unshare(_CLONE_NEWNET) == 0
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def writable_paths(workdir: Path, backend: str, extra: list[Path]) -> list[str]:
    # /proc/self/task: drivers name their threads (the CUDA driver's init fails without it); in the
    # forked child it resolves to the worker's own process, nothing else of /proc.
    paths = [str(workdir), "/dev/null", "/proc/self/task", *map(str, extra)]
    if backend == "cuda":
        paths += glob.glob("/dev/nvidia*")
    return paths


def confine(cfg: SandboxConfig, backend: str, writable: list[str], abi: int, net: bool) -> None:
    """Runs in the forked child before exec: everything here is inherited by the worker."""
    limits = [(resource.RLIMIT_CPU, cfg.cpu_seconds), (resource.RLIMIT_NOFILE, cfg.max_open_files),
              (resource.RLIMIT_FSIZE, cfg.max_file_mb << 20), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NPROC, cfg.max_processes)]
    if backend == "cpu":
        limits.append((resource.RLIMIT_AS, int(cfg.memory_gb * (1 << 30))))
    for which, value in limits:
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))
    if net:
        _enter_network_namespace()
    if abi:
        landlock.restrict_writes([p for p in writable if os.path.exists(p)], abi)


@dataclass
class ExitInfo:
    returncode: int | None
    reason: str


class SandboxedProcess:
    """One worker process in the sandbox. Use as a context manager; `request` sends and awaits a reply."""

    def __init__(self, role: str, workdir: Path, cfg: SandboxConfig, backend: str,
                 env: dict[str, str] | None = None, writable: list[Path] | None = None,
                 pass_fds: tuple[int, ...] = (), readable: tuple[str, ...] = (), trusted: bool = False):
        self.role, self.workdir, self.cfg = role, Path(workdir), cfg
        self.deadline = time.monotonic() + cfg.timeout_s
        self._exit_info: ExitInfo | None = None
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        support = isolation_support()
        abi = int(support["landlock_abi"]) if cfg.restrict_writes else 0
        net = bool(support["network_namespace"]) and cfg.isolate_network
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        try:   # replies carry whole output tensors: fewer, larger pipe transfers
            fcntl.fcntl(self._from_child, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass   # above /proc/sys/fs/pipe-max-size: keep the default
        child_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir / "tmp"), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": _PACKAGE_ROOT, "HPC_BACKEND": backend, "CUDA_CACHE_PATH": str(self.workdir / ".nv"),
            "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / "inductor"),
        }
        for key in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "LANG", "LC_ALL", "CXX", "NVCC",
                    "CUDA_HOME"):
            if key in os.environ:
                child_env[key] = os.environ[key]
        child_env.update(env or {})
        self._stderr = open(self.workdir / STDERR_NAME, "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hpc.runner", role, str(to_child_r), str(from_child_w)],
                cwd=self.workdir, env=child_env, stdin=subprocess.DEVNULL, stdout=self._stderr,
                stderr=self._stderr, pass_fds=(to_child_r, from_child_w, *pass_fds), start_new_session=True,
                preexec_fn=functools.partial(confine, cfg, backend,
                                             writable_paths(self.workdir, backend, writable or []), abi, net),
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.isolation = {"landlock_abi": abi, "network_namespace": net}

    @property
    def worker_pid(self) -> int:
        """The worker process's pid in the harness's pid namespace."""
        return self.proc.pid

    def restart_clock(self) -> None:
        """Start the wall limit now: a process started ahead of its evaluation gets the whole limit."""
        self.deadline = time.monotonic() + self.cfg.timeout_s

    def request(self, message: dict, timeout: float | None = None):
        """Send one JSON message and return the decoded reply; SandboxError on any failure."""
        self.send(message)
        return self.receive(message.get("op", "?"), timeout)

    def send(self, message: dict) -> None:
        """Send without waiting (pair with `receive`): two processes can then work at once."""
        try:
            write_message(self._to_child, encode_json(message))
        except BrokenPipeError:
            raise self._failure() from None

    def receive(self, op: str, timeout: float | None = None):
        """The reply to the message `send` sent (`op` names it in a timeout's reason)."""
        deadline = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        try:
            reply = read_reply(self._from_child, deadline)
        except ChannelClosed:
            raise self._failure() from None
        except ChannelTimeout:
            self.kill()
            waited = self.cfg.timeout_s if timeout is None else timeout
            raise SandboxError(f"timed out after {waited:.0f} s in {op}", "timeout") from None
        except Exception as e:   # undecodable reply: a hostile or broken worker
            self.kill()
            raise SandboxError(f"malformed reply from the {self.role} process: {type(e).__name__}: {e}") from None
        if not isinstance(reply, dict):
            raise SandboxError(f"malformed reply from the {self.role} process")
        if reply.get("error"):
            raise SandboxError(str(reply["error"]), str(reply.get("kind", "error")))
        return reply

    def _failure(self) -> SandboxError:
        info = self.close()
        return SandboxError(info.reason, "crash")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> ExitInfo:
        """Ask the worker to exit, then kill its whole group; describe how it ended (idempotent)."""
        if self._exit_info is not None:
            return self._exit_info
        if self.proc.poll() is None:
            try:
                write_message(self._to_child, encode_json({"op": "exit"}))
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        rc = self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self._stderr.close()
        self._exit_info = ExitInfo(rc, _describe_exit(rc, self.stderr_tail()))
        return self._exit_info

    def stderr_tail(self, limit: int = 1500) -> str:
        try:
            with open(self.workdir / STDERR_NAME, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _describe_exit(rc: int | None, stderr: str) -> str:
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        what = f"killed by {name}"
        if -rc == signal.SIGXCPU:
            what += " (CPU time limit)"
    else:
        what = f"exited with code {rc}"
    last = stderr.strip().splitlines()[-3:] if stderr.strip() else []
    return what + (": " + " | ".join(last) if last else "")

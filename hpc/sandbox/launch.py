"""One launcher for everything the evaluator runs confined: sandboxed workers, the compiler and
the agent's bash tool. `spawn(argv, policy)` starts a program under a `Policy` and returns a
`Confined` handle whose `kill()` ends it and everything it started.

Threat model: the program runs arbitrary native code and may rewrite its own libc or
interpreter in memory, so every defense is outside its process: the kernel (namespaces,
Landlock, seccomp, rlimits, uids) and the stub process below.

How a program starts. The harness starts a stub (hpc/sandbox/stub.py, `python -I -S`, standard
library only) with the program's environment and passed fds. The stub:
  1. enters a new PID namespace and network namespace (unless the policy allows network) and,
     for a non-root harness, a user namespace that maps only the harness's own uid; or joins the
     PID namespace (and user namespace) of another confined process (`Policy.join`, a pidfd), so
     that legacy CUDA IPC, which checks the exporter's pid, works between an evaluation's two
     workers;
  2. forks the program, which is pid 1 of its new PID namespace. In that child: a private mount
     namespace with a fresh /proc (it shows only that PID namespace), rlimits, the uid drop
     (`Policy.uid`; a process that stays root drops every capability instead), SIGKILL when the
     stub dies (PR_SET_PDEATHSIG), Landlock on reads and writes (paths opened before the uid
     drop), seccomp (hpc/sandbox/seccomp.py: a hand-written BPF deny list, since no maintained
     binding ships PyPI wheels and the filter is small), exec;
  3. reports the program's host pid and the isolation actually in force over a pipe, and waits.
When pid 1 of a PID namespace dies the kernel kills everything in it, so ending the program (or
the stub, through PR_SET_PDEATHSIG) ends every process it started, setsid daemons included.
Where PID namespaces are not available the stub is a child subreaper instead: orphans of the
program become its children, and it kills them all once the program has ended. The stub's
process group (a new session) is killed as the last layer.

Harness access: the program is never made undumpable; a root harness keeps ptrace-read access
(CAP_SYS_PTRACE), a non-root one owns the user namespace the program runs in.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from hpc.profile.cores import compile_cores
from hpc.sandbox import cgroup, seccomp, stub
from hpc.sandbox.tempdirs import owned_tempdir

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]          # the hpc package
# the folder the running package was imported from (inside a sandbox: the link folder, not the repository)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STUB = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from hpc.sandbox.stub import main; main()"
START_TIMEOUT_S = 60.0

# What every confined program may read: the system's programs and libraries, and from /etc only
# what the loader, libc and Python read (not shadow files, keys or credentials).
SYSTEM_READABLE = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys",
                   "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
                   *(f"/etc/{name}" for name in (
                       "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "passwd", "group",
                       "nsswitch.conf", "host.conf", "hosts", "resolv.conf", "gai.conf", "localtime", "timezone",
                       "os-release", "debian_version", "lsb-release", "mime.types", "locale.alias", "ssl")))
SYSTEM_WRITABLE = ("/dev/null",)
# What a compiler reads of the system: programs, libraries, headers and the loader's files; no
# device (`#include "/dev/zero"` drove cc1plus to 23 GB), no /sys, no /proc, no home folder.
TOOLCHAIN_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                    *(f"/etc/{name}" for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives")))



class LaunchError(Exception):
    """The program could not be started confined as its policy asks."""


@dataclass(frozen=True)
class Limits:
    """rlimits of the program and everything it starts (None: inherited). Core dumps are always off."""

    cpu_seconds: int | None = None
    memory_bytes: int | None = None      # address space
    file_bytes: int | None = None        # largest file it may write
    open_files: int | None = None
    processes: int | None = None         # the program's cgroup's tasks (pids.max), and RLIMIT_NPROC per uid


@dataclass(frozen=True)
class Policy:
    """What a confined program may do. Paths are added to `system` (SYSTEM_READABLE unless said) /
    SYSTEM_WRITABLE and, with `proc`, the program's own /proc entries; `readable` None leaves reads
    unconfined, `writable` None writes."""

    readable: tuple[str, ...] | None = ()
    writable: tuple[str, ...] | None = ()
    network: bool = False                # False: an empty network namespace, no TCP (Landlock)
    seccomp: str = "strict"              # strict | gpu | trusted (seccomp.py says what each allows) | off
    uid: int | None = None               # a root harness runs the program as this uid (and gid)
    limits: Limits = field(default_factory=Limits)
    pass_fds: tuple[int, ...] = ()       # stay open in the program under the same numbers
    join: int | None = None              # pidfd of a confined program whose PID namespace to share
    pid_namespace: bool = True           # False: the subreaper sweep alone (as where the kernel refuses one)
    landlock: bool = True
    background: bool = False             # lowest CPU priority (SCHED_IDLE), off the cores kept for timing
                                         # (hpc.profile.cores): never slows a timed run beside it
    memory_bytes: int | None = None      # what its cgroup may hold (memory.max, swap off): every page of its
                                         # processes, memfd and tmpfs pages included
    system: tuple[str, ...] = SYSTEM_READABLE   # what it reads of the system (TOOLCHAIN_SYSTEM: a compiler's)
    proc: bool = True                    # it reads its own /proc entries
    unreadable: tuple[str, ...] = ()     # folders inside `readable` whose files it may not read (listed only)

    def __post_init__(self):
        if self.seccomp not in (*seccomp.PROFILES, "off"):
            raise ValueError(f"seccomp must be one of {', '.join(seccomp.PROFILES)}, off; got {self.seccomp!r}")


class Confined:
    """A started program (Popen-like: `pid` is the stub's, `poll`, `wait`, `returncode`).

    `worker_pid` is the program's host pid; `isolation` what was in force; `cgroup` its own group
    (None for a program started from inside a sandbox, which stays in that sandbox's group).
    `kill()` ends the program and everything it started without waiting; `reap()` also waits,
    kills the stub's process group (the last layer), reads which cgroup limits the program ran
    into (`exceeded`) and removes its group."""

    def __init__(self, popen: subprocess.Popen, worker_pid: int, isolation: dict[str, object],
                 group: cgroup.Cgroup | None = None):
        self.popen, self.worker_pid, self.isolation, self.cgroup = popen, worker_pid, isolation, group
        self.exceeded: list[str] = []
        try:
            self.pidfd: int | None = os.pidfd_open(worker_pid)
        except OSError:   # already gone
            self.pidfd = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
        if self.popen.returncode is None:
            try:   # the stub kills the program (and, without a PID namespace, sweeps its orphans)
                os.kill(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float = 10.0) -> int:
        """Kill everything, wait for the stub, then kill its process group; the exit status."""
        self.kill()
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("sandbox stub %d did not end in %.0f s: killing its group", self.popen.pid, timeout)
            rc = None
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if rc is None:
            rc = self.popen.wait()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.cgroup is not None:
            self.exceeded = self.cgroup.exceeded()
            if not self.cgroup.remove():
                log.warning("sandbox: cgroup %s could not be removed", self.cgroup.name)
            self.cgroup = None
        return rc


def spawn(argv: list[str], policy: Policy, *, cwd: str | os.PathLike, env: dict[str, str],
          stdin=subprocess.DEVNULL, stdout=None, stderr=None) -> Confined:
    """Start `argv` confined by `policy`; returns once it has exec'd (LaunchError if it could not)."""
    if policy.uid is not None and not can_switch_uid():
        raise LaunchError("a uid to run as needs a root harness (with its capabilities)")
    cpus = sorted(compile_cores()) if policy.background or policy.seccomp in ("strict", "gpu") else None
    group = _group(policy, cpus)
    readable, listable = ((None, []) if policy.readable is None
                          else carve([*policy.system, *policy.readable], policy.unreadable))
    writable = None if policy.writable is None else [*SYSTEM_WRITABLE, *policy.writable]
    spec = {"readable": readable, "listable": listable, "proc": policy.proc, "writable": writable,
            "network": policy.network, "seccomp": policy.seccomp, "uid": policy.uid,
            "limits": {k: v for k, v in asdict(policy.limits).items() if v is not None},
            "pass_fds": list(policy.pass_fds), "join": policy.join, "landlock": policy.landlock,
            "pid_namespace": policy.pid_namespace, "background": policy.background,
            "reach": [*(readable or []), *(writable or []), str(cwd), _program_path(argv[0], env)],
            "cgroup": None if group is None else {"procs": group.procs_files(),
                                                  "dirs": sorted({str(d) for d in group.dirs.values()}),
                                                  "freezer": group.versions["freezer"]}}
    try:
        return _start(argv, policy, spec, group, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
    except BaseException:
        if group is not None:
            group.remove()
        raise


def carve(readable: list[str], unreadable: Iterable[str]) -> tuple[list[str], list[str]]:
    """`readable` less the folders `unreadable` and all beneath them, as Landlock takes it: (what
    may be read, the folders on the way that may only be listed). A folder holding an unreadable
    one is replaced by its entries, down to the unreadable one; its entries stay listable, so
    Python's import system still lists the package around it (and finds the module it cannot read)."""
    hidden = [os.path.realpath(p) for p in unreadable]
    out, listable, work = [], [], [os.path.realpath(p) for p in readable]
    while work:
        root = work.pop()
        if any(root == h or root.startswith(h + os.sep) for h in hidden):
            continue
        if not any(h.startswith(root.rstrip(os.sep) + os.sep) for h in hidden) or not os.path.isdir(root):
            out.append(root)
            continue
        listable.append(root)
        try:
            work += [os.path.realpath(os.path.join(root, name)) for name in os.listdir(root)]
        except OSError:
            continue
    return sorted(set(out)), sorted(set(listable))


def _program_path(name: str, env: dict[str, str]) -> str:
    """Where `name` is found on the program's PATH (itself when it holds a slash or is not found)."""
    if "/" in name:
        return name
    return shutil.which(name, path=env.get("PATH", os.defpath)) or name


def _group(policy: Policy, cpus: list[int] | None) -> cgroup.Cgroup | None:
    """The program's own cgroup; None where this process is itself a confined program (a
    compile that a sandboxed `python` asks for stays in that sandbox's group, which bounds it).
    LaunchError where the machine cannot give it one."""
    limits = cgroup.Limits(memory_bytes=policy.memory_bytes, tasks=policy.limits.processes,
                           cpus=None if cpus is None else frozenset(cpus))
    try:
        return cgroup.Cgroup.create(limits)
    except cgroup.CgroupUnavailable as e:
        if cgroup.inside_sandbox():
            return None
        raise LaunchError(f"sandbox: {e}") from None


def _start(argv: list[str], policy: Policy, spec: dict, group: cgroup.Cgroup | None, *, cwd, env, stdin, stdout,
           stderr) -> Confined:
    status_r, status_w = os.pipe()
    fds = (*policy.pass_fds, status_w, *(() if policy.join is None else (policy.join,)))
    try:
        popen = subprocess.Popen([sys.executable, "-I", "-S", "-c", _STUB, json.dumps(spec), str(status_w), *argv],
                                 cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=fds,
                                 start_new_session=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        report = _read_reports(status_r)
    finally:
        os.close(status_r)
    if "error" in report or "pid" not in report:
        popen.kill()
        popen.wait()
        raise LaunchError(str(report.get("error", "the sandbox stub exited before starting the program")))
    pid = int(report.pop("pid"))
    if group is not None:
        report["cgroup"] = cgroup.support().describe()
    return Confined(popen, pid, report, group)


def _read_reports(fd: int) -> dict:
    """The stub's and the child's JSON lines, merged, until the pipe closes (at exec)."""
    data, deadline = b"", time.monotonic() + START_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {"error": f"the sandbox did not start the program in {START_TIMEOUT_S:.0f} s"}
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    report: dict = {}
    for line in data.splitlines():
        report.update(json.loads(line))
    return report


def run(argv: list[str], policy: Policy, *, cwd: str | os.PathLike, env: dict[str, str], timeout: float,
        output_limit: int = 1 << 20) -> tuple[int | None, str, list[str]]:
    """Run to completion with stdout and stderr together; (exit code, or None on timeout, output,
    the cgroup limits it ran into: Cgroup.exceeded).
    The output goes through an unlinked file, so a program printing without end costs disk (up
    to its file-size limit), never memory; head and tail are kept past `output_limit`."""
    with tempfile.TemporaryFile() as out:
        proc = spawn(argv, policy, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        rc = proc.reap()
        size = out.seek(0, os.SEEK_END)
        out.seek(0)
        if size <= output_limit:
            text = out.read().decode("utf-8", "replace")
        else:
            head = out.read(output_limit // 2)
            out.seek(size - output_limit // 2)
            text = (head.decode("utf-8", "replace") + f"\n[... {size - output_limit} bytes ...]\n"
                    + out.read().decode("utf-8", "replace"))
    return (None if timed_out else rc), text, proc.exceeded


@functools.lru_cache(maxsize=None)
def probe() -> dict[str, object]:
    """What this machine lets a confined program have, found by starting one (once per process)."""
    true = shutil.which("true") or "/bin/true"
    proc = spawn([true], Policy(), cwd="/", env={"PATH": "/usr/bin:/bin"})
    proc.reap()
    return proc.isolation


# -- what a confined program may read ------------------------------------------------------------

def python_readable() -> list[str]:
    """What a Python program of this toolkit reads: the interpreter, its standard library,
    site-packages (torch), the hpc package and the folder that puts it on PYTHONPATH."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    extra = [str(PACKAGE_DIR), python_path_dir()]
    if os.environ.get("CUDA_HOME"):
        extra.append(os.environ["CUDA_HOME"])
    return [p for p in [*sorted(paths), *extra] if os.path.exists(p)]


def tool_readable(*names: str) -> list[str]:
    """The install folders (the parent of bin/) of the named programs found on PATH: what a
    compiler needs beside the system (its cc1plus, headers and libraries under /opt/gcc, say)."""
    found = []
    for name in names:
        path = shutil.which(name)
        if path:
            found.append(os.path.dirname(os.path.dirname(os.path.realpath(path))))
    return [p for p in dict.fromkeys(found) if p != "/"]


def inline_compilers() -> tuple[str, ...]:
    """What torch.utils.cpp_extension.load_inline runs in a program: the C++ compiler it picks
    (CXX, else c++) and nvcc."""
    return (os.environ.get("CXX", "c++"), "nvcc")


_path_dir: str | None = None
_path_dir_lock = threading.Lock()


def python_path_dir() -> str:
    """A folder holding only a link to the hpc package: PYTHONPATH for confined programs, so the
    repository around the package (its solutions and tests) need not be readable. One per
    harness process (threads starting workers at once must agree on it)."""
    global _path_dir
    with _path_dir_lock:
        if _path_dir is None:
            path, _owner = owned_tempdir("hpc-pythonpath-")   # the lock held for the process's life
            folder = str(path)
            os.chmod(folder, 0o755)
            os.symlink(PACKAGE_DIR, os.path.join(folder, "hpc"), target_is_directory=True)
            atexit.register(shutil.rmtree, folder, True)
            _path_dir = folder
        return _path_dir


# -- the uid a root harness runs programs as -----------------------------------------------------

def run_as(uid: int, readable: Iterable[str], writable: Iterable[str] = ()) -> int | None:
    """`uid` when this harness is root (None otherwise, and for `uid` -1: the config's choice to
    stay uid 0, without capabilities). The folders above every path that `uid` may not search are
    covered for the program alone (the stub's `_reach`), and `writable` is handed to it by the
    caller (`give`); LaunchError, in one line, where `uid` cannot read a path of `readable` itself:
    never a silent fallback to root."""
    if uid < 0 or not can_switch_uid():
        return None
    handed = [os.path.realpath(p) for p in writable]
    for path in readable:
        real = os.path.realpath(path)
        if any(real == h or real.startswith(h + os.sep) for h in handed):
            continue
        if os.path.exists(path) and not _mode_allows(real, uid, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise LaunchError(f"uid {uid} cannot read {path}: make it readable to others (chmod -R o+rX), or set "
                              f"sandbox.run_as_uid: -1 to run confined programs as uid 0 without capabilities")
    return uid


@functools.lru_cache(maxsize=1)
def can_switch_uid() -> bool:
    """Root with the capabilities to change uid and hand files over (not so inside a sandbox)."""
    needed = (1 << 0) | (1 << 6) | (1 << 7)   # CAP_CHOWN, CAP_SETGID, CAP_SETUID
    return os.geteuid() == 0 and stub.capabilities("CapEff") & needed == needed


def _mode_allows(path: str, uid: int, want: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == uid else 0
    return (st.st_mode >> shift) & want == want


def give(uid: int | None, paths: Iterable[str | os.PathLike]) -> None:
    """Make `paths` (and everything beneath, links not followed) owned by `uid`, for writing. The
    walk goes by folder descriptors (os.fwalk), each name changed relative to its folder's: a
    program of that uid that swaps a folder for a link while the walk runs (a root harness walks
    it) moves nothing outside."""
    if uid is None:
        return
    for root in paths:
        os.chown(root, uid, uid, follow_symlinks=False)
        if os.path.isdir(root) and not os.path.islink(root):
            for _folder, dirs, files, folder_fd in os.fwalk(root, follow_symlinks=False):
                for name in dirs + files:
                    try:
                        os.chown(name, uid, uid, dir_fd=folder_fd, follow_symlinks=False)
                    except FileNotFoundError:   # removed meanwhile
                        pass

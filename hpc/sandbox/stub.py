"""The launcher's stub: the small process between the harness and a confined program.

It runs as `python -I -S` (no site, no environment influence), imports only the standard library
and the Landlock and seccomp helpers, enters the namespaces, forks the program, confines it
before exec (hpc/sandbox/launch.py says in what order and why), reports its pid and the
isolation in force, and waits: it ends the way the program ended. Without a PID namespace it is
the program's child subreaper and kills every orphan once the program has ended. SIGTERM asks
it to kill the program (and so, the PID namespace).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
from pathlib import Path

from hpc.sandbox import cgroup, landlock, seccomp

# Without a fresh /proc: the program's own /proc/<pid> and global files that say nothing of others.
_PROC_GLOBAL = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg", "/proc/uptime", "/proc/version",
                "/proc/filesystems", "/proc/devices", "/proc/sys", "/proc/driver/nvidia")
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 12, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT = 1, 24, 28, 47
_PR_SET_CHILD_SUBREAPER, _PR_CAP_AMBIENT_CLEAR_ALL = 36, 4
_SECBITS = 0b11000011   # NOROOT, NO_CAP_AMBIENT_RAISE and their locks: exec as root grants nothing
_LIMITS = {"cpu_seconds": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_AS,
           "file_bytes": resource.RLIMIT_FSIZE, "open_files": resource.RLIMIT_NOFILE,
           "processes": resource.RLIMIT_NPROC}


def capabilities(which: str) -> int:
    """A capability set of this process from /proc/self/status (CapEff, CapBnd, ...)."""
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(which + ":")).split()[1], 16)


def main() -> None:
    """Entry point: `python -I -S -c ... main()` SPEC_JSON STATUS_FD ARGV..."""
    spec, status_fd, argv = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    harness = os.getppid()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.set_inheritable(status_fd, False)
    report: dict[str, object] = {}
    try:
        program = _which(argv[0])
        pidns = _enter_namespaces(spec, report)
        if not pidns:
            _prctl(_PR_SET_CHILD_SUBREAPER, 1, "PR_SET_CHILD_SUBREAPER")
        life_r, life_w = os.pipe()
        pid = os.fork()
    except OSError as e:
        _say(status_fd, {"error": f"sandbox: {e}"})
        os._exit(127)
    if pid == 0:
        try:
            os.close(life_w)
            _say(status_fd, _confine_child(spec, pidns, life_r))
            os.execv(program, argv)
        except BaseException as e:   # noqa: BLE001 - whatever it was, the program must not start
            _say(status_fd, {"error": f"sandbox: {type(e).__name__}: {e}"})
        os._exit(127)
    os.close(life_r)
    child = os.pidfd_open(pid)
    signal.signal(signal.SIGTERM, lambda *_: _pidfd_kill(child))
    for fd in spec["pass_fds"] + ([] if spec["join"] is None else [spec["join"]]):
        os.close(fd)
    _say(status_fd, {"pid": pid, **report})
    os.close(status_fd)
    orphaned = _kill_when_orphaned(child, harness)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0
            break
    if not pidns:
        _sweep()
    if orphaned and spec["cgroup"] is not None:   # else the harness reads what the group ran into, then removes it
        cgroup.remove_dirs([Path(d) for d in spec["cgroup"]["dirs"]], spec["cgroup"]["freezer"])
    _exit_like(status)


def _which(name: str) -> str:
    """The program's path, looked up on PATH now: after Landlock the lookup could not read what
    it imports."""
    if "/" in name:
        return name
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise OSError(2, f"{name}: command not found")


def _say(fd: int, message: dict) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _kill_when_orphaned(pidfd: int, harness: int) -> bool:
    """Return when the program has ended; kill it if the harness that started this stub dies first
    (and say so). A program normally ends when its pipes close, but one the harness had frozen
    (while another program of its window was timed) never reads that end: it would stay forever."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    orphaned = False
    while not poller.poll(1000):
        if os.getppid() != harness:
            orphaned = True
            _pidfd_kill(pidfd)
    return orphaned


def _pidfd_kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int, what: str) -> None:
    if _libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


def _unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")


def _enter_namespaces(spec: dict, report: dict) -> bool:
    """New (or joined) namespaces for the program; True when it will be pid 1 of a PID namespace."""
    root = os.geteuid() == 0 and capabilities("CapEff") & (1 << 21)   # CAP_SYS_ADMIN
    user = 0 if root else _CLONE_NEWUSER
    net = 0 if spec["network"] else _CLONE_NEWNET
    pid = _CLONE_NEWPID if spec["pid_namespace"] else 0
    if spec["join"] is not None:
        if _libc().setns(spec["join"], _CLONE_NEWPID | user) != 0:
            raise OSError(ctypes.get_errno(), "setns into the joined PID namespace failed")
        report.update(pid_namespace="joined", user_namespace=bool(user))
        try:
            if net:
                _unshare(net)
            report["network_namespace"] = bool(net)
        except OSError:
            report["network_namespace"] = False
        return True
    uid, gid = os.getuid(), os.getgid()
    for flags in dict.fromkeys((user | pid | net, user | net, 0)):
        try:
            if flags:
                _unshare(flags)
        except OSError:
            continue
        if flags & _CLONE_NEWUSER:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        report.update(pid_namespace=bool(flags & _CLONE_NEWPID), network_namespace=bool(flags & _CLONE_NEWNET),
                      user_namespace=bool(flags & _CLONE_NEWUSER))
        return bool(flags & _CLONE_NEWPID)
    raise AssertionError("unreachable: the last attempt enters no namespace")


def _confine_child(spec: dict, pidns: bool, life_r: int) -> dict[str, object]:
    """In the forked child, before exec: everything here holds for the program and its descendants."""
    libc = _libc()
    if spec["cgroup"] is not None:   # first: whatever runs from here on is bounded by the group
        for procs in spec["cgroup"]["procs"]:
            with open(procs, "w") as f:
                f.write("0")
    fresh_proc = private = False
    if pidns:
        try:
            _unshare(_CLONE_NEWNS)
            private = libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
            if not private or libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
                raise OSError(ctypes.get_errno(), "mount failed")
            fresh_proc = True
        except OSError:
            pass
    shadowed = [] if spec["uid"] is None else _reach(spec["reach"], spec["uid"], private)
    if spec["background"]:   # inherited by everything it starts (cc1plus, ptxas, ...)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    for name, value in spec["limits"].items():
        which = _LIMITS[name]
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    abi = landlock.abi_version() if spec["landlock"] else 0
    ruleset = None
    if abi and (spec["readable"] is not None or spec["writable"] is not None):
        proc_read = [] if not spec["proc"] else ["/proc"] if fresh_proc else ["/proc/self", *_PROC_GLOBAL]
        readable = None if spec["readable"] is None else [*spec["readable"], *proc_read]
        writable = None if spec["writable"] is None else [*spec["writable"], "/proc/self/task"]
        ruleset = landlock.Ruleset(readable, writable, abi, spec["listable"])
    if spec["uid"] is not None:
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    elif os.geteuid() == 0 and (capabilities("CapBnd") or capabilities("CapEff")):
        _drop_capabilities()   # a program of another uid (one a sandbox starts) holds none to drop
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    poller = select.poll()
    poller.register(life_r, select.POLLIN)
    if poller.poll(0):   # the stub died before the signal was armed
        os._exit(1)
    if ruleset is not None:
        ruleset.enforce()
    profile = spec["seccomp"]
    if profile != "off":
        if seccomp.arch() is None:
            profile = "unavailable"
        else:
            seccomp.install(profile)
    return {"proc": "fresh" if fresh_proc else "host", "landlock_abi": abi if ruleset is not None else 0,
            "shadowed": shadowed,
            "reads_confined": ruleset is not None and spec["readable"] is not None,
            "writes_confined": ruleset is not None and spec["writable"] is not None,
            "seccomp": profile, "uid": os.getuid(),
            "capabilities": os.geteuid() == 0 and capabilities("CapBnd") != 0}


def _searchable(path: str, uid: int) -> bool:
    """Whether `uid` (gid `uid`, no other groups) may search the folder `path`, by its mode bits."""
    st = os.stat(path)
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == uid else 0
    return bool((st.st_mode >> shift) & 1)


def _reach(paths: list[str], uid: int, private: bool) -> list[str]:
    """Let `uid` reach `paths` through folders it may not search (the interpreter under a root's
    home of mode 700, say), in this process's own mount namespace and nowhere else: each such
    folder is covered by an empty tmpfs it may search, holding only the entries on the way to
    `paths`, each bound back from the real one. Nothing else of the covered folder is there; what
    the program may read beneath is still Landlock's to say. Returns the covered folders."""
    targets = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    blocked = {"/".join(parts[:i]) for parts in (t.split("/") for t in targets) for i in range(2, len(parts))}
    blocked = sorted((b for b in blocked if not _searchable(b, uid)), key=lambda b: b.count("/"))
    if not blocked:
        return []
    libc = _libc()
    if not private:
        _unshare(_CLONE_NEWNS)
        if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "mount --make-rprivate / failed")
    for folder in blocked:
        names = sorted({t[len(folder) + 1:].split("/")[0] for t in targets if t.startswith(folder + "/")})
        held = {name: os.open(os.path.join(folder, name), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC) for name in names}
        st = os.stat(folder)
        options = f"mode=0755,uid={st.st_uid},gid={st.st_gid},size=64k".encode()
        if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
            raise OSError(ctypes.get_errno(), f"cannot cover {folder}")
        for name, fd in held.items():
            entry = os.path.join(folder, name)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(entry)
            else:
                open(entry, "w").close()
            if libc.mount(f"/proc/self/fd/{fd}".encode(), entry.encode(), None, _MS_BIND | _MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"cannot bind {entry} back")
            os.close(fd)
    return blocked


def _drop_capabilities() -> None:
    """Still uid 0: no capability now, none regained at exec, none raised later."""
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, "PR_CAP_AMBIENT_CLEAR_ALL")
    _prctl(_PR_SET_SECUREBITS, _SECBITS, "PR_SET_SECUREBITS")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap, "PR_CAPBSET_DROP")


def _exit_like(status: int) -> None:
    """End the stub the way the program ended, so the harness sees its signal or exit code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _sweep() -> None:
    """Subreaper without a PID namespace: kill every child (orphans of the program land here)
    until none is left."""
    me = os.getpid()
    while True:
        for pid in _children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(entry))
    return found


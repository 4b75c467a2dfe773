"""Every confined program in a cgroup of its own: its memory, its tasks and its cores are bounded
by the kernel, and it is held by the freezer, none of which it can undo.

Why cgroups and not what a process can see of itself: rlimits bound one process (RLIMIT_AS misses
pages written into a memfd and never mapped; RLIMIT_NPROC is never applied to uid 0), affinity is
a thread's own to change, and a program held with SIGSTOP resumes itself with any SIGCONT it can
have sent (a POSIX timer that fires every millisecond undid the harness's hold in round 3). A
cgroup holds everything the program starts: the kernel puts every child and thread in it.

One group per program, in each hierarchy it needs (`Cgroup.create`):
- memory: `memory.max` with swap off (v2), or `memory.limit_in_bytes` and the memory+swap limit
  (v1); every page the program's processes are charged for counts, memfd and tmpfs pages
  included, and going over is the kernel's out-of-memory kill inside the group, never outside.
- pids: `pids.max`, threads included, whatever the uid.
- cpuset: the cores it may run on, set by the harness (`set_cpus`) for a window and back after.
- freezer: `cgroup.freeze` (v2, a core file of every non-root group, with or without controllers)
  or `freezer.state` (v1); `freeze` returns only once the kernel reports the group frozen.
Each controller is found where this machine has it: a v1 hierarchy of its own, else the v2 one
(a machine with both, as this project's dev and CI machines, has v1 memory, pids and cpuset and
the v2 freezer). The groups are made under the harness's own group in each hierarchy; where a
controller is missing, or the harness may not make groups there, `support()` says which, and
nothing confined starts (hpc.sandbox.launch).

A program joins its group itself, before it execs (the stub's child writes "0" to each
`cgroup.procs`), so nothing it runs is ever outside it. The stub removes the group once the
program has ended, so a killed harness leaves none behind; `sweep` removes those of harness
processes that are gone.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

RESOURCES = ("memory", "pids", "cpuset")   # the controllers every group is made in
PREFIX = "hpc-"                            # hpc-<harness pid>-<n>-<random>
FREEZE_TIMEOUT_S = 10.0                    # a task in uninterruptible sleep freezes only when it leaves it
_counter = itertools.count()


class CgroupUnavailable(Exception):
    """This machine (or this harness) cannot give a program the cgroup it must run in."""


class FreezeError(Exception):
    """The group did not report frozen in time."""


@dataclass(frozen=True)
class Limits:
    """What a program's group bounds (None: not bounded beyond the harness's own group)."""

    memory_bytes: int | None = None    # everything its processes are charged for, swap off
    tasks: int | None = None           # processes and threads
    cpus: frozenset[int] | None = None


@dataclass(frozen=True)
class Hierarchies:
    """Where this harness makes groups: each controller's directory (the harness's own group in
    the hierarchy that has it) and which cgroup version each is."""

    dirs: dict[str, Path] = field(default_factory=dict)        # memory, pids, cpuset, freezer
    versions: dict[str, int] = field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        """For the record's isolation: each controller's version."""
        return {name: f"v{self.versions[name]}" for name in sorted(self.dirs)}


def _mounts() -> tuple[dict[str, tuple[Path, str]], tuple[Path, str] | None]:
    """The cgroup mounts of this mount namespace: v1 by controller (mount point, its root), and
    the v2 one."""
    v1: dict[str, tuple[Path, str]] = {}
    v2 = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, point = fields[3], Path(fields[4].replace("\\040", " "))
            if tail[0] == "cgroup2" and v2 is None:
                v2 = (point, root)
            elif tail[0] == "cgroup":
                for option in tail[2].split(","):
                    v1.setdefault(option, (point, root))
    return v1, v2


def _own_paths() -> tuple[dict[str, str], str | None]:
    """This process's group in each v1 hierarchy (by controller) and in the v2 one."""
    v1: dict[str, str] = {}
    v2 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and not controllers:
                v2 = path
            for name in controllers.split(","):
                v1[name] = path
    return v1, v2


def _under(mount: tuple[Path, str], path: str) -> Path:
    """A group's directory: its path as /proc/self/cgroup writes it, below the mount's root."""
    point, root = mount
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return point / rel.lstrip("/")


@functools.lru_cache(maxsize=1)
def support() -> Hierarchies:
    """Where this harness makes its programs' groups; CgroupUnavailable naming what is missing."""
    mounts_v1, mount_v2 = _mounts()
    own_v1, own_v2 = _own_paths()
    v2_dir = _under(mount_v2, own_v2) if mount_v2 is not None and own_v2 is not None else None
    v2_controllers = set(_read(v2_dir / "cgroup.controllers").split()) if v2_dir is not None else set()
    dirs: dict[str, Path] = {}
    versions: dict[str, int] = {}
    missing = []
    for name in RESOURCES:
        if name in mounts_v1 and name in own_v1:
            dirs[name], versions[name] = _under(mounts_v1[name], own_v1[name]), 1
        elif name in v2_controllers:
            dirs[name], versions[name] = v2_dir, 2
        else:
            missing.append(name)
    if v2_dir is not None:
        dirs["freezer"], versions["freezer"] = v2_dir, 2
    elif "freezer" in mounts_v1 and "freezer" in own_v1:
        dirs["freezer"], versions["freezer"] = _under(mounts_v1["freezer"], own_v1["freezer"]), 1
    else:
        missing.append("freezer")
    if missing:
        raise CgroupUnavailable(f"no {', '.join(missing)} cgroup controller on this machine (mount cgroup v2 with "
                                f"memory, pids and cpuset, or their v1 hierarchies and a freezer)")
    hierarchies = Hierarchies(dirs, versions)
    _enable_v2(hierarchies)
    for directory in set(dirs.values()):
        if not os.access(directory, os.W_OK):
            raise CgroupUnavailable(f"cannot make cgroups under {directory} (not writable by this harness: run it as "
                                    f"root, or in a cgroup v2 subtree delegated to its user)")
    sweep(hierarchies)
    return hierarchies


def _enable_v2(hierarchies: Hierarchies) -> None:
    """Turn the v2 controllers the groups use on for the harness's children."""
    wanted = {name for name in RESOURCES if hierarchies.versions[name] == 2}
    if not wanted:
        return
    directory = hierarchies.dirs[next(iter(wanted))]
    enabled = set(_read(directory / "cgroup.subtree_control").split())
    if wanted <= enabled:
        return
    try:
        _write(directory / "cgroup.subtree_control", " ".join(f"+{name}" for name in sorted(wanted - enabled)))
    except OSError as e:
        why = ("its group holds processes (cgroup v2 lets only an empty group share controllers): start the "
               "harness in a group of its own" if e.errno == errno.EBUSY else e.strerror)
        raise CgroupUnavailable(f"cannot enable {', '.join(sorted(wanted))} for the sandboxes under {directory}: "
                                f"{why}") from None


class Cgroup:
    """One program's group in every hierarchy (`dirs`, by controller). Made by the harness, joined
    by the program itself before it execs (`procs_files`), removed once it has ended."""

    def __init__(self, name: str, dirs: dict[str, Path], versions: dict[str, int]):
        self.name, self.dirs, self.versions = name, dirs, versions

    @classmethod
    def create(cls, limits: Limits, hierarchies: Hierarchies | None = None) -> Cgroup:
        """A new group with `limits`; CgroupUnavailable where it cannot be made."""
        hierarchies = hierarchies or support()
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        made: dict[str, Path] = {}
        group = cls(name, made, dict(hierarchies.versions))
        try:
            for controller, base in hierarchies.dirs.items():
                directory = base / name
                if directory not in made.values():
                    directory.mkdir()
                made[controller] = directory
            group._limit(limits, hierarchies)
        except OSError as e:
            group.remove()
            raise CgroupUnavailable(f"cannot make the program's cgroup: {e}") from None
        return group

    def _limit(self, limits: Limits, hierarchies: Hierarchies) -> None:
        memory, v = self.dirs["memory"], self.versions["memory"]
        if limits.memory_bytes is not None:
            if v == 2:
                _write(memory / "memory.max", str(limits.memory_bytes))
                _write_if(memory / "memory.swap.max", "0")
                _write_if(memory / "memory.oom.group", "1")   # the whole program ends, not one of its processes
            else:
                _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
                _write_if(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if limits.tasks is not None:
            _write(self.dirs["pids"] / "pids.max", str(limits.tasks))
        if self.versions["cpuset"] == 1:   # a v1 cpuset takes no task before it has cores and memory nodes
            base = hierarchies.dirs["cpuset"]
            _write(self.dirs["cpuset"] / "cpuset.mems", _read(base / "cpuset.mems").strip())
            if limits.cpus is None:
                _write(self.dirs["cpuset"] / "cpuset.cpus", _read(base / "cpuset.cpus").strip())
        if limits.cpus is not None:
            self.set_cpus(limits.cpus)

    def procs_files(self) -> list[str]:
        """The files a process writes "0" into to join the group (one per hierarchy)."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def pids(self) -> list[int]:
        """Every process in the group (host pids); [] once it is gone."""
        try:
            return sorted(int(p) for p in _read(self.dirs["freezer"] / "cgroup.procs").split())
        except OSError:
            return []

    # -- holding it ---------------------------------------------------------------------------

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> None:
        """Freeze every task of the group and return once the kernel says they are; FreezeError
        after `timeout` seconds. Nothing the program does resumes it: no signal, timer or child."""
        directory = self.dirs["freezer"]
        if self.versions["freezer"] == 2:
            _write(directory / "cgroup.freeze", "1")
        else:
            _write(directory / "freezer.state", "FROZEN")
        deadline, spins = time.monotonic() + timeout, 0
        while not self.frozen():
            if time.monotonic() > deadline:
                raise FreezeError(f"cgroup {self.name} was not frozen after {timeout:.1f} s "
                                  f"({len(self.pids())} processes)")
            spins += 1
            if spins > 200:
                time.sleep(0.0002)

    def frozen(self) -> bool:
        """Whether the kernel reports every task of the group frozen."""
        directory = self.dirs["freezer"]
        try:
            if self.versions["freezer"] == 2:
                return "frozen 1" in _read(directory / "cgroup.events").splitlines()
            return _read(directory / "freezer.state").strip() == "FROZEN"
        except OSError:
            return False

    def thaw(self) -> None:
        directory = self.dirs["freezer"]
        try:
            if self.versions["freezer"] == 2:
                _write(directory / "cgroup.freeze", "0")
            else:
                _write(directory / "freezer.state", "THAWED")
        except FileNotFoundError:
            pass   # removed: nothing left to thaw

    def set_cpus(self, cpus: frozenset[int] | set[int]) -> None:
        """Where every task of the group may run from now on (its own affinity cannot widen it)."""
        _write(self.dirs["cpuset"] / "cpuset.cpus", ",".join(str(c) for c in sorted(cpus)))

    def cpus(self) -> set[int]:
        return _parse_cpus(_read(self.dirs["cpuset"] / "cpuset.cpus"))

    # -- what it hit, and its end --------------------------------------------------------------

    def exceeded(self) -> list[str]:
        """The limits the group ran into: "memory" (the kernel killed a process of it for memory),
        "tasks" (a fork or thread was refused); [] where none."""
        hit = []
        memory = self.dirs["memory"]
        events = _counts(memory / ("memory.events" if self.versions["memory"] == 2 else "memory.oom_control"))
        if events.get("oom_kill", 0) > 0 or events.get("oom", 0) > 0:
            hit.append("memory")
        if _counts(self.dirs["pids"] / "pids.events").get("max", 0) > 0:
            hit.append("tasks")
        return hit

    def kill(self) -> None:
        """SIGKILL every process of the group (a v1-frozen one is thawed first, to die)."""
        directory = self.dirs["freezer"]
        if self.versions["freezer"] == 2 and (directory / "cgroup.kill").exists():
            try:
                _write(directory / "cgroup.kill", "1")
            except OSError:
                pass
            return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.versions["freezer"] == 1:
            self.thaw()

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left and remove the group's directories; whether all are gone."""
        return remove_dirs(list(self.dirs.values()), self.versions.get("freezer", 2), timeout)


def remove_dirs(dirs: list[Path], freezer_version: int, timeout: float = 5.0) -> bool:
    """Remove a group's directories (the stub calls this after its program has ended, with the
    paths alone): its processes killed, a v1 freezer thawed, each rmdir retried while its last
    tasks exit."""
    deadline = time.monotonic() + timeout
    left = list(dict.fromkeys(dirs))
    while True:
        for directory in list(left):
            try:
                for pid in _read(directory / "cgroup.procs").split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if freezer_version == 1 and (directory / "freezer.state").exists():
                    _write(directory / "freezer.state", "THAWED")
                directory.rmdir()
                left.remove(directory)
            except FileNotFoundError:
                left.remove(directory)
            except OSError:
                pass   # busy: its last task has not exited yet
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.005)


def sweep(hierarchies: Hierarchies) -> None:
    """Remove the groups of harness processes that are gone (killed before their stubs removed them)."""
    for base in set(hierarchies.dirs.values()):
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for entry in entries:
            if not entry.name.startswith(PREFIX) or not entry.is_dir():
                continue
            owner = entry.name[len(PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                remove_dirs([entry], hierarchies.versions.get("freezer", 2), timeout=0.5)


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _write_if(path: Path, value: str) -> None:
    """Write a file this kernel may not have (swap accounting off, an older kernel)."""
    if path.exists():
        _write(path, value)


def _counts(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file ("key value" lines) as numbers; {} where it is missing."""
    try:
        text = _read(path)
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _parse_cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def inside_sandbox() -> bool:
    """Whether this process runs in a group this toolkit made for a confined program (whose limits
    then bound whatever it starts)."""
    try:
        text = _read(Path("/proc/self/cgroup"))
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1].startswith(PREFIX) for line in text.splitlines())

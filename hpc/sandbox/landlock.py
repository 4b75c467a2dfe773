"""Linux Landlock through raw syscalls: confine a process's reads and writes to a few paths.

Unprivileged and inherited by every descendant; applied by the launcher (hpc.sandbox.launch) in
the confined child right before exec. One ruleset covers both: `readable` paths may be read,
listed and executed, `writable` ones also written. It also scopes signals and abstract UNIX
sockets (ABI >= 6), so the process can signal or connect to nothing outside its own domain
(Landlock also denies it ptrace of any process outside), and denies TCP bind/connect (ABI >= 4).
"""

from __future__ import annotations

import ctypes
import os
import stat

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # x86_64 and aarch64 share these numbers
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_WRITE_V1 = _WRITE_FILE | sum(1 << b for b in range(4, 13))   # remove dir/file, make char/dir/reg/sock/fifo/block/sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_READ = _READ_FILE | _READ_DIR | _EXECUTE
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE   # the rights a rule on a non-directory may hold
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """0 when Landlock is unavailable (old kernel, disabled, or blocked by seccomp)."""
    try:
        v = _libc().syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


class Ruleset:
    """Rules whose paths are opened now (O_PATH) and enforced later by `enforce`, so a rule can
    name a folder the process can no longer reach once it has dropped its uid.

    `readable` None: reads are not confined; `writable` None: writes are not confined;
    `listable`: folders whose entries may be listed (everywhere beneath them) but whose files are
    read only where `readable` says. Paths that do not exist are skipped."""

    def __init__(self, readable: list[str] | None, writable: list[str] | None, abi: int,
                 listable: list[str] = ()):
        self.abi = abi
        write = _WRITE_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
        self.handled = (_READ if readable is not None else 0) | (write if writable is not None else 0)
        self._rules: list[tuple[int, int, str]] = []
        try:
            for paths, rights in ((readable or [], _READ), (writable or [], _READ | write),
                                  (listable if readable is not None else [], _READ_DIR)):
                for path in paths:
                    try:
                        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                    except FileNotFoundError:
                        continue
                    allowed = rights & self.handled
                    if not stat.S_ISDIR(os.fstat(fd).st_mode):
                        allowed &= _FILE_RIGHTS
                    self._rules.append((fd, allowed, path))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd, _, _ in self._rules:
            os.close(fd)
        self._rules = []

    def enforce(self) -> None:
        """Restrict this thread (and everything it execs) to the rules; OSError if the kernel refuses."""
        abi = self.abi
        attr = _RulesetAttr(self.handled, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                            (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
        size = 8 if abi < 4 else (16 if abi < 6 else 24)
        libc = _libc()
        ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        if ruleset < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
        try:
            for fd, allowed, path in self._rules:
                if not allowed:
                    continue
                rule = _PathBeneathAttr(allowed, fd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
            if libc.syscall(_SYS_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
        finally:
            os.close(ruleset)
            self.close()

"""Linux Landlock through raw syscalls: confine a process's writes (and, as a second layer, its
reads) to a few folders.

Unprivileged and inherited by every descendant; used in the forked child right before exec.
Also scopes signals and abstract UNIX sockets (ABI >= 6) so the confined process cannot signal
or connect to the harness, and denies TCP bind/connect (ABI >= 4).
"""

from __future__ import annotations

import ctypes
import os

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # x86_64 and aarch64 share these numbers
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_WRITE_ACCESS_V1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write file, remove, make *
_REFER, _TRUNCATE = 1 << 13, 1 << 14
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


def restrict_writes(writable: list[str], abi: int) -> None:
    """Allow writes only beneath `writable`; raise OSError if the kernel refuses."""
    handled = _WRITE_ACCESS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                        (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    # a file (e.g. /dev/null) takes only file rights; directories take them all
    rules = [(path, handled if os.path.isdir(path) else handled & (_WRITE_FILE | _TRUNCATE)) for path in writable]
    _restrict(attr, size, rules, no_new_privs=True)


def restrict_reads(readable: list[str]) -> None:
    """A further layer over `restrict_writes` (which must come first: it sets no_new_privs):
    files and folders outside `readable` can be neither read nor listed."""
    handled = _READ_FILE | _READ_DIR
    rules = [(path, handled if os.path.isdir(path) else _READ_FILE) for path in readable]
    _restrict(_RulesetAttr(handled, 0, 0), 8, rules, no_new_privs=False)


def _restrict(attr: _RulesetAttr, size: int, rules: list[tuple[str, int]], no_new_privs: bool) -> None:
    libc = _libc()
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, allowed in rules:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(allowed, pfd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(pfd)
        if no_new_privs and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)

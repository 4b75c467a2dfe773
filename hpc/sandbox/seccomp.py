"""A small seccomp filter, its BPF written by hand: the syscalls a confined process may not make.

Hand-written rather than a library: the filter is a deny list of about thirty syscalls, a few
argument checks (socket's domain, sendto's address) and one flag check (clone's namespace flags),
under a hundred BPF instructions. libseccomp's own Python binding has no PyPI wheels; pyseccomp (ctypes over the
system's libseccomp) is unmaintained since 2021, and the rest are forks or alphas. None would
make this smaller or clearer, and each would add a C library to the sandbox's trusted base.

What is denied, and why (everything else is allowed; Landlock, the namespaces, the cgroup, the uid
and the rlimits do the rest):
- Sockets are allow-listed, not deny-listed (strict and gpu profiles): a family no rule covers is
  a way out (AF_VSOCK reaches a virtual machine's host past the network namespace, Landlock's
  TCP rules and an AF_UNIX check alike; AF_NETLINK, AF_PACKET, AF_BLUETOOTH, ... each its own
  kernel surface). strict: socket() of every family -> EACCES (a candidate and the agent's bash
  need none); socketpair() only as AF_UNIX, an anonymous pair that reaches nothing. gpu: socket()
  only as AF_UNIX, every other family -> EACCES: the CUDA driver creates an AF_UNIX socket at
  init and fails (error 304) when it cannot, then connects to the MPS daemon's socket and goes on
  without MPS when that answers ENOENT. So every way to address a socket of the host is closed:
  connect() -> ENOENT (what the driver sees on a machine without MPS; the network namespace has
  nothing else to reach), sendto() with an address -> EACCES, sendmsg() and sendmmsg() -> EACCES
  (their address is in memory seccomp cannot read).
- SIGCONT sent by the program (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
  pidfd_send_signal) -> EPERM (strict and gpu): it resumes a stopped process and interrupts a
  sleeping one, and a program that sent it to itself every millisecond undid the harness's stop.
  The harness now holds programs with the cgroup freezer, which no signal undoes; this is the
  second layer. A POSIX timer that delivers SIGCONT cannot be refused here (timer_create's
  sigevent is in memory seccomp cannot read): it meets the freezer alone.
- sched_setaffinity -> EPERM (strict and gpu profiles): an untrusted program is timed on the
  cores the harness pins it to, against baselines held alike (hpc.profile.cores); one that could
  move itself, or a thread or child it starts, onto the other cores would run wider than its
  baselines and read faster than it is. It starts on the cores compiles may use
  (hpc.sandbox.launch); only the harness moves it.
- io_uring_setup/enter/register: io_uring's operations (connect, openat, ...) are not seen by
  seccomp, so they would bypass this filter.
- ptrace, process_vm_readv/writev: reading or writing another process (Landlock scopes ptrace
  too; this is the second layer).
- bpf, perf_event_open, userfaultfd: large kernel attack surface no kernel needs from here
  (perf also measures other processes; userfaultfd is the usual exploit primitive).
- keyctl, add_key, request_key: kernel keyrings can hold the harness's credentials.
- mount, umount2, pivot_root and the new mount API: changing what paths mean.
- unshare, setns, clone with a CLONE_NEW* flag: new namespaces (a user namespace gives back
  capabilities inside it). clone3 answers ENOSYS: its flags are in memory seccomp cannot read,
  and libc then falls back to clone, whose flags are checked.
- kexec_*, init_module, finit_module, delete_module: loading kernel code.
A syscall of another architecture (an i386 `int 0x80` on x86_64, or x32) answers ENOSYS, since
its numbers differ from the ones checked here.
"""

from __future__ import annotations

import ctypes
import errno
import os

PROFILES = ("strict", "gpu", "trusted")

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000
_AF_UNIX = 1
_SIGCONT = 18
_CLONE_NEW = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
              | 0x00000080)   # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

# name: (x86_64, aarch64)
_SYSCALLS = {
    "socket": (41, 198), "connect": (42, 203), "sendto": (44, 206), "sendmsg": (46, 211),
    "sendmmsg": (307, 269), "clone": (56, 220), "clone3": (435, 435),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "sched_setaffinity": (203, 122),
    "socketpair": (53, 199), "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240), "pidfd_send_signal": (424, 424),
}
# the signal-sending calls and which argument is the signal
_SIGNAL_ARG = {"kill": 1, "tkill": 1, "tgkill": 2, "rt_sigqueueinfo": 1, "rt_tgsigqueueinfo": 2,
               "pidfd_send_signal": 1}
_DENIED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv",
           "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
           "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
           "mount_setattr", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module", "finit_module",
           "delete_module")

# classic BPF
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16   # struct seccomp_data; arg0's low word (little-endian)
_OFF_ARG4 = _OFF_ARG0 + 4 * 8
_PR_SET_NO_NEW_PRIVS, _SYS_SECCOMP, _SET_MODE_FILTER = 38, {"x86_64": 317, "aarch64": 277}, 1


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def arch() -> str | None:
    """The machine's name in the tables above, or None where this filter has no numbers."""
    machine = os.uname().machine
    return machine if machine in _AUDIT_ARCH else None


def program(profile: str, machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions."""
    if profile not in PROFILES:
        raise ValueError(f"seccomp profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    col = 0 if machine == "x86_64" else 1
    nr = {name: numbers[col] for name, numbers in _SYSCALLS.items()}

    def ret_errno(code: int) -> tuple[int, int, int, int]:
        return (_RET, 0, 0, _RET_ERRNO | code)

    prog = [(_LD_W_ABS, 0, 0, _OFF_ARCH), (_JEQ, 1, 0, _AUDIT_ARCH[machine]), ret_errno(errno.ENOSYS),
            (_LD_W_ABS, 0, 0, _OFF_NR)]
    if machine == "x86_64":
        prog += [(_JGE, 0, 1, _X32_BIT), ret_errno(errno.ENOSYS)]
    for name in _DENIED:
        prog += [(_JEQ, 0, 1, nr[name]), ret_errno(errno.EPERM)]
    prog += [(_JEQ, 0, 1, nr["clone3"]), ret_errno(errno.ENOSYS)]
    prog += [(_JEQ, 0, 4, nr["clone"]), (_LD_W_ABS, 0, 0, _OFF_ARG0), (_JSET, 0, 1, _CLONE_NEW),
             ret_errno(errno.EPERM), (_RET, 0, 0, _RET_ALLOW)]
    def only_unix(name: str) -> list[tuple[int, int, int, int]]:   # `name`(AF_UNIX, ...) alone
        return [(_JEQ, 0, 4, nr[name]), (_LD_W_ABS, 0, 0, _OFF_ARG0), (_JEQ, 1, 0, _AF_UNIX),
                ret_errno(errno.EACCES), (_RET, 0, 0, _RET_ALLOW)]

    if profile in ("strict", "gpu"):
        prog += [(_JEQ, 0, 1, nr["sched_setaffinity"]), ret_errno(errno.EPERM)]
        for name, arg in _SIGNAL_ARG.items():
            prog += [(_JEQ, 0, 4, nr[name]), (_LD_W_ABS, 0, 0, _OFF_ARG0 + 8 * arg), (_JEQ, 0, 1, _SIGCONT),
                     ret_errno(errno.EPERM), (_RET, 0, 0, _RET_ALLOW)]
        prog += only_unix("socketpair")
    if profile == "strict":
        prog += [(_JEQ, 0, 1, nr["socket"]), ret_errno(errno.EACCES)]
    if profile == "gpu":
        prog += only_unix("socket")
        prog += [(_JEQ, 0, 1, nr["connect"]), ret_errno(errno.ENOENT)]
        for name in ("sendmsg", "sendmmsg"):
            prog += [(_JEQ, 0, 1, nr[name]), ret_errno(errno.EACCES)]
        # sendto(fd, buf, len, flags, dest_addr, addrlen): denied when either word of dest_addr is set
        prog += [(_JEQ, 0, 5, nr["sendto"]), (_LD_W_ABS, 0, 0, _OFF_ARG4), (_JEQ, 0, 2, 0),
                 (_LD_W_ABS, 0, 0, _OFF_ARG4 + 4), (_JEQ, 1, 0, 0), ret_errno(errno.EACCES)]
    prog.append((_RET, 0, 0, _RET_ALLOW))
    return prog


def install(profile: str) -> None:
    """Filter this thread and everything it execs from now on; OSError if the kernel refuses.
    Sets no_new_privs (which the filter needs without CAP_SYS_ADMIN)."""
    machine = arch()
    if machine is None:
        raise OSError(errno.ENOSYS, f"no seccomp syscall table for {os.uname().machine}")
    instructions = program(profile, machine)
    filters = (_SockFilter * len(instructions))(*[_SockFilter(*ins) for ins in instructions])
    prog = _SockFprog(len(instructions), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.syscall(_SYS_SECCOMP[machine], _SET_MODE_FILTER, 0, ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER) failed")


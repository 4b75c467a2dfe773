"""What the three processes of one evaluation share: the harness, the reference worker (trusted:
it makes every input and checks every output) and the program worker (the candidate, or eager /
torch.compile for a baseline).

Inputs reach the program from outside its process, made from seeds it never sees, one call at a
time: the reference makes a batch of inputs in memory the program cannot map, and each call's
inputs are written into the program's input slot just before that call starts. Outputs stay in the
program's memory; right after a call returns, the process that drives the calls copies the ones it
checks (the harness on cpu, with process_vm_readv; the reference on cuda, through CUDA IPC).

- header (8 KiB memfd; harness, reference, program): the program's description of its last
  outputs (where they are, dtype, shape, strides) or of its failure.
- slot: the inputs of the next frame's calls. On cpu, private anonymous memory of the program's
  own (`HostSlot`: 2 MiB aligned, on transparent huge pages where the host grants them), which the
  harness writes with process_vm_writev; on 4 KiB pages a row's figure moved with where its input's
  pages landed in physical memory (up to 30%, docs/benchmarks.md). On cpu the slot is SHIFT_SPAN
  (hpc.sandbox.messages) longer than its positions, and each go frame says how far past the start
  its inputs lie this time (a multiple of 64 bytes, `timing.input_shifts_cpu` places in turn): a
  call can run 50% slower with its output at one offset from its input within a 4 KiB page than at
  another (4K aliasing, benchmarks/cpu_aliasing.py), and where a process's heap puts its outputs
  is drawn anew in each process. On cuda, a device allocation of the reference's own, exported
  once to the program.
- staging (memfd on cpu; harness and reference only): a batch of inputs the reference made, and
  the outputs the harness captured, for the reference to check.
- go pipe (driver -> program) and done pipe (program -> driver): one 32-byte frame per frame of
  calls. A timed frame runs several calls back to back (a burst), each on inputs of its own in its
  own position of the slot, and the header describes every call's outputs: the handshake is paid
  once per frame, not once per call.

Everything the program writes is untrusted: descriptors are validated against the expected
outputs, and a call's outputs are read from its memory, never taken from its word.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import select
import struct
import time
from dataclasses import asdict, dataclass, field

from hpc.sandbox.messages import CANDIDATE_KINDS, FailureKind, reported_kind
from hpc.sandbox.protocol import DTYPE_NAMES

HEADER_BYTES = 65536
MAX_OUTPUTS = 16                                   # outputs of one call
MAX_DIMS = 8
ALIGN = 256
_FRAME = struct.Struct("<qqqq")                   # (sequence number, value, calls, input shift in bytes)
_COUNT = struct.Struct("<II")                     # (outputs, error length) at offset 0
_OUTPUT = struct.Struct(f"<BB6x{MAX_DIMS}qQ64s")   # dtype, ndim, shape, address, handle
_OUTPUTS_AT, _ERROR_MAX = 64, 4096
_ERROR_AT = HEADER_BYTES - _ERROR_MAX
MAX_DESCRIPTORS = (_ERROR_AT - _OUTPUTS_AT) // _OUTPUT.size   # outputs of every call of one frame
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
STOP = -1                                          # a go frame that ends the program's serve loop
DONE_OK, DONE_FAILED = 0, 1


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input or output: dtype name, shape, and (inputs) its byte offset in the slot."""

    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @classmethod
    def parse(cls, data: dict) -> TensorSpec:
        """From plain data (a message): ValueError when malformed."""
        dtype, shape, offset = data.get("dtype"), data.get("shape"), data.get("offset", 0)
        if dtype not in DTYPE_NAMES or not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and d >= 0 for d in shape) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"malformed tensor spec {str(data)[:120]}")
        return cls(dtype, tuple(shape), offset)


@dataclass(frozen=True)
class InputLayout:
    """Where each input of a call lives: tensors in the slot at their offsets; anything else
    (a number, a shape) is a constant the task's `get_inputs` returns on every seed."""

    entries: tuple[TensorSpec | dict, ...]   # a TensorSpec, or {"value": <JSON>} for a constant
    slot_bytes: int

    @property
    def stride(self) -> int:
        """Bytes from one position of the slot to the next (a frame's calls each have one)."""
        return align(self.slot_bytes)

    def to_message(self) -> dict:
        return {"entries": [asdict(e) if isinstance(e, TensorSpec) else e for e in self.entries],
                "slot_bytes": self.slot_bytes}

    @classmethod
    def from_message(cls, data: dict) -> InputLayout:
        entries = tuple(e if "value" in e else TensorSpec.parse(e) for e in data["entries"])
        return cls(entries, int(data["slot_bytes"]))


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed(specs: list[TensorSpec]) -> tuple[list[TensorSpec], int]:
    """The specs laid out one after another (each aligned), and the bytes they take."""
    out, offset = [], 0
    for s in specs:
        out.append(TensorSpec(s.dtype, s.shape, offset))
        offset += align(s.numel * ITEMSIZE[s.dtype])
    return out, offset


# --- the header: the program's outputs or failure -------------------------------------------


@dataclass
class OutputDescriptor:
    """The program's claim about one contiguous output: dtype, shape and where it lives (cpu: its
    address in the program's memory; cuda: its byte offset in the allocation `handle` names). A
    claim only says where to look: the bytes are read from there."""

    dtype: str
    shape: tuple[int, ...]
    address: int
    handle: bytes = bytes(64)


def write_outputs(header: mmap.mmap, outputs: list[OutputDescriptor]) -> None:
    """Describe the outputs of a frame's calls, call after call (ValueError: more than fit)."""
    if len(outputs) > MAX_DESCRIPTORS:
        raise ValueError(f"{len(outputs)} outputs in one frame (at most {MAX_DESCRIPTORS})")
    for k, o in enumerate(outputs):
        _OUTPUT.pack_into(header, _OUTPUTS_AT + k * _OUTPUT.size, DTYPE_NAMES.index(o.dtype), len(o.shape),
                          *(list(o.shape) + [0] * (MAX_DIMS - len(o.shape))), o.address, o.handle)
    _COUNT.pack_into(header, 0, len(outputs), 0)


def write_failure(header: mmap.mmap, kind: FailureKind, message: str) -> None:
    data = f"{kind}\0{message}".encode("utf-8", "replace")[:_ERROR_MAX]
    header[_ERROR_AT:_ERROR_AT + len(data)] = data
    _COUNT.pack_into(header, 0, 0, len(data))


def read_outputs(header: mmap.mmap) -> list[OutputDescriptor]:
    """The program's descriptors; ValueError when they are malformed."""
    count, _ = _COUNT.unpack_from(header, 0)
    if count > MAX_DESCRIPTORS:
        raise ValueError(f"claims {count} outputs (at most {MAX_DESCRIPTORS})")
    out = []
    for k in range(count):
        fields = _OUTPUT.unpack_from(header, _OUTPUTS_AT + k * _OUTPUT.size)
        code, ndim = fields[0], fields[1]
        if code >= len(DTYPE_NAMES) or ndim > MAX_DIMS:
            raise ValueError(f"output {k}: malformed descriptor")
        shape = tuple(fields[2:2 + ndim])
        if any(d < 0 for d in shape):
            raise ValueError(f"output {k}: negative shape")
        out.append(OutputDescriptor(DTYPE_NAMES[code], shape, fields[2 + MAX_DIMS], fields[-1]))
    return out


def validated_outputs(claims: list[OutputDescriptor], expected: list[TensorSpec], calls: int = 1,
                      position: int = 0) -> list[OutputDescriptor]:
    """The descriptors of the call at `position` of a frame of `calls` calls, if the program
    described every call's outputs and these have the expected structure (ValueError)."""
    if len(claims) != calls * len(expected):
        if calls == 1:
            raise ValueError(f"returned {len(claims)} outputs, expected {len(expected)}")
        raise ValueError(f"described {len(claims)} outputs for {calls} calls of {len(expected)} outputs each")
    claims = claims[position * len(expected):(position + 1) * len(expected)]
    for k, (c, e) in enumerate(zip(claims, expected)):
        if c.shape != e.shape:
            raise ValueError(f"output {k} has shape {c.shape}, expected {e.shape}")
        if c.dtype != e.dtype:
            raise ValueError(f"output {k} has dtype {c.dtype}, expected {e.dtype}")
    return claims


def read_failure(header: mmap.mmap) -> tuple[FailureKind, str]:
    """(kind, message) the program wrote with its failed call; a kind a program may not report
    (hpc.sandbox.messages.CANDIDATE_KINDS: never the task's or the harness's, whoever's program it
    is) makes it a malformed report (OUTPUT), charged to the program."""
    _, length = _COUNT.unpack_from(header, 0)
    text = bytes(header[_ERROR_AT:_ERROR_AT + min(length, _ERROR_MAX)]).decode("utf-8", "replace")
    kind, _, message = text.partition("\0")
    message = message.strip()[:1000] or "the program reported a failure without a reason"
    try:
        return reported_kind(kind, CANDIDATE_KINDS), message
    except ValueError as e:
        return FailureKind.OUTPUT, f"malformed failure report ({e}): {message}"


# --- the go and done pipes ------------------------------------------------------------------


class ProgramGone(Exception):
    """The program's end of a pipe closed: it exited or crashed."""


class CallTimeout(Exception):
    """No done frame before the deadline."""


def send_frame(fd: int, seq: int, value: int = 0, calls: int = 1, shift: int = 0) -> None:
    os.write(fd, _FRAME.pack(seq, value, calls, shift))   # 32 bytes: one atomic pipe write


def read_frame(fd: int, deadline: float, spin: bool) -> tuple[int, int, int, int]:
    """The next frame from `fd`: (sequence number, value, calls, shift), blocking until `deadline` (with
    `spin`, polling without sleeping: a waiting core answers in a microsecond, a woken one in tens)."""
    buf = b""
    while len(buf) < _FRAME.size:
        if spin:
            try:
                chunk = os.read(fd, _FRAME.size - len(buf))
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CallTimeout() from None
                continue
        else:
            remaining = None if deadline == math.inf else deadline - time.monotonic()
            if (remaining is not None and remaining <= 0) or not select.select([fd], [], [], remaining)[0]:
                raise CallTimeout()
            chunk = os.read(fd, _FRAME.size - len(buf))
        if not chunk:
            raise ProgramGone()
        buf += chunk
    return _FRAME.unpack(buf)


def set_spinning(fd: int, spin: bool) -> None:
    os.set_blocking(fd, not spin)


# --- the harness's side: creating and sizing everything --------------------------------------


@dataclass
class ExchangeFds:
    """The file descriptor numbers a worker was started with (they stay open under these numbers)."""

    header: int
    staging: int = -1          # reference only
    go: int = -1               # program: read end; driver: write end
    done: int = -1             # program: write end; driver: read end

    def to_message(self) -> dict:
        return asdict(self)

    @classmethod
    def from_message(cls, data: dict) -> ExchangeFds:
        return cls(**{k: int(v) for k, v in data.items()})


@dataclass
class Exchange:
    """The memfds and pipes of one worker pair, made by the harness before the workers start.
    The driver of the calls holds the go pipe's write end and the done pipe's read end: the
    harness on cpu, the reference worker on cuda."""

    backend: str
    header: int = field(default=-1)
    staging: int = field(default=-1)
    go_read: int = field(default=-1)
    go_write: int = field(default=-1)
    done_read: int = field(default=-1)
    done_write: int = field(default=-1)
    reference: ExchangeFds | None = None    # the numbers each worker holds them under
    program: ExchangeFds | None = None

    @classmethod
    def create(cls, backend: str) -> Exchange:
        ex = cls(backend)
        ex.header = os.memfd_create("hpc-header", os.MFD_CLOEXEC)
        os.ftruncate(ex.header, HEADER_BYTES)
        ex.staging = os.memfd_create("hpc-staging", os.MFD_CLOEXEC)
        ex.go_read, ex.go_write = os.pipe2(os.O_CLOEXEC)
        ex.done_read, ex.done_write = os.pipe2(os.O_CLOEXEC)
        driver = not ex.harness_drives
        ex.reference = ExchangeFds(ex.header, ex.staging, ex.go_write if driver else -1,
                                   ex.done_read if driver else -1)
        ex.program = ExchangeFds(ex.header, -1, ex.go_read, ex.done_write)
        return ex

    @property
    def harness_drives(self) -> bool:
        return self.backend != "cuda"

    @staticmethod
    def passed(fds: ExchangeFds) -> tuple[int, ...]:
        return tuple(fd for fd in (fds.header, fds.staging, fds.go, fds.done) if fd >= 0)

    def after_start(self) -> None:
        """Both workers started: close the ends only they use, so a dead worker shows as EOF."""
        keep_driver = self.harness_drives
        for name in ("go_read", "done_write") + (() if keep_driver else ("go_write", "done_read")):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def close(self) -> None:
        for name in ("header", "staging", "go_read", "go_write", "done_read", "done_write"):
            fd = getattr(self, name)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)


def map_fd(fd: int, nbytes: int) -> mmap.mmap | None:
    """A shared read-write mapping of `nbytes` of a memfd (None for 0 bytes)."""
    return mmap.mmap(fd, nbytes) if nbytes else None


# --- a cpu program's input slot, and its memory read and written from outside (cpu) -----------

HUGE_PAGE = 2 << 20


def huge_span(nbytes: int) -> int:
    """`nbytes` rounded up to whole huge pages."""
    return -(-nbytes // HUGE_PAGE) * HUGE_PAGE


class HostSlot:
    """A cpu program's input slot: private anonymous memory, 2 MiB aligned, advised onto transparent
    huge pages (MADV_HUGEPAGE, which the common `madvise` setting grants), every page touched here,
    so that where it lies in physical memory is settled before any call and is the same few pages
    for every call. Made by the program's trusted setup, before any candidate code runs."""

    def __init__(self, nbytes: int):
        span = huge_span(nbytes)
        self.map = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        offset = -base % HUGE_PAGE
        try:
            self.map.madvise(mmap.MADV_HUGEPAGE, offset, span)
        except (AttributeError, OSError):
            pass   # no transparent huge pages here: 4 KiB pages, and the conditions say so
        self.address = base + offset
        ctypes.memset(self.address, 0, span)
        self.view = memoryview(self.map)[offset:offset + nbytes]


def huge_page_share(pid: int, address: int, nbytes: int) -> float | None:
    """The share of `nbytes` at `address` of process `pid` that lies on huge pages
    (/proc/PID/smaps: AnonHugePages of the mappings over the range); None where it cannot be read."""
    if nbytes <= 0:
        return None
    end, huge, inside = address + nbytes, 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and hi > address
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return min(1.0, huge / huge_span(nbytes))


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = None


def _process_vm(name: str):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        for fn in ("process_vm_readv", "process_vm_writev"):
            getattr(_libc, fn).restype = ctypes.c_ssize_t
            getattr(_libc, fn).argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return getattr(_libc, name)


def _transfer(name: str, verb: str, pid: int, address: int, local: memoryview) -> None:
    fn = _process_vm(name)
    n = len(local)
    done = 0
    buf = (ctypes.c_char * n).from_buffer(local) if n else None
    base = ctypes.addressof(buf) if n else 0
    while done < n:
        here = _IoVec(base + done, n - done)
        there = _IoVec(address + done, n - done)
        got = fn(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"cannot {verb} {n} bytes at {address:#x} of process {pid}: {os.strerror(err)}")
        done += got


def read_process_memory(pid: int, address: int, into: memoryview) -> None:
    """Copy len(into) bytes at `address` of process `pid` into `into` (process_vm_readv); OSError
    when the range is not readable there (a bad claim or a process that hid itself)."""
    _transfer("process_vm_readv", "read", pid, address, into)


def write_process_memory(pid: int, address: int, data: memoryview) -> None:
    """Copy `data` (a writable buffer) to `address` of process `pid` (process_vm_writev); OSError
    when the range is not writable there (a process that unmapped or protected its slot)."""
    _transfer("process_vm_writev", "write", pid, address, data)

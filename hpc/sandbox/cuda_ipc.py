"""Device memory shared between two worker processes through CUDA IPC (the driver API).

Two directions, both between the reference worker (trusted) and the program worker:
- the reference's input slot: a device allocation of its own (`DeviceBuffer`, outside torch's
  caching allocator, so exporting it exposes nothing else of the reference's memory), which the
  program maps once and reads each call's inputs from;
- the program's outputs: after each call it names the allocation holding each output
  (`handle_of`), and the reference maps it (`Mappings`) to copy the outputs out.

The importer trusts nothing it is told: a handle is opened by the driver (a forged one fails), and
the byte range a claim implies must lie inside the allocation the handle opened.
"""

from __future__ import annotations

import ctypes

import torch

from hpc.sandbox.protocol import DTYPE_NAMES

_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class IpcError(Exception):
    """The driver refused an export or an import, or a description is malformed."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise IpcError(f"no CUDA driver library: {e}") from None
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    """IpcError naming the driver's error in its own words ("out of memory" for CUresult 2, which
    hpc.errors.names_out_of_memory reads: a suite's evaluation is then run again alone)."""
    if result != 0:
        text = ctypes.c_char_p()
        if _cuda().cuGetErrorString(result, ctypes.byref(text)) != 0 or not text.value:
            raise IpcError(f"{what} failed (CUresult {result})")
        raise IpcError(f"{what} failed: {text.value.decode(errors='replace')} (CUresult {result})")


def _range(ptr: int) -> tuple[int, int]:
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_cuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


class _Mapped:
    """`nbytes` of device memory at `ptr` as a uint8 array torch can wrap without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` at device address `ptr` as a uint8 tensor that does not own them."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.as_tensor(_Mapped(ptr, nbytes), device=device)


class DeviceBuffer:
    """A device allocation of its own (cuMemAlloc in torch's current context), exportable alone."""

    def __init__(self, nbytes: int, device: torch.device):
        torch.cuda.synchronize(device)   # torch's primary context is current on this thread
        ptr = ctypes.c_uint64()
        _check(_cuda().cuMemAlloc_v2(ctypes.byref(ptr), max(nbytes, 256)), "cuMemAlloc")
        self.ptr, self.nbytes = ptr.value, nbytes
        self.tensor = as_tensor(self.ptr, nbytes, device)

    def export(self) -> bytes:
        handle = _Handle()
        _check(_cuda().cuIpcGetMemHandle(ctypes.byref(handle), self.ptr), "cuIpcGetMemHandle")
        return bytes(handle)

    def free(self) -> None:
        if self.ptr:
            self.tensor = None
            _cuda().cuMemFree_v2(self.ptr)
            self.ptr = 0


class Mappings:
    """Allocations of another process opened by handle, each once, closed together; and this
    process's own exported buffers (`own`), which a handle may name too (a program that returns a
    view of the input slot: CUDA cannot open a handle in the process that made it)."""

    def __init__(self):
        self._open: dict[bytes, tuple[int, int]] = {}
        self._own: dict[bytes, DeviceBuffer] = {}

    def own(self, handle: bytes, buffer: DeviceBuffer) -> None:
        self._own[handle] = buffer

    def view(self, handle: bytes, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` at `offset` of the allocation `handle` names, as uint8 (IpcError if outside it)."""
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8, device=device)
        if len(handle) != _HANDLE_BYTES:
            raise IpcError("malformed handle")
        if handle in self._own:
            buffer = self._own[handle]
            if offset < 0 or offset + nbytes > buffer.nbytes:
                raise IpcError(f"claims {nbytes} bytes at offset {offset} of a {buffer.nbytes}-byte allocation")
            return buffer.tensor[offset:offset + nbytes]
        if handle not in self._open:
            torch.cuda.synchronize(device)   # torch's context exists and is current on this thread
            ptr = ctypes.c_uint64()
            _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), _Handle.from_buffer_copy(handle),
                                                 _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
            self._open[handle] = (ptr.value, 0)    # closed by close() even if the next call fails
            self._open[handle] = (ptr.value, _range(ptr.value)[1])
        base, size = self._open[handle]
        if offset < 0 or offset + nbytes > size:
            raise IpcError(f"claims {nbytes} bytes at offset {offset} of a {size}-byte allocation")
        return as_tensor(base + offset, nbytes, device)

    def close(self) -> None:
        for ptr, _ in self._open.values():
            _cuda().cuIpcCloseMemHandle(ptr)
        self._open.clear()


_exported: dict[tuple[int, int], bytes] = {}


def forget_exported() -> None:
    """Forget every handle made: memory went back to the driver (torch.cuda.graph empties torch's
    cache before a capture), and a new allocation at a freed one's address and size would
    otherwise get the freed one's handle, which the importer cannot open."""
    _exported.clear()


def handle_of(tensor: torch.Tensor) -> tuple[bytes, int]:
    """(handle of the allocation holding `tensor`, byte offset of its first element in it); the
    handle is made once per allocation (torch's caching allocator hands the same ones back)."""
    ptr = tensor.data_ptr()
    base, size = _range(ptr)
    handle = _exported.get((base, size))
    if handle is None:
        h = _Handle()
        _check(_cuda().cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
        handle = _exported[(base, size)] = bytes(h)
    return handle, ptr - base

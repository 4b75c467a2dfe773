"""Device memory shared between two worker processes through CUDA IPC (the driver API).

Correctness on the GPU compares outputs of up to 256 MB per trial: copied to the host, through a
pipe and back to a device they cost ~0.5 s a trial. Instead the program process exports each
output's allocation and the reference process, which holds the expected outputs on the device,
maps it read-only in use and compares there. Only the program process exports: the reference's
memory is never reachable from another process, so a candidate cannot read the expected outputs.

An exported output is described by plain data (`{"$cuda_ipc": {...}}`); the importer trusts
none of it: the handle is opened by the driver (a forged one fails), and the byte range the
dtype and shape imply must lie inside the allocation the handle opened.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Iterator

import torch

from hpc.sandbox.protocol import DTYPE_NAMES

_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
KEY = "$cuda_ipc"


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
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise IpcError(f"{what} failed (CUresult {result})")


def _range(ptr: int) -> tuple[int, int]:
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_cuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    return base.value, size.value


def export(tensor: torch.Tensor) -> dict:
    """A description another process can map: the handle of the allocation holding `tensor`
    (contiguous, on the current device, kept alive by the caller until the importer is done)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise IpcError("only a contiguous CUDA tensor can be exported")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise IpcError(f"dtype {name} cannot be exported")
    torch.cuda.synchronize(tensor.device)    # the current context on this thread, and the data written
    ptr = tensor.data_ptr()
    base, _ = _range(ptr) if tensor.numel() else (ptr, 0)
    handle = _Handle()
    if tensor.numel():
        _check(_cuda().cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return {KEY: {"handle": bytes(handle).hex() if tensor.numel() else "", "offset": ptr - base,
                  "dtype": name, "shape": list(tensor.shape)}}


def is_exported(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {KEY}


class _Mapped:
    """`nbytes` of device memory at `ptr` as a uint8 array torch can wrap without copying."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def _spec(value: object) -> tuple[bytes, int, torch.dtype, list[int], int]:
    if not is_exported(value) or not isinstance(value[KEY], dict):
        raise IpcError("output was not exported")
    d = value[KEY]
    dtype, shape, offset = DTYPES.get(d.get("dtype")), d.get("shape"), d.get("offset")
    if dtype is None or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape) \
            or len(shape) > 16 or not isinstance(offset, int) or offset < 0:
        raise IpcError("exported output description is malformed")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        handle = bytes.fromhex(d.get("handle", "")) if nbytes else b""
    except (TypeError, ValueError):
        raise IpcError("exported output handle is malformed") from None
    if nbytes and len(handle) != _HANDLE_BYTES:
        raise IpcError("exported output handle is malformed")
    return handle, offset, dtype, shape, nbytes


@contextmanager
def imported(values: list, device: torch.device) -> Iterator[list[torch.Tensor]]:
    """The exported outputs `values` as tensors on `device`, valid inside the block only."""
    torch.cuda.synchronize(device)
    opened: dict[bytes, tuple[int, int]] = {}   # outputs in one allocation share its handle: opened once
    try:
        tensors = []
        for value in values:
            handle, offset, dtype, shape, nbytes = _spec(value)
            if not nbytes:
                tensors.append(torch.empty(shape, dtype=dtype, device=device))
                continue
            if handle not in opened:
                ptr = ctypes.c_uint64()
                _check(_cuda().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), _Handle.from_buffer_copy(handle),
                                                     _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
                opened[handle] = (ptr.value, 0)    # closed below even if the next call fails
                opened[handle] = (ptr.value, _range(ptr.value)[1])
            base, size = opened[handle]
            if offset + nbytes > size:
                raise IpcError(f"exported output claims {nbytes} bytes at offset {offset} of a {size}-byte allocation")
            raw = torch.as_tensor(_Mapped(base + offset, nbytes), device=device)
            tensors.append(raw.view(dtype).reshape(shape))
        yield tensors
    finally:
        torch.cuda.synchronize(device)     # every kernel reading the mappings has finished
        for ptr, _ in opened.values():
            _cuda().cuIpcCloseMemHandle(ptr)

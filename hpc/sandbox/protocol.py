"""Length-prefixed messages over pipes between the harness and a sandboxed process.

The harness sends JSON. The sandboxed side answers with a reply: a JSON header (plain data, each
tensor replaced by {"$tensor": k} and described by dtype and shape) followed by each tensor's raw
bytes as its own message. Nothing is unpickled, so a hostile process can send tensors and plain
data but never an object that runs code; and a 256 MB output crosses the pipe as its bytes,
written from the tensor's memory and read into the harness's, with no serialization around it.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time

_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 8 << 30


class ChannelClosed(Exception):
    """The other side closed its end (exited or crashed)."""


class ChannelTimeout(Exception):
    """No complete message before the deadline."""


def write_message(fd: int, payload: bytes | memoryview) -> None:
    for part in (_HEADER.pack(len(payload)), payload):   # no concatenated copy of a large payload
        view = memoryview(part).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]


def read_message(fd: int, deadline: float | None = None) -> bytes:
    (length,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if length > MAX_MESSAGE:
        raise ChannelClosed(f"message of {length} bytes exceeds the limit")
    return _read_exact(fd, length, deadline)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise ChannelTimeout()
        k = os.readv(fd, [view[got:]])
        if not k:
            raise ChannelClosed()
        got += k
    return buf


def encode_json(obj) -> bytes:
    return json.dumps(obj).encode()


def decode_json(data: bytes):
    return json.loads(data)


MAX_TENSORS = 4096
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
               "complex64", "complex128")


def write_reply(fd: int, obj) -> None:
    """`obj` (plain data and CPU tensors) as a header message and one message per tensor."""
    tensors: list = []

    def strip(x):
        if isinstance(x, dict):
            return {str(k): strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        if hasattr(x, "untyped_storage"):     # a torch.Tensor, without importing torch here
            tensors.append(x.detach().to("cpu").resolve_conj().resolve_neg().contiguous())
            return {"$tensor": len(tensors) - 1}
        return x

    header = strip(obj)
    specs = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]
    write_message(fd, encode_json({"reply": header, "tensors": specs}))
    for t in tensors:
        write_message(fd, memoryview(t.reshape(-1).view(_byte_dtype()).numpy()) if t.numel() else b"")


def _byte_dtype():
    import torch

    return torch.uint8


def read_reply(fd: int, deadline: float | None = None):
    """The reply `write_reply` sent; ValueError when it is malformed."""
    import torch

    head = decode_json(read_message(fd, deadline))
    if not isinstance(head, dict) or not isinstance(head.get("tensors"), list) or len(head["tensors"]) > MAX_TENSORS:
        raise ValueError("reply header is malformed")
    tensors = []
    for spec in head["tensors"]:
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPE_NAMES or not isinstance(spec.get("shape"), list) \
                or not all(isinstance(d, int) and d >= 0 for d in spec["shape"]):
            raise ValueError(f"reply tensor spec {str(spec)[:80]} is malformed")
        dtype = getattr(torch, spec["dtype"])
        numel = 1
        for d in spec["shape"]:
            numel *= d
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if expected > MAX_MESSAGE:
            raise ValueError(f"reply tensor of {expected} bytes exceeds the limit")
        data = read_message(fd, deadline)
        if len(data) != expected:
            raise ValueError(f"reply tensor has {len(data)} bytes, its spec says {expected}")
        flat = torch.frombuffer(data, dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(spec["shape"]))

    def restore(x):
        if isinstance(x, dict):
            if set(x) == {"$tensor"}:
                k = x["$tensor"]
                if not isinstance(k, int) or not 0 <= k < len(tensors):
                    raise ValueError("reply refers to a tensor it did not send")
                return tensors[k]
            return {k: restore(v) for k, v in x.items()}
        if isinstance(x, list):
            return [restore(v) for v in x]
        return x

    return restore(head.get("reply"))

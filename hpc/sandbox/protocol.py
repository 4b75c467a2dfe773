"""Length-prefixed messages over pipes between the harness and a sandboxed process.

The harness sends JSON; the sandboxed side answers with `torch.save` payloads that the harness
loads with `weights_only=True`, so a hostile process can send tensors and plain data but never
an object that runs code when unpickled.
"""

from __future__ import annotations

import io
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


def encode_torch(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def decode_torch(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")

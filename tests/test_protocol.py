"""The reply format between a sandboxed worker and the harness: tensors as raw bytes, nothing unpickled."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from hpc.sandbox.protocol import encode_json, read_reply, write_message, write_reply


def _roundtrip(obj):
    r, w = os.pipe()
    try:
        writer = threading.Thread(target=write_reply, args=(w, obj))
        writer.start()
        got = read_reply(r, deadline=None)
        writer.join()
        return got
    finally:
        os.close(r)
        os.close(w)


def test_nested_plain_data_and_tensors_of_every_kind_come_back_equal():
    big = torch.randn(1 << 20)
    obj = {"outputs": [[big, torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]],
           "misc": [torch.tensor(3.5, dtype=torch.bfloat16), torch.zeros(0, 4), torch.tensor([True, False]),
                    torch.randn(3, dtype=torch.complex64).conj()],
           "times_ms": [0.5, float("nan")], "ok": True, "name": "x", "none": None}
    got = _roundtrip(obj)
    assert torch.equal(got["outputs"][0][0], big)
    assert torch.equal(got["outputs"][0][1], torch.arange(6).reshape(2, 3).t())     # non-contiguous view
    bf, empty, flags, cplx = got["misc"]
    assert bf.dtype == torch.bfloat16 and bf.shape == () and float(bf) == 3.5
    assert empty.shape == (0, 4) and flags.tolist() == [True, False]
    assert torch.equal(cplx, obj["misc"][3].resolve_conj())
    assert got["times_ms"][0] == 0.5 and math.isnan(got["times_ms"][1])
    assert (got["ok"], got["name"], got["none"]) == (True, "x", None)


def _raw(header: dict, *buffers: bytes):
    r, w = os.pipe()
    try:
        write_message(w, encode_json(header))
        for b in buffers:
            write_message(w, b)
        return read_reply(r, deadline=None)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("header,buffers,match", [
    ({"reply": {}, "tensors": [{"dtype": "float32", "shape": [4]}]}, [b"\0" * 12], "12 bytes, its spec says 16"),
    ({"reply": {}, "tensors": [{"dtype": "object", "shape": [1]}]}, [], "malformed"),
    ({"reply": {}, "tensors": [{"dtype": "float32", "shape": [-1]}]}, [], "malformed"),
    ({"reply": {"$tensor": 1}, "tensors": [{"dtype": "uint8", "shape": [1]}]}, [b"\0"], "did not send"),
    ({"reply": {}, "tensors": "x"}, [], "header is malformed"),
    ({"reply": {}, "tensors": [{"dtype": "float64", "shape": [1 << 31, 1 << 31]}]}, [], "exceeds the limit"),
])
def test_a_malformed_reply_is_refused_with_a_reason(header, buffers, match):
    with pytest.raises(ValueError, match=match):
        _raw(header, *buffers)

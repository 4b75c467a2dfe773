"""What the harness, the reference and the program share (hpc.sandbox.exchange): every claim the
program writes is validated before anything acts on it, and frames end cleanly when a side dies."""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from pathlib import Path

import pytest

from hpc.sandbox.exchange import (HEADER_BYTES, MAX_DESCRIPTORS, STOP, CallTimeout, Exchange, InputLayout,
                                  OutputDescriptor, ProgramGone, TensorSpec, packed, read_failure, read_frame,
                                  read_outputs, read_process_memory, send_frame, write_failure, write_outputs)
from hpc.sandbox import exchange
from hpc.sandbox.messages import FailureKind


@pytest.fixture
def header():
    fd = os.memfd_create("test-header")
    os.ftruncate(fd, HEADER_BYTES)
    m = mmap.mmap(fd, HEADER_BYTES)
    yield m
    m.close()
    os.close(fd)


def test_output_descriptors_round_trip(header):
    claims = [OutputDescriptor("float32", (2, 3), 4096), OutputDescriptor("bfloat16", (), 0, b"h" * 64)]
    write_outputs(header, claims)
    assert read_outputs(header) == claims


@pytest.mark.parametrize("corrupt, words", [
    (lambda h: struct.pack_into("<II", h, 0, MAX_DESCRIPTORS + 1, 0), "claims"),
    (lambda h: struct.pack_into("<B", h, 64, 200), "malformed"),     # a dtype code past the table
    (lambda h: struct.pack_into("<B", h, 65, 9), "malformed"),       # more dimensions than a descriptor holds
    (lambda h: struct.pack_into("<q", h, 72, -5), "negative"),       # a negative extent
])
def test_a_malformed_claim_is_refused(header, corrupt, words):
    write_outputs(header, [OutputDescriptor("float32", (4,), 0)])
    corrupt(header)
    with pytest.raises(ValueError, match=words):
        read_outputs(header)


def test_a_failure_keeps_its_kind_and_a_bounded_message(header):
    write_failure(header, "rules", "x" * 10_000)
    kind, message = read_failure(header)
    assert kind == "rules" and 0 < len(message) <= 1000 and set(message) == {"x"}


@pytest.mark.parametrize("claimed", ["timeout", "correctness", "no such kind", ""])
def test_a_failure_of_a_kind_no_worker_may_report_is_a_malformed_report(header, claimed):
    """A program cannot claim the harness's own findings, nor a kind nobody defined: the report is
    malformed (charged to the program), and its claim kept in the reason."""
    write_failure(header, claimed, "it was not me")   # a hostile program writes the header as it likes
    kind, message = read_failure(header)
    assert kind == FailureKind.OUTPUT and "malformed failure report" in message and "it was not me" in message


def test_the_layout_packs_tensors_aligned_and_keeps_constants():
    tensors, total = packed([TensorSpec("float32", (3,)), TensorSpec("int64", (5, 2))])
    assert [t.offset for t in tensors] == [0, 256] and total == 512
    layout = InputLayout((tensors[0], {"value": 7}, tensors[1]), total)
    assert InputLayout.from_message(layout.to_message()) == layout
    with pytest.raises(ValueError):
        TensorSpec.parse({"dtype": "object", "shape": [1]})


def test_frames_time_out_and_end_when_the_writer_is_gone():
    r, w = os.pipe()
    try:
        send_frame(w, 7, 1, calls=16, shift=384)
        assert read_frame(r, time.monotonic() + 1, spin=False) == (7, 1, 16, 384)
        with pytest.raises(CallTimeout):
            read_frame(r, time.monotonic() + 0.05, spin=False)
        os.set_blocking(r, False)
        send_frame(w, STOP, 0)
        assert read_frame(r, math.inf, spin=True) == (STOP, 0, 1, 0)
    finally:
        os.close(w)
    with pytest.raises(ProgramGone):
        read_frame(r, time.monotonic() + 1, spin=True)
    os.close(r)


def test_the_program_is_given_no_staging_and_the_driver_keeps_only_its_pipe_ends():
    """Staging (the reference's batch of future inputs) never reaches the program's process."""
    cpu, cuda = Exchange.create("cpu"), Exchange.create("cuda")
    try:
        for ex in (cpu, cuda):
            assert ex.program.staging == -1 and ex.staging not in Exchange.passed(ex.program)
        assert cpu.reference.go == -1 and cuda.reference.go == cuda.go_write   # the driver: harness, reference
        cpu.after_start()
        assert cpu.go_read == -1 and cpu.done_write == -1 and cpu.go_write >= 0
    finally:
        cpu.close()
        cuda.close()


def test_process_memory_is_read_only_where_the_claim_is_mapped():
    import ctypes

    data = ctypes.create_string_buffer(b"abcdefgh", 8)
    out = bytearray(8)
    read_process_memory(os.getpid(), ctypes.addressof(data), memoryview(out))
    assert bytes(out) == b"abcdefgh"
    with pytest.raises(OSError):
        read_process_memory(os.getpid(), 8, memoryview(bytearray(16)))


def test_process_memory_is_written_only_where_it_is_writable():
    """The harness writes a cpu program's inputs this way: a slot the program made read-only (or
    unmapped) fails the write, which is then the program's failure."""
    import ctypes

    slot = exchange.HostSlot(4096)
    data = bytearray(b"inputs!!")
    exchange.write_process_memory(os.getpid(), slot.address + 8, memoryview(data))
    assert bytes(slot.view[8:16]) == b"inputs!!"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(slot.address), exchange.HUGE_PAGE, mmap.PROT_READ) == 0
    with pytest.raises(OSError, match="cannot write 8 bytes"):
        exchange.write_process_memory(os.getpid(), slot.address + 8, memoryview(data))


def _grants_huge_pages() -> bool:
    """Whether this host gives MADV_HUGEPAGE memory transparent huge pages at its first touch."""
    try:
        root = Path("/sys/kernel/mm/transparent_hugepage")
        enabled, defrag = (root / "enabled").read_text(), (root / "defrag").read_text()
    except OSError:
        return False
    return "[never]" not in enabled and any(f"[{d}]" in defrag for d in ("always", "madvise", "defer+madvise"))


def test_a_host_slot_is_aligned_touched_and_on_huge_pages_where_the_host_grants_them():
    """Where an input's 4 KiB pages landed moved a row's figure up to 30% between evaluations
    (docs/benchmarks.md); a slot on huge pages is a few contiguous 2 MiB pages wherever it lands."""
    slot = exchange.HostSlot(5 << 20)   # three huge pages
    assert slot.address % exchange.HUGE_PAGE == 0 and len(slot.view) == 5 << 20
    share = exchange.huge_page_share(os.getpid(), slot.address, 5 << 20)
    if _grants_huge_pages():
        assert share == 1.0
    else:
        assert share is not None and 0.0 <= share <= 1.0
    assert exchange.huge_page_share(os.getpid(), slot.address, 0) is None
    assert exchange.huge_page_share(1 << 30, slot.address, 4096) is None   # no such process


def test_a_call_below_the_least_figure_after_the_overhead_keeps_its_outside_clock_time():
    from hpc.profile.timing import bounded_figures

    times_ns = [300_000, 310_000, 320_000]          # 0.30-0.32 ms on the outside clock
    figures, used = bounded_figures(times_ns, 200_000.0, least_ms=0.05)
    assert used == 200_000.0 and figures == [0.1, 0.11, 0.12]
    # a handshake inflated by noise would take the median (0.01 ms) below the least figure: not taken off
    figures, used = bounded_figures(times_ns, 300_000.0, least_ms=0.05)
    assert used == 0.0 and figures == [0.3, 0.31, 0.32]
    figures, used = bounded_figures(times_ns, 300_000.0, least_ms=0.0)
    assert used == 300_000.0


def test_when_the_candidates_overhead_is_kept_every_programs_is_kept():
    from hpc.profile.timing import window_figures

    times_ns = {"candidate": [300_000, 310_000, 320_000], "eager": [500_000, 510_000, 520_000]}
    figures, used = window_figures(times_ns, 200_000.0, least_ms=0.05)
    assert used == 200_000.0 and figures["candidate"] == [0.1, 0.11, 0.12] and figures["eager"] == [0.3, 0.31, 0.32]
    # the candidate's handshake is not taken off: nor is eager's, or eager's 0.51 ms would read 0.21 against 0.31
    figures, used = window_figures(times_ns, 300_000.0, least_ms=0.05)
    assert used == 0.0 and figures["candidate"] == [0.3, 0.31, 0.32] and figures["eager"] == [0.5, 0.51, 0.52]


def test_an_output_of_the_wrong_structure_is_refused():
    from hpc.sandbox.exchange import validated_outputs

    expected = [TensorSpec("float32", (4, 2))]
    good = [OutputDescriptor("float32", (4, 2), 0)]
    assert validated_outputs(good, expected) == good
    for claims, message in (([], "returned 0 outputs"), ([OutputDescriptor("float32", (2, 4), 0)], "shape"),
                            ([OutputDescriptor("float64", (4, 2), 0)], "dtype")):
        with pytest.raises(ValueError, match=message):
            validated_outputs(claims, expected)


def test_a_frames_outputs_are_read_per_call_and_must_cover_every_call(header):
    from hpc.sandbox.exchange import MAX_DESCRIPTORS, validated_outputs

    expected = [TensorSpec("float32", (4,)), TensorSpec("int64", (2,))]
    frame = [OutputDescriptor(e.dtype, e.shape, 1000 * k + j) for k in range(3) for j, e in enumerate(expected)]
    assert [c.address for c in validated_outputs(frame, expected, calls=3, position=2)] == [2000, 2001]
    with pytest.raises(ValueError, match="5 outputs for 3 calls"):
        validated_outputs(frame[:5], expected, calls=3, position=0)
    swapped = frame[:2] + frame[3:4] + frame[2:3] + frame[4:]
    with pytest.raises(ValueError, match="output 0 has shape"):
        validated_outputs(swapped, expected, calls=3, position=1)
    write_outputs(header, [OutputDescriptor("float32", (1,), k) for k in range(MAX_DESCRIPTORS)])
    assert len(read_outputs(header)) == MAX_DESCRIPTORS >= 256
    with pytest.raises(ValueError, match="at most"):
        write_outputs(header, [OutputDescriptor("float32", (1,), 0)] * (MAX_DESCRIPTORS + 1))

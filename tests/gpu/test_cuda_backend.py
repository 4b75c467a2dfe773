"""CUDA-only behaviour on a real GPU (the hack suite's CUDA variants live in tests/test_hacks.py).

Runs only where torch sees a CUDA device (the H200 machine): `scripts/test-gpu.sh`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from hpc.candidate import load_candidate
from hpc.errors import names_out_of_memory
from hpc.pipeline import evaluate
from hpc.sandbox import cuda_ipc
from hpc.sandbox.messages import Attach, ReferenceSetup
from hpc.sandbox.process import SandboxedProcess
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS

pytestmark = pytest.mark.gpu
HONEST = TESTS / "fixtures" / "honest_relu"


def _timed_by(rec) -> dict:
    return {name: (c["timed_by"], c.get("graphs_refused", "")) for name, c in json.loads(rec.conditions).items()}


def test_side_stream_work_is_timed(cuda_config):
    """Slow work hidden on a private stream still lands inside the measured interval: not paid as fast.
    (Its stream never joins the captured one, so it cannot be recorded as a graph: timed by calls.)"""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks_cuda" / "side_stream"), cuda_config)
    assert rec.candidate_ms > 5.0, rec.reason
    assert rec.reward <= 1.0
    assert {how for how, _ in _timed_by(rec).values()} == {"calls"}, rec.conditions


def test_an_honest_candidate_and_its_baselines_are_timed_as_graph_replays(cuda_config):
    rec = evaluate(load_task(RELU_TASK), load_candidate(HONEST), cuda_config)
    assert rec.status == "ok" and rec.correct, rec.reason
    assert set(_timed_by(rec).values()) == {("graph replays", "")}, rec.conditions
    assert rec.timed_checks > 0


def test_a_candidate_that_records_nothing_in_its_graph_is_timed_by_calls(cuda_config):
    """Native code that launches nothing while its call is captured would make every replay free:
    the replay's outputs are checked on fresh inputs first, found wrong, and every program of the
    window is timed by calls instead (the candidate is not failed: an honest one whose graph misses
    work must not be)."""
    honest = evaluate(load_task(RELU_TASK), load_candidate(HONEST), cuda_config)
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks_cuda" / "graph_dodger"), cuda_config)
    assert rec.status == "ok" and rec.correct, rec.reason
    assert {how for how, _ in _timed_by(rec).values()} == {"calls"}, rec.conditions
    assert "graph replay" in _timed_by(rec)["candidate"][1]
    assert rec.candidate_ms > 0.5 * honest.candidate_ms, (rec.candidate_ms, honest.candidate_ms)


def test_a_cuda_fault_does_not_poison_the_next_evaluation(cuda_config):
    bad = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks" / "segfault"), cuda_config)
    assert bad.status == "failed" and "illegal memory access" in bad.reason
    good = evaluate(load_task(RELU_TASK), load_candidate(HONEST), cuda_config)
    assert good.status == "ok" and good.correct, good.reason
    assert good.hardware and good.backend == "cuda" and good.eager_ms > 0 and good.compile_ms > 0


def test_load_inline_cuda_single_file_is_paid(cuda_config):
    """KernelBench's own CUDA format: compiled on first load (about a minute), cached by content after."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu_inline_cuda.py"),
                   cuda_config)
    assert rec.status == "ok", rec.reason
    assert rec.correct and rec.compiled and rec.reward >= 1


def test_work_left_running_by_a_process_that_skips_the_synchronize_is_caught(cuda_config, monkeypatch):
    """Native code makes the runtime's synchronize a no-op, so its process answers before the output
    exists: the reference copies the outputs out the moment the call is answered, and they are
    unfinished. (Its asm labels are refused statically; the check is switched off here to reach
    the defense behind it.)"""
    from hpc import pipeline

    monkeypatch.setattr(pipeline, "kernel_defect", lambda files, libraries: "")
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks_cuda" / "sync_bypass"), cuda_config)
    assert rec.status == "failed" and rec.failed_stage == "verify", rec.reason
    assert "outside atol" in rec.reason and rec.reward == -1.0


@pytest.fixture
def reference_slot(tmp_path, cuda_config):
    """A reference worker set up for the ReLU task, its input slot exported: (worker, handle, bytes)."""
    from hpc.sandbox.exchange import Exchange
    from hpc.sandbox.prestart import harness_file

    exchange = Exchange.create("cuda")
    proc = SandboxedProcess("reference", tmp_path, cuda_config.sandbox, "cuda", trusted=True,
                            pass_fds=Exchange.passed(exchange.reference))
    task = harness_file(RELU_TASK, tmp_path, "task.py")   # what the worker may read: its own folder
    laid = proc.request(ReferenceSetup(str(task), cuda_config.scale, 1, "cuda", probe_seed=2))
    attached = proc.request(Attach(laid.layout, laid.outputs, spin=False, burst=1, fds=exchange.reference.to_message(),
                                   correctness=dataclasses.asdict(cuda_config.correctness), flush_bytes=0,
                                   batch_bytes=1 << 30, staging_bytes=0, per_call=0))
    yield proc, bytes.fromhex(attached.slot_handle), laid.layout["slot_bytes"]
    proc.close()
    exchange.close()


def test_a_mapping_is_refused_outside_the_allocation_its_handle_names(reference_slot):
    """The importer's checks (the program maps the reference's slot this way, the reference the
    program's outputs): the exported slot maps whole; a range past it or a forged handle is refused."""
    _, handle, nbytes = reference_slot
    maps = cuda_ipc.Mappings()
    try:
        assert maps.view(handle, 0, nbytes, torch.device("cuda")).numel() == nbytes
        with pytest.raises(cuda_ipc.IpcError, match="claims"):
            maps.view(handle, 0, nbytes + (1 << 28), torch.device("cuda"))
        with pytest.raises(cuda_ipc.IpcError):
            maps.view(os.urandom(64), 0, 16, torch.device("cuda"))
        with pytest.raises(cuda_ipc.IpcError, match="malformed"):
            maps.view(b"short", 0, 16, torch.device("cuda"))
    finally:
        maps.close()


def test_a_device_buffer_beyond_the_device_fails_as_out_of_memory():
    """The driver's own words reach the reason, so that a suite's evaluation that ran out of device
    memory beside others is run again alone (hpc.engine.again_alone); a bare CUresult 2 was not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    with pytest.raises(cuda_ipc.IpcError) as failed:
        cuda_ipc.DeviceBuffer(torch.cuda.get_device_properties(device).total_memory * 2, device)
    assert "out of memory" in str(failed.value) and names_out_of_memory(str(failed.value)), failed.value

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
from hpc.pipeline import evaluate
from hpc.sandbox import cuda_ipc
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS

pytestmark = pytest.mark.gpu
HONEST = TESTS / "fixtures" / "honest_relu"


def test_side_stream_work_is_timed(cuda_config):
    """Slow work hidden on a private stream still lands inside the measured interval: not paid as fast."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks_cuda" / "side_stream"), cuda_config)
    assert rec.candidate_ms > 5.0, rec.reason
    assert rec.reward <= 1.0


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


def test_outputs_are_compared_in_the_reference_worker(cuda_config):
    """CUDA IPC between the sandboxed workers: the candidate's outputs never cross a pipe."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(HONEST), cuda_config)
    assert rec.status == "ok" and rec.correct, rec.reason
    assert json.loads(rec.isolation)["outputs_shared"] is True


@pytest.fixture
def reference_with_kept_outputs(tmp_path, cuda_config):
    """A reference worker holding one trial's outputs of the ReLU task on the device."""
    proc = SandboxedProcess("reference", tmp_path, cuda_config.sandbox, "cuda")
    proc.request({"op": "setup", "task": str(RELU_TASK), "scale": cuda_config.scale, "init_seed": 1,
                  "device": "cuda"})
    assert proc.request({"op": "outputs", "trials": [{"seed": 2, "distribution": "default", "index": 0}],
                         "keep": True})["kept"] == 1
    yield proc
    proc.close()


def test_the_reference_worker_maps_only_what_an_export_owns(reference_with_kept_outputs, cuda_config):
    """The importer's checks, driven with real exports from this process: the right values
    compare equal; a range past the allocation, a forged handle or a malformed description is
    refused as the program's failure (kind "program"), and the worker still answers after."""
    ref = reference_with_kept_outputs
    expected = ref.request({"op": "kept_outputs"})["outputs"][0][0].cuda()
    correctness = dataclasses.asdict(cuda_config.correctness)

    def compare(described):
        return ref.request({"op": "compare", "outputs": [described], "correctness": correctness})

    reply = compare(cuda_ipc.export(expected))
    assert reply["comparison"]["ok"] and reply["dtypes"] == ["float32"]
    wrong = expected + 1.0
    assert not compare(cuda_ipc.export(wrong))["comparison"]["ok"]
    oversized = cuda_ipc.export(expected)
    oversized[cuda_ipc.KEY]["shape"] = [expected.numel() + (1 << 28)]
    forged = cuda_ipc.export(expected)
    forged[cuda_ipc.KEY]["handle"] = os.urandom(64).hex()
    malformed = {cuda_ipc.KEY: {"handle": "zz", "offset": -1, "dtype": "float32", "shape": [4]}}
    for bad in (oversized, forged, malformed):
        with pytest.raises(SandboxError) as err:
            compare(bad)
        assert err.value.kind == "program" and "could not be mapped" in err.value.reason
    assert compare(cuda_ipc.export(expected))["comparison"]["ok"]
    halves = torch.cat([expected, expected])     # two outputs in one allocation: its handle opened once
    n = expected.numel()
    two = [cuda_ipc.export(halves[:n]), cuda_ipc.export(halves[n:])]
    reply = ref.request({"op": "compare", "outputs": two, "correctness": correctness})
    assert not reply["comparison"]["ok"] and "returned 2 outputs" in reply["comparison"]["reason"]

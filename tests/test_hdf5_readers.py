"""The files the project writes open in other HDF5 readers than the h5py that wrote them: Debian's
h5dump (HDF5 1.10, the oldest library with SWMR). Written with h5py's "latest" format (HDF5 2.0's),
h5dump failed with an internal error and h5ls showed the bool columns as *ERROR*."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hpc.results.hdf5 import ResultWriter
from hpc.results.record import EvalRecord
from hpc.results.training import TrainingWriter
from hpc.samples import Sample, write_samples

pytestmark = pytest.mark.skipif(shutil.which("h5dump") is None,
                                reason="needs Debian's h5dump (scripts/system-deps.sh installs hdf5-tools)")


def _h5dump(path) -> str:
    out = subprocess.run(["h5dump", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "error" not in out.stderr.lower(), out.stderr[-2000:]
    listing = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "*ERROR*" not in listing.stdout, listing.stdout
    return out.stdout


def test_a_results_file_opens_in_hdf5_1_10(tmp_path):
    path = tmp_path / "r.h5"
    with ResultWriter(path, {"git_commit": "abc"}) as writer:
        writer.append(EvalRecord(task_id="level1/x", task_level=1, reward=3.0, correct=True, compiled=True,
                                 candidate_times_ms=[1.5, 2.5], reason="ünïcode", compile_cached=True))
        writer.append(EvalRecord(task_id="level1/y", status="failed", failed_stage="compile"))
    dump = _h5dump(path)
    assert 'DATASET "correct"' in dump and '"TRUE"' in dump and "level1/x" in dump


def test_a_training_file_and_a_samples_file_open_in_hdf5_1_10(tmp_path):
    train = tmp_path / "train.h5"
    with TrainingWriter(train) as writer:
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 2, "sft_loss": 0.5})
    assert 'DATASET "sft_loss"' in _h5dump(train)
    samples = tmp_path / "samples.h5"
    write_samples(samples, [Sample("level1/x", "s0", code="print(1)")])
    assert "level1/x" in _h5dump(samples)

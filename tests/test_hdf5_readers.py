"""The files the project writes open in other HDF5 readers than the h5py that wrote them: Debian's
h5dump (HDF5 1.10, the oldest library with SWMR) and h5py 3.12 on HDF5 1.14 (installed beside the
venv by scripts/setup-env.sh test). Written with h5py's "latest" format (HDF5 2.0's),
h5dump failed with an internal error and h5ls showed the bool columns as *ERROR*."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.results.hdf5 import ResultWriter
from hpc.results.record import EvalRecord
from hpc.results.training import TrainingWriter
from hpc.samples import Sample, write_samples

OLD_H5PY = Path(sys.prefix) / "old-h5py"
needs_h5dump = pytest.mark.skipif(shutil.which("h5dump") is None,
                                  reason="needs Debian's h5dump (scripts/system-deps.sh installs hdf5-tools)")

READ_WITH_OLD_H5PY = """
import sys, h5py
assert h5py.version.hdf5_version.startswith("1.14"), h5py.version.hdf5_version
with h5py.File(sys.argv[1], "r", swmr=True) as f:
    n = int(f["records"].attrs["count"])
    print(f["records/task_id"][:n].tolist(), f["records/correct"][:n].tolist(), f["records/reward"][:n].tolist())
"""


def _h5dump(path) -> str:
    out = subprocess.run(["h5dump", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "error" not in out.stderr.lower(), out.stderr[-2000:]
    listing = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "*ERROR*" not in listing.stdout, listing.stdout
    return out.stdout


def _results_file(path: Path) -> Path:
    with ResultWriter(path, {"git_commit": "abc"}) as writer:
        writer.append(EvalRecord(task_id="level1/x", task_level=1, reward=3.0, correct=True, compiled=True,
                                 candidate_times_ms=[1.5, 2.5], reason="ünïcode", compile_cached=True))
        writer.append(EvalRecord(task_id="level1/y", status="failed", failed_stage="compile"))
    return path


@needs_h5dump
def test_a_results_file_opens_in_hdf5_1_10(tmp_path):
    dump = _h5dump(_results_file(tmp_path / "r.h5"))
    assert 'DATASET "correct"' in dump and '"TRUE"' in dump and "level1/x" in dump


def test_a_results_file_reads_in_h5py_3_12_on_hdf5_1_14(tmp_path):
    assert OLD_H5PY.is_dir(), f"{OLD_H5PY} missing: run `source scripts/setup-env.sh test`"
    out = subprocess.run([sys.executable, "-c", READ_WITH_OLD_H5PY, str(_results_file(tmp_path / "r.h5"))],
                         env={"PYTHONPATH": str(OLD_H5PY), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("] [")[:2] == ["[b'level1/x', b'level1/y'", "True, False"], out.stdout


@needs_h5dump
def test_a_training_file_and_a_samples_file_open_in_hdf5_1_10(tmp_path):
    train = tmp_path / "train.h5"
    with TrainingWriter(train) as writer:
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 2, "sft_loss": 0.5})
    assert 'DATASET "sft_loss"' in _h5dump(train)
    samples = tmp_path / "samples.h5"
    write_samples(samples, [Sample("level1/x", "s0", code="print(1)")])
    assert "level1/x" in _h5dump(samples)

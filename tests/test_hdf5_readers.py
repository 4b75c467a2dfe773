"""The files the project writes open in other HDF5 readers than the h5py that wrote them: Debian's
h5dump (HDF5 1.10, the oldest library with SWMR) and h5py 3.12 on HDF5 1.14 (installed beside the
venv by scripts/setup-env.sh test), each seeing the columns' units and meanings; and the pandas
one-liner of results/SCHEMA.md and the README loads a results file. Written with h5py's "latest"
format (HDF5 2.0's), h5dump failed with an internal error and h5ls showed the bool columns as
*ERROR*."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py

import pytest

from hpc.results.hdf5 import SCHEMA_VERSION, ResultWriter
from hpc.results.record import COLUMNS, EvalRecord
from hpc.results.training import TrainingWriter
from hpc.samples import Sample, write_samples
from tests.conftest import ROOT

OLD_H5PY = Path(sys.prefix) / "old-h5py"
needs_h5dump = pytest.mark.skipif(shutil.which("h5dump") is None,
                                  reason="needs Debian's h5dump (scripts/system-deps.sh installs hdf5-tools)")

READ_WITH_OLD_H5PY = """
import sys, h5py
assert h5py.version.hdf5_version.startswith("1.14"), h5py.version.hdf5_version
with h5py.File(sys.argv[1], "r", swmr=True) as f:
    n = int(f["records"].attrs["count"])
    print(f["records/task_id"][:n].tolist(), f["records/correct"][:n].tolist(), f["records/reward"][:n].tolist())
    print(f.attrs["schema_doc"], f.attrs["schema_version"], f["records/candidate_ms"].attrs["units"])
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
    assert dump.count('ATTRIBUTE "units"') == dump.count('ATTRIBUTE "description"') == len(COLUMNS)
    assert '"results/SCHEMA.md"' in dump and '"median time per call, on a clock outside' in dump


def test_a_results_file_reads_in_h5py_3_12_on_hdf5_1_14(tmp_path):
    assert OLD_H5PY.is_dir(), f"{OLD_H5PY} missing: run `source scripts/setup-env.sh test`"
    out = subprocess.run([sys.executable, "-c", READ_WITH_OLD_H5PY, str(_results_file(tmp_path / "r.h5"))],
                         env={"PYTHONPATH": str(OLD_H5PY), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("] [")[:2] == ["[b'level1/x', b'level1/y'", "True, False"], out.stdout
    assert out.stdout.splitlines()[1] == f"results/SCHEMA.md {SCHEMA_VERSION} ms", out.stdout


@needs_h5dump
def test_a_training_file_and_a_samples_file_open_in_hdf5_1_10(tmp_path):
    train = tmp_path / "train.h5"
    with TrainingWriter(train) as writer:
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 2, "sft_loss": 0.5})
    assert 'DATASET "sft_loss"' in _h5dump(train)
    samples = tmp_path / "samples.h5"
    write_samples(samples, [Sample("level1/x", "s0", code="print(1)")])
    assert "level1/x" in _h5dump(samples)


def _pandas_one_liner() -> str:
    """The pandas one-liner as results/SCHEMA.md shows it: the python block of its section on reading."""
    section = (ROOT / "results" / "SCHEMA.md").read_text().split("### Reading a file with h5py or pandas", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_pandas_one_liner_loads_a_results_file(tmp_path, monkeypatch):
    """The one-liner, run as documented (in the folder of a `results.h5`), gives one row per
    complete record, a column per field, text as str and the vlen times as arrays; the README
    shows the same lines."""
    assert importlib.util.find_spec("pandas"), "pandas missing: `source scripts/setup-env.sh test` installs it"
    code = _pandas_one_liner()
    assert code in (ROOT / "README.md").read_text(), "the README's pandas one-liner is not results/SCHEMA.md's"
    path = _results_file(tmp_path / "results.h5")
    with h5py.File(path, "a") as f:   # a third row a writer has written but not yet counted: left out
        for ds in f["records"].values():
            ds.resize((3,))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(code, scope)
    df = scope["df"]
    assert df.shape == (2, len(COLUMNS)) and set(df.columns) == {c.name for c in COLUMNS}
    assert df.task_id.tolist() == ["level1/x", "level1/y"] and df.reason[0] == "ünïcode"
    assert df.correct.tolist() == [True, False] and df.task_level.tolist() == [1, 0]
    assert df.reward[0] == 3.0 and math.isnan(df.reward[1])
    assert df.candidate_times_ms[0].tolist() == [1.5, 2.5] and df.candidate_times_ms[1].tolist() == []


def _undescribed(path: Path) -> list[str]:
    """Every dataset of the file at `path` without a non-empty description or without units."""
    missing: list[str] = []

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset) and (not obj.attrs.get("description") or "units" not in obj.attrs):
            missing.append(name)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return missing


def test_every_dataset_of_every_kind_of_file_says_what_it_holds_and_in_what_units(tmp_path):
    """Results, training, samples and synthesis manifest files: each dataset has `description` and
    `units` (one line a reader sees in h5dump or h5py, without the docs)."""
    from hpc.synthesis.manifest import write_manifest

    train = tmp_path / "train.h5"
    with TrainingWriter(train) as writer:
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 2, "sft_loss": 0.5})
    samples = tmp_path / "samples.h5"
    write_samples(samples, [Sample("level1/x", "s0", code="print(1)")])
    record = {"index": 0, "task_id": "level1/0_relu", "stem": "0_relu", "level": 1, "accepted": True, "filter": "",
              "kind": "", "reason": "", "ops": ["F.relu"], "data_source": "hpc-synthesis", "family": "matrix",
              "categories": ["activation"], "code": "print(1)", "ast_hash": "ab", "signature": {"inputs": []},
              "outputs": [{"shape": [4], "mean": 0.5, "std": 0.3, "variation": 0.375}], "eager_ms": 1.5,
              "peak_mib": 12.5, "seconds": {"load": 0.1}, "ran": ["load"]}
    write_manifest(tmp_path, [record], ("load",), {"seed": 0, "count": 1, "source": "composer", "backend": "cpu",
                                                  "scale": "cpu", "shards": 1}, {})
    for path in (_results_file(tmp_path / "r.h5"), train, samples, tmp_path / "manifest.h5"):
        assert _undescribed(path) == [], path.name

"""Samples files (hpc.samples): round trip, clear errors for bad files, and jobs/evaluate.py
evaluating every sample of a samples file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc.candidate import SINGLE_FILE, WORKDIR, load_candidate
from hpc.errors import DataFileError
from hpc.results.hdf5 import read_records
from hpc.samples import Sample, materialize, read_samples, write_samples
from tests.conftest import RELU_TASK, ROOT, TESTS
from tests.test_evaluate_job import _evaluate

HONEST = TESTS / "fixtures" / "honest_relu"
SINGLE = (TESTS / "fixtures" / "honest_relu_inline.py").read_text()


def _workdir(relu_body: str | None = None) -> dict[str, str]:
    """honest_relu's files; with `relu_body`, its kernel computes that instead (a wrong candidate)."""
    kernel = (HONEST / "kernels" / "relu.cpp").read_text()
    if relu_body is not None:
        kernel = kernel.replace("x[i] > 0.f ? x[i] : 0.f", relu_body)
    return {"model_new.py": (HONEST / "model_new.py").read_text(), "kernels/relu.cpp": kernel}


def test_round_trip_and_materialize_as_loadable_candidates(tmp_path):
    samples = [Sample("level1/19_ReLU", "0", code=SINGLE), Sample("level1/19_ReLU", "1", files=_workdir()),
               Sample("level2/07_swish", "a-1.b", code="é ünïcode\n")]
    path = tmp_path / "s.h5"
    write_samples(path, samples, model="some-model-v2")
    assert read_samples(path) == samples
    with h5py.File(path) as f:
        assert f.attrs["model"] == "some-model-v2" and f.attrs["format"] == "hpc-samples"

    single = materialize(samples[0], tmp_path / "m")
    assert single == tmp_path / "m" / "level1" / "19_ReLU" / "0" / "19_ReLU.py"
    cand = load_candidate(single)
    assert cand.kind == SINGLE_FILE and cand.files == {"19_ReLU.py": SINGLE.encode()}
    workdir = materialize(samples[1], tmp_path / "m")
    cand = load_candidate(workdir)
    assert workdir == tmp_path / "m" / "level1" / "19_ReLU" / "1" and cand.kind == WORKDIR
    assert cand.files == {name: text.encode() for name, text in samples[1].files.items()}

    # the same sample again: the same path and bytes, and nothing left of what was there before
    (workdir / "kernels" / "stale.cpp").write_text("int stale;")
    assert materialize(samples[1], tmp_path / "m") == workdir
    assert load_candidate(workdir).sha256 == cand.sha256 and not (workdir / "kernels" / "stale.cpp").exists()
    # a folder already holding exactly the sample is left alone: array tasks materialize side by side
    inode = (workdir / "model_new.py").stat().st_ino
    assert materialize(samples[1], tmp_path / "m") == workdir
    assert (workdir / "model_new.py").stat().st_ino == inode
    assert sorted(p.name for p in workdir.parent.iterdir()) == ["0", "1"]   # no staging folder left


def _raw(path: Path, attrs: dict | None = None, **datasets) -> Path:
    """A samples file written by hand, malformed as a test needs."""
    with h5py.File(path, "w") as f:
        for key, value in (attrs if attrs is not None else {"format": "hpc-samples", "format_version": 1}).items():
            f.attrs[key] = value
        for name, values in datasets.items():
            if isinstance(values, np.ndarray):
                f.create_dataset(name, data=values)
            else:
                f.create_dataset(name, data=np.array(values, dtype=object), dtype=h5py.string_dtype())
    return path


GOOD = {"task_id": ["level1/relu"], "sample_id": ["0"], "code": [SINGLE]}


@pytest.mark.parametrize("attrs, datasets, words", [
    (None, {k: v for k, v in GOOD.items() if k != "code"}, "missing dataset code"),
    (None, {**GOOD, "sample_id": ["0", "1"]}, "dataset sample_id has 2 rows, task_id has 1"),
    (None, {**GOOD, "code": [b"\xff\xfe bad"]}, "dataset code row 0: not UTF-8"),
    (None, {**GOOD, "code": np.array([1.0])}, "dataset code: expected a 1-D dataset of strings"),
    ({"format": "something-else"}, GOOD, "not a samples file"),
    ({"format": "hpc-samples", "format_version": 7}, GOOD, "format_version 7 is not 1"),
    (None, {**GOOD, "sample_id": ["../escape"]}, "dataset sample_id: expected letters, digits"),
    (None, {**GOOD, "task_id": ["level1/../../etc"]}, "dataset task_id: expected a task id"),
    (None, {**GOOD, "files": ['{"model_new.py": "x"}']}, "exactly one of datasets code and files"),
    (None, {**GOOD, "code": [""], "files": ["{not json"]}, "dataset files row 0: not JSON"),
    (None, {**GOOD, "code": [""], "files": ['{"kernels/relu.cpp": "x"}']}, "dataset files: no model_new.py"),
    (None, {**GOOD, "code": [""], "files": ['{"model_new.py": "x", "../evil.cpp": "x"}']}, "'../evil.cpp' is not"),
    (None, {k: v * 2 for k, v in GOOD.items()}, "sample id repeated for this task"),
])
def test_bad_samples_files_are_a_clear_error(tmp_path, attrs, datasets, words):
    path = _raw(tmp_path / "bad.h5", attrs, **datasets)
    with pytest.raises(DataFileError) as err:
        read_samples(path)
    assert str(err.value).startswith(f"samples {path}: ") and words in str(err.value), str(err.value)


def test_not_hdf5_and_writing_a_bad_sample_are_errors(tmp_path):
    text = tmp_path / "s.h5"
    text.write_text("task_id,code\n")
    with pytest.raises(DataFileError, match="cannot read as HDF5"):
        read_samples(text)
    with pytest.raises(DataFileError, match="exactly one of datasets code and files"):
        write_samples(tmp_path / "w.h5", [Sample("level1/relu", "0")])


def test_evaluate_job_evaluates_every_sample_of_a_samples_file(tmp_path, cache_dir):
    tasks = tmp_path / "tasks" / "level1"
    tasks.mkdir(parents=True)
    samples = []
    for name in ("relu_a", "relu_b"):
        (tasks / f"{name}.py").write_text(RELU_TASK.read_text())
        samples += [Sample(f"level1/{name}", "good", files=_workdir()),
                    Sample(f"level1/{name}", "wrong", files=_workdir(relu_body="x[i]"))]
    write_samples(tmp_path / "samples.h5", samples, model="fixture")
    run = tmp_path / "run"
    proc = _evaluate(tmp_path, str(tasks.parent), str(tmp_path / "samples.h5"), "--out", str(run),
                     "--executor", "local", cache_dir=cache_dir)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log

    records = read_records(run / "results.h5")
    outcome = {(r.task_id, Path(r.candidate_path).relative_to(run / "samples").as_posix()): (r.correct, r.failed_stage)
               for r in records}
    assert len(records) == 4 and outcome == {
        ("level1/relu_a", "level1/relu_a/good"): (True, ""), ("level1/relu_a", "level1/relu_a/wrong"): (False, "verify"),
        ("level1/relu_b", "level1/relu_b/good"): (True, ""), ("level1/relu_b", "level1/relu_b/wrong"): (False, "verify"),
    }, [r.reason for r in records]


def test_evaluate_job_refuses_samples_of_no_task_in_one_line(tmp_path):
    (tmp_path / "tasks" / "level1").mkdir(parents=True)
    (tmp_path / "tasks" / "level1" / "relu.py").write_text(RELU_TASK.read_text())
    write_samples(tmp_path / "s.h5", [Sample("relu", "0", code=SINGLE)])
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), str(tmp_path / "tasks"),
                           str(tmp_path / "s.h5"), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: samples {tmp_path / 's.h5'}: no sample is of a task evaluated here (samples name 'relu', "
        "tasks are named like 'level1/relu')"], proc.stderr

"""Samples files: generated candidates (from any model, several per task) in one HDF5 file.

A model's generations arrive as one file instead of a folder tree per sample; evaluation writes
each sample out as an ordinary candidate (`materialize`) and loads it with load_candidate, so a
sample is evaluated exactly like the same code laid out in a candidates folder.

Layout (docs/formats.md): file attributes `format` = "hpc-samples", `format_version` = 1 and
optionally `model`; 1-D UTF-8 string datasets of one row per sample, all of the same length:
`task_id`, `sample_id`, `code` (a KernelBench single file, or "") and, optionally, `files` (JSON
{relative path: text} of a workdir, or ""). Each row has exactly one of `code` and `files`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import h5py
import numpy as np

from hpc.candidate import MODEL_FILE
from hpc.errors import DataFileError
from hpc.results.columns import Column, describe
from hpc.task import Task

FORMAT = "hpc-samples"
FORMAT_VERSION = 1
COLUMNS = (Column("task_id", str, "", "the task id as hpc.task forms it (level1/19_ReLU)"),
           Column("sample_id", str, "", "unique within its task: letters, digits, '.', '_', '-'"),
           Column("code", str, "", "a KernelBench single file (ModelNew + load_inline), or empty"),
           Column("files", str, "", "a workdir as {path: text} (model_new.py, kernels/...), or empty", json=True))
_STR = h5py.string_dtype("utf-8")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")

log = logging.getLogger(__name__)


@dataclass
class Sample:
    task_id: str                  # as hpc.task forms it: "level1/19_ReLU"
    sample_id: str                # unique within its task; a folder name
    code: str = ""                # a KernelBench single file (ModelNew + load_inline) ...
    files: dict[str, str] = field(default_factory=dict)   # ... or a workdir: model_new.py, kernels/<file>


def write_samples(path: str | Path, samples: list[Sample], model: str = "") -> None:
    """Write (replace) a samples file; refuses a sample that read_samples would refuse."""
    path = Path(path)
    _check_all(samples, f"samples {path}")
    columns = {"task_id": [s.task_id for s in samples], "sample_id": [s.sample_id for s in samples],
               "code": [s.code for s in samples],
               "files": [json.dumps(s.files, sort_keys=True) if s.files else "" for s in samples]}
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        if model:
            f.attrs["model"] = model
        for c in COLUMNS:
            f.create_dataset(c.name, data=np.array(columns[c.name], dtype=object), dtype=_STR)
        describe(f, COLUMNS)


def read_samples(path: str | Path) -> list[Sample]:
    """Every sample of a samples file, in file order; any malformation is a DataFileError naming the dataset."""
    path = Path(path)
    where = f"samples {path}"
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataFileError(f"{where}: cannot read as HDF5 ({e})") from None
    with f:
        if _text(f.attrs.get("format")) != FORMAT:
            raise DataFileError(f"{where}: not a samples file (attribute format is not {FORMAT!r})")
        if f.attrs.get("format_version") != FORMAT_VERSION:
            raise DataFileError(f"{where}: format_version {f.attrs.get('format_version')} is not {FORMAT_VERSION}")
        columns = {c.name: _column(f, c.name, where) for c in COLUMNS if c.name != "files" or c.name in f}
    rows = len(columns["task_id"])
    for name, values in columns.items():
        if len(values) != rows:
            raise DataFileError(f"{where}: dataset {name} has {len(values)} rows, task_id has {rows}")
    samples = []
    for i in range(rows):
        files = columns["files"][i] if "files" in columns else ""
        try:
            files = json.loads(files) if files else {}
        except json.JSONDecodeError as e:
            raise DataFileError(f"{where}: dataset files row {i}: not JSON ({e})") from None
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise DataFileError(f"{where}: dataset files row {i}: expected a JSON object of path -> text")
        samples.append(Sample(columns["task_id"][i], columns["sample_id"][i], columns["code"][i], files))
    _check_all(samples, where)
    return samples


def materialize(sample: Sample, root: str | Path) -> Path:
    """Write the sample as a candidate under root/<task id>/<sample id>/ and return its path for
    load_candidate: the single file (named like the task's problem file) or the workdir. The same
    sample always lands on the same path with the same bytes, so a requeued shard finds it. A folder
    that already holds exactly these files is left alone (array tasks materialize the same samples
    side by side); anything else there is replaced whole, by a rename, so a changed sample leaves no
    stale kernel behind and no reader sees a half-written one."""
    dest = Path(root) / sample.task_id / sample.sample_id
    wanted = ({f"{PurePosixPath(sample.task_id).name}.py": sample.code} if sample.code else sample.files)
    wanted = {name: text.encode("utf-8") for name, text in wanted.items()}
    entry = dest / next(iter(wanted)) if sample.code else dest
    if _holds(dest, wanted):
        return entry
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{sample.sample_id}."))
    for name, data in wanted.items():
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_bytes(data)
    old = dest.with_name(f".{sample.sample_id}.old.{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    try:
        staged.rename(dest)
    except OSError:   # another array task placed it between our check and now: theirs has the same bytes
        shutil.rmtree(staged)
    shutil.rmtree(old, ignore_errors=True)
    return entry


def _holds(folder: Path, wanted: dict[str, bytes]) -> bool:
    if not folder.is_dir():
        return False
    present = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    return present.keys() == wanted.keys() and all(present[n].read_bytes() == data for n, data in wanted.items())


def sample_candidates(path: str | Path, tasks: list[Task], root: str | Path) -> list[tuple[Task, Path | None]]:
    """Every (task, materialized sample) in task then file order; a task without a sample once,
    with None, so it is recorded as missing. Samples of other tasks are left out (with a note):
    --only may have left their tasks out."""
    samples = read_samples(path)
    if not samples:
        raise DataFileError(f"samples {path}: no samples")
    by_task: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_task[sample.task_id].append(sample)
    known = {t.task_id for t in tasks}
    others = [s.task_id for s in samples if s.task_id not in known]
    if len(others) == len(samples):
        raise DataFileError(f"samples {path}: no sample is of a task evaluated here (samples name {others[0]!r}, "
                            f"tasks are named like {tasks[0].task_id!r})")
    if others:
        log.warning("samples %s: %d sample(s) of tasks not evaluated here left out (e.g. %s)", path, len(others),
                    others[0])
    return [(task, materialize(sample, root)) if sample else (task, None)
            for task in tasks for sample in (by_task[task.task_id] or [None])]


def _check_all(samples: list[Sample], where: str) -> None:
    seen = set()
    for i, s in enumerate(samples):
        at = f"{where}: sample {i} ({s.task_id}/{s.sample_id})"
        if not all(map(_is_name, s.task_id.split("/"))):
            raise DataFileError(f"{at}: dataset task_id: expected a task id like level1/19_ReLU")
        if not _is_name(s.sample_id):
            raise DataFileError(f"{at}: dataset sample_id: expected letters, digits, '.', '_' or '-'")
        if bool(s.code) == bool(s.files):
            raise DataFileError(f"{at}: expected exactly one of datasets code and files")
        if s.files and MODEL_FILE not in s.files:
            raise DataFileError(f"{at}: dataset files: no {MODEL_FILE}")
        for name in s.files:
            # what load_candidate reads of a workdir; anything else would be silently left out
            if name != MODEL_FILE and not (name.startswith("kernels/") and _is_name(name.removeprefix("kernels/"))):
                raise DataFileError(f"{at}: dataset files: {name!r} is not {MODEL_FILE} or kernels/<file>")
        if (s.task_id, s.sample_id) in seen:
            raise DataFileError(f"{at}: sample id repeated for this task")
        seen.add((s.task_id, s.sample_id))


def _is_name(part: str) -> bool:
    """A safe path component: no separator, not '.' or '..'."""
    return bool(_NAME.fullmatch(part)) and part not in (".", "..")


def _column(f: h5py.File, name: str, where: str) -> list[str]:
    if name not in f:
        raise DataFileError(f"{where}: missing dataset {name}")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or h5py.check_string_dtype(ds.dtype) is None:
        raise DataFileError(f"{where}: dataset {name}: expected a 1-D dataset of strings")
    values = []
    for i, raw in enumerate(ds[:]):
        try:
            values.append(_text(raw))
        except UnicodeDecodeError:
            raise DataFileError(f"{where}: dataset {name} row {i}: not UTF-8") from None
    return values


def _text(value) -> str | None:
    return value.decode("utf-8") if isinstance(value, bytes) else value

"""Training metrics in HDF5: one row per training step and every trajectory, in the results file
beside the evaluation records (or without them).

Layout (results/SCHEMA.md): group /train (attributes schema_version, created) holds two tables of
the hpc.results.hdf5 kind, so the same writer lock, crash recovery and SWMR reads serve them:
/train/steps, one row per step (STEP_FIELDS), and /train/trajectories, one row per trajectory
(TRAJECTORY_FIELDS, the whole trajectory as JSON in `data`). Steps strictly increase and the
trajectories' steps never decrease, so a resumed run cuts both tables after its checkpoint's step
(truncate_after) and continues without duplicate rows. An evaluation of a policy (hpc.rl.evaluation)
writes its trajectories to the same table beside its records (EvaluationWriter): no step rows, the
trajectories' step is the checkpoint's.

A float step column (a metric) that a file lacks reads as NaN, and the file's next writer adds it
(NaN in the rows already there): a new metric is a new entry of STEP_FIELDS, not a new schema
version. Files of versions 1 to 3 lack the metrics added before that rule, and are read and
continued alike.
"""

from __future__ import annotations

import json
import math
import operator
import os
import time
from pathlib import Path

import h5py
import numpy as np

from hpc.errors import UserError
from hpc.results.hdf5 import AppendingFile, ResultWriter, column_dtype, complete_rows, read_retrying, to_python

TRAIN_GROUP = "train"
STEPS = "steps"
TRAJECTORIES = "trajectories"
TRAIN_SCHEMA_VERSION = 4

# One step row, in column order. Floats are NaN where a stage does not measure them (no KL in SFT).
STEP_FIELDS: dict[str, type] = {
    "step": int,                    # global, 1-based, strictly increasing
    "stage": str,                   # "sft", "ppo_single", "rft", "value", "ppo_multi", ...
    "stage_step": int,              # 1-based within the stage
    **{name: float for name in (
        "reward_mean", "reward_std", "pass_rate", "faster_than_eager_rate", "faster_than_compile_rate",
        "kl_to_reference", "entropy", "clip_fraction", "approx_kl", "policy_loss", "value_loss", "sft_loss",
        "explained_variance", "advantage_mean", "response_length_mean", "response_clipped_ratio",
        "malformed_rate", "turns_mean", "tokens_per_second", "generation_s", "reward_s", "update_s", "step_s",
        "samples_kept", "optimizer_steps", "update_tokens", "actor_grad_norm", "actor_update_ratio",
        "critic_grad_norm", "critic_update_ratio")},
    "samples": int,                 # trajectories (or sequences) the step learned from
    "timestamp": float,             # Unix time; the time of writing when not given
}
REQUIRED = tuple(name for name, tp in STEP_FIELDS.items() if tp is not float)
TRAJECTORY_FIELDS: dict[str, type] = {"step": int, "stage": str, "task_id": str, "reward": float,
                                      "end_reason": str, "data": str}
TRAJECTORY_KEYS = ("task_id", "reward", "end_reason")   # every trajectory dict has these (and data is all of it)


class TrainingWriter(AppendingFile):
    """Appends step metrics and trajectories to a results file's /train tables, flushed at every
    append (one writer per file: the file's evaluation records are written by a ResultWriter at
    another time). Use as a context manager."""

    def _prepare(self) -> None:
        if TRAIN_GROUP not in self.file:
            _create_layout(self.file)
        else:
            _add_missing_metrics(_train_group(self.file, self.path), self.path)
        self.steps = self.file[TRAIN_GROUP][STEPS]
        self.trajectories = self.file[TRAIN_GROUP][TRAJECTORIES]
        self.last_step = _last_step(self.steps)     # 0 before the first row
        self._last_trajectory_step = _last_step(self.trajectories)

    def append_step(self, metrics: dict) -> None:
        """One step's row: step, stage, stage_step and samples required, a missing (or None) float NaN,
        an unknown key a ValueError (a misspelt metric would otherwise vanish)."""
        unknown = unknown_step_metrics(metrics)
        if unknown:
            raise ValueError(f"append_step: unknown metric {unknown[0]!r} (the columns: STEP_FIELDS in "
                             "hpc/results/training.py)")
        missing = [key for key in REQUIRED if metrics.get(key) is None]
        if missing:
            raise ValueError(f"append_step: no {missing[0]!r} (required: {', '.join(REQUIRED)})")
        row = {name: _typed(name, tp, metrics.get(name), "append_step") for name, tp in STEP_FIELDS.items()}
        if metrics.get("timestamp") is None:
            row["timestamp"] = time.time()
        if row["step"] < 1:
            raise ValueError(f"append_step: step {row['step']} (steps count from 1)")
        if row["step"] <= self.last_step:
            raise ValueError(f"append_step: step {row['step']} does not follow step {self.last_step} (a resumed "
                             "run calls truncate_after(its checkpoint's step) first)")
        self.append_rows(self.steps, {name: [value] for name, value in row.items()})
        self.last_step = row["step"]

    def append_trajectories(self, step: int, stage: str, trajectories: list[dict]) -> None:
        """A step's trajectories, each stored whole as JSON, all in one flush (a crash keeps all or none)."""
        if not trajectories:
            return
        step = _typed("step", int, step, "append_trajectories")
        if step < 1:
            raise ValueError(f"append_trajectories: step {step} (steps count from 1)")
        if step < self._last_trajectory_step:
            raise ValueError(f"append_trajectories: step {step} is before step {self._last_trajectory_step}, "
                             "already written (a resumed run calls truncate_after(its checkpoint's step) first)")
        columns: dict[str, list] = {name: [] for name in TRAJECTORY_FIELDS}
        for i, trajectory in enumerate(trajectories):
            missing = [key for key in TRAJECTORY_KEYS if key not in trajectory]
            if missing:
                raise ValueError(f"append_trajectories: trajectory {i} has no {missing[0]!r}")
            try:
                data = json.dumps(trajectory)
            except (TypeError, ValueError) as e:
                raise ValueError(f"append_trajectories: trajectory {i} is not JSON-ready ({e})") from None
            row = {"step": step, "stage": stage, **{key: trajectory[key] for key in TRAJECTORY_KEYS}, "data": data}
            for name, tp in TRAJECTORY_FIELDS.items():
                columns[name].append(_typed(name, tp, row[name], f"append_trajectories: trajectory {i}"))
        self.append_rows(self.trajectories, columns)
        self._last_trajectory_step = step

    def truncate_after(self, step: int) -> None:
        """Drop the rows of steps after `step` from both tables: a run resumed from its checkpoint at
        `step` then appends step + 1 without duplicating what the killed run wrote after it."""
        for group in (self.steps, self.trajectories):
            count = int(group.attrs["count"])
            keep = int(np.searchsorted(group["step"][:count], step, side="right"))
            if keep < count:
                self.truncate_rows(group, keep)
        self.last_step = _last_step(self.steps)
        self._last_trajectory_step = _last_step(self.trajectories)


class EvaluationWriter(ResultWriter, TrainingWriter):
    """Evaluation records (`append`) and the trajectories that produced them (`append_trajectories`)
    in one file: a file has one writer at a time, so one writer holds both tables (an evaluation of
    a policy, hpc.rl.evaluation, and the merge of its shards)."""

    def _prepare(self) -> None:
        ResultWriter._prepare(self)
        TrainingWriter._prepare(self)


def _create_layout(f: h5py.File) -> None:
    group = f.create_group(TRAIN_GROUP)
    group.attrs["schema_version"] = TRAIN_SCHEMA_VERSION
    group.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name, fields in ((STEPS, STEP_FIELDS), (TRAJECTORIES, TRAJECTORY_FIELDS)):
        table = group.create_group(name)
        table.attrs["count"] = 0
        for column, tp in fields.items():
            table.create_dataset(column, shape=(0,), maxshape=(None,), dtype=column_dtype(tp), chunks=(64,))


def unknown_step_metrics(names) -> list[str]:
    """The names among `names` that are not step columns (STEP_FIELDS)."""
    return [name for name in names if name not in STEP_FIELDS]


def _add_missing_metrics(group: h5py.Group, path: Path) -> None:
    """Every metric column the steps table lacks, NaN in every row already there (a run resumed
    into a file written before the metric existed), and the current version on an older group.
    Done before the writer's SWMR mode, after which no column can be created. A column this code
    does not know (a newer one's metric) is a UserError: rows written here would leave it short."""
    steps = group[STEPS]
    unknown = unknown_step_metrics(steps)
    if unknown:
        raise UserError(f"results {path}: /{TRAIN_GROUP}/{STEPS} has a column {unknown[0]!r} that this version "
                        "does not write (a newer one made it): continue the file with that version")
    for column, tp in STEP_FIELDS.items():
        if tp is float and column not in steps:
            length = steps["step"].shape[0]
            steps.create_dataset(column, data=np.full(length, np.nan), maxshape=(None,), dtype=column_dtype(tp),
                                 chunks=(64,))
    if group.attrs["schema_version"] < TRAIN_SCHEMA_VERSION:
        group.attrs["schema_version"] = TRAIN_SCHEMA_VERSION


def _last_step(table: h5py.Group) -> int:
    count = int(table.attrs["count"])
    return int(table["step"][count - 1]) if count else 0


def _typed(name: str, tp: type, value, where: str):
    """`value` as the column's type: ints exactly (a float step is a bug), None as NaN for floats."""
    try:
        if tp is int:
            return operator.index(value)
        if tp is float:
            return math.nan if value is None else float(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name}={value!r} is not {tp.__name__}") from None


def _train_group(f: h5py.File, path: Path) -> h5py.Group:
    """The /train group, checked: UserError for a file without training data or with malformed."""
    if TRAIN_GROUP not in f:
        raise UserError(f"results {path}: no training data (no /{TRAIN_GROUP} group)")
    group = f[TRAIN_GROUP]
    version = group.attrs.get("schema_version")
    if not isinstance(version, (int, np.integer)) or not 1 <= version <= TRAIN_SCHEMA_VERSION:
        raise UserError(f"results {path}: /{TRAIN_GROUP} is not training data of schema version "
                        f"1..{TRAIN_SCHEMA_VERSION}")
    for name, fields in ((STEPS, STEP_FIELDS), (TRAJECTORIES, TRAJECTORY_FIELDS)):
        table = group.get(name)
        expected = [column for column, tp in fields.items() if name != STEPS or tp is not float]   # metrics: NaN
        missing = expected if not isinstance(table, h5py.Group) or "count" not in table.attrs else \
            [column for column in expected if column not in table]
        if missing:
            raise UserError(f"results {path}: malformed training data, /{TRAIN_GROUP}/{name} lacks columns "
                            f"{', '.join(missing[:5])}")
    return group


def read_steps(path: str | os.PathLike) -> list[dict]:
    """Every complete step row, as written (NaN where not measured); SWMR-safe while training runs."""
    path = Path(path)
    columns, n = read_retrying(path, lambda f: complete_rows(_train_group(f, path)[STEPS]))
    return [{name: to_python(columns[name][i]) if name in columns else math.nan for name in STEP_FIELDS}
            for i in range(n)]


def read_trajectories(path: str | os.PathLike, step: int | None = None) -> list[dict]:
    """Every complete trajectory (of one step when given): its JSON parsed, with the columns."""
    path = Path(path)

    def read(f: h5py.File) -> tuple[dict[str, np.ndarray], int]:
        table = _train_group(f, path)[TRAJECTORIES]
        if step is None:
            return complete_rows(table)
        steps = table["step"][:int(table.attrs["count"])]
        return complete_rows(table, int(np.searchsorted(steps, step, "left")),
                             int(np.searchsorted(steps, step, "right")))

    columns, n = read_retrying(path, read)
    out = []
    for i in range(n):
        row = {name: to_python(columns[name][i]) for name in TRAJECTORY_FIELDS}
        try:
            data = json.loads(row.pop("data"))
            if not isinstance(data, dict):
                raise ValueError
        except ValueError:
            raise UserError(f"results {path}: malformed training data, a trajectory of step {row['step']} "
                            "is not JSON") from None
        out.append({**data, **row})
    return out

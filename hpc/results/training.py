"""Training metrics in HDF5: one row per training step and every trajectory, in the results file
beside the evaluation records (or without them).

Layout (results/SCHEMA.md): group /train (attributes schema_version, created) holds two tables of
the hpc.results.hdf5 kind, so the same writer lock, crash recovery and SWMR reads serve them:
/train/steps, one row per step (STEP_COLUMNS), and /train/trajectories, one row per trajectory
(TRAJECTORY_COLUMNS, the whole trajectory as JSON in `data`); each column with its units and
meaning, which the writer puts on its dataset. Steps strictly increase and the trajectories'
steps never decrease, so a resumed run cuts both tables after its checkpoint's step
(truncate_after) and continues without duplicate rows. An evaluation of a policy (hpc.rl.evaluation)
writes its trajectories to the same table beside its records (EvaluationWriter): no step rows, the
trajectories' step is the checkpoint's.

A float step column (a metric) that a file lacks reads as NaN, and the file's next writer adds it
(NaN in the rows already there): a new metric is a new entry of STEP_COLUMNS, not a new schema
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

from hpc.errors import ResultsFileError
from hpc.results.columns import Column, column_dtype, describe
from hpc.results.hdf5 import AppendingFile, ResultWriter, complete_rows, read_retrying, to_python, wait_for_layout

TRAIN_GROUP = "train"
STEPS = "steps"
TRAJECTORIES = "trajectories"
TRAIN_SCHEMA_VERSION = 4

# One step row, in column order (results/SCHEMA.md's table of step fields is generated from it).
# Floats are NaN where a stage does not measure them (no KL in SFT); a metric added after version 1
# says the /train version that added it, and a file without it reads it as NaN.
STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", int, "", "global step, 1-based, strictly increasing over the whole run"),
    Column("stage", str, "", "the recipe's stage: `sft`, `ppo_single`, `rft`, `value`, `ppo_multi`, ..."),
    Column("stage_step", int, "", "step within the stage, 1-based"),
    Column("reward_mean", float, "1", "mean reward of the step's trajectories"),
    Column("reward_std", float, "1", "standard deviation of the rewards of the step's trajectories"),
    Column("pass_rate", float, "1", "share of the step's trajectories whose final candidate passed (correct, no "
                                    "stage failed)"),
    Column("faster_than_eager_rate", float, "1", "share of the step's trajectories passing and faster than the eager "
                                                 "baseline by more than the reward margin"),
    Column("faster_than_compile_rate", float, "1", "share of the step's trajectories passing and faster than the "
                                                   "compiled baseline by more than the reward margin"),
    Column("kl_to_reference", float, "nat/token", "KL of the policy to the reference policy, per token"),
    Column("entropy", float, "nat/token", "policy entropy, per token"),
    Column("clip_fraction", float, "1", "share of tokens whose probability ratio was clipped"),
    Column("approx_kl", float, "nat/token", "k3 estimate of KL(old policy, new policy) over the update"),
    Column("policy_loss", float, "1", "the policy's loss in the step's update"),
    Column("value_loss", float, "1", "the critic's loss in the step's update"),
    Column("sft_loss", float, "nat/token", "the supervised (cross-entropy) loss in the step's update"),
    Column("explained_variance", float, "1", "of the returns by the critic's values"),
    Column("advantage_mean", float, "1", "mean advantage over response tokens"),
    Column("response_length_mean", float, "tokens", "generated tokens per trajectory"),
    Column("response_clipped_ratio", float, "1", "share of trajectories cut at the token limit"),
    Column("malformed_rate", float, "1", "share of trajectories with an unparseable reply"),
    Column("turns_mean", float, "1", "agent turns per trajectory"),
    Column("tokens_per_second", float, "tokens/s", "generated tokens per second of generation"),
    Column("generation_s", float, "s", "wall time of the step's generation"),
    Column("reward_s", float, "s", "wall time of the step's rewards (evaluating the candidates)"),
    Column("update_s", float, "s", "wall time of the step's update"),
    Column("step_s", float, "s", "wall time of the whole step"),
    Column("samples_kept", float, "1", "rft steps: the trajectories rejection sampling keeps so far, out of every rft "
                                       "stage's samples up to this step (reward above the stage's `min_reward`, no "
                                       "loop, no malformed call, some tokens generated): the data of a later `sft` "
                                       "stage with `data: rft`"),
    Column("optimizer_steps", float, "1", "optimizer steps the step took: 1 for sft and value, `rl.ppo_epochs` x "
                                          "`rl.minibatches` for ppo (the actor's, and as many of the critic's), 0 for "
                                          "rft and measure", added_in=2),
    Column("update_tokens", float, "tokens", "tokens (padding excluded) the policy's update passed forward and "
                                             "backward on the writing trainer rank, summed over its optimizer steps "
                                             "(the critic's and the reference's passes not counted): the numerator of "
                                             "the update's tokens/s and MFU", added_in=3),
    Column("actor_grad_norm", float, "1", "the actor's global gradient norm at each optimizer step, before clipping "
                                          "to `rl.clip_grad`, averaged over the step's optimizer steps (sft and ppo "
                                          "steps)", added_in=4),
    Column("actor_update_ratio", float, "1", "||w_after - w_before|| / ||w_before|| over the actor's fp32 master "
                                             "weights at each optimizer step, averaged likewise: how far a step moves "
                                             "the model for its size", added_in=4),
    Column("critic_grad_norm", float, "1", "the critic's global gradient norm at each optimizer step, before clipping "
                                           "to `rl.clip_grad`, averaged over the step's optimizer steps (value and "
                                           "ppo steps with a critic)", added_in=4),
    Column("critic_update_ratio", float, "1", "||w_after - w_before|| / ||w_before|| over the critic's fp32 master "
                                              "weights at each optimizer step, averaged likewise", added_in=4),
    Column("samples", int, "1", "trajectories (or sequences) the step learned from"),
    Column("timestamp", float, "s", "Unix time (seconds since 1970-01-01 UTC); the time the row was written when not "
                                    "given"),
)
STEP_FIELDS: dict[str, type] = {c.name: c.type for c in STEP_COLUMNS}   # name -> type, as rows are checked
REQUIRED = tuple(name for name, tp in STEP_FIELDS.items() if tp is not float)
TRAJECTORY_COLUMNS: tuple[Column, ...] = (
    Column("step", int, "", "the step that generated it"),
    Column("stage", str, "", "that step's stage"),
    Column("task_id", str, "", "the task"),
    Column("reward", float, "1", "its reward (NaN when none)"),
    Column("end_reason", str, "", "why the episode ended"),
    Column("data", str, "", "the whole trajectory as given to `append_trajectories` (a JSON object); "
                            "`read_trajectories` returns it parsed, with the columns above", json=True),
)
TRAJECTORY_FIELDS: dict[str, type] = {c.name: c.type for c in TRAJECTORY_COLUMNS}
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
        describe(self.steps, STEP_COLUMNS)
        describe(self.trajectories, TRAJECTORY_COLUMNS)
        self.last_step = _last_step(self.steps)     # 0 before the first row
        self._last_trajectory_step = _last_step(self.trajectories)

    def append_step(self, metrics: dict) -> None:
        """One step's row: step, stage, stage_step and samples required, a missing (or None) float NaN,
        an unknown key a ValueError (a misspelt metric would otherwise vanish)."""
        unknown = unknown_step_metrics(metrics)
        if unknown:
            raise ValueError(f"append_step: unknown metric {unknown[0]!r} (the columns: STEP_COLUMNS in "
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
    does not know (a newer one's metric) is a ResultsFileError: rows written here would leave it short."""
    steps = group[STEPS]
    unknown = unknown_step_metrics(steps)
    if unknown:
        raise ResultsFileError(f"results {path}: /{TRAIN_GROUP}/{STEPS} has a column {unknown[0]!r} that this version "
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
    """The /train group, checked: ResultsFileError for a file without training data or with malformed."""
    wait_for_layout(f, path, TRAIN_GROUP)
    if TRAIN_GROUP not in f:
        raise ResultsFileError(f"results {path}: no training data (no /{TRAIN_GROUP} group)")
    group = f[TRAIN_GROUP]
    version = group.attrs.get("schema_version")
    if not isinstance(version, (int, np.integer)) or not 1 <= version <= TRAIN_SCHEMA_VERSION:
        raise ResultsFileError(f"results {path}: /{TRAIN_GROUP} is not training data of schema version "
                               f"1..{TRAIN_SCHEMA_VERSION}")
    for name, fields in ((STEPS, STEP_FIELDS), (TRAJECTORIES, TRAJECTORY_FIELDS)):
        table = group.get(name)
        expected = [column for column, tp in fields.items() if name != STEPS or tp is not float]   # metrics: NaN
        missing = expected if not isinstance(table, h5py.Group) or "count" not in table.attrs else \
            [column for column in expected if column not in table]
        if missing:
            raise ResultsFileError(f"results {path}: malformed training data, /{TRAIN_GROUP}/{name} lacks columns "
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
            raise ResultsFileError(f"results {path}: malformed training data, a trajectory of step {row['step']} "
                                   "is not JSON") from None
        out.append({**data, **row})
    return out

"""Training metrics in HDF5: round trip, bad rows refused, resume without duplicates, a killed
trainer's file recovered, sharing a file with evaluation records, and the training part of the
analysis report (jobs/analyze.py run in this process: no interpreter start per case)."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import sys

import h5py
import pytest

from hpc.errors import ResultsFileError
from hpc.results.hdf5 import ResultWriter, file_attrs, read_records
from hpc.results.record import EvalRecord
from hpc.results.training import STEP_FIELDS, TRAIN_SCHEMA_VERSION, TrainingWriter, read_steps, read_trajectories
from jobs.analyze import main as analyze_main


def step_row(step: int, stage: str, stage_step: int, **metrics) -> dict:
    return {"step": step, "stage": stage, "stage_step": stage_step, "samples": 4, "step_s": 60.0, **metrics}


def trajectory(task_id: str, reward: float, **extra) -> dict:
    return {"task_id": task_id, "reward": reward, "end_reason": "submitted", **extra}


def test_steps_and_trajectories_round_trip(tmp_path):
    path = tmp_path / "train.h5"
    with TrainingWriter(path, {"git_commit": "abc"}) as w:
        w.append_trajectories(1, "sft", [trajectory("level1/a", 1.0, turns=[{"role": "assistant", "text": "ünï"}])])
        w.append_step(step_row(1, "sft", 1, sft_loss=2.5, timestamp=100.0))
        w.append_trajectories(2, "ppo_single", [trajectory("level1/a", -1.0), trajectory("level1/b", math.nan)])
        w.append_step(step_row(2, "ppo_single", 1, reward_mean=0.5, kl_to_reference=None))
    steps = read_steps(path)
    assert list(steps[0]) == list(STEP_FIELDS)
    assert [(s["step"], s["stage"], s["stage_step"], s["samples"]) for s in steps] == [(1, "sft", 1, 4),
                                                                                      (2, "ppo_single", 1, 4)]
    assert steps[0]["sft_loss"] == 2.5 and steps[0]["timestamp"] == 100.0 and math.isnan(steps[0]["reward_mean"])
    assert steps[1]["reward_mean"] == 0.5 and math.isnan(steps[1]["kl_to_reference"]) and steps[1]["timestamp"] > 1e9
    first, *rest = read_trajectories(path)
    assert first == {"task_id": "level1/a", "reward": 1.0, "end_reason": "submitted", "step": 1, "stage": "sft",
                     "turns": [{"role": "assistant", "text": "ünï"}]}
    assert [(t["step"], t["task_id"]) for t in rest] == [(2, "level1/a"), (2, "level1/b")]
    assert math.isnan(rest[1]["reward"])
    assert [t["task_id"] for t in read_trajectories(path, step=2)] == ["level1/a", "level1/b"]
    assert read_trajectories(path, step=3) == []
    assert file_attrs(path)["git_commit"] == "abc"


def test_bad_rows_are_value_errors_and_write_nothing(tmp_path):
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        w.append_step(step_row(1, "sft", 1))
        w.append_trajectories(1, "sft", [trajectory("t", 0.0)])
        with pytest.raises(ValueError, match="unknown metric 'rewrd_mean'"):
            w.append_step(step_row(2, "sft", 2, rewrd_mean=1.0))
        with pytest.raises(ValueError, match="no 'stage_step'"):
            w.append_step({"step": 2, "stage": "sft", "samples": 1})
        with pytest.raises(ValueError, match="step=2.0 is not int"):
            w.append_step(step_row(2.0, "sft", 2))
        with pytest.raises(ValueError, match="step 1 does not follow step 1"):
            w.append_step(step_row(1, "sft", 2))
        with pytest.raises(ValueError, match="trajectory 1 has no 'end_reason'"):
            w.append_trajectories(2, "sft", [trajectory("t", 0.0), {"task_id": "t", "reward": 0.0}])
        with pytest.raises(ValueError, match="trajectory 0 is not JSON-ready"):
            w.append_trajectories(2, "sft", [trajectory("t", 0.0, tokens={1, 2})])
        with pytest.raises(ValueError, match="step 0 \\(steps count from 1\\)"):
            w.append_trajectories(0, "sft", [trajectory("t", 0.0)])
    with TrainingWriter(tmp_path / "other.h5") as w:
        with pytest.raises(ValueError, match="step 0 \\(steps count from 1\\)"):
            w.append_step(step_row(0, "sft", 1))
        w.append_trajectories(3, "sft", [trajectory("t", 0.0)])
        with pytest.raises(ValueError, match="step 2 is before step 3, already written"):
            w.append_trajectories(2, "sft", [trajectory("t", 0.0)])
    assert len(read_steps(path)) == 1 and len(read_trajectories(path)) == 1


def test_truncate_after_lets_a_resumed_run_continue_without_duplicates(tmp_path):
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        for step in range(1, 6):
            w.append_trajectories(step, "rft", [trajectory(f"s{step}-{i}", float(i)) for i in range(3)])
            w.append_step(step_row(step, "rft", step))
    with TrainingWriter(path) as w:        # resumed from the checkpoint of step 3
        assert w.last_step == 5
        w.truncate_after(3)
        assert w.last_step == 3
        w.append_trajectories(4, "rft", [trajectory("again", 1.0)])
        w.append_step(step_row(4, "rft", 4, reward_mean=9.0))
    assert [s["step"] for s in read_steps(path)] == [1, 2, 3, 4] and read_steps(path)[-1]["reward_mean"] == 9.0
    assert [t["task_id"] for t in read_trajectories(path) if t["step"] >= 3] == ["s3-0", "s3-1", "s3-2", "again"]
    with h5py.File(path, "r") as f:
        assert f["train/trajectories/data"].shape == (10,)      # the cut rows are gone, not only hidden


def test_records_and_training_share_a_file_with_one_writer_at_a_time(tmp_path):
    path = tmp_path / "results.h5"
    with TrainingWriter(path) as w:
        w.append_step(step_row(1, "sft", 1))
        with pytest.raises(ResultsFileError, match="another process is writing it"):
            ResultWriter(path)
    with ResultWriter(path) as w:          # adds /records to a file holding training metrics
        w.append(EvalRecord(task_id="level1/a", reward=1.0))
    with TrainingWriter(path) as w:
        w.append_step(step_row(2, "ppo_single", 1))
    with ResultWriter(path) as w:
        w.append(EvalRecord(task_id="level1/b"))
    assert [r.task_id for r in read_records(path)] == ["level1/a", "level1/b"]
    assert [s["step"] for s in read_steps(path)] == [1, 2]


TRAINER = """
import sys
from hpc.results.training import TrainingWriter
with TrainingWriter(sys.argv[1]) as w:
    step = 0
    while True:
        step += 1
        w.append_trajectories(step, "ppo_multi", [{"task_id": f"t{i}", "reward": float(step), "end_reason": "done",
                                                   "text": "x" * 2000} for i in range(8)])
        w.append_step({"step": step, "stage": "ppo_multi", "stage_step": step, "samples": 8, "reward_mean": step})
        print(step, flush=True)
"""


def test_a_killed_trainer_loses_at_most_the_row_being_written_and_the_next_writer_continues(tmp_path):
    path = tmp_path / "results.h5"
    with ResultWriter(path) as w:
        w.append(EvalRecord(task_id="level1/before"))
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(path)], stdout=subprocess.PIPE, text=True)
    finished = 0
    while finished < 10:
        finished = int(proc.stdout.readline())
    assert len(read_steps(path)) >= 10          # a live reader follows the trainer
    while finished < 30:
        finished = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = read_steps(path)              # read while the file is still marked open by the dead writer
    assert len(steps) >= finished and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(s["reward_mean"] == s["step"] for s in steps)
    trajectories = read_trajectories(path)
    assert len(trajectories) >= 8 * len(steps) and len(trajectories) % 8 == 0     # a step's batch: all or none

    with TrainingWriter(path) as w:       # recovers the file, both groups, and continues it
        w.truncate_after(len(steps))
        w.append_step(step_row(len(steps) + 1, "ppo_multi", len(steps) + 1))
    assert [s["step"] for s in read_steps(path)] == list(range(1, len(steps) + 2))
    assert len(read_trajectories(path)) == 8 * len(steps) and read_trajectories(path, 3)[0]["text"] == "x" * 2000
    assert [r.task_id for r in read_records(path)] == ["level1/before"]


def test_files_without_or_with_malformed_training_data_are_user_errors(tmp_path):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(ResultsFileError, match="cannot read as HDF5"):
        read_steps(junk)
    records_only = tmp_path / "records.h5"
    with ResultWriter(records_only) as w:
        w.append(EvalRecord(task_id="level1/a"))
    with pytest.raises(ResultsFileError, match="no training data"):
        read_trajectories(records_only)
    broken = tmp_path / "broken.h5"
    with TrainingWriter(broken) as w:
        w.append_step(step_row(1, "sft", 1))
    with h5py.File(broken, "a") as f:
        del f["train/steps/stage"]
    with pytest.raises(ResultsFileError, match="malformed training data, /train/steps lacks columns stage"):
        read_steps(broken)
    with pytest.raises(ResultsFileError, match="malformed training data"):
        TrainingWriter(broken)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=[1, 2, 3])
    with pytest.raises(ResultsFileError, match="not an hpc results file"):
        TrainingWriter(other)


def test_a_file_of_schema_version_1_reads_and_continues_with_the_columns_added_since(tmp_path):
    """A run started before `optimizer_steps` (version 1): its rows read it as NaN, and resuming
    into the same file adds the column (NaN for the old rows) and marks the file version 2."""
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        w.append_step(step_row(1, "sft", 1, sft_loss=2.0))
        w.append_step(step_row(2, "sft", 2, sft_loss=1.0))
    with h5py.File(path, "a") as f:     # what a version-1 writer left
        del f["train/steps/optimizer_steps"]
        f["train"].attrs["schema_version"] = 1
    old = read_steps(path)
    assert [r["sft_loss"] for r in old] == [2.0, 1.0] and all(math.isnan(r["optimizer_steps"]) for r in old)
    with TrainingWriter(path) as w:
        w.truncate_after(1)
        w.append_step(step_row(2, "ppo", 1, optimizer_steps=4))
    rows = read_steps(path)
    assert [r["stage"] for r in rows] == ["sft", "ppo"]
    assert math.isnan(rows[0]["optimizer_steps"]) and rows[1]["optimizer_steps"] == 4
    assert all(math.isnan(r["update_tokens"]) for r in rows)
    with h5py.File(path, "r") as f:
        assert f["train"].attrs["schema_version"] == TRAIN_SCHEMA_VERSION == 4
        assert f["train/steps/optimizer_steps"].shape == f["train/steps/update_tokens"].shape == (2,)
    with h5py.File(path, "a") as f:     # a current file without a required column is malformed
        del f["train/steps/stage_step"]
    with pytest.raises(ResultsFileError, match="/train/steps lacks columns stage_step"):
        read_steps(path)


def write_training(path, stages: list[tuple[str, int]], records: list[EvalRecord] = ()) -> None:
    step = 0
    with TrainingWriter(path, {"config": json.dumps({"rl": {}})}) as w:
        for stage, n in stages:
            for k in range(1, n + 1):
                step += 1
                metrics = {"sft_loss": 2.0 / k} if stage == "sft" else {
                    "reward_mean": 0.1 * k, "pass_rate": 0.05 * k, "faster_than_compile_rate": 0.01 * k,
                    "kl_to_reference": 0.001 * k, "entropy": 1.0 - 0.01 * k, "clip_fraction": 0.1,
                    "explained_variance": 0.5, "response_length_mean": 800.0, "tokens_per_second": 2500.0,
                    "generation_s": 40.0, "reward_s": 15.0, "update_s": 5.0}
                w.append_step(step_row(step, stage, k, **metrics))
    if records:
        with ResultWriter(path) as w:
            for rec in records:
                w.append(rec)


def test_analyze_reports_training_runs_with_and_without_evaluation_records(tmp_path, capsys):
    """trainrun: a training run's folder (train.h5 only); both.h5: one file with training metrics and
    evaluation records; mixed: a folder with both files."""
    passing = EvalRecord(task_id="level1/a", task_level=1, correct=True, speedup_eager=2.0, speedup_compile=1.5,
                         reward=3.0)
    write_training(tmp_path / "trainrun" / "train.h5", [("sft", 4), ("ppo_single", 12), ("ppo_multi", 8)])
    write_training(tmp_path / "both.h5", [("ppo_single", 6)], [passing])
    write_training(tmp_path / "mixed" / "train.h5", [("rft", 3)])
    with ResultWriter(tmp_path / "mixed" / "results.h5") as w:
        w.append(passing)
    out = tmp_path / "report"
    runs = [str(tmp_path / name) for name in ("trainrun", "both.h5", "mixed")]
    assert analyze_main([*runs, "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    data = (out / "training.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert md.startswith("# Training and evaluation report") and "![training](training.png)" in md
    assert "### Training: trainrun" in md and "### Training: both" in md and "### Training: mixed" in md
    assert "## Run: both" in md and "## Run: mixed" in md
    assert "## Run: trainrun" not in md          # no evaluation records: no evaluation section
    rows = set(md.splitlines())
    # the last 5 steps of each stage: sft_loss 2/k for k = 1..4 (all four); ppo_single k = 8..12
    assert "| sft | 4 | 1-4 | 0.07 | - | - | - | - | - | - | 1.042 | - | - | - |" in rows, md
    assert "| ppo_single | 12 | 5-16 | 0.20 | 1.000 | 50.0% | 10.0% | 0.010 | 0.900 | 0.500 | - | - | 800 | 2500 |" \
        in rows, md
    assert "| ppo_multi | 8 | 17-24 |" in md and (out / "fast_p.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["both", "mixed"]
    assert [t["source"] for t in summary["training"]] == [
        str(tmp_path / "trainrun" / "train.h5"), str(tmp_path / "both.h5"), str(tmp_path / "mixed" / "train.h5")]
    first = summary["training"][0]
    assert (first["label"], first["steps"], [s["stage"] for s in first["stages"]]) == \
        ("trainrun", 24, ["sft", "ppo_single", "ppo_multi"])
    assert first["stages"][0]["final"]["reward_mean"] is None and first["stages"][1]["final"]["pass_rate"] == 0.5

    only = tmp_path / "only"
    assert analyze_main([str(tmp_path / "trainrun" / "train.h5"), "--out", str(only)]) == 0
    assert (only / "report.md").read_text().startswith("# Training report") and (only / "training.png").is_file()
    assert "### Training: trainrun" in (only / "report.md").read_text()     # train.h5 is labelled by its folder
    assert not (only / "fast_p.png").exists() and json.loads((only / "summary.json").read_text())["runs"] == []
    capsys.readouterr()


def test_analyze_of_malformed_training_data_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "run.h5"
    write_training(path, [("sft", 2)])
    with h5py.File(path, "a") as f:
        f["train"].attrs["schema_version"] = 7
    assert analyze_main([str(path), "--out", str(tmp_path / "report")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: results {path}: /train is not training data of schema version 1..{TRAIN_SCHEMA_VERSION}"]


OPTIMIZER_COLUMNS = ("actor_grad_norm", "actor_update_ratio", "critic_grad_norm", "critic_update_ratio")


def test_a_file_of_schema_version_3_reads_the_optimizer_columns_as_nan_and_gains_them(tmp_path):
    """A run written before the optimizer's metrics (version 3): its rows read them as NaN; resumed,
    the file gains the columns (NaN for the old rows, the new row's values) and version 4."""
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        w.append_step(step_row(1, "sft", 1, sft_loss=2.0))
    with h5py.File(path, "a") as f:     # what a version-3 writer left
        for column in OPTIMIZER_COLUMNS:
            del f[f"train/steps/{column}"]
        f["train"].attrs["schema_version"] = 3
    assert all(math.isnan(read_steps(path)[0][c]) for c in OPTIMIZER_COLUMNS)
    with TrainingWriter(path) as w:
        w.append_step(step_row(2, "sft", 2, actor_grad_norm=0.5, actor_update_ratio=1e-4))
    rows = read_steps(path)
    assert all(math.isnan(rows[0][c]) for c in OPTIMIZER_COLUMNS)
    assert (rows[1]["actor_grad_norm"], rows[1]["actor_update_ratio"]) == (0.5, 1e-4)
    with h5py.File(path, "r") as f:
        assert f["train"].attrs["schema_version"] == 4


def test_a_new_metric_is_a_column_added_to_older_files_without_a_schema_version(tmp_path, monkeypatch):
    """A metric added to STEP_FIELDS after a file was written: the file reads it as NaN, a writer
    resuming into it adds the column (NaN for the old rows, the new row's value) and keeps the
    schema version; the code before the metric reads the newer file but refuses to write to it."""
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        w.append_step(step_row(1, "sft", 1, sft_loss=2.0))
    monkeypatch.setitem(STEP_FIELDS, "new_metric", float)
    assert math.isnan(read_steps(path)[0]["new_metric"])
    with TrainingWriter(path) as w:
        w.append_step(step_row(2, "sft", 2, sft_loss=1.0, new_metric=0.25))
    rows = read_steps(path)
    assert math.isnan(rows[0]["new_metric"]) and rows[1]["new_metric"] == 0.25
    assert [r["sft_loss"] for r in rows] == [2.0, 1.0]
    with h5py.File(path, "r") as f:
        assert f["train"].attrs["schema_version"] == TRAIN_SCHEMA_VERSION
        assert f["train/steps/new_metric"].shape == f["train/steps/step"].shape == (2,)
    monkeypatch.delitem(STEP_FIELDS, "new_metric")
    assert [r["sft_loss"] for r in read_steps(path)] == [2.0, 1.0]
    with pytest.raises(ResultsFileError, match="has a column 'new_metric' that this version does not write"):
        TrainingWriter(path)


def test_a_steps_metrics_take_only_step_columns_and_a_misspelt_one_fails_where_it_is_set():
    from hpc.rl.metrics import StepMetrics, rollout_metrics
    from hpc.rl.rollout import RolloutStats
    from hpc.rl.update import EpochsStats, UpdateStats

    row = StepMetrics(sft_loss=1.0)
    row.add(step=1, stage="sft", stage_step=1, samples=2)
    with pytest.raises(ValueError, match="unknown metric 'sft_los'"):
        row.add(sft_los=0.5)
    assert row.as_dict() == {"sft_loss": 1.0, "step": 1, "stage": "sft", "stage_step": 1, "samples": 2}
    update = EpochsStats(UpdateStats(*[0.5] * len(dataclasses.fields(UpdateStats))), []).as_dict()
    assert StepMetrics(**update).as_dict() == update          # the update's statistics are step columns
    outcomes = [{"reward": r, "correct": r > 0, "faster_eager": r > 1, "faster_compile": False, "generated": 10,
                 "clipped": 1, "replies": 2, "malformed": False} for r in (0.0, 2.0)]
    rollout = rollout_metrics(outcomes, RolloutStats(generation_s=4.0, tools_s=1.0, generated_tokens=20),
                              timed=True).as_dict()
    assert (rollout["samples"], rollout["reward_mean"], rollout["pass_rate"], rollout["faster_than_eager_rate"],
            rollout["response_clipped_ratio"], rollout["tokens_per_second"]) == (2, 1.0, 0.5, 0.5, 0.5, 5.0)
    assert math.isnan(rollout_metrics(outcomes, RolloutStats(), timed=False).as_dict()["faster_than_compile_rate"])


def _rl_row(step: int, stage: str, stage_step: int, samples: int) -> dict:
    return step_row(step, stage, stage_step, reward_mean=0.5, reward_std=0.9, pass_rate=0.75, kl_to_reference=0.01,
                    clip_fraction=0.1, explained_variance=0.3, value_loss=0.2, samples=samples)


def _training_rows(stages: list[tuple[str, int]]) -> list[dict]:
    rows: list[dict] = []
    for stage, n in stages:
        for k in range(1, n + 1):
            step = len(rows) + 1
            rows.append(step_row(step, stage, k, sft_loss=2.0 / k) if "sft" in stage else
                        step_row(step, stage, k, value_loss=0.5) if stage == "value" else
                        _rl_row(step, stage, k, 32 if stage.startswith("measure") else 16))
    return rows


@pytest.mark.parametrize("stages", [
    [("warmup_sft", 2), ("value", 1), ("ppo_single", 1), ("rft_sample", 1), ("ppo_multi", 1)],   # the test recipe
    [("warmup_sft", 400), ("measure_before", 1), ("ppo", 32), ("measure_after", 1)]])            # the default
def test_training_plot_draws_each_stage_name_inside_its_panel_on_whole_steps(tmp_path, monkeypatch, stages):
    """A panel's x axis spans its steps, each a whole slot with integer ticks, so every stage's
    name lies inside its panel: a one-step axis put the first stage's start (x = 0.5) far left of
    the panel, and its name with it (training.png grew 1.7x wider, a blank band on its left), and
    the last stage's name ran past the panel's right edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from hpc.analysis import plots

    saved = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or save(fig, path))
    plots.plot_training([("run", _training_rows(stages))], tmp_path / "training.png")
    (fig,) = saved
    renderer = FigureCanvasAgg(fig).get_renderer()
    names = []
    for ax in fig.axes:
        if not ax.get_visible() or not ax.lines:
            continue
        box = ax.get_window_extent(renderer)
        steps = max(x for line in ax.lines for x in line.get_xdata())
        assert ax.get_xlim() == (0.5, steps + 0.5), ax.get_title()
        assert all(tick == int(tick) for tick in ax.get_xticks() if 0.5 <= tick <= steps + 0.5), ax.get_title()
        for text in ax.texts:
            extent = text.get_window_extent(renderer)
            assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, (ax.get_title(), text.get_text())
            names.append(text.get_text().strip(" →"))
    assert set(names) == {stage for stage, _ in stages}

"""The analysis: metrics over hand-built records checked exactly, jobs/analyze.py end to end on real
HDF5 files (shards merged, report, plots, summary.json), and bad input as one error line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.analysis.metrics import fast_p, geomean, make_run, summarize, summarize_run, top_reasons
from hpc.results.hdf5 import ResultWriter
from hpc.results.record import EvalRecord
from hpc.suite import summary_table
from tests.conftest import ROOT

ANALYZE = ROOT / "jobs" / "analyze.py"
TASK = """import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(8)]

def get_init_inputs():
    return []
"""


def ok(task_id: str, se: float, sc: float, reward: float = 1.0, **kw) -> EvalRecord:
    return EvalRecord(task_id=task_id, task_level=int(task_id[5]), candidate_sha256=f"sha-{task_id}", compiled=True,
                      correct=True, speedup_eager=se, speedup_compile=sc, reward=reward, **kw)


def bad(task_id: str, stage: str, reason: str, **kw) -> EvalRecord:
    rec = EvalRecord(task_id=task_id, task_level=int(task_id[5]), candidate_sha256=f"sha-{task_id}", reward=-1.0,
                     **kw)
    return rec.fail(stage, reason)


SUITE = {"level1/a": 1, "level1/b": 1, "level2/c": 2, "level2/d": 2}


def test_fast_p_counts_a_missing_task_as_incorrect():
    records = [ok("level1/a", 2.0, 0.9), ok("level1/b", 1.2, 1.6), bad("level2/c", "verify", "mismatch")]
    assert fast_p(records, 1.0, "eager", missing=1) == 0.5
    assert fast_p(records, 1.5, "eager", missing=1) == 0.25
    assert fast_p(records, 2.0, "eager", missing=1) == 0.0          # strictly above p
    assert fast_p(records, 1.0, "compile", missing=1) == 0.25
    assert fast_p(records, 1.0, "eager") == 2 / 3                   # without the missing task
    s = summarize_run(make_run(records, SUITE)).overall
    assert (s.samples, s.tasks, s.missing, s.passed, s.pass_rate) == (4, 4, 1, 2, 0.5)
    assert s.fast_p_eager == {0.0: 0.5, 0.5: 0.5, 0.8: 0.5, 1.0: 0.5, 1.5: 0.25, 2.0: 0.0}
    assert s.fast_p_compile == {0.0: 0.5, 0.5: 0.5, 0.8: 0.5, 1.0: 0.25, 1.5: 0.25, 2.0: 0.0}


def test_a_failed_sample_is_never_fast_whatever_its_speedup():
    # correct, then rejected at profile (e.g. below the physical floor): its speedup does not count
    late = EvalRecord(task_id="level1/a", task_level=1, correct=True, speedup_eager=50.0, speedup_compile=50.0)
    late.fail("profile", "faster than the floor")
    s = summarize([late, ok("level1/b", 4.0, 1.0)])
    assert (s.pass_rate, s.faster_eager, s.fast_p_eager[2.0]) == (0.5, 0.5, 0.5)
    assert s.geomean_eager == pytest.approx(4.0, rel=1e-15)


def test_geomean_is_over_finite_positive_values_only():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0, rel=1e-15)
    assert geomean([2.0, 8.0, math.nan, 0.0, -1.0, math.inf]) == pytest.approx(4.0, rel=1e-15)
    assert math.isnan(geomean([])) and math.isnan(geomean([math.nan]))
    records = [ok("level1/a", 2.0, 0.5), ok("level1/b", 8.0, 0.125), bad("level2/c", "compile", "x")]
    s = summarize(records)
    assert s.geomean_eager == pytest.approx(4.0, rel=1e-15)
    assert s.geomean_compile == pytest.approx(0.25, rel=1e-15)


def test_a_pass_rate_trend_is_its_last_quarter_against_its_first_over_their_samples():
    from hpc.analysis.metrics import pass_rate_trend

    rising = [{"pass_rate": 0.2, "samples": 16}] * 8 + [{"pass_rate": 0.5, "samples": 16}] * 8
    first, last, z = pass_rate_trend(rising)
    assert (first, last) == (0.2, 0.5) and 3 < z < 5          # 64 samples a quarter: 0.2 -> 0.5
    flat = [{"pass_rate": r, "samples": 16} for r in (0.25, 0.19, 0.31, 0.25) * 4]
    assert abs(pass_rate_trend(flat)[2]) < 1
    assert math.isnan(pass_rate_trend(rising[:3])[2])          # fewer than 4 steps: no quarters
    assert math.isnan(pass_rate_trend([{"pass_rate": 0.0, "samples": 16}] * 8)[2])


def test_faster_means_faster_by_more_than_the_reward_margin():
    records = [ok("level1/a", 1.05, 1.051), ok("level1/b", 1.2, 1.0)]
    s = summarize(records)
    assert (s.faster_eager, s.faster_compile) == (0.5, 0.5)         # 1.05 is not faster, 1.051 is
    wide = summarize(records, margin=0.25)
    assert (wide.faster_eager, wide.faster_compile) == (0.0, 0.0)


def test_levels_split_with_their_own_missing_tasks():
    records = [ok("level1/a", 2.0, 2.0, reward=3.0), bad("level1/b", "compile", "nvcc: error"),
               ok("level2/c", 0.5, 0.5, reward=1.0)]
    run = summarize_run(make_run(records, SUITE, label="r"))
    assert list(run.levels) == [1, 2]
    one, two = run.levels[1], run.levels[2]
    assert (one.name, one.samples, one.missing, one.pass_rate, one.faster_eager, one.mean_reward) == \
        ("level 1", 2, 0, 0.5, 0.5, 1.0)
    assert (two.name, two.samples, two.missing, two.pass_rate, two.faster_eager, two.mean_reward) == \
        ("level 2", 2, 1, 0.5, 0.0, 1.0)
    assert run.overall.name == "all" and run.overall.samples == 4 and run.overall.mean_reward == 1.0


def test_failures_by_stage_in_stage_order_with_missing_and_reasons():
    records = [bad("level1/a", "verify", "mismatch: max abs 3"), bad("level1/b", "compile", "nvcc: error A"),
               bad("level2/c", "compile", "nvcc: error B\nsecond line"), bad("level2/x", "compile", "nvcc: error A"),
               EvalRecord(task_id="level2/y", task_level=2, compiled=True),       # compile-only: never verified
               ok("level1/z", 1.0, 1.0)]
    suite = {**SUITE, "level1/z": 1, "level2/x": 2, "level2/y": 2}
    run = summarize_run(make_run(records, suite))
    assert list(run.overall.failures.items()) == [("compile", 3), ("verify", 1), ("unverified", 1),
                                                  ("missing", 1)]
    assert run.levels[2].failures == {"compile": 2, "unverified": 1, "missing": 1}
    assert run.reasons == {"compile": [("nvcc: error A", 2), ("nvcc: error B", 1)],
                           "verify": [("mismatch: max abs 3", 1)]}
    assert top_reasons(records, top=1)["compile"] == [("nvcc: error A", 2)]


def test_without_a_suite_the_denominator_is_the_recorded_tasks_and_every_sample_counts():
    records = [ok("level1/a", 2.0, 2.0), bad("level1/a", "compile", "x", candidate_path="second sample"),
               ok("level1/b", 0.5, 0.5)]
    s = summarize_run(make_run(records)).overall
    assert (s.samples, s.tasks, s.missing, s.pass_rate, s.faster_eager) == (3, 2, 0, 2 / 3, 1 / 3)


def test_records_outside_the_suite_are_left_out_and_counted():
    run = make_run([ok("level1/a", 2.0, 2.0), ok("level3/other", 2.0, 2.0)], SUITE)
    summary = summarize_run(run)
    assert (run.outside_suite, summary.overall.samples, summary.overall.passed) == (1, 4, 1)


def test_summary_table_takes_its_rates_from_the_metrics():
    table = summary_table([ok("level1/a", 2.0, 1.0, reward=2.0), bad("level1/b", "compile", "x")])
    all_row = next(line for line in table.splitlines() if line.startswith("all "))
    assert all_row.split() == ["all", "2", "50%", "50%", "0%", "2.00", "1.00", "0.50"]


# --- jobs/analyze.py end to end -----------------------------------------------------------------------

def write_suite(root: Path) -> Path:
    for task_id in SUITE:
        path = root / "suite" / f"{task_id}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TASK)
    return root / "suite"


def write_results(path: Path, records: list[EvalRecord], margin: float = 0.05, **attrs: str) -> Path:
    with ResultWriter(path, {"git_commit": "0123456789abcdef", "config": json.dumps({"reward": {"margin": margin}}),
                             **attrs}) as w:
        for rec in records:
            w.append(rec)
    return path


def write_two_runs(root: Path) -> tuple[Path, Path]:
    """run1: a folder of two shards (one task re-run, one task missing); run2: one file of another
    model with a wider margin and a record outside the suite."""
    run1 = root / "run1"
    write_results(run1 / "shard-0000.h5", [ok("level1/a", 2.0, 1.5, reward=3.0, timestamp=2.0),
                                           bad("level2/c", "compile", "nvcc: error: bad | pipe")])
    write_results(run1 / "shard-0001.h5", [ok("level1/b", 0.5, 0.25, reward=1.0),
                                           ok("level1/a", 9.0, 9.0, reward=3.0, timestamp=1.0)])  # older: merged away
    run2 = write_results(root / "run2.h5", [
        ok("level1/a", 1.4, 1.6, reward=3.0), ok("level1/b", 1.6, 1.2, reward=2.0),
        bad("level2/c", "verify", "mismatch"), ok("level2/d", 3.0, 0.9, reward=2.0),
        ok("level3/extra", 5.0, 5.0, reward=3.0)], margin=0.5, model="model-b")
    return run1, run2


def analyze(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ANALYZE), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path


def test_analyze_merges_shards_and_reports_two_runs(tmp_path):
    run1, run2 = write_two_runs(tmp_path)
    out = tmp_path / "report"
    proc = analyze(str(run1), str(run2), "--out", str(out), "--tasks", str(write_suite(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out / "report.md")
    assert "merged 2 shards" in proc.stderr and (run1 / "results.h5").is_file()

    md = (out / "report.md").read_text()
    rows = set(md.splitlines())
    g_eager, g_compile = f"{(1.4 * 1.6 * 3.0) ** (1 / 3):.3f}", f"{(1.6 * 1.2 * 0.9) ** (1 / 3):.3f}"
    assert "| run1 | 50.0% | 25.0% | 25.0% | 1.000 | 0.612 | 25.0% | 25.0% | 1.000 |" in rows, md
    assert f"| model-b | 75.0% | 50.0% | 25.0% | {g_eager} | {g_compile} | 75.0% | 50.0% | 1.500 |" in rows, md
    assert "| level 1 | 2 | 2 | 0 | 100.0% | 50.0% | 50.0% | 1.000 | 0.612 | 2.000 |" in rows, md
    assert "| level 2 | 2 | 2 | 1 | 0.0% | 0.0% | 0.0% | - | - | -1.000 |" in rows, md
    assert "| all | eager | 50.0% | 25.0% | 25.0% | 25.0% | 25.0% | 0.0% |" in rows, md
    assert "| compile | 0 | 1 | 1 | 25.0% | nvcc: error: bad \\| pipe (1) |" in rows, md
    assert "| missing | 0 | 1 | 1 | 25.0% |  |" in rows, md
    assert f"| model-b | {run2} | 0123456789ab | 4 | 4 | speedup > 1.5 | 1 |" in rows, md
    for png in ("fast_p.png", "speedup_by_level.png", "failures.png"):
        assert_png(out / png)
        assert f"]({png})" in md
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and '<img src="fast_p.png"' in page
    assert '<td>model-b</td><td class="n">75.0%</td>' in page

    summary = json.loads((out / "summary.json").read_text())
    first, second = summary["runs"]
    assert (first["label"], second["label"], second["margin"], second["outside_suite"]) == ("run1", "model-b", 0.5, 1)
    assert first["overall"]["fast_p_eager"] == {"0": 0.5, "0.5": 0.25, "0.8": 0.25, "1": 0.25, "1.5": 0.25, "2": 0.0}
    assert first["overall"]["failures"] == {"compile": 1, "missing": 1}
    assert first["levels"]["2"]["geomean_eager"] is None and first["levels"]["1"]["pass_rate"] == 1.0
    assert second["overall"]["faster_eager"] == 0.5 and second["overall"]["samples"] == 4

    again = analyze(str(run1), str(run2), "--out", str(out), "--name", "one", "--name", "two")
    assert again.returncode == 0 and "merged" not in again.stderr, again.stderr   # results.h5 newer than shards
    assert [r["label"] for r in json.loads((out / "summary.json").read_text())["runs"]] == ["one", "two"]


def test_a_pool_give_up_later_evaluated_in_the_same_file_is_one_sample(tmp_path):
    from hpc.pool.coordinator import _failed
    from hpc.pool.messages import WorkItem

    item = WorkItem(id="level1/a", task="suite/level1/a.py", candidate="cands/level1/a",
                    meta={"task_id": "level1/a", "task_level": 1, "candidate_sha256": "sha-level1/a"})
    gave_up = EvalRecord(**_failed(item, "rank 2 lost").record)
    assert (gave_up.status, gave_up.failed_stage, gave_up.task_level) == ("error", "pool", 1)
    assert math.isnan(gave_up.reward)
    gave_up.timestamp = 5.0
    path = write_results(tmp_path / "pool.h5", [gave_up, ok("level1/b", 2.0, 2.0, reward=3.0),
                                                 ok("level1/a", 2.0, 2.0, reward=3.0, timestamp=9.0)])
    out = tmp_path / "report"
    proc = analyze(str(path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    overall = json.loads((out / "summary.json").read_text())["runs"][0]["overall"]
    assert (overall["samples"], overall["pass_rate"]) == (2, 1.0)


def test_analyze_as_a_local_submitit_job(tmp_path):
    _, run2 = write_two_runs(tmp_path)
    out = tmp_path / "report"
    proc = analyze(str(run2), "--out", str(out), "--executor", "local")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out / "report.md") and "local job" in proc.stderr
    assert json.loads((out / "summary.json").read_text())["runs"][0]["overall"]["samples"] == 5
    missing = analyze(str(tmp_path / "nope"), "--out", str(out), "--executor", "local")
    assert missing.returncode == 2 and missing.stderr.splitlines() == [f"error: run {tmp_path / 'nope'}: "
                                                                       "no such file or folder"]


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "notes.h5").write_text("not HDF5\n")
    real = write_results(tmp_path / "real.h5", [ok("level1/a", 2.0, 2.0)] * 50)
    (tmp_path / "truncated.h5").write_bytes(real.read_bytes()[:4000])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "shard-0000.h5").write_bytes(real.read_bytes()[:4000])
    (tmp_path / "empty_run").mkdir()
    write_results(tmp_path / "no_records.h5", [])
    return {"nonexistent": (tmp_path / "nope.h5", "no such file or folder"),
            "not HDF5": (tmp_path / "notes.h5", "cannot read as HDF5"),
            "truncated": (tmp_path / "truncated.h5", "cannot read as HDF5"),
            "truncated shard": (tmp_path / "run", "shard-0000.h5: cannot read as HDF5"),
            "empty folder": (tmp_path / "empty_run", "empty (no results.h5, shard-*.h5 or train.h5)"),
            "no records": (tmp_path / "no_records.h5", "no records")}


@pytest.mark.parametrize("case", ["nonexistent", "not HDF5", "truncated", "truncated shard", "empty folder",
                                  "no records"])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, case):
    path, message = _bad_inputs(tmp_path)[case]
    proc = analyze(str(path), "--out", str(tmp_path / "report"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and str(path) in lines[0] and message in lines[0], lines
    assert not (tmp_path / "report" / "report.md").exists()


def test_bad_arguments_are_one_error_line(tmp_path):
    _, run2 = write_two_runs(tmp_path)
    for args, message in ([[str(run2), "--out", str(tmp_path / "r"), "--name", "a", "--name", "b"],
                           "error: --name: 2 names for 1 runs (give one per run, in order)"],
                          [[str(run2), str(run2), "--out", str(tmp_path / "r")],
                           "error: runs labelled alike (model-b): tell them apart with --name"],
                          [[str(run2)], "error: jobs/analyze.py: the following arguments are required: --out"]):
        proc = analyze(*args)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message], proc.stderr


def test_training_plot_gives_the_rl_steps_an_axis_of_their_own():
    """400 SFT steps then 18 RL steps: the RL panels number the RL steps 1..18, not 401..418."""
    from hpc.analysis.plots import RL, SFT, VALUE, _axis_rows

    nan = float("nan")
    rows = ([{"step": k, "stage": "sft", "sft_loss": 1.0, "value_loss": nan, "reward_mean": nan} for k in range(1, 401)]
            + [{"step": 400 + k, "stage": "value", "sft_loss": nan, "value_loss": 0.5, "reward_mean": nan}
               for k in range(1, 3)]
            + [{"step": 402 + k, "stage": "ppo", "sft_loss": nan, "value_loss": 0.5, "reward_mean": 1.0}
               for k in range(1, 19)])
    assert [r["x"] for r in _axis_rows(rows, RL)] == list(range(1, 19))
    assert [r["step"] for r in _axis_rows(rows, VALUE)] == [401, 402]     # PPO's value loss is not pretraining
    assert len(_axis_rows(rows, SFT)) == 400

"""jobs/synthesize.py and slurm_templates/synthesize.sbatch: a submitit array on a real local Slurm
with one array task requeued mid-run, the template's array and merge steps, resumption, and
one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from hpc.synthesis.manifest import read_manifest
from hpc.synthesis.shards import read_shard
from tests.conftest import ROOT
from tests.test_slurm_templates import TEMPLATES, sbatch, wait_for_job

STATIC_ONLY = {"filters": {"skip": ["eager", "finite", "constant", "runtime", "compile"]},
               "compose": {"max_ops": 2}}
# The reference worker runs (eager, finite, constant, stochastic: seconds per candidate), timing
# and compile do not: long enough to requeue a shard in the middle, short enough for a test.
REFERENCE_ONLY = {"filters": {"skip": ["runtime", "compile"]}, "compose": {"families": ["matrix"], "max_ops": 2}}


def _config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "synth.yaml"
    path.write_text(json.dumps(data))
    return path


def _synthesize(*args: str, cache_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / "synthesize.py"), *map(str, args),
                             "--backend", "cpu", "--progress-every", "5"],
                            env={**os.environ, "HPC_CACHE_DIR": str(cache_dir)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _dataset(run: Path) -> dict[str, str]:
    dataset = run / "dataset"
    return {str(p.relative_to(dataset)): p.read_text() for p in sorted(dataset.rglob("*"))
            if p.suffix in (".py", ".jsonl")}


def test_array_task_requeued_mid_run_records_every_candidate_once(slurm, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = _synthesize("--out", run, "--count", 6, "--seed", 1, "--shards", 2, "--executor", "slurm",
                       "--config", _config(tmp_path, REFERENCE_ONLY), cache_dir=cache_dir)
    shard0 = run / "shard-0000.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (shard0.exists() and read_shard(shard0)[1]):
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)
    array = next(p.name.split("_")[0] for p in (run / "submitit").glob("*_0_log.out"))
    subprocess.run(["scontrol", "requeue", f"{array}_0"], check=True, capture_output=True, timeout=30)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log

    states = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", f"{array}_0", "-o", "State"],
                            capture_output=True, text=True, timeout=30).stdout.split()
    assert "REQUEUED" in states, states
    for shard in run.glob("shard-*.jsonl"):
        counts = Counter(r["index"] for r in read_shard(shard)[1])
        assert max(counts.values()) == 1, counts          # the requeued task did not redo finished work
    stats = json.loads((run / "dataset" / "stats.json").read_text())
    assert stats["candidates"] == 6 and stats["shards"] == 2, log
    assert {f["name"]: f["entered"] for f in stats["filters"]}["eager"] > 0


def test_template_array_then_merge_gives_the_dataset_of_a_local_run(slurm, tmp_path, cache_dir):
    config = _config(tmp_path, STATIC_ONLY)
    run = tmp_path / "run"
    env = {"HPC_OUT": str(run), "HPC_COUNT": "24", "HPC_SEED": "3", "HPC_BACKEND": "cpu",
           "HPC_SYNTH_ARGS": f"--config {config}", "HPC_PYTHON": sys.executable, "HPC_CACHE_DIR": str(cache_dir)}
    array = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, env, "--array=0-2", "--export=ALL")
    merge = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, env, f"--dependency=afterok:{array}", "--export=ALL")
    state = wait_for_job(merge)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))
    assert state == "COMPLETED", logs
    assert sorted(p.name for p in run.glob("shard-*.jsonl")) == ["shard-0000.jsonl", "shard-0001.jsonl",
                                                                  "shard-0002.jsonl"]
    local = tmp_path / "local"
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "synthesize", "--out", str(local), "--count", "24",
                           "--seed", "3", "--config", str(config)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert _dataset(run) == _dataset(local) and _dataset(run)


def test_template_names_a_missing_parameter(slurm, tmp_path):
    job = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, {}, "--export=NONE,PATH=/usr/bin:/bin")
    assert wait_for_job(job, 120) == "FAILED"
    lines = (tmp_path / f"{job}.out").read_text().strip().splitlines()
    assert lines == ["error: HPC_OUT is not set (sbatch --export=ALL,HPC_OUT=...)"]


def test_a_second_submission_checks_only_what_is_missing(tmp_path, cache_dir):
    config = _config(tmp_path, STATIC_ONLY)
    run = tmp_path / "run"
    first = _synthesize("--out", run, "--count", 8, "--shards", 2, "--executor", "local", "--config", config,
                        cache_dir=cache_dir)
    log, _ = first.communicate(timeout=600)
    assert first.returncode == 0, log
    again = _synthesize("--out", run, "--count", 8, "--shards", 2, "--executor", "local", "--config", config,
                        cache_dir=cache_dir)
    log, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and log.count("(0 checked, 4 already recorded") == 2, log
    assert json.loads((run / "dataset" / "stats.json").read_text())["candidates"] == 8


def test_one_shard_then_merge_in_this_process(tmp_path, cache_dir):
    config = _config(tmp_path, STATIC_ONLY)
    run = tmp_path / "run"
    base = [sys.executable, str(ROOT / "jobs" / "synthesize.py"), "--out", str(run), "--count", "5", "--config",
            str(config), "--shards", "2"]
    early = subprocess.run([*base, "--merge"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert early.returncode == 2 and early.stderr.strip().splitlines() == [
        f"error: run {run}: no shard files (shard-*.jsonl) to merge"]
    for shard in ("0", "1"):
        proc = subprocess.run([*base, "--shard", shard], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*base, "--merge"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "| **accepted** | 5 |" in proc.stdout
    report = (run / "dataset" / "report.md").read_text()     # the merged shards' quality report
    assert "| **accepted** | 5 |" in report and "## Rejections by reason" in report and "| input family |" in report


def test_bad_arguments_are_one_line(tmp_path):
    script = str(ROOT / "jobs" / "synthesize.py")
    for args, line in ((["--out", str(tmp_path), "--count", "4", "--shards", "0"],
                        "error: --shards: expected an integer >= 1, got 0"),
                       (["--out", str(tmp_path), "--count", "4", "--shards", "2", "--shard", "2"],
                        "error: --shard: expected 0..1, got 2"),
                       (["--out", str(tmp_path), "--bogus"],
                        "error: jobs/synthesize.py: unrecognized arguments: --bogus")):
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr


def test_a_corrupt_shard_is_one_line_and_exit_2(tmp_path, cache_dir):
    """A shard file whose middle line is not a record (not UTF-8 here) is corruption, not a torn
    write: the merge and a new submission both say which file and line, exit 2, submit nothing."""
    config = _config(tmp_path, STATIC_ONLY)
    run = tmp_path / "run"
    first = _synthesize("--out", run, "--count", 6, "--shards", 2, "--executor", "local", "--config", config,
                        cache_dir=cache_dir)
    log, _ = first.communicate(timeout=600)
    assert first.returncode == 0, log
    shard = run / "shard-0001.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    shard.write_bytes(b"".join([lines[0], b"\xff\xfe garbage\n", *lines[2:]]))
    line = f"error: shard {shard} line 2: corrupt (not a JSON record); move the file away to check its candidates again"
    for step in (["--merge"], ["--executor", "local"]):
        proc = _synthesize("--out", run, "--count", 6, "--shards", 2, "--config", config, *step, cache_dir=cache_dir)
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 2 and log.strip().splitlines() == [line], log
    assert len(list((run / "submitit").glob("*_log.out"))) == 2    # the first run's two tasks only


def test_validate_checks_a_datasets_tasks_at_a_scale_and_keeps_their_names(tmp_path, cache_dir):
    """--validate DATASET runs the dataset's tasks through the filters that run a task, at the
    scale asked (here the CPU path: on a GPU node the default is --backend cuda --scale gpu, the
    1-100 ms window, 16 GiB), keeps their names, and skips what made the dataset (contaminated,
    duplicate, compile); the manifest records each accepted task's peak memory."""
    from tests.test_synthesis import GOOD, HEAVY, PLANTED

    dataset = tmp_path / "made" / "dataset"
    dataset.mkdir(parents=True)
    rows = [{"code": GOOD, "ops": ["nn.Linear", "torch.relu"], "data_source": "hpc-synthesis",
             "task_id": "level2/000003_Linear_ReLU"},
            {"code": PLANTED["too_fast"][0], "ops": ["torch.tanh"], "data_source": "hpc-synthesis",
             "task_id": "level1/000007_Tanh"},
            {"code": HEAVY, "ops": ["torch.mul", "torch.sum"], "data_source": "hpc-synthesis",
             "task_id": "level2/000009_Mul_Sum"}]
    (dataset / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # too_fast (a tanh of 8 values, microseconds) is out of the window whatever the machine's load;
    # a task too slow by a fixed margin is not (a 1536^3 matmul took 0.1-2 s across loads)
    config = _config(tmp_path, {"filters": {"runtime_ms_cpu": [0.3, 1000.0], "max_memory_mib_cpu": 32},
                                "eval": {"timing": {"warmup": 1, "iterations": 5}}})
    run = tmp_path / "validated"
    proc = _synthesize("--out", run, "--validate", dataset, "--scale", "cpu", "--executor", "local", "--config", config,
                       cache_dir=cache_dir)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log
    out = run / "dataset"
    assert [str(p.relative_to(out)) for p in out.rglob("*.py")] == ["level2/000003_Linear_ReLU.py"], log
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in records] == ["level2/000003_Linear_ReLU"] and 0.3 < records[0]["eager_ms"] < 1000
    assert 0 < records[0]["peak_mib"] < 32
    stats = json.loads((out / "stats.json").read_text())
    assert [(r["filter"], r["kind"]) for r in stats["rejections"]] == [("memory", "too much memory"),
                                                                      ("runtime", "too fast")]
    assert stats["quality"]["peak_mib"]["max"] == records[0]["peak_mib"]
    assert f"| task | peak memory MiB at the cpu scale | {records[0]['peak_mib']:.4g} |" in (out / "report.md").read_text()
    peaks = {r["task_id"]: r["peak_mib"] for r in read_manifest(out / "manifest.h5")[0]}
    assert peaks["level2/000003_Linear_ReLU"] == records[0]["peak_mib"] and peaks["level2/000009_Mul_Sum"] >= 128
    entered = {f["name"]: f["entered"] for f in stats["filters"]}
    assert entered["memory"] == 3 and entered["runtime"] == 2
    assert entered["contaminated"] == entered["duplicate"] == entered["compile"] == 0
    assert stats["scale"] == "cpu"
    for args, line in ((["--validate", dataset, "--from", dataset / "manifest.jsonl"],
                        "error: --validate: takes its tasks from the dataset; not with --from or --import-only"),
                       (["--validate", tmp_path], f"error: --validate {tmp_path}: no manifest.jsonl (a synthesized "
                                                  "dataset folder, RUN/dataset, expected)")):
        proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "synthesize.py"), "--out", str(tmp_path / "x"),
                               *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr


def test_template_validates_a_dataset_and_names_a_missing_source(slurm, tmp_path, cache_dir):
    """HPC_VALIDATE through slurm_templates/synthesize.sbatch: an array task checks the dataset's
    task (the CPU path here: HPC_BACKEND=cpu, --scale cpu), the merge writes the validated
    dataset; without HPC_COUNT, HPC_FROM or HPC_VALIDATE the template says so in one line."""
    from tests.test_synthesis import GOOD

    dataset = tmp_path / "made" / "dataset"
    dataset.mkdir(parents=True)
    (dataset / "manifest.jsonl").write_text(json.dumps({"code": GOOD, "ops": ["nn.Linear", "torch.relu"],
                                                        "task_id": "level2/000003_Linear_ReLU"}) + "\n")
    # too_fast (a tanh of 8 values, microseconds) is out of the window whatever the machine's load;
    # a task too slow by a fixed margin is not (a 1536^3 matmul took 0.1-2 s across loads)
    config = _config(tmp_path, {"filters": {"runtime_ms_cpu": [0.3, 1000.0]},
                                "eval": {"timing": {"warmup": 1, "iterations": 5}}})
    run = tmp_path / "validated"
    env = {"HPC_OUT": str(run), "HPC_VALIDATE": str(dataset), "HPC_BACKEND": "cpu", "HPC_PYTHON": sys.executable,
           "HPC_SYNTH_ARGS": f"--scale cpu --config {config}", "HPC_CACHE_DIR": str(cache_dir)}
    array = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, env, "--array=0-0", "--export=ALL")
    merge = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, env, f"--dependency=afterok:{array}", "--export=ALL")
    state = wait_for_job(merge)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))
    assert state == "COMPLETED", logs
    assert [str(p.relative_to(run / "dataset")) for p in (run / "dataset").rglob("*.py")] == [
        "level2/000003_Linear_ReLU.py"], logs
    job = sbatch(TEMPLATES / "synthesize.sbatch", tmp_path, {}, f"--export=NONE,PATH=/usr/bin:/bin,HPC_OUT={run}")
    assert wait_for_job(job, 120) == "FAILED"
    assert (tmp_path / f"{job}.out").read_text().strip().splitlines() == [
        "error: HPC_COUNT is not set (sbatch --export=ALL,HPC_COUNT=...; or HPC_FROM=FILE, HPC_VALIDATE=DATASET)"]

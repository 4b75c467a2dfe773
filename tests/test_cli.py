"""The `hpc` command line contract: --json fields, HDF5 output, one-line errors with non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from hpc.results.hdf5 import read_records
from tests.conftest import LOCKED_TASK_HEAD, RELU_TASK, ROOT, TESTS, plumbing_config


def hpc(*args, env_cache=None, timeout=600, tmpdir=None):
    import os

    env = None
    if env_cache is not None or tmpdir is not None:
        env = {**os.environ, **({"HPC_CACHE_DIR": str(env_cache)} if env_cache is not None else {}),
               **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {})}
    return subprocess.run([sys.executable, "-m", "hpc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_eval_json_has_the_contract_fields_and_writes_hdf5(tmp_path, cache_dir):
    out = tmp_path / "r.h5"
    proc = hpc("eval", RELU_TASK, TESTS / "fixtures" / "honest_relu", "--backend", "cpu", "--scale", "cpu",
               "--json", "--out", out, "--iterations", "20", env_cache=cache_dir,
               tmpdir=tmp_path)   # its own device locks: no evaluation of a parallel test counts as beside it
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("compiled", "correct", "reward", "speedup_eager", "speedup_compile", "reason"):
        assert key in result
    assert result["compiled"] and result["correct"] and result["reward"] >= 1
    [rec] = read_records(out)
    assert rec.reward == result["reward"] and rec.task_id == "level1/relu"
    conditions = json.loads(rec.conditions)   # each timing's provenance
    assert set(conditions) == {"candidate", "eager", "compile:default"}
    for measured in conditions.values():
        assert {"at", "loadavg_1m", "beside"} <= measured.keys() and measured["beside"] == 0
        assert measured["flush_gb_s"] > 0   # the memory bandwidth one core got while the window ran
        assert 0.0 <= measured["inputs_on_huge_pages"] <= 1.0   # where its inputs lay (tests/test_exchange.py)
        assert measured["input_shifts"] == 32   # frame after frame, 32 places within 4 KiB
        assert measured["window_minor_faults"] >= 0   # its process's page faults over the window
        assert 0.0 <= measured["heap_on_huge_pages"] <= 1.0   # its heap's share on 2 MiB pages (test_hardware.py)
        assert measured["timed_in_process"] == 0 and len(measured["process_medians_ms"]) == 1   # one process each
    assert conditions["candidate"]["process_medians_ms"][conditions["candidate"]["timed_in_process"]] == round(
        rec.candidate_ms, 6)


def test_eval_of_a_failing_candidate_exits_one_and_keeps_its_record(tmp_path, cache_dir):
    out = tmp_path / "r.h5"
    proc = hpc("eval", RELU_TASK, TESTS / "hacks" / "numpy_compute", "--json", "--out", out, env_cache=cache_dir)
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["reward"] == -1 and "numpy" in result["reason"] and not result["compiled"]
    assert proc.stderr.strip() == f"failed: static: {result['reason']}"
    [rec] = read_records(out)
    assert rec.reward == -1 and rec.failed_stage == "static"


def test_eval_suite_with_two_jobs_records_every_task_once_in_task_order(tmp_path, cache_dir):
    tasks, solutions = tmp_path / "tasks" / "level1", tmp_path / "solutions" / "level1"
    tasks.mkdir(parents=True)
    for name in ("relu_a", "relu_b", "relu_c"):
        (tasks / f"{name}.py").write_text(RELU_TASK.read_text())
        shutil.copytree(TESTS / "fixtures" / "honest_relu", solutions / name)
    out = tmp_path / "r.h5"
    proc = hpc("eval-suite", tasks.parent, solutions.parent, "--backend", "cpu", "--scale", "cpu", "--jobs", "2",
               "--iterations", "20", "--out", out, "--config", plumbing_config(tmp_path), env_cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    records = read_records(out)
    assert sorted(r.task_id for r in records) == ["level1/relu_a", "level1/relu_b", "level1/relu_c"]
    assert all(r.status == "ok" and r.correct for r in records), [r.reason for r in records]
    table_rows = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("level1/")]
    assert table_rows == ["level1/relu_a", "level1/relu_b", "level1/relu_c"]


# Tasks that meet through a flock on LOCK (tests.conftest.LOCKED_TASK_HEAD): the hog's Model holds it
# shared (each of its evaluation's processes builds one) for as long as the process that built it
# lives; the squeezed one's Model waits up to 5 s for a neighbour to hold it, and runs out of memory
# while one does.
_LOCKED_RELU = LOCKED_TASK_HEAD + """

class Model(nn.Module):
    def __init__(self):
        super().__init__()
{init}

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(1 << 16)]


def get_init_inputs():
    return []
"""
_HOG = ("        self.held = os.open(LOCK, os.O_RDONLY)\n        fcntl.flock(self.held, fcntl.LOCK_SH)\n"
        "        time.sleep(3)")
_SQUEEZED = ("        if neighbour_holds_lock(5):\n"
             "            raise torch.OutOfMemoryError('out of memory: a neighbour holds the memory')")


def test_eval_suite_runs_an_evaluation_out_of_memory_beside_another_again_alone(tmp_path, cache_dir):
    """With two jobs the squeezed task runs out of memory while the hog runs beside it; run again
    once the hog is done, it passes, and that record, with the first one's reason, is the one kept."""
    lock = tmp_path / "memory.lock"
    lock.touch()
    tasks, solutions = tmp_path / "tasks" / "level1", tmp_path / "solutions" / "level1"
    tasks.mkdir(parents=True)
    for name, init in (("a_hog", _HOG), ("b_squeezed", _SQUEEZED)):
        (tasks / f"{name}.py").write_text(_LOCKED_RELU.format(lock=str(lock), init=init))
        shutil.copytree(TESTS / "fixtures" / "honest_relu", solutions / name)
    config = tmp_path / "locked.yaml"   # the workers may read the lock file in the test's folder
    config.write_text(plumbing_config(tmp_path).read_text() + "sandbox:\n  restrict_reads: false\n  run_as_uid: -1\n")
    out = tmp_path / "r.h5"
    proc = hpc("eval-suite", tasks.parent, solutions.parent, "--backend", "cpu", "--scale", "cpu", "--jobs", "2",
               "--iterations", "20", "--out", out, "--config", config, env_cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    hog, squeezed = read_records(out)   # each once
    assert (hog.task_id, hog.status, hog.first_reason) == ("level1/a_hog", "ok", "")
    assert (squeezed.task_id, squeezed.status, squeezed.correct) == ("level1/b_squeezed", "ok", True)
    assert "OutOfMemoryError: out of memory: a neighbour holds the memory" in squeezed.first_reason
    assert proc.stderr.count("ran out of memory with other evaluations beside it") == 1


@pytest.mark.parametrize("args, words", [
    (["eval", "missing_task.py", "x"], "no such file"),
    (["eval", RELU_TASK, "missing_candidate"], "no such file"),
    (["eval", RELU_TASK, TESTS / "fixtures" / "honest_relu", "--backend", "tpu"], "invalid choice"),
    (["eval", TESTS / "conftest.py", TESTS / "fixtures" / "honest_relu"], "not a KernelBench problem file"),
    (["eval-suite", "nowhere", "nowhere"], "no such file or folder"),
    (["eval-suite", ROOT / "kernels" / "tasks", ROOT / "kernels" / "solutions", "--jobs", "0"], "--jobs"),
    (["frobnicate"], "invalid choice"),
    (["eval", RELU_TASK, TESTS / "fixtures" / "honest_relu", "--config", "missing.yaml"], "missing.yaml: no such file"),
])
def test_bad_arguments_print_one_line_and_exit_nonzero(args, words):
    proc = hpc(*args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_results_file_that_is_not_hdf5_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_text("not hdf5")
    proc = hpc("eval", RELU_TASK, TESTS / "fixtures" / "honest_relu", "--out", bad)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_plain_kernelbench_problem_file_evaluates_unmodified(cache_dir):
    proc = hpc("eval", TESTS / "fixtures" / "kernelbench" / "19_ReLU.py", TESTS / "fixtures" / "honest_relu",
               "--json", "--iterations", "20", env_cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["correct"] and result["reward"] >= 1 and result["task_id"] == "19_ReLU"

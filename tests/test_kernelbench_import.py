"""hpc import-kernelbench: KernelBench's eval_results.json and baseline timings as EvalRecords.

The fixture JSON follows what KernelBench writes: scripts/eval_from_generations.py
(add_to_eval_results_file: problem id -> list of {sample_id, compiled, correctness, metadata,
runtime, runtime_stats}; src/eval.py's metadata keys) and scripts/generate_baseline_time.py
(results/timing/<hardware>/baseline_time_torch*.json: "level1" -> "19_ReLU.py" -> stats or null).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys

import pytest

from hpc.cli import main
from hpc.errors import UserError
from hpc.results.hdf5 import file_attrs, read_records
from hpc.results.kernelbench import import_kernelbench
from tests.conftest import ROOT, TESTS

H100 = "NVIDIA H100 80GB HBM3"


def _stats(mean: float, std: float) -> dict:
    return {"mean": mean, "std": std, "min": mean - std, "max": mean + 2 * std, "num_trials": 100,
            "hardware": H100, "device": "cuda:0"}


EVAL_RESULTS = {
    "19": [
        {"sample_id": 0, "compiled": True, "correctness": True,
         "metadata": {"hardware": H100, "device": "cuda:0", "correctness_trials": "(5 / 5)"},
         "runtime": 2.0, "runtime_stats": _stats(2.0, 0.02)},
        {"sample_id": 1, "compiled": True, "correctness": False,
         "metadata": {"hardware": H100, "device": "cuda:0", "max_difference": ["0.500000", "0.750000"],
                      "avg_difference": ["0.100000", "0.200000"], "correctness_issue": "Output mismatch",
                      "correctness_trials": "(3 / 5)"},
         "runtime": -1.0, "runtime_stats": {}},
        {"sample_id": 2, "compiled": True, "correctness": True,
         "metadata": {"hardware": H100, "device": "cuda:0", "correctness_trials": "(5 / 5)"},
         "runtime": 3.5, "runtime_stats": _stats(3.5, 0.07)},
    ],
    "20": [
        {"sample_id": 0, "compiled": False, "correctness": False,
         "metadata": {"hardware": H100, "device": "cuda:0", "compilation_error_name": "builtins.RuntimeError",
                      "compilation_error": "Error building extension 'leaky_relu'\nnvcc fatal: bad flag"},
         "runtime": -1.0, "runtime_stats": {}},
    ],
}
EAGER = {"level1": {"19_ReLU.py": _stats(4.27, 0.00845), "20_LeakyReLU.py": _stats(4.27, 0.00191)}}
COMPILE = {"level1": {"19_ReLU.py": _stats(3.0, 0.003), "20_LeakyReLU.py": None}}


@pytest.fixture
def kb(tmp_path):
    """KernelBench's files as a run leaves them: eval results, baseline timings, problem files."""
    paths = {"results": tmp_path / "eval_results.json", "eager": tmp_path / "baseline_time_torch.json",
             "compile": tmp_path / "baseline_time_torch_compile_inductor_default.json",
             "tasks": tmp_path / "KernelBench"}
    for key, data in (("results", EVAL_RESULTS), ("eager", EAGER), ("compile", COMPILE)):
        paths[key].write_text(json.dumps(data, indent=4))
    level1 = paths["tasks"] / "level1"
    level1.mkdir(parents=True)
    shutil.copy(TESTS / "fixtures" / "kernelbench" / "19_ReLU.py", level1 / "19_ReLU.py")
    (level1 / "20_LeakyReLU.py").write_text((level1 / "19_ReLU.py").read_text().replace("relu", "leaky_relu"))
    return paths


def test_samples_map_to_records_with_our_task_ids_speedups_and_reward(kb, tmp_path):
    out = tmp_path / "kb.h5"
    code = main(["import-kernelbench", str(kb["results"]), "--level", "1", "--out", str(out),
                 "--baseline-eager", str(kb["eager"]), "--baseline-compile", str(kb["compile"]),
                 "--tasks", str(kb["tasks"])])
    assert code == 0
    records = read_records(out)
    assert [(r.task_id, r.candidate_path) for r in records] == [
        ("level1/19_ReLU", "kernelbench:level1/19/sample0"), ("level1/19_ReLU", "kernelbench:level1/19/sample1"),
        ("level1/19_ReLU", "kernelbench:level1/19/sample2"), ("level1/20_LeakyReLU", "kernelbench:level1/20/sample0")]
    fast, wrong, eager_only, broken = records
    relu_sha = hashlib.sha256((kb["tasks"] / "level1" / "19_ReLU.py").read_bytes()).hexdigest()
    for r in records:
        assert (r.task_level, r.scale, r.backend, r.hardware, r.reward_kind) == (1, "gpu", "cuda", H100, "discrete")
        assert json.loads(r.config)["source"] == "kernelbench-import"
    assert fast.task_sha256 == wrong.task_sha256 == relu_sha

    # faster than eager and torch.compile by more than the margin: 3
    assert (fast.status, fast.failed_stage, fast.compiled, fast.correct, fast.trials) == ("ok", "", True, True, 5)
    assert (fast.candidate_ms, fast.eager_ms, fast.compile_ms) == (2.0, 4.27, 3.0)
    assert (fast.speedup_eager, fast.speedup_compile, fast.reward) == (4.27 / 2.0, 3.0 / 2.0, 3.0)
    assert fast.candidate_cv == pytest.approx(0.01) and fast.eager_cv == pytest.approx(0.00845 / 4.27)
    # faster than eager only: 2
    assert (eager_only.speedup_eager, eager_only.speedup_compile, eager_only.reward) == (4.27 / 3.5, 3.0 / 3.5, 2.0)
    # wrong output: a correctness failure, paid -1, no timing
    assert (wrong.status, wrong.failed_stage, wrong.reason) == ("failed", "verify", "Output mismatch")
    assert (wrong.compiled, wrong.correct, wrong.trials, wrong.max_abs_error, wrong.reward) == (True, False, 5, 0.75, -1.0)
    assert math.isnan(wrong.candidate_ms) and math.isnan(wrong.speedup_eager)
    # did not compile: a compile failure with KernelBench's error as log; compile baseline was null
    assert (broken.status, broken.failed_stage, broken.compiled, broken.reward) == ("failed", "compile", False, -1.0)
    assert broken.reason == "Error building extension 'leaky_relu'" and "nvcc fatal" in broken.compile_log
    assert broken.eager_ms == 4.27 and math.isnan(broken.compile_ms)

    attrs = file_attrs(out)
    assert attrs["source"] == "kernelbench-import" and json.loads(attrs["config"])["level"] == 1


def test_without_problem_files_the_baseline_names_the_task_and_no_baseline_means_no_reward(kb):
    records = import_kernelbench(kb["results"], 1, baseline_eager=kb["eager"])
    assert [r.task_id for r in records] == ["level1/19_ReLU"] * 3 + ["level1/20_LeakyReLU"]
    assert all(r.task_sha256 == "" for r in records)
    fast = records[0]
    assert fast.correct and fast.speedup_eager == 4.27 / 2.0 and math.isnan(fast.speedup_compile)
    assert math.isnan(fast.reward)          # 2 or 3 depends on the missing torch.compile time
    assert records[1].reward == -1.0


def test_older_one_sample_per_problem_layout(tmp_path, kb):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"19": EVAL_RESULTS["19"][0]}))
    [rec] = import_kernelbench(old, 1, kb["tasks"], kb["eager"], kb["compile"])
    assert (rec.task_id, rec.candidate_path, rec.reward) == ("level1/19_ReLU", "kernelbench:level1/19/sample0", 3.0)


def _write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _bad_sample(**change) -> dict:
    return {"19": [{**EVAL_RESULTS["19"][0], **change}]}


@pytest.mark.parametrize("results, eager, words", [
    ('{"19": [', EAGER, "not valid JSON"),
    ([1, 2], EAGER, "expected a non-empty object of problem id -> samples"),
    ({"nineteen": []}, EAGER, "key 'nineteen': expected an integer id"),
    ({"19": 5}, EAGER, ": 19: expected a list of samples"),
    (_bad_sample(compiled="yes"), EAGER, ": 19/0/compiled: expected true or false"),
    (_bad_sample(runtime="fast"), EAGER, ": 19/0/runtime: expected a number"),
    (_bad_sample(sample_id="0"), EAGER, ": 19[0]/sample_id: expected an integer"),
    ({"19": [EVAL_RESULTS["19"][0]] * 2}, EAGER, ": 19: sample 0 appears more than once"),
    (EVAL_RESULTS, {"level2": {}}, "no key 'level1' (has 'level2')"),
    (EVAL_RESULTS, {"level1": {"19_ReLU.py": {"mean": "4.27"}}}, ": level1/19_ReLU.py/mean: expected a positive number"),
    (EVAL_RESULTS, {"level1": {"19_ReLU.py": EAGER["level1"]["19_ReLU.py"]}}, "cannot name problem 20"),
])
def test_malformed_input_is_one_line_naming_the_key(tmp_path, capsys, results, eager, words):
    args = ["import-kernelbench", _write(tmp_path, "eval_results.json", results), "--level", "1",
            "--out", str(tmp_path / "out.h5"), "--baseline-eager", _write(tmp_path, "eager.json", eager)]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert not (tmp_path / "out.h5").exists()


def test_problem_files_must_be_in_a_level_folder_and_hold_every_problem(kb, tmp_path):
    with pytest.raises(UserError, match="no problem files in a level1 folder"):
        import_kernelbench(kb["results"], 1, TESTS / "fixtures" / "kernelbench")
    (kb["tasks"] / "level1" / "20_LeakyReLU.py").unlink()
    with pytest.raises(UserError, match="problem 20 has no problem file numbered 20"):
        import_kernelbench(kb["results"], 1, kb["tasks"])


def test_command_line_error_exits_two_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "import-kernelbench", str(tmp_path / "missing.json"),
                           "--level", "1", "--out", str(tmp_path / "out.h5")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: eval results {tmp_path / 'missing.json'}: cannot read (No such file or directory)"]


def test_the_documented_example_inputs_import_as_the_docs_say(tmp_path):
    """docs/formats.md shows an eval_results.json and a baseline file: they import into the records
    it describes."""
    import re

    doc = (ROOT / "docs" / "formats.md").read_text()
    section = doc[doc.index("## Importing KernelBench's own results"):]
    results, eager = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)[:2]]
    (tmp_path / "eval_results.json").write_text(json.dumps(results))
    (tmp_path / "eager.json").write_text(json.dumps(eager))
    out = tmp_path / "kb.h5"
    assert main(["import-kernelbench", str(tmp_path / "eval_results.json"), "--level", "1", "--out", str(out),
                 "--baseline-eager", str(tmp_path / "eager.json")]) == 0
    ok, wrong = read_records(out)
    assert (ok.task_id, ok.correct, ok.candidate_ms, ok.eager_ms) == ("level1/19_ReLU", True, 2.0, 4.27)
    assert math.isnan(ok.reward)
    assert (wrong.status, wrong.failed_stage, wrong.reward) == ("failed", "verify", -1.0)

"""KernelBench's own evaluation results as EvalRecords, so its runs are analyzed beside ours.

KernelBench (github.com/ScalingIntelligence/KernelBench) writes two kinds of JSON:

- `runs/<run>/eval_results.json` (scripts/eval_from_generations.py): problem id (a string, "19")
  -> a list of samples `{"sample_id", "compiled", "correctness", "metadata", "runtime",
  "runtime_stats"}`. Older versions stored one such sample object per problem, and derived
  harnesses a `{sample id: sample}` object; all three are read. `runtime` is the mean of
  `runtime_stats` (`mean`, `std`, `min`, `max`, `num_trials`) in ms, -1 when not timed.
- `results/timing/<hardware>/baseline_time_torch.json` (eager) and
  `baseline_time_torch_compile_inductor_default.json` (torch.compile), from
  scripts/generate_baseline_time.py: `"level<N>"` -> problem file name (`"19_ReLU.py"`) -> the same
  statistics, or null where timing failed.

Speedups are baseline mean / runtime, as KernelBench's scripts/benchmark_eval_analysis.py computes
them; the reward is ours (hpc.reward with the default RewardConfig).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from hpc.candidate import SINGLE_FILE
from hpc.config import RewardConfig
from hpc.errors import DataFileError, TaskError, read_reason
from hpc.results.record import EvalRecord
from hpc.reward import compute_reward
from hpc.task import Task, discover_tasks

SOURCE = "kernelbench-import"
# KernelBench's metadata keys that explain a failure, most specific first
_REASON_KEYS = ("compilation_error", "runtime_error", "correctness_issue", "cuda_error", "other_error",
                "error_message")


def import_config(eval_results: Path, level: int, tasks_dir: Path | None, baseline_eager: Path | None,
                  baseline_compile: Path | None) -> str:
    """What an import read: every imported record's `config`, and the results file's attribute."""
    return json.dumps({"source": SOURCE, "eval_results": str(eval_results), "level": level,
                       "tasks": str(tasks_dir or ""), "baseline_eager": str(baseline_eager or ""),
                       "baseline_compile": str(baseline_compile or "")})


def import_kernelbench(eval_results: Path, level: int, tasks_dir: Path | None = None,
                       baseline_eager: Path | None = None, baseline_compile: Path | None = None) -> list[EvalRecord]:
    """One record per sample, by problem then sample id. Task ids are those our suite gives the same
    KernelBench file (`level1/19_ReLU`): the file is found by its number under `tasks_dir`, else
    named by a baseline file's key; a problem neither names is an error."""
    results = _load_json(eval_results, "eval results")
    where = f"eval results {eval_results}"
    if not isinstance(results, dict) or not results:
        raise DataFileError(f"{where}: expected a non-empty object of problem id -> samples")
    eager = _baselines(baseline_eager, level)
    compiled = _baselines(baseline_compile, level)
    tasks = _tasks_by_number(tasks_dir, level) if tasks_dir else {}
    named = {_number(name): name for name in (*eager, *compiled) if _number(name) is not None}
    config = import_config(eval_results, level, tasks_dir, baseline_eager, baseline_compile)
    reward = RewardConfig()
    now = time.time()
    records = []
    for key in sorted(results, key=lambda k: _problem_id(k, where)):
        problem = int(key)
        task = tasks.get(problem)
        if tasks_dir and task is None:
            raise DataFileError(f"{where}: problem {problem} has no problem file numbered {problem} "
                                f"in a level{level} folder under {tasks_dir}")
        file_name = task.path.name if task else named.get(problem)
        if file_name is None:
            raise DataFileError(f"{where}: cannot name problem {problem}: pass --tasks (KernelBench's problem files) "
                                f"or a baseline file that lists it")
        base = dict(task_id=task.task_id if task else f"level{level}/{Path(file_name).stem}",
                    task_level=task.level if task else level, task_sha256=task.sha256 if task else "",
                    scale="gpu", backend="cuda", candidate_kind=SINGLE_FILE, config=config,
                    reward_kind=reward.kind, timestamp=now)
        for sample_id, sample in _samples(results[key], f"{where}: {key}"):
            rec = EvalRecord(**base, candidate_path=f"kernelbench:level{level}/{problem}/sample{sample_id}")
            _fill(rec, sample, eager.get(file_name), compiled.get(file_name), reward, f"{where}: {key}/{sample_id}")
            records.append(rec)
    return records


def _fill(rec: EvalRecord, sample: dict, eager: tuple[float, float] | None, compiled: tuple[float, float] | None,
          reward: RewardConfig, where: str) -> None:
    """Outcome, timing and reward of one KernelBench sample."""
    for key in ("compiled", "correctness"):
        if not isinstance(sample.get(key), bool):
            raise DataFileError(f"{where}/{key}: expected true or false")
    meta = _object(sample, "metadata", where)
    stats = _object(sample, "runtime_stats", where)
    runtime = sample.get("runtime", -1.0)
    if not _is_number(runtime):
        raise DataFileError(f"{where}/runtime: expected a number")
    rec.hardware = str(meta.get("hardware") or stats.get("hardware") or "")
    rec.compiled = sample["compiled"]
    rec.correct = sample["compiled"] and sample["correctness"]
    trials = re.fullmatch(r"\((\d+) / (\d+)\)", str(meta.get("correctness_trials", "")))
    rec.trials = int(trials.group(2)) if trials else 0
    diffs = meta.get("max_difference")       # one string per failed trial
    diffs = [_float(d) for d in diffs] if isinstance(diffs, list) else []
    rec.max_abs_error = max((d for d in diffs if math.isfinite(d)), default=math.nan)
    rec.eager_ms, rec.eager_cv = eager or (math.nan, math.nan)
    rec.compile_ms, rec.compile_cv = compiled or (math.nan, math.nan)
    if not rec.compiled:
        rec.compile_log = str(meta.get("compilation_error", ""))
        rec.fail("compile", _reason(meta, "did not compile (KernelBench recorded no error)"))
    elif not rec.correct:
        rec.fail("verify", _reason(meta, "incorrect (KernelBench recorded no reason)"))
    elif runtime > 0:
        rec.candidate_ms = float(runtime)
        if _is_number(stats.get("std")):
            rec.candidate_cv = stats["std"] / runtime
        rec.speedup_eager = rec.eager_ms / rec.candidate_ms
        rec.speedup_compile = rec.compile_ms / rec.candidate_ms
    # a correct sample without both speedups has no reward: which tier it earns is unknown
    if not rec.correct or (math.isfinite(rec.speedup_eager) and math.isfinite(rec.speedup_compile)):
        rec.reward = compute_reward(rec.correct, rec.speedup_eager, rec.speedup_compile, reward)


def _reason(meta: dict, default: str) -> str:
    for key in _REASON_KEYS:
        text = str(meta.get(key) or "").strip()
        if text:
            return text.splitlines()[0][:300]
    return default


def _samples(entry, where: str) -> list[tuple[int, dict]]:
    """(sample id, sample) in sample order, from any of the three layouts."""
    if isinstance(entry, dict) and "compiled" in entry:      # one sample per problem (older KernelBench)
        entry = [entry]
    if isinstance(entry, list):
        pairs = []
        for i, sample in enumerate(entry):
            if not isinstance(sample, dict):
                raise DataFileError(f"{where}[{i}]: expected a sample object")
            sample_id = sample.get("sample_id")
            if not isinstance(sample_id, int) or isinstance(sample_id, bool):
                raise DataFileError(f"{where}[{i}]/sample_id: expected an integer")
            pairs.append((sample_id, sample))
    elif isinstance(entry, dict):                             # {sample id: sample}
        pairs = []
        for key, sample in entry.items():
            if not isinstance(sample, dict):
                raise DataFileError(f"{where}/{key}: expected a sample object")
            pairs.append((_problem_id(key, where), sample))
    else:
        raise DataFileError(f"{where}: expected a list of samples")
    ids = [sample_id for sample_id, _ in pairs]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise DataFileError(f"{where}: sample {repeated[0]} appears more than once")
    return sorted(pairs, key=lambda pair: pair[0])


def _baselines(path: Path | None, level: int) -> dict[str, tuple[float, float]]:
    """Problem file name -> (mean ms, coefficient of variation); problems timed as null are left out."""
    if path is None:
        return {}
    data = _load_json(path, "baseline")
    where = f"baseline {path}"
    if not isinstance(data, dict):
        raise DataFileError(f"{where}: expected an object of level name -> problems")
    if f"level{level}" not in data:
        raise DataFileError(f"{where}: no key 'level{level}' (has {', '.join(map(repr, data)) or 'none'})")
    problems = data[f"level{level}"]
    if not isinstance(problems, dict):
        raise DataFileError(f"{where}: level{level}: expected an object of problem file name -> timing")
    out = {}
    for name, stats in problems.items():
        if stats is None:
            continue
        if not isinstance(stats, dict):
            raise DataFileError(f"{where}: level{level}/{name}: expected an object with mean and std, or null")
        mean, std = stats.get("mean"), stats.get("std")
        if not _is_number(mean) or mean <= 0:
            raise DataFileError(f"{where}: level{level}/{name}/mean: expected a positive number")
        out[name] = (float(mean), std / mean if _is_number(std) else math.nan)
    return out


def _tasks_by_number(tasks_dir: Path, level: int) -> dict[int, Task]:
    tasks = [t for t in discover_tasks(tasks_dir) if t.level == level]
    if not tasks:
        raise TaskError(f"tasks {tasks_dir}: no problem files in a level{level} folder")
    by_number: dict[int, Task] = {}
    for task in tasks:
        number = _number(task.path.name)
        if number is None:
            continue
        if number in by_number:
            raise TaskError(f"tasks {tasks_dir}: problem {number} is both {by_number[number].task_id} and {task.task_id}")
        by_number[number] = task
    return by_number


def _number(file_name: str) -> int | None:
    """KernelBench numbers its problem files: "19_ReLU.py" is problem 19."""
    match = re.match(r"(\d+)_", file_name)
    return int(match.group(1)) if match else None


def _problem_id(key: str, where: str) -> int:
    if not re.fullmatch(r"\d+", key):
        raise DataFileError(f"{where}: key {key!r}: expected an integer id")
    return int(key)


def _object(sample: dict, key: str, where: str) -> dict:
    value = sample.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataFileError(f"{where}/{key}: expected an object")
    return value


def _float(text) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _load_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DataFileError(f"{what} {path}: {read_reason(e)}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{what} {path}: not valid JSON ({e})") from None

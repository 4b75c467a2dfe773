"""Evaluate one candidate on one task: static -> compile -> load -> correctness -> timing -> baseline -> reward.

The harness (this process) never imports task or candidate code. The reference and the
candidate each run in their own sandboxed process; reference outputs stay in this process and
are compared here. Every stage that fails leaves a named reason in the record.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from hpc.baseline import get_baselines, task_cost, timing_request, timing_setup
from hpc.candidate import SINGLE_FILE, Candidate
from hpc.compile.native import compile_workdir, default_toolchain
from hpc.config import EvalConfig, config_to_dict
from hpc.hardware import device_name, versions
from hpc.profile.device_lock import DeviceLock
from hpc.profile.timing import TimingStats
from hpc.results.record import EvalRecord
from hpc.runner.op_monitor import op_monitor_library
from hpc.reward import compute_reward
from hpc.sandbox import cuda_ipc
from hpc.sandbox.prestart import WorkerPair, worker_pair
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.task import Task
from hpc.verify.compare import Comparison, compare_fingerprints, compare_outputs
from hpc.verify.static import kernel_defect, link_flags, source_defect

_BUILD_FAILED = "Error building extension"


STOP_AFTER = ("compile", "correctness", "reward")


def evaluate(task: Task, candidate: Candidate, cfg: EvalConfig, stop_after: str = "reward") -> EvalRecord:
    """One evaluation; never raises for anything the candidate does.

    `stop_after` ends it early for an agent's tools: "compile" (its compile tool), "correctness"
    (verify); such records keep a NaN reward unless a stage failed.
    """
    if stop_after not in STOP_AFTER:
        raise ValueError(f"stop_after must be one of {STOP_AFTER}, got {stop_after!r}")
    t0 = time.monotonic()
    config = config_to_dict(cfg)
    rec = EvalRecord(
        task_id=task.task_id, task_level=task.level, task_sha256=task.sha256, scale=cfg.scale,
        candidate_sha256=candidate.sha256, candidate_kind=candidate.kind, candidate_path=str(candidate.path),
        candidate_source=candidate.source_text(), backend=cfg.backend, hardware=device_name(cfg.backend),
        versions=json.dumps(versions()), policy=json.dumps(config["policy"]),
        config=json.dumps(config), reward_kind=cfg.reward.kind, timestamp=time.time())
    clock, lock = _StageClock(), DeviceLock(cfg.backend)
    try:
        _run_stages(rec, task, candidate, cfg, stop_after, clock, lock)
    finally:
        rec.stage_seconds = json.dumps({**clock.seconds, **{k: round(v, 4) for k, v in lock.seconds.items()}})
    if rec.status == "failed":
        rec.reward = cfg.reward.incorrect
    rec.wall_seconds = time.monotonic() - t0
    return rec


class _StageClock:
    """Seconds per stage, kept with the record: where an evaluation's time goes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, stage: str) -> None:
        now = time.monotonic()
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + now - self._last, 4)
        self._last = now


def _run_stages(rec: EvalRecord, task: Task, candidate: Candidate, cfg: EvalConfig, stop_after: str,
                clock: _StageClock, lock: DeviceLock) -> None:
    defect = (source_defect(candidate.files[candidate.model_file].decode("utf-8", "replace"), candidate.model_file)
              or kernel_defect(candidate.files, cfg.policy.libraries))
    clock.mark("static")
    if defect:
        rec.fail("static", defect)
        return
    if stop_after == "compile":
        if candidate.kind != SINGLE_FILE:   # a single file's load_inline builds when loaded
            with tempfile.TemporaryDirectory(prefix="hpc-compile-") as workroot:
                _compile(rec, candidate, cfg, candidate.materialize(Path(workroot)).parent, [])
        clock.mark("compile")
        return
    seeds = _Seeds.draw(cfg)
    rec.seeds = json.dumps({"init": seeds.init, "trials": seeds.trials, "timing": seeds.timing,
                            "timed_checks": seeds.checked})
    writable = _extension_dir(candidate, cfg)
    with ExitStack() as stack:
        pair = worker_pair(cfg.sandbox, cfg.backend, writable)
        stack.callback(pair.close)
        stack.callback(pair.kill)   # first: the harness has its results; an orderly exit took seconds
        model_file = candidate.materialize(pair.candidate_dir)
        env = _compile(rec, candidate, cfg, pair.candidate_dir, writable)
        clock.mark("compile")
        if rec.failed_stage:
            return
        if not _run_processes(rec, task, candidate, cfg, pair, model_file, env, seeds, lock, stop_after, clock):
            return
    clock.mark("shutdown")
    try:
        baselines = get_baselines(task, cfg, seeds.init, lock)
    except SandboxError as e:
        rec.fail("baseline", f"baseline failed: {e.reason}", "error")
        return
    finally:
        clock.mark("baseline")
    eager = baselines["eager"].stats
    compiled = min((b.stats for name, b in baselines.items() if name.startswith("compile")),
                   key=lambda s: s.median_ms)
    rec.eager_ms, rec.eager_cv = eager.median_ms, eager.cv
    rec.compile_ms, rec.compile_cv = compiled.median_ms, compiled.cv
    rec.baseline_cached = all(b.cached for b in baselines.values())
    rec.speedup_eager = rec.eager_ms / rec.candidate_ms
    rec.speedup_compile = rec.compile_ms / rec.candidate_ms
    rec.reward = compute_reward(True, rec.speedup_eager, rec.speedup_compile, cfg.reward)


def _extension_dir(candidate: Candidate, cfg: EvalConfig) -> list[Path]:
    """A single-file candidate's load_inline builds into the cache on import: the one folder
    outside its workdir that its process may write (so it cannot use a prestarted one)."""
    if candidate.kind != SINGLE_FILE:
        return []
    ext_dir = cfg.cache_path() / "torch_extensions" / candidate.sha256[:32]
    ext_dir.mkdir(parents=True, exist_ok=True)
    return [ext_dir]


def _compile(rec: EvalRecord, candidate: Candidate, cfg: EvalConfig, cand_dir: Path,
             extension_dirs: list[Path]) -> dict[str, str]:
    """Workdir: build kernels now, outside the sandbox's reach. Single file: load_inline builds on
    import, into `extension_dirs` (`_extension_dir`). Returns the environment the candidate's
    process loads it with."""
    if candidate.kind == SINGLE_FILE:
        return {"TORCH_EXTENSIONS_DIR": str(extension_dirs[0]), "MAX_JOBS": str(len(os.sched_getaffinity(0)))}
    toolchain = default_toolchain(cfg.backend, cfg.compile.cuda_arch, link_flags(cfg.policy.libraries))
    result = compile_workdir(cand_dir, toolchain, cfg.cache_path(), timeout=cfg.compile.timeout_s)
    rec.compile_seconds, rec.compile_cached, rec.compile_log = result.seconds, result.cached, result.log[-4000:]
    if not result.ok:
        rec.fail("compile", _first_error(result.log))
        return {}
    rec.compiled = True
    return {"HPC_KERNEL_LIBRARY": str(result.library)}


@dataclass
class _Seeds:
    """Every seed of one evaluation, drawn fresh (unless the config fixes them) and recorded."""

    init: int
    trials: list[dict]
    timing: int
    checked: list[int]   # timed iterations whose outputs are checked against the reference

    @classmethod
    def draw(cls, cfg: EvalConfig) -> _Seeds:
        rng = secrets.SystemRandom()
        base = cfg.seed if cfg.seed >= 0 else rng.randrange(1 << 31)
        trials = [{"seed": base + 1 + k, "distribution": "default"} for k in range(cfg.correctness.trials)]
        trials += [{"seed": base + 101 + k, "distribution": d} for k, d in enumerate(cfg.correctness.distributions)]
        return cls(base, [{**t, "index": k} for k, t in enumerate(trials)], base + 1001,
                   sorted(rng.sample(range(cfg.timing.iterations), cfg.correctness.timed_checks)))


def _run_processes(rec: EvalRecord, task: Task, candidate: Candidate, cfg: EvalConfig, pair: WorkerPair,
                   model_file: Path, env: dict[str, str], seeds: _Seeds, lock: DeviceLock, stop_after: str,
                   clock: _StageClock) -> bool:
    """Load, correctness and timing in the pair's two processes. False when a stage failed or
    `stop_after` ended the evaluation."""
    setup = {"op": "setup", "task": str(task.path), "scale": cfg.scale, "init_seed": seeds.init,
             "device": cfg.backend}
    ref, cand = pair.reference, pair.program
    rec.isolation = json.dumps(cand.isolation)
    stage = "load"
    try:
        with lock.shared():   # both set up at once; the reference's failure is the task's, reported first
            ref.send(setup)
            cand.send({**setup, **timing_setup(cfg), "program": "candidate", "model_file": str(model_file),
                       "op_monitor": str(op_monitor_library(cfg.cache_path())),
                       "environment": env, "share_outputs": cfg.backend == "cuda" and cfg.sandbox.share_outputs,
                       "policy": {"allowed_torch_ops": cfg.policy.allowed_torch_ops,
                                  "require_custom_kernel": cfg.policy.require_custom_kernel}})
            try:
                ref.receive("setup")
            except SandboxError as e:
                rec.fail("load", f"reference: {e.reason}", "error")
                return False
            loaded = cand.receive("setup")
            share = "ipc_probe" in loaded and ref.request(
                {"op": "probe_ipc", "probe": loaded["ipc_probe"]}).get("ok") is True
            rec.isolation = json.dumps({**cand.isolation, "outputs_shared": share})
        rec.compiled = True
        clock.mark("load")
        stage = "correctness"
        dtypes = _check_correctness(rec, ref, cand, seeds.trials, cfg, lock, share)
        clock.mark("correctness")
        if rec.failed_stage or stop_after == "correctness":
            return False
        stage = "timing"
        _time_candidate(rec, task, ref, cand, cfg, seeds.timing, seeds.checked, dtypes, lock)
        clock.mark("timing")
    except SandboxError as e:
        clock.mark(stage)
        _fail_from_sandbox(rec, stage, e, candidate)
        return False
    return not rec.failed_stage


def _first_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "undefined reference" in ln]
    return "compile error: " + ((errors or lines or ["compiler failed"])[0])[:300]


def _fail_from_sandbox(rec: EvalRecord, stage: str, e: SandboxError, candidate: Candidate) -> None:
    if e.kind == "policy":
        rec.fail(stage, f"policy: {e.reason}")
    elif e.kind == "task":
        rec.fail("load", e.reason, "error")
    elif e.kind == "harness":
        rec.fail(stage, e.reason, "error")
    elif stage == "load" and candidate.kind == SINGLE_FILE and _BUILD_FAILED in e.reason:
        rec.fail("compile", f"load_inline: {e.reason}")
    else:
        rec.fail(stage, e.reason if e.kind != "crash" else f"candidate process {e.reason}")


def _check_correctness(rec: EvalRecord, ref: SandboxedProcess, cand: SandboxedProcess, trials: list,
                       cfg: EvalConfig, lock: DeviceLock, share: bool) -> list:
    """One trial at a time, so at most one trial's outputs are held here at once. With `share`
    (CUDA IPC works between the two processes) the reference keeps its outputs on the device
    and compares the program's there (`_compare_shared`): no output crosses a pipe."""
    dtypes: list = []
    on_gpu = cfg.backend == "cuda"
    rec.max_abs_error = rec.max_rel_error = 0.0
    for k, trial in enumerate(trials):
        with lock.shared():   # both compute at once; the replies are read one after the other
            ref.send({"op": "outputs", "trials": [trial], "keep": share})
            cand.send({"op": "outputs", "trials": [trial], "export": share})
            expected = ref.receive("outputs").get("outputs", [None])[0]
            got = cand.receive("outputs")["outputs"][0]
            shared = share and isinstance(got, list) and all(map(cuda_ipc.is_exported, got))
            if shared:
                cmp, dtypes = _compare_shared(ref, got, cfg)
            else:
                if share:
                    expected = ref.request({"op": "kept_outputs"})["outputs"][0]
                if on_gpu:
                    cmp = compare_outputs(expected, got, cfg.correctness, "cuda")
        if not on_gpu:      # on the host: outside the lock, so other evaluations' timings go on
            cmp = compare_outputs(expected, got, cfg.correctness)
        rec.max_abs_error = max(rec.max_abs_error, cmp.max_abs_error)
        rec.max_rel_error = max(rec.max_rel_error, cmp.max_rel_error)
        rec.trials = k + 1
        if not cmp.ok:
            rec.fail("correctness", f"trial {k} (seed {trial['seed']}, {trial['distribution']} inputs): {cmp.reason}")
            return dtypes
        if not shared:
            dtypes = [t.dtype for t in expected]
    rec.correct = True
    return dtypes


def _compare_shared(ref: SandboxedProcess, got: list, cfg: EvalConfig) -> tuple[Comparison, list]:
    """The reference's verdict on the program's exported outputs; an export it cannot map is the
    program's failure (only the program's process could have made it so)."""
    try:
        reply = ref.request({"op": "compare", "outputs": got, "correctness": dataclasses.asdict(cfg.correctness)})
    except SandboxError as e:
        if e.kind != "program":
            raise
        return Comparison(False, e.reason), []
    fields = reply.get("comparison")
    if not isinstance(fields, dict) or set(fields) != {f.name for f in dataclasses.fields(Comparison)}:
        raise SandboxError("malformed comparison from the reference process", "error")
    return Comparison(**fields), [cuda_ipc.DTYPES[name] for name in reply.get("dtypes", [])]


def _host_clock_ms(cand: SandboxedProcess, t, seed: int, flush: int) -> tuple[float, float]:
    """Single calls timed twice: by the worker's clock as in the timed loop, and by this process's
    clock (round trip less an empty round trip). Returns both minima in milliseconds.

    Both wrap the same calls, so a busy machine or sleeping thread pools move them together;
    only a worker whose clock under-reports leaves the first far below the second. Minima, not
    medians: on an oversubscribed CPU a descheduled harness adds milliseconds to a round trip
    (never subtracts), and the least disturbed call shows the true cost on both clocks.
    """
    cand.request({"op": "prepare_calls", "seed": seed + 7, "size": t.host_check_calls, "flush_bytes": flush})
    reported, calls, empty = [], [], []
    for j in range(t.host_check_calls):
        start = time.perf_counter()
        cand.request({"op": "run_call", "index": -1})
        middle = time.perf_counter()
        ms = cand.request({"op": "run_call", "index": j}).get("ms")
        calls.append(time.perf_counter() - middle)
        empty.append(middle - start)
        reported.append(ms if isinstance(ms, float) else math.nan)
    host = max(min(calls) - min(empty), 0.0) * 1e3
    return (min(reported) if all(map(math.isfinite, reported)) else math.nan), host


def _time_candidate(rec: EvalRecord, task: Task, ref: SandboxedProcess, cand: SandboxedProcess, cfg: EvalConfig,
                    seed: int, checked: list[int], dtypes: list, lock: DeviceLock) -> None:
    t = cfg.timing
    with lock.exclusive():
        reply = cand.request(timing_request(cfg, seed))
    times = reply.get("times_ms")
    if not isinstance(times, list) or len(times) != t.iterations or not all(
            isinstance(x, float) and x > 0 for x in times):
        rec.fail("timing", "malformed timing reply")
        return
    rec.candidate_times_ms = times
    stats = TimingStats.of(times)
    rec.candidate_ms, rec.candidate_iqr_ms, rec.candidate_cv, rec.candidate_noise = (
        stats.median_ms, stats.iqr_ms, stats.cv, stats.noise)
    host = reply.get("host_ms")
    if isinstance(host, list) and host and all(isinstance(x, float) for x in host):
        rec.candidate_host_ms = statistics.median(host)
    if reply.get("timers_intact") is not True:
        rec.fail("timing", "timer functions were replaced during the run")
        return
    prints = reply.get("fingerprints")
    with lock.shared():
        expected = ref.request({"op": "fingerprints", "seed": seed, "iterations": checked})["fingerprints"]
    for i, fp in zip(checked, expected):
        if not isinstance(prints, list) or len(prints) != t.iterations or not compare_fingerprints(
                fp, prints[i], cfg.correctness, dtypes):
            rec.correct = False
            rec.fail("timing", f"output of timed iteration {i} is wrong (stale or cached result?)")
            return
    rec.timed_checks = len(checked)
    flush = (t.flush_bytes_cuda if cfg.backend == "cuda" else t.flush_bytes_cpu) if t.flush_cache else 0
    # A deferred-work or clock-tampering candidate under-reports every time; an honest one on an
    # oversubscribed host can lose one measurement to the scheduler (every round trip delayed), so
    # a pass in any of a few fresh measurements is a pass.
    for _ in range(t.host_check_attempts):
        with lock.exclusive():
            reported, rec.host_check_ms = _host_clock_ms(cand, t, seed, flush)
        if reported >= t.host_check_ratio * rec.host_check_ms:
            break
    else:
        rec.fail("timing", f"reported {reported:.4g} ms per call but the harness clock measured "
                           f"{rec.host_check_ms:.4g} ms for the same calls, in each of {t.host_check_attempts} "
                           "measurements (timer tampering or deferred work)")
        return
    cost = task_cost(task, cfg, ref, seed, lock)
    rec.flops, rec.min_bytes = cost["flops"], cost["bytes"]
    bandwidth, tflops = cfg.floor.ceilings(cfg.backend)
    if bandwidth or tflops:
        rec.floor_ms = 1e3 * max(rec.min_bytes / (bandwidth * 1e9) if bandwidth else 0.0,
                                 rec.flops / (tflops * 1e12) if tflops else 0.0)
        if rec.candidate_ms < rec.floor_ms:
            rec.fail("timing", f"implausible: {rec.candidate_ms:.4g} ms is below the hardware floor "
                               f"{rec.floor_ms:.4g} ms ({rec.flops:.3g} FLOP, {rec.min_bytes:.3g} B)")

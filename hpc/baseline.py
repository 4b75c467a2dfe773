"""What is measured once per task and cached: eager and torch.compile baselines, timed in a fresh
worker pair by the candidate's protocol (hpc.profile.timing: inputs from the reference, the
outside clock, the handshake's cost taken off), cached per task + scale + hardware + torch
version + protocol; and the task's cost, its FLOPs and fewest bytes moved (per task + scale +
torch version)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
from dataclasses import dataclass

from hpc.config import EvalConfig
from hpc.hardware import conditions, device_name, versions
from hpc.profile.device_lock import DeviceLock
from hpc.profile.timing import PROTOCOL, TimingStats, figures_ms, timing_calls
from hpc.sandbox.prestart import WorkerPair, start_pair
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.task import Task


@dataclass
class Baseline:
    program: str           # eager | compile[:mode]
    stats: TimingStats
    cached: bool
    conditions: dict       # hpc.hardware.conditions when it was measured


def baseline_key(task: Task, program: str, cfg: EvalConfig) -> str:
    t = cfg.timing
    parts = [task.sha256, cfg.scale, cfg.backend, device_name(cfg.backend), versions()["torch"], program, PROTOCOL,
             str((t.warmup, t.iterations, t.flush_cache, t.flush_bytes_cpu, t.flush_bytes_cuda, t.calibration_calls))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def baseline_programs(cfg: EvalConfig) -> list[str]:
    return ["eager"] + [f"compile:{m}" for m in cfg.baseline.compile_modes]


def get_baselines(task: Task, cfg: EvalConfig, init_seed: int, lock: DeviceLock | None = None) -> dict[str, Baseline]:
    """Eager and each torch.compile mode, from the cache or measured now (then cached)."""
    lock = lock or DeviceLock(cfg.backend)
    cache = cfg.cache_path() / "baselines"
    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, Baseline] = {}
    for program in baseline_programs(cfg):
        path = cache / f"{baseline_key(task, program, cfg)}.json"
        if path.is_file():
            try:
                cached = json.loads(path.read_text())
                out[program] = Baseline(program, TimingStats(**cached["stats"]), True, dict(cached["conditions"]))
                continue
            except (ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
        stats, measured = measure_program(task, program, cfg, init_seed, lock)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"task": task.task_id, "program": program, "scale": cfg.scale,
                                   "hardware": device_name(cfg.backend), "versions": versions(),
                                   "stats": dataclasses.asdict(stats), "conditions": measured}))
        tmp.replace(path)
        out[program] = Baseline(program, stats, False, measured)
    return out


def task_cost(task: Task, cfg: EvalConfig, ref: SandboxedProcess, seed: int, lock: DeviceLock) -> dict[str, float]:
    """{"flops", "bytes"} of the task at this scale, from the cache or counted now by `ref` (the
    task's reference worker) and cached: counting runs the model under torch's FLOP counter, seconds
    per evaluation otherwise. It counts on the meta device first, holding no lock (a process's first
    count imports the counter, ~1.4 s, and a shared hold that long stalls every timed run queued
    behind it); only a task whose forward needs real values is counted on the device, under `lock`
    (shared). A cached cost is a file read, with no lock."""
    key = hashlib.sha256("\0".join([task.sha256, cfg.scale, cfg.backend, versions()["torch"], "cost"]).encode())
    path = cfg.cache_path() / "costs" / f"{key.hexdigest()[:32]}.json"
    try:
        cost = json.loads(path.read_text())
        return {"flops": float(cost["flops"]), "bytes": float(cost["bytes"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    reply = ref.request({"op": "cost", "seed": seed, "meta": True})
    if "meta_failed" in reply:
        with lock.shared():
            reply = ref.request({"op": "cost", "seed": seed})
    cost = {"flops": float(reply["flops"]), "bytes": float(reply["bytes"])}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"task": task.task_id, "scale": cfg.scale, **cost}))
    tmp.replace(path)
    return cost


def measure_program(task: Task, program: str, cfg: EvalConfig, init_seed: int, lock: DeviceLock,
                    pair: WorkerPair | None = None) -> tuple[TimingStats, dict]:
    """Time eager or torch.compile (`program`: eager | compile[:mode]) by the candidate's protocol in
    a worker pair: a new one, or `pair` (one started for this; the caller closes it); its figures
    and the conditions they were taken in. SandboxError when it cannot be timed."""
    from hpc.profile.driver import PairDriver

    if pair is None:
        fresh = start_pair(cfg.sandbox, cfg.backend, trusted=True)
        try:
            return measure_program(task, program, cfg, init_seed, lock, fresh)
        finally:
            fresh.kill()
            fresh.close()
    rng = secrets.SystemRandom()
    draw = lambda: rng.randrange(1 << 62)   # noqa: E731
    name, _, mode = program.partition(":")
    driver = PairDriver(pair, cfg)
    t = cfg.timing
    with lock.shared():
        driver.setup(task, init_seed, draw())
    with lock.exclusive():
        overhead_ns = driver.calibrate()
    with lock.shared():   # torch.compile compiles here, not inside the exclusive timing
        driver.load({"program": name, "mode": mode or "default"})
    with lock.exclusive():
        measured = conditions(cfg.backend, lock.beside())
        result = driver.run(timing_calls([draw() for _ in range(t.warmup + t.iterations)], t.warmup, set()))
    if result.failure is not None:
        raise SandboxError(f"{program} could not be timed: {result.failure.reason}", "error")
    return TimingStats.of(figures_ms(result.times_ns, overhead_ns)), measured

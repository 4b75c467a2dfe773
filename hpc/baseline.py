"""What is measured once per task and cached: eager and torch.compile baselines, timed in clean
sandboxed processes with the candidate's protocol (per task + scale + hardware + torch version +
protocol), and the task's cost, its FLOPs and fewest bytes moved (per task + scale + torch version)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpc.config import EvalConfig
from hpc.hardware import device_name, versions
from hpc.profile.device_lock import DeviceLock
from hpc.profile.start_gate import start_gate_library
from hpc.profile.timing import PROTOCOL, TimingStats
from hpc.sandbox.process import SandboxedProcess
from hpc.task import Task


@dataclass
class Baseline:
    program: str           # eager | compile[:mode]
    stats: TimingStats
    cached: bool


def baseline_key(task: Task, program: str, cfg: EvalConfig) -> str:
    t = cfg.timing
    parts = [task.sha256, cfg.scale, cfg.backend, device_name(cfg.backend), versions()["torch"], program, PROTOCOL,
             str((t.warmup, t.iterations, t.flush_cache, t.flush_bytes_cpu, t.flush_bytes_cuda,
                  t.start_gate_timeout_us))]
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
                out[program] = Baseline(program, TimingStats(**json.loads(path.read_text())["stats"]), True)
                continue
            except (ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
        stats = measure_program(task, program, cfg, init_seed, lock)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"task": task.task_id, "program": program, "scale": cfg.scale,
                                   "hardware": device_name(cfg.backend), "versions": versions(),
                                   "stats": dataclasses.asdict(stats)}))
        tmp.replace(path)
        out[program] = Baseline(program, stats, False)
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
                    proc: SandboxedProcess | None = None) -> TimingStats:
    """Time eager or torch.compile in a fresh sandboxed process (SandboxError on failure): a new
    one, or `proc`, a program process not yet set up (one started ahead; the caller closes it)."""
    if proc is None:
        with tempfile.TemporaryDirectory(prefix="hpc-baseline-") as workdir, \
                SandboxedProcess("program", Path(workdir), cfg.sandbox, cfg.backend) as fresh:
            return measure_program(task, program, cfg, init_seed, lock, fresh)
    name, _, mode = program.partition(":")
    with lock.shared():   # torch.compile compiles here, not inside the exclusive timing
        proc.request({"op": "setup", "task": str(task.path), "scale": cfg.scale, "init_seed": init_seed,
                      "device": cfg.backend, "program": name, "mode": mode or "default", **timing_setup(cfg)})
    with lock.exclusive():
        reply = proc.request(timing_request(cfg, seed=init_seed + 1))
    return TimingStats.of(reply["times_ms"])


def timing_setup(cfg: EvalConfig) -> dict:
    """What a timed program's setup message needs for the timing protocol (cuda: the start gate)."""
    if cfg.backend != "cuda":
        return {}
    return {"start_gate": str(start_gate_library(cfg.cache_path(), cfg.compile.cuda_arch)),
            "start_gate_timeout_us": cfg.timing.start_gate_timeout_us}


def timing_request(cfg: EvalConfig, seed: int) -> dict:
    t = cfg.timing
    flush = (t.flush_bytes_cuda if cfg.backend == "cuda" else t.flush_bytes_cpu) if t.flush_cache else 0
    return {"op": "time", "seed": seed, "warmup": t.warmup, "iterations": t.iterations, "flush_bytes": flush}

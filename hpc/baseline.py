"""The baselines' side of an evaluation, and the task's cost.

Eager Model, each torch.compile mode and the empty program (the handshake alone) live in one
trusted worker pair of their own, started for each evaluation and timed side by side with the
candidate (hpc.profile.window). Nothing of a baseline's timing is carried from one evaluation to
the next; what is kept is torch.compile's own compiled code (inductor's cache, in the cache folder,
which only trusted processes may write) and the task's cost, its FLOPs and fewest bytes moved,
counted once per task + scale + torch version.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
from pathlib import Path

from hpc.config import EvalConfig
from hpc.hardware import conditions, versions
from hpc.profile.cores import PinError, timing
from hpc.profile.device_lock import DeviceLock
from hpc.profile.timing import CALIBRATION_WARMUP, TimingStats, calibration_calls, figures_ms, timing_calls
from hpc.profile.window import (Entrant, EntrantError, Recording, flush_rate, handshake_ns, process_name, record_graphs,
                               run_window, timed_by)
from hpc.sandbox.messages import Cost, FailureKind
from hpc.sandbox.prestart import WorkerPair, window_pids, worker_pair
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.task import Task

EMPTY = "empty"


def baseline_programs(cfg: EvalConfig) -> list[str]:
    return ["eager"] + [f"compile:{m}" for m in cfg.baseline.compile_modes]


def inductor_cache(cfg: EvalConfig) -> Path:
    path = cfg.cache_path() / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_baseline_pair(cfg: EvalConfig) -> WorkerPair:
    """A trusted pair for the baselines (prestarted where a block is open), its program writing
    compiled code to the inductor cache."""
    cache = inductor_cache(cfg)
    return worker_pair(cfg.sandbox, cfg.backend, writable=[cache], trusted=True,
                       env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})


def load_baselines(driver, task: Task, cfg: EvalConfig, init_seed: int, probe_seed: int, lock: DeviceLock,
                   programs: list[str], burst: int = 0) -> int:
    """Set the baselines' pair up for `task`, with `burst` calls a timed frame (0: sized from its
    reference's probe), and load `programs` in it: torch.compile compiles here, not inside the timed
    window, holding `lock.autotuning()` (its first call picks launch configs by timing them). The
    burst; SandboxError when a step fails."""
    with lock.shared():
        burst = driver.setup(task, init_seed, probe_seed, burst)["burst"]
    for program in programs:
        name, _, mode = program.partition(":")
        try:
            with lock.autotuning() if name == "compile" else lock.shared():
                driver.load({"program": name, "mode": mode or "default"})
        except SandboxError as e:
            raise SandboxError(f"{program} could not be loaded: {e.reason}", FailureKind.ERROR) from None
    return burst


def baseline_entrants(driver, cfg: EvalConfig, programs: list[str], burst: int, process: int = 0,
                      frames: int = 0) -> list[Entrant]:
    """The window's entrants from the baselines' pair of `process` (hpc.profile.window.process_name):
    each program in `programs` with `frames` timed frames of `burst` calls (as many as the
    candidate's process of that number; 0: timing.iterations), inputs from seeds drawn here, and in
    the first process the empty program."""
    from hpc.profile.driver import input_shifts

    rng = secrets.SystemRandom()
    t = cfg.timing
    frames = frames or t.iterations
    out = []
    for program in programs:
        calls = timing_calls([rng.randrange(1 << 62) for _ in range(t.warmup + frames)], t.warmup, set(), burst,
                             input_shifts(cfg))
        out.append(Entrant(process_name(program, process), driver, program, calls[:t.warmup * burst],
                           calls[t.warmup * burst:]))
    if process:
        return out
    empty = calibration_calls(t.calibration_calls, burst, input_shifts(cfg))
    cut = CALIBRATION_WARMUP * burst
    out.append(Entrant(EMPTY, driver, EMPTY, empty[:cut], empty[cut:], checkable=False))
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
    reply = ref.request(Cost(seed, meta=True))
    if reply.meta_failed is not None:
        with lock.shared():
            reply = ref.request(Cost(seed))
    if reply.flops is None or reply.bytes is None:
        raise SandboxError(f"malformed reply from the reference process: no cost ({reply.meta_failed})")
    cost = {"flops": reply.flops, "bytes": reply.bytes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"task": task.task_id, "scale": cfg.scale, **cost}))
    tmp.replace(path)
    return cost


def measure_program(task: Task, program: str, cfg: EvalConfig, init_seed: int, lock: DeviceLock,
                    pair: WorkerPair | None = None) -> tuple[TimingStats, dict]:
    """Time eager or torch.compile (`program`: eager | compile[:mode]) alone, beside the empty
    program, in a worker pair: a new one, or `pair` (one started for this; the caller closes it);
    its figures and the conditions they were taken in. SandboxError when it cannot be timed."""
    from hpc.profile.driver import PairDriver, flush_bytes, graph_replays, keeps_awake

    program = "compile:default" if program == "compile" else program
    if pair is None:
        fresh = start_baseline_pair(cfg)
        try:
            return measure_program(task, program, cfg, init_seed, lock, fresh)
        finally:
            fresh.kill()
            fresh.close()
    driver = PairDriver(pair, cfg)
    burst = load_baselines(driver, task, cfg, init_seed, secrets.randbelow(1 << 62), lock, [program])
    entrants = baseline_entrants(driver, cfg, [program], burst)
    recording = Recording(False)
    if graph_replays(cfg):
        try:
            with lock.shared():
                recording = record_graphs(entrants, burst)
        except EntrantError as e:
            raise SandboxError(f"{e}", FailureKind.ERROR) from None
        if recording.failure is not None:
            raise SandboxError(f"{recording.failed} could not be timed: {recording.failure.reason}", FailureKind.ERROR)
    try:
        with lock.exclusive(), timing(*window_pids(pair), backend=cfg.backend, awake=keeps_awake(cfg)) as placed:
            measured = {**conditions(cfg.backend, lock.beside()), **placed}
            window = run_window(entrants, cfg.timing.rounds, random.SystemRandom())
    except PinError as e:
        raise SandboxError(f"{program} could not be timed: {e}", FailureKind.ERROR) from None
    measured.update(timed_by(recording), **flush_rate(window, flush_bytes(cfg)), **driver.placement())
    if window.failure is not None:
        raise SandboxError(f"{window.failed} could not be timed: {window.failure.reason}", FailureKind.ERROR)
    overhead_ns, _ = handshake_ns(window.times_ns[EMPTY])
    return TimingStats.of(figures_ms(window.times_ns[program], overhead_ns)), measured

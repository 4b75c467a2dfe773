"""Evaluate one candidate on one task: static -> compile -> load -> verify -> profile -> reward.

The harness (this process) never imports task or candidate code. The reference (the task's code,
trusted) and the candidate each run in their own sandboxed process; every input the candidate sees
is made by the reference from seeds only the two trusted processes know, every output is checked
outside the candidate's process, and every time is read on a clock outside it
(hpc.profile.timing). The candidate is timed side by side with eager and torch.compile, which run
in a trusted pair of their own (hpc.baseline, hpc.profile.window). Every stage that fails leaves a
named reason in the record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import secrets
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from hpc.baseline import (EMPTY, baseline_entrants, baseline_programs, load_baselines, start_baseline_pair,
                          task_cost)
from hpc.candidate import SINGLE_FILE, Candidate
from hpc.compile.native import compile_workdir, default_toolchain
from hpc.compile.op_monitor import op_monitor_library
from hpc.config import EvalConfig, config_to_dict
from hpc.hardware import conditions, device_name, heap_on_huge_pages, minor_faults, versions
from hpc.profile.cores import PinError, timing
from hpc.profile.device_lock import DeviceLock
from hpc.profile.driver import (PairDriver, flush_bytes, graph_replays, input_shifts, keeps_awake, process_frames,
                                timing_processes)
from hpc.profile.timing import Call, Failure, TimingStats, timing_calls, window_figures
from hpc.profile.window import (Entrant, EntrantError, Recording, Window, fastest_process, flush_rate, handshake_ns,
                                paired_ratio, process_name, process_of, program_of, record_graphs, run_window,
                                timed_by)
from hpc.results.record import STOP_AFTER, EvalRecord, StopAfter
from hpc.reward import compute_reward
from hpc.sandbox.launch import LaunchError
from hpc.sandbox.messages import FailureKind
from hpc.sandbox.prestart import WorkerPair, harness_file, window_pids, worker_pair
from hpc.sandbox.process import SandboxError
from hpc.sandbox.tempdirs import owned_temporary
from hpc.task import Task
from hpc.verify.static import kernel_defect, link_flags, python_text, source_defect

log = logging.getLogger(__name__)

_BUILD_FAILED = "Error building extension"


# stop_after's names before the stages had one vocabulary (hpc.results.record.STOP_AFTER)
RENAMED_STOP_AFTER = {"correctness": "verify", "reward": "profile"}


def evaluate(task: Task, candidate: Candidate, cfg: EvalConfig, stop_after: StopAfter = "profile") -> EvalRecord:
    """One evaluation; never raises for anything the candidate does.

    `stop_after` ends it early for an agent's tools: "compile" (its compile tool), "verify" (its
    verify tool); such records keep a NaN reward unless a stage failed. "profile" runs every stage
    and pays the reward. The correctness reward times nothing: its evaluations stop after verify
    and pay a correct candidate there.
    """
    if stop_after not in STOP_AFTER:
        now = f" ({stop_after!r} is now {RENAMED_STOP_AFTER[stop_after]!r})" if stop_after in RENAMED_STOP_AFTER else ""
        raise ValueError(f"stop_after must be one of {STOP_AFTER}, got {stop_after!r}{now}")
    untimed = cfg.reward.kind == "correctness" and stop_after == "profile"
    t0 = time.monotonic()
    config = config_to_dict(cfg)
    rec = EvalRecord(
        task_id=task.task_id, task_level=task.level, task_sha256=task.sha256, scale=cfg.scale,
        candidate_sha256=candidate.sha256, candidate_kind=candidate.kind, candidate_path=str(candidate.path),
        candidate_source=candidate.source_text(), backend=cfg.backend, hardware=device_name(cfg.backend),
        versions=json.dumps(versions()), rules=json.dumps(config["rules"]),
        config=json.dumps(config), reward_kind=cfg.reward.kind, timestamp=time.time())
    clock, lock = _StageClock(), DeviceLock(cfg.backend)
    try:
        with lock.active():   # counted as running beside other evaluations' timings
            _run_stages(rec, task, candidate, cfg, "verify" if untimed else stop_after, clock, lock)
    finally:
        rec.stage_seconds = json.dumps({**clock.seconds, **{k: round(v, 4) for k, v in lock.seconds.items()}})
    if rec.status == "failed":
        rec.reward = cfg.reward.incorrect
    elif untimed and rec.status == "ok" and rec.correct:
        rec.reward = compute_reward(True, math.nan, math.nan, cfg.reward)
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


def _run_stages(rec: EvalRecord, task: Task, candidate: Candidate, cfg: EvalConfig, stop_after: StopAfter,
                clock: _StageClock, lock: DeviceLock) -> None:
    text, defect = python_text(candidate.files[candidate.model_file])
    defect = (defect or source_defect(text, candidate.model_file, cfg.rules.libraries)
              or kernel_defect(candidate.files, cfg.rules.libraries))
    clock.mark("static")
    if defect:
        rec.fail("static", defect)
        return
    if stop_after == "compile":
        if candidate.kind != SINGLE_FILE:   # a single file's load_inline builds when loaded
            with owned_temporary("hpc-compile-") as workroot:
                _compile(rec, candidate, cfg, candidate.materialize(Path(workroot)).parent, [])
        clock.mark("compile")
        return
    seeds = Seeds.draw(cfg)
    rec.seeds = seeds.to_json()
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
        starting = _Starting(cfg, writable, stack) if stop_after == "profile" else None
        if not _run_processes(rec, task, candidate, cfg, pair, model_file, env, seeds, lock, stop_after, clock,
                              starting):
            return
        clock.mark("cost")
    clock.mark("shutdown")
    rec.reward = compute_reward(True, rec.speedup_eager, rec.speedup_compile, cfg.reward)


class _Starting:
    """The pairs a timed evaluation needs besides its first, each started in the background: the
    baselines' first pair while the candidate loads and is checked; once the candidate has passed,
    its further processes' pairs and a baselines' pair for each of them
    (hpc.profile.driver.timing_processes). A candidate that fails its trials, as most do in
    training, costs no pair it does not use."""

    def __init__(self, cfg: EvalConfig, writable: list[Path], stack: ExitStack):
        self.cfg, self.writable, self.stack = cfg, writable, stack
        self.starter = ThreadPoolExecutor(2 * timing_processes(cfg) - 1, thread_name_prefix="pairs")
        stack.callback(self.starter.shutdown, wait=False)
        self.candidates: list[Future] = []
        self.baselines = [self._start(start_baseline_pair, cfg)]

    def further(self) -> None:
        """Start the further processes' pairs."""
        for _ in range(timing_processes(self.cfg) - 1):
            self.candidates.append(self._start(worker_pair, self.cfg.sandbox, self.cfg.backend, self.writable))
            self.baselines.append(self._start(start_baseline_pair, self.cfg))

    def _start(self, start, *args) -> Future:
        future = self.starter.submit(start, *args)
        self.stack.callback(_end_pair, future)
        return future


def _end_pair(starting: Future) -> None:
    """End a pair once it has started (or failed to)."""
    try:
        pair = starting.result()
    except (SandboxError, OSError):
        return
    pair.kill()
    pair.close()


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
    toolchain = default_toolchain(cfg.backend, cfg.compile.cuda_arch, link_flags(cfg.rules.libraries))
    try:
        result = compile_workdir(cand_dir, toolchain, cfg.cache_path(), timeout=cfg.compile.timeout_s,
                                 max_library_mb=cfg.compile.max_library_mb, run_as_uid=cfg.sandbox.run_as_uid,
                                 memory_gb=cfg.compile.memory_gb)
    except LaunchError as e:   # this machine's, not the candidate's
        rec.fail("compile", f"the compiler could not be started confined: {e}", "error")
        return {}
    rec.compile_seconds, rec.compile_cached, rec.compile_log = result.seconds, result.cached, result.log[-4000:]
    if not result.ok:
        rec.fail("compile", _first_error(result.log))
        return {}
    rec.compiled = True
    return {"HPC_KERNEL_LIBRARY": str(harness_file(result.library, cand_dir, "kernels.so"))}



@dataclass
class ProcessSeeds:
    """The seeds of one of the candidate's processes (each program is timed in
    hpc.profile.driver.timing_processes of them): its trials', its frames' (warm-up, then timed),
    and which of its timed frames (indexes among them) are checked. Each process is verified on
    trials of its own and checked in its own frames: whatever one process saw tells another
    nothing."""

    trials: list[dict]
    timing: list[int]         # one per frame: its calls' seeds are made from it (hpc.profile.timing.call_seeds)
    checked: list[int]


@dataclass
class Seeds:
    """Every seed of one evaluation. The init seed (the weights) is the candidate's to know; every
    other seed makes inputs it sees only when its call starts, so each is drawn on its own from the
    system's randomness, never derived from another. A config with a fixed `seed` derives them all
    from it, reproducibly and so predictably: for debugging, never for a reward."""

    init: int
    probe: int
    processes: list[ProcessSeeds]
    burst: int = 1            # calls a timed frame runs (set once the task's reference has run)

    @classmethod
    def draw(cls, cfg: EvalConfig) -> Seeds:
        if cfg.seed >= 0:
            rng = random.Random(cfg.seed)
        else:
            rng = secrets.SystemRandom()
        t = cfg.timing
        draw = lambda: rng.randrange(1 << 62)   # noqa: E731
        init = cfg.seed if cfg.seed >= 0 else rng.randrange(1 << 31)
        processes = []
        for frames in process_frames(cfg):
            trials = [{"seed": draw(), "distribution": "default"} for _ in range(cfg.correctness.trials)]
            trials += [{"seed": draw(), "distribution": d} for d in cfg.correctness.distributions]
            processes.append(ProcessSeeds(trials, [draw() for _ in range(t.warmup + frames)],
                                          sorted(rng.sample(range(frames), min(cfg.correctness.timed_checks, frames)))))
        return cls(init, draw(), processes)

    def to_json(self) -> str:
        """What the record keeps (written after the evaluation, when no worker is alive)."""
        return json.dumps({"init": self.init, "burst": self.burst, "processes": [
            {"trials": [{**t, "index": k} for k, t in enumerate(p.trials)], "timing": p.timing,
             "timed_checks": p.checked} for p in self.processes]})


def _run_processes(rec: EvalRecord, task: Task, candidate: Candidate, cfg: EvalConfig, pair: WorkerPair,
                   model_file: Path, env: dict[str, str], seeds: Seeds, lock: DeviceLock, stop_after: StopAfter,
                   clock: _StageClock, starting: _Starting | None) -> bool:
    """Load and verify the candidate in its pair's two processes, and in its further processes'
    pairs (`starting`), then the window that times them beside the baselines' pairs. False when a
    stage failed or `stop_after` ended the evaluation."""
    drivers = [PairDriver(pair, cfg)]
    rec.isolation = json.dumps(pair.program.isolation)
    stage = "load"
    try:
        monitor = harness_file(op_monitor_library(cfg.cache_path()), pair.candidate_dir, "op_monitor.so")
        guard = {"op_monitor": str(monitor), "rules": {"allowed_torch_ops": cfg.rules.allowed_torch_ops,
                                                         "require_custom_kernel": cfg.rules.require_custom_kernel}}
        with lock.shared():
            seeds.burst = drivers[0].setup(task, seeds.init, seeds.probe)["burst"]
            rec.seeds = seeds.to_json()
            drivers[0].load({"program": "candidate", "model_file": str(model_file), "environment": env, **guard})
        rec.compiled = True
        clock.mark("load")
        stage = "verify"
        verified = _verify(rec, drivers[0], seeds, 0, lock, cfg)
        clock.mark("verify")
        if not verified:
            return False
        rec.correct = True
        if stop_after == "verify":
            return False
        starting.further()
        stage = "baseline"
        programs = baseline_programs(cfg)
        try:   # the first baselines' pair, while the further pairs start
            baseline_drivers = [PairDriver(starting.baselines[0].result(), cfg)]
            load_baselines(baseline_drivers[0], task, cfg, seeds.init, seeds.probe, lock, programs, seeds.burst)
        except SandboxError as e:
            rec.fail("baseline", f"baseline failed: {e.reason}", "error")
            return False
        clock.mark("baseline")
        rec.correct = not starting.candidates   # until every further process has passed too
        for k, future in enumerate(starting.candidates, start=1):   # the same candidate, loaded and verified anew
            stage = "load"
            try:
                further = future.result()
            except (SandboxError, OSError) as e:   # the harness's: its processes never ran the candidate
                rec.fail("load", f"the candidate's process {k} could not be started: {getattr(e, 'reason', e)}",
                         "error")
                return False
            drivers.append(PairDriver(further, cfg))
            library = env.get("HPC_KERNEL_LIBRARY")
            further_env = {**env, **({"HPC_KERNEL_LIBRARY": str(harness_file(Path(library), further.candidate_dir,
                                                                            "kernels.so"))} if library else {})}
            monitor = harness_file(op_monitor_library(cfg.cache_path()), further.candidate_dir, "op_monitor.so")
            further_model = candidate.materialize(further.candidate_dir)
            with lock.shared():
                drivers[k].setup(task, seeds.init, seeds.probe, seeds.burst)
                drivers[k].load({"program": "candidate", "model_file": str(further_model), "environment": further_env,
                                 **guard, "op_monitor": str(monitor)})
            clock.mark("load")
            stage = "verify"
            verified = _verify(rec, drivers[k], seeds, k, lock, cfg)
            clock.mark("verify")
            if not verified:
                return False
        rec.correct = True
        stage = "baseline"
        try:
            for future in starting.baselines[1:]:
                baseline_drivers.append(PairDriver(future.result(), cfg))
                load_baselines(baseline_drivers[-1], task, cfg, seeds.init, seeds.probe, lock, programs, seeds.burst)
        except SandboxError as e:
            rec.fail("baseline", f"baseline failed: {e.reason}", "error")
            return False
        clock.mark("baseline")
        stage = "profile"
        warmup = cfg.timing.warmup * seeds.burst
        entrants = []
        for k, (driver, drawn) in enumerate(zip(drivers, seeds.processes)):
            calls = timing_calls(drawn.timing, cfg.timing.warmup, set(drawn.checked), seeds.burst, input_shifts(cfg))
            entrants.append(Entrant(process_name("candidate", k), driver, "", calls[:warmup], calls[warmup:],
                                    hold=driver.pair.program.proc.cgroup))
        for k, (driver, frames) in enumerate(zip(baseline_drivers, process_frames(cfg))):
            entrants += baseline_entrants(driver, cfg, programs, seeds.burst, k, frames)
        processes = {**{process_name("candidate", k): d for k, d in enumerate(drivers)},
                     **{process_name("baselines", k): d for k, d in enumerate(baseline_drivers)}}
        try:
            recording = Recording(False, "timing.graphs is off" if cfg.backend == "cuda" else "")
            if graph_replays(cfg):
                with lock.shared():
                    recording = record_graphs(entrants, seeds.burst)
                if not recording.graphs:
                    log.info("%s: timed by calls: %s", rec.task_id, recording.reason)
            window = Window(failed=recording.failed, failure=recording.failure)
            if recording.failure is None:
                trusted, references = window_pids(*(d.pair for d in baseline_drivers))
                pinned = timing(trusted, [*references, *(d.pair.reference.worker_pid for d in drivers)],
                                backend=cfg.backend, confined=[d.pair.program.proc.cgroup for d in drivers],
                                awake=keeps_awake(cfg))
                with lock.exclusive(), pinned as placed:
                    measured = {**conditions(cfg.backend, lock.beside()), **placed}
                    faults = {k: minor_faults(d.pair.program.processes()) for k, d in processes.items()}
                    window = run_window(entrants, cfg.timing.rounds, random.SystemRandom())
                    faults = {k: minor_faults(d.pair.program.processes()) - faults[k] for k, d in processes.items()}
                measured.update(timed_by(recording), **flush_rate(window, flush_bytes(cfg)))
                own = {k: {**d.placement(), "window_minor_faults": faults[k],
                           "heap_on_huge_pages": heap_on_huge_pages(d.pair.program.worker_pid)}
                       for k, d in processes.items()}
        except EntrantError as e:
            if program_of(e.name) == "candidate":
                raise e.error from None
            rec.fail("baseline", f"baseline failed: {e}", "error")
            return False
        except PinError as e:   # only the harness's own programs are pinned by their threads
            rec.fail("baseline", f"baseline failed: {e}", "error")
            return False
        clock.mark("profile")
        if window.failure is not None:
            failure = window.failure
            if program_of(window.failed) != "candidate":
                rec.fail("baseline", f"baseline failed: {window.failed}: {failure.reason}", "error")
                return False
            if failure.kind == FailureKind.CORRECTNESS:
                rec.correct = False
                timed = failure.call - warmup
                of = f" of its process {process_of(window.failed)}" if process_of(window.failed) else ""
                failure.reason = (f"output of timed call {timed}{of} is wrong (stale, cached or unfinished?): "
                                  f"{failure.reason}")
            _fail(rec, stage, failure, cfg)
            return False
    except SandboxError as e:
        clock.mark(stage)
        _fail_from_sandbox(rec, stage, e, candidate)
        return False
    rec.timed_checks = sum(checks["checked"] for name, checks in window.checks.items()
                           if program_of(name) == "candidate")
    cost = task_cost(task, cfg, pair.reference, seeds.probe, lock)
    rec.flops, rec.min_bytes = cost["flops"], cost["bytes"]
    bandwidth, tflops = cfg.floor.ceilings(cfg.backend)
    if bandwidth or tflops:
        rec.floor_ms = 1e3 * max(rec.min_bytes / (bandwidth * 1e9) if bandwidth else 0.0,
                                 rec.flops / (tflops * 1e12) if tflops else 0.0)
    overhead_ns, resolution_ns = handshake_ns(window.times_ns[EMPTY])
    floor_ms = 0.0 if math.isnan(rec.floor_ms) else rec.floor_ms
    fastest = {p: fastest_process(window.times_ns, p) for p in ["candidate", *programs]}
    figures, used_ns = window_figures(window.times_ns, overhead_ns, max(floor_ms, resolution_ns / 1e6),
                                      fastest["candidate"])
    if used_ns != overhead_ns:
        log.warning("%s: less the handshake's %.4g ms the calls fall below the hardware floor or the handshake's "
                    "noise: every program's outside-clock times are the figures", rec.task_id, overhead_ns / 1e6)
    rec.conditions = json.dumps({p: {**measured, **own[_pair_of(name)], **_processes_read(figures, p, name)}
                                 for p, name in fastest.items()})
    rec.overhead_ms = used_ns / 1e6
    rec.candidate_times_ms = times = figures[fastest["candidate"]]
    stats = TimingStats.of(times)
    rec.candidate_ms, rec.candidate_iqr_ms, rec.candidate_cv, rec.candidate_noise = (
        stats.median_ms, stats.iqr_ms, stats.cv, stats.noise)
    if rec.candidate_ms < floor_ms:
        rec.fail("profile", f"implausible: {rec.candidate_ms:.4g} ms is below the hardware floor "
                            f"{rec.floor_ms:.4g} ms ({rec.flops:.3g} FLOP, {rec.min_bytes:.3g} B)")
        return False
    rec.eager_times_ms = figures[fastest["eager"]]
    eager = TimingStats.of(rec.eager_times_ms)
    rec.eager_ms, rec.eager_cv = eager.median_ms, eager.cv
    rounds = cfg.timing.rounds
    rec.speedup_eager = paired_ratio(rec.eager_times_ms, times, rounds)
    compiled = [figures[fastest[p]] for p in programs if p.startswith("compile")]
    if compiled:   # none when baseline.compile_modes is empty: compile_ms stays NaN, and so does the speedup
        speedups = [(paired_ratio(figs, times, rounds), figs) for figs in compiled]
        rec.speedup_compile, rec.compile_times_ms = min(speedups, key=lambda pair: pair[0])   # the fastest mode
        fastest_mode = TimingStats.of(rec.compile_times_ms)
        rec.compile_ms, rec.compile_cv = fastest_mode.median_ms, fastest_mode.cv
    rec.baseline_cached = False
    return True


def _pair_of(name: str) -> str:
    """The pair an entrant ran in: `candidate@k` for the candidate's, `baselines@k` for a baseline's."""
    k = process_of(name)
    return process_name("candidate" if program_of(name) == "candidate" else "baselines", k)


def _processes_read(figures: dict[str, list[float]], program: str, fastest: str) -> dict:
    """For the record's conditions: which of `program`'s processes gave its figures, and each
    process's median (ms a call), in order."""
    mine = sorted((process_of(name), figs) for name, figs in figures.items() if program_of(name) == program)
    medians = [round(statistics.median(figs), 6) for _, figs in mine]
    return {"timed_in_process": process_of(fastest), "process_medians_ms": medians}


def _verify(rec: EvalRecord, driver: PairDriver, seeds: Seeds, process: int, lock: DeviceLock,
            cfg: EvalConfig) -> bool:
    """The candidate's correctness trials in its process `process`, each checked before the next
    runs; False (the record failed at verify) when one fails. The record's trials and errors add
    up over its processes."""
    own = seeds.processes[process].trials
    trials = [Call(t["seed"], t["distribution"], checked=True, check_inputs=True, poison=k % 2)
              for k, t in enumerate(own)]
    with lock.shared():
        result = driver.run(trials, batch_limit=1)
    rec.max_abs_error = max(rec.max_abs_error if process else 0.0, result.checks["max_abs_error"])
    rec.max_rel_error = max(rec.max_rel_error if process else 0.0, result.checks["max_rel_error"])
    rec.trials = (rec.trials if process else 0) + result.checks["checked"]
    if result.failure is None:
        return True
    rec.correct = False
    failure = result.failure
    if failure.kind == FailureKind.CORRECTNESS and 0 <= failure.call < len(trials):
        t = own[failure.call]
        where = f" of process {process}" if process else ""
        failure.reason = f"trial {failure.call}{where} (seed {t['seed']}, {t['distribution']} inputs): {failure.reason}"
    _fail(rec, "verify", failure, cfg)
    return False


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "undefined reference" in ln]
    return "compile error: " + ((errors or lines or ["compiler failed"])[0])[:300]


def _fail(rec: EvalRecord, stage: str, failure: Failure, cfg: EvalConfig) -> None:
    """A loop's failure, charged to the candidate unless it was the task's or the harness's."""
    if failure.kind in (FailureKind.TASK, FailureKind.HARNESS):
        rec.fail(stage, failure.reason, "error")
    elif failure.kind == FailureKind.RULES:
        rec.fail(stage, f"rules: {failure.reason}")
    elif failure.kind == FailureKind.TIMEOUT:
        rec.fail(stage, f"timed out after {cfg.sandbox.timeout_s:.0f} s in {stage}")
    elif failure.kind == FailureKind.CRASH:
        rec.fail(stage, f"candidate process {failure.reason}")
    else:
        rec.fail(stage, failure.reason)


def _fail_from_sandbox(rec: EvalRecord, stage: str, e: SandboxError, candidate: Candidate) -> None:
    if e.kind == FailureKind.RULES:
        rec.fail(stage, f"rules: {e.reason}")
    elif e.kind == FailureKind.TASK:
        rec.fail("load" if stage == "load" else stage, e.reason, "error")
    elif e.kind == FailureKind.HARNESS:
        rec.fail(stage, e.reason, "error")
    elif stage == "load" and candidate.kind == SINGLE_FILE and _BUILD_FAILED in e.reason:
        rec.fail("compile", f"load_inline: {e.reason}")
    else:
        rec.fail(stage, e.reason if e.kind != FailureKind.CRASH else f"candidate process {e.reason}")

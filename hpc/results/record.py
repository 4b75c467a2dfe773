"""One evaluation record: everything known about one candidate on one task, stage by stage."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

from hpc.config import BACKENDS
from hpc.results.columns import column, columns_of

# ok; failed: the candidate's fault (paid the incorrect reward); error: the harness's or the task's
Status = Literal["ok", "failed", "error"]
Stage = Literal["static", "compile", "load", "verify", "profile", "baseline", "pool"]
STATUSES: tuple[Status, ...] = get_args(Status)
STAGES: tuple[Stage, ...] = get_args(Stage)
# The stages an evaluation may stop after, in order (task -> candidate -> compile -> verify ->
# profile -> reward): hpc.pipeline.evaluate's `stop_after`, a reward-pool request's `kind` and the
# agent's tools of the same names.
StopAfter = Literal["compile", "verify", "profile"]
STOP_AFTER: tuple[StopAfter, ...] = get_args(StopAfter)
# Stages under their names before version 6 of the results schema (hpc.results.hdf5 reads an older
# file's under the new ones)
RENAMED_STAGES: dict[str, Stage] = {"correctness": "verify", "timing": "profile"}


@dataclass
class EvalRecord:
    """One row of /records; each field is a column, with its units and meaning (results/SCHEMA.md's
    table of fields is generated from them)."""

    # what was evaluated
    task_id: str = column("", "", "`level<N>/<file stem>`")
    task_level: int = column(0, "", "N from the task's `levelN` folder, 0 if none")
    task_sha256: str = column("", "", "SHA-256 of the task's problem file")
    scale: str = column("", "", "the task's input sizes: `cpu` or `gpu`")
    candidate_sha256: str = column("", "", "SHA-256 over the candidate's files (names and contents)")
    candidate_kind: str = column("", "", "`single_file` or `workdir`")
    candidate_path: str = column("", "", "where the candidate was read from; for a sample of a policy evaluation "
                                         "`policy:<checkpoint dir>#<task id>/<k>` (see Policy evaluations)")
    candidate_source: str = column("", "", "every file of the candidate, concatenated with `// ===== name =====` "
                                           "headers")
    backend: str = column("", "", "`cpu` or `cuda` (hpc.config.BACKENDS); empty when never known (a request the "
                                  "reward pool gave up on)")
    hardware: str = column("", "", "CPU model and count, or GPU name and memory")
    versions: str = column("", "", "hpc, torch, python and cuda versions", json=True)
    rules: str = column("", "", "the op and library rules in force (the evaluation config's `rules`; the column "
                                "was `policy` before version 5)", json=True)
    config: str = column("", "", "the whole evaluation config", json=True)
    isolation: str = column("", "", "sandbox features in force (Landlock ABI, network namespace)", json=True)
    # outcome per stage
    status: Status = column("ok", "", "`ok`; `failed` (the candidate's fault, reward -1); `error` (the task's or "
                                      "the harness's fault, no reward)")
    failed_stage: Stage | Literal[""] = column("", "", "the stage that failed: `static` (the source checks before "
                                                       "the build), `compile` (the build, or a single file's "
                                                       "load_inline), `load` (the task, or the candidate in its "
                                                       "sandboxed process), `verify` (the correctness trials: a "
                                                       "wrong output, a broken rule, a crash or timeout), `profile` "
                                                       "(the timing window: a wrong timed output, a crash, a time "
                                                       "below the hardware floor), `baseline` (eager or "
                                                       "torch.compile could not be loaded or timed), `pool` (the "
                                                       "reward pool gave up on the request: worker rank lost or "
                                                       "request timed out); empty when none failed. `verify` and "
                                                       "`profile` were `correctness` and `timing` before version 6")
    reason: str = column("", "", "one line: compiler error, mismatch statistics, a broken rule (`rules: ...`), "
                                 "crash signal, timeout...")
    first_reason: str = column("", "", "where the evaluation ran out of memory while others ran beside it on the device "
                                       "(`eval-suite --jobs` > 1) and was run again alone: the first one's "
                                       "`failed_stage: reason`; the record is the second's. Empty otherwise",
                               added_in=8)
    compiled: bool = column(False, "", "kernels built (workdir) or extension loaded (single file)")
    compile_seconds: float = column(math.nan, "s", "native compile wall time (NaN for single files)")
    compile_cached: bool = column(False, "", "the compile was served from the content-hash cache")
    compile_log: str = column("", "", "the last 4000 characters of the compiler's output")
    correct: bool = column(False, "", "all correctness trials and timed-output checks passed")
    trials: int = column(0, "1", "correctness trials run (they stop at the first failure)")
    seeds: str = column("", "", "the init seed, the calls a timed frame runs (`burst`), and for each of the "
                                "candidate's processes (`processes`; before protocol `outside-11` one, at the top level) "
                                "each trial's seed and input distribution, each frame's seed (`timing`) and the checked "
                                "timed frames (`timed_checks`) (written when the evaluation has ended: no seed but the "
                                "init seed is known to the candidate before its call)", json=True)
    max_abs_error: float = column(math.nan, "", "the worst absolute error of an output over the trials (in the "
                                                "output's own units)")
    max_rel_error: float = column(math.nan, "1", "the worst relative error of an output over the trials")
    timed_checks: int = column(0, "1", "timed calls whose outputs were copied out and checked against the reference")
    # timing
    candidate_ms: float = column(math.nan, "ms", "median time per call, on a clock outside the candidate's process, "
                                                 "less `overhead_ms`")
    candidate_iqr_ms: float = column(math.nan, "ms", "interquartile range of the candidate's times per call")
    candidate_cv: float = column(math.nan, "1", "coefficient of variation (std / mean) of the candidate's times")
    candidate_noise: float = column(math.nan, "1", "relative standard error of the candidate's median")
    overhead_ms: float = column(math.nan, "ms", "the handshake's fixed cost taken off every call: the median of an "
                                                "empty program's calls, timed the same way in the baselines' trusted "
                                                "worker in the same window (before 2026-12-02: in the candidate's "
                                                "worker before its code was loaded); 0 when taking it off would leave "
                                                "the candidate's median below `floor_ms` or below the handshake's own "
                                                "noise (its IQR, at least a tenth of it): every program's outside-clock "
                                                "times are then the figures (before 2026-12-04 the baselines' "
                                                "were still taken less the handshake)", added_in=3)
    flops: float = column(math.nan, "FLOP", "matmul/conv-family floating-point operations of one reference call "
                                            "(torch's FLOP counter)")
    min_bytes: float = column(math.nan, "bytes", "bytes any implementation must move: inputs, parameters and outputs "
                                                 "once each")
    floor_ms: float = column(math.nan, "ms", "max(flops / peak, min_bytes / bandwidth) from the config's ceilings; NaN "
                                             "where none are set. A candidate whose outside-clock time is below it is "
                                             "rejected as implausible")
    eager_ms: float = column(math.nan, "ms", "median time per call of the eager PyTorch reference, timed under the "
                                             "same protocol")
    eager_cv: float = column(math.nan, "1", "coefficient of variation of the eager reference's times")
    compile_ms: float = column(math.nan, "ms", "median time per call of the torch.compile'd reference (its fastest "
                                               "mode), timed under the same protocol")
    compile_cv: float = column(math.nan, "1", "coefficient of variation of the compiled reference's times")
    baseline_cached: bool = column(False, "", "the baselines came from a cache; always false since baselines are timed "
                                              "in every evaluation's own window (2026-12-02)")
    conditions: str = column("", "", "each timing's provenance, by program (`candidate`, `eager`, `compile:<mode>`): "
                                     "`at` (UTC), `loadavg_1m`, `beside` (other evaluations running on the device), "
                                     "and on cuda `sm_clock_mhz`, `mem_clock_mhz`, `temperature_c`, `power_w`; "
                                     "`timed_by` (`graph replays` or `calls`; from protocol `outside-4`) and, when a "
                                     "cuda window was timed by calls, `graphs_refused` (why); `program_cores` and "
                                     "`driver_cores`, where the window pinned the programs and the drivers (from "
                                     "protocol `outside-5`; absent where nothing was pinned); on cpu `flush_gb_s`, "
                                     "the window's cache flushes as a read rate, the memory bandwidth one core got "
                                     "while the programs were timed (from 2026-12-05); the same for every "
                                     "program since they are timed in one window; on cpu `inputs_on_huge_pages`, "
                                     "the share of the program's input slot on 2 MiB pages (protocol `outside-6`); "
                                     "`window_minor_faults`, the minor page faults of the program's process "
                                     "(and all it started) over the window, warm-up included, the baselines' "
                                     "shared by eager, torch.compile and the empty program (from 2026-12-06); "
                                     "`heap_on_huge_pages`, the share of that process's heap on 2 MiB pages at the "
                                     "window's end (null where it has none; from 2026-12-06); `timed_in_process`, "
                                     "which of the program's processes gave its figures (its fastest), and "
                                     "`process_medians_ms`, each process's median, in order (protocol "
                                     "`outside-11`; on cpu each program is timed in `timing.processes_cpu` "
                                     "processes; the per-process readings above are that process's)", json=True, added_in=4)
    speedup_eager: float = column(math.nan, "1", "how many times faster than eager the candidate is: each of the "
                                                 "candidate's frames against eager's median in the same round of the "
                                                 "window, and the median of those over the candidate's frames (from "
                                                 "`eager_times_ms` and `candidate_times_ms`; from version 7, before "
                                                 "eager_ms / candidate_ms)")
    speedup_compile: float = column(math.nan, "1", "the same against torch.compile's fastest mode "
                                                   "(`compile_times_ms`; from version 7, before compile_ms / "
                                                   "candidate_ms)")
    reward: float = column(math.nan, "1", "the reward (hpc/reward.py); NaN when status is `error`")
    reward_kind: str = column("", "", "`discrete` or `continuous`")
    candidate_times_ms: list[float] = column([], "ms", "every timed frame's figure per call of the candidate, in "
                                                       "the order timed: the window's rounds (`timing.rounds`) hold "
                                                       "consecutive runs of them, of lengths differing by at most one")
    eager_times_ms: list[float] = column([], "ms", "the same for eager", added_in=7)
    compile_times_ms: list[float] = column([], "ms", "the same for torch.compile's fastest mode", added_in=7)
    timestamp: float = column(0.0, "s", "Unix time the evaluation started (seconds since 1970-01-01 UTC)")
    wall_seconds: float = column(0.0, "s", "the whole evaluation's wall time")
    stage_seconds: str = column("", "s", "wall seconds of each stage the evaluation went through, up to the one that "
                                         "ended it: `static`, `compile`, `load`, `verify`, `baseline`, `profile`, "
                                         "`cost` (counting the task's FLOPs and bytes), `shutdown` (ending the "
                                         "workers); and the device lock's `lock_wait_shared`, `lock_wait_exclusive`, "
                                         "`lock_held_exclusive` (hpc/profile/device_lock.py). `verify` and `profile` "
                                         "were `correctness` and `timing` before version 6", json=True, added_in=2)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """ValueError for a status, stage or backend outside its vocabulary: checked when a record
        is made (or read from a file) and when it is written."""
        _check("status", self.status, STATUSES)
        _check("failed_stage", self.failed_stage, ("", *STAGES))
        _check("backend", self.backend, ("", *BACKENDS))

    def fail(self, stage: Stage, reason: str, status: Status = "failed") -> "EvalRecord":
        _check("failed_stage", stage, STAGES)
        _check("status", status, ("failed", "error"))
        self.status, self.failed_stage, self.reason = status, stage, reason
        return self

    def summary(self) -> dict:
        """The CLI's --json object: the contract fields first, then the rest except bulky ones."""
        out = {"compiled": self.compiled, "correct": self.correct, "reward": _num(self.reward),
               "speedup_eager": _num(self.speedup_eager), "speedup_compile": _num(self.speedup_compile),
               "reason": self.reason}
        for f in dataclasses.fields(self):
            if f.name not in out and f.name not in BULKY:
                value = getattr(self, f.name)
                out[f.name] = _num(value) if isinstance(value, float) else value
        return out


BULKY = ("candidate_source", "candidate_times_ms", "eager_times_ms", "compile_times_ms", "config")   # not in summary()


def _check(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"record {name}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")


def _num(x: float):
    return None if isinstance(x, float) and math.isnan(x) else x


FIELDS = [f for f in dataclasses.fields(EvalRecord)]
COLUMNS = columns_of(EvalRecord)


POLICY_SAMPLE = "policy:"   # candidate_path of one sample of a policy evaluation: policy:<checkpoint>#<task>/<k>


def record_key(rec: EvalRecord) -> tuple[str, str]:
    """What makes two records one evaluation: the task and the candidate's hash (its path without
    one). A sample of a policy is keyed by its sample id (its `policy:` path) instead: two samples
    that end with the same code are still two samples."""
    if rec.candidate_path.startswith(POLICY_SAMPLE):
        return rec.task_id, rec.candidate_path
    return rec.task_id, rec.candidate_sha256 or rec.candidate_path

"""One evaluation record: everything known about one candidate on one task, stage by stage."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from hpc.config import BACKENDS

# ok; failed: the candidate's fault (paid the incorrect reward); error: the harness's or the task's
Status = Literal["ok", "failed", "error"]
Stage = Literal["static", "compile", "load", "correctness", "timing", "baseline", "pool"]
STATUSES: tuple[Status, ...] = get_args(Status)
STAGES: tuple[Stage, ...] = get_args(Stage)


@dataclass
class EvalRecord:
    # what was evaluated
    task_id: str = ""
    task_level: int = 0
    task_sha256: str = ""
    scale: str = ""
    candidate_sha256: str = ""
    candidate_kind: str = ""
    candidate_path: str = ""
    candidate_source: str = ""
    backend: str = ""             # one of hpc.config.BACKENDS; "" when never known (a request the pool gave up on)
    hardware: str = ""
    versions: str = ""            # JSON
    rules: str = ""               # JSON: the op and library rules in force (config `rules`)
    config: str = ""              # JSON: the full evaluation config
    isolation: str = ""           # JSON: sandbox features that were in force
    # outcome per stage
    status: Status = "ok"
    failed_stage: Stage | Literal[""] = ""   # "" when none failed
    reason: str = ""
    compiled: bool = False
    compile_seconds: float = math.nan
    compile_cached: bool = False
    compile_log: str = ""
    correct: bool = False
    trials: int = 0
    seeds: str = ""               # JSON: correctness seeds and distributions, timing seed
    max_abs_error: float = math.nan
    max_rel_error: float = math.nan
    timed_checks: int = 0
    # timing (milliseconds)
    candidate_ms: float = math.nan
    candidate_iqr_ms: float = math.nan
    candidate_cv: float = math.nan
    candidate_noise: float = math.nan
    overhead_ms: float = math.nan       # the handshake's fixed cost, taken off every call's outside-clock time
    flops: float = math.nan
    min_bytes: float = math.nan
    floor_ms: float = math.nan         # max(flops / peak, min_bytes / bandwidth); NaN when no ceilings
    eager_ms: float = math.nan
    eager_cv: float = math.nan
    compile_ms: float = math.nan
    compile_cv: float = math.nan
    baseline_cached: bool = False
    conditions: str = ""          # JSON {candidate | eager | compile:<mode>: when, load, evaluations beside, GPU}
    speedup_eager: float = math.nan
    speedup_compile: float = math.nan
    reward: float = math.nan
    reward_kind: str = ""
    candidate_times_ms: list[float] = field(default_factory=list)
    timestamp: float = 0.0
    wall_seconds: float = 0.0
    stage_seconds: str = ""       # JSON {stage: seconds}: compile, load, correctness, timing, baseline...
                                  # and the device lock's lock_wait_shared, lock_wait_exclusive, lock_held_exclusive

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
            if f.name not in out and f.name not in ("candidate_source", "candidate_times_ms", "config"):
                value = getattr(self, f.name)
                out[f.name] = _num(value) if isinstance(value, float) else value
        return out


def _check(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"record {name}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")


def _num(x: float):
    return None if isinstance(x, float) and math.isnan(x) else x


FIELDS = [f for f in dataclasses.fields(EvalRecord)]


POLICY_SAMPLE = "policy:"   # candidate_path of one sample of a policy evaluation: policy:<checkpoint>#<task>/<k>


def record_key(rec: EvalRecord) -> tuple[str, str]:
    """What makes two records one evaluation: the task and the candidate's hash (its path without
    one). A sample of a policy is keyed by its sample id (its `policy:` path) instead: two samples
    that end with the same code are still two samples."""
    if rec.candidate_path.startswith(POLICY_SAMPLE):
        return rec.task_id, rec.candidate_path
    return rec.task_id, rec.candidate_sha256 or rec.candidate_path

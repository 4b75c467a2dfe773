"""Metrics over evaluation records: the numbers behind the summary table and the analysis report.

A sample is one record (one candidate on one task). Rates are over ALL tasks: a task of the
suite with no record counts as one failing sample, so a run cannot look better by skipping hard
tasks. A sample passes when it is correct and failed no stage; only passing samples count as
faster, and speedups are averaged (geometric mean) over passing samples only. "Faster" means
faster by more than the reward's margin, as the reward pays (hpc/reward.py).
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from dataclasses import dataclass

from hpc.config import RewardConfig
from hpc.results.record import STAGES, EvalRecord

FAST_P = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
BASELINES = ("eager", "compile")
PASSED = "passed"
UNVERIFIED = "unverified"   # no stage failed, but correctness was never established (e.g. a compile-only check)
MISSING = "missing"         # a task of the suite with no record
OUTCOMES = (PASSED, *STAGES, UNVERIFIED, MISSING)
DEFAULT_MARGIN = RewardConfig().margin


def passed(rec: EvalRecord) -> bool:
    """Correct and failed no later stage (a correct candidate can still fail at profile or baseline)."""
    return rec.correct and not rec.failed_stage


def outcome(rec: EvalRecord) -> str:
    """The one bucket of OUTCOMES a record falls in."""
    return PASSED if passed(rec) else rec.failed_stage or UNVERIFIED


def speedup(rec: EvalRecord, baseline: str) -> float:
    return rec.speedup_eager if baseline == "eager" else rec.speedup_compile


def geomean(xs: list[float]) -> float:
    """Geometric mean of the finite positive values; NaN when there are none."""
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def fast_p(records: list[EvalRecord], p: float, baseline: str = "eager", missing: int = 0) -> float:
    """KernelBench's fast_p: the fraction of samples that pass with a speedup over `baseline` above
    p. `missing` tasks without a record count as failing samples. NaN with no sample at all."""
    return fast_p_curve(records, [p], baseline, missing)[0]


def fast_p_curve(records: list[EvalRecord], ps: list[float], baseline: str = "eager",
                 missing: int = 0) -> list[float]:
    """fast_p at every p of `ps`, sorting the passing speedups once (a plotted curve has hundreds)."""
    total = len(records) + missing
    xs = sorted(x for x in (speedup(r, baseline) for r in records if passed(r)) if not math.isnan(x))
    return [(len(xs) - bisect.bisect_right(xs, p)) / total if total else math.nan for p in ps]


@dataclass
class Summary:
    """The numbers of one group of samples: a level, or the whole run."""
    name: str
    samples: int                  # records plus missing tasks: the denominator of every rate
    tasks: int                    # distinct task ids, missing ones included
    missing: int
    passed: int
    pass_rate: float
    faster_eager: float           # passing and faster than eager by more than the margin
    faster_compile: float
    geomean_eager: float          # over passing samples only
    geomean_compile: float
    mean_reward: float            # over records with a reward (a missing task has none)
    fast_p_eager: dict[float, float]
    fast_p_compile: dict[float, float]
    failures: dict[str, int]      # outcome -> samples, passed left out, in OUTCOMES order


def summarize(records: list[EvalRecord], missing: int = 0, margin: float = DEFAULT_MARGIN,
              name: str = "all") -> Summary:
    """One group's numbers; `missing` tasks of the suite without a record count as failing."""
    ok = [r for r in records if passed(r)]
    total = len(records) + missing
    counts = Counter(outcome(r) for r in records)
    counts[MISSING] += missing
    rewards = [r.reward for r in records if math.isfinite(r.reward)]
    return Summary(
        name=name, samples=total, tasks=len({r.task_id for r in records}) + missing, missing=missing,
        passed=len(ok), pass_rate=len(ok) / total if total else math.nan,
        faster_eager=fast_p(records, 1.0 + margin, "eager", missing),
        faster_compile=fast_p(records, 1.0 + margin, "compile", missing),
        geomean_eager=geomean([r.speedup_eager for r in ok]), geomean_compile=geomean([r.speedup_compile for r in ok]),
        mean_reward=sum(rewards) / len(rewards) if rewards else math.nan,
        fast_p_eager=dict(zip(FAST_P, fast_p_curve(records, FAST_P, "eager", missing))),
        fast_p_compile=dict(zip(FAST_P, fast_p_curve(records, FAST_P, "compile", missing))),
        failures={k: counts[k] for k in sorted(counts, key=_order) if k != PASSED and counts[k]})


def _order(stage: str) -> tuple[int, str]:
    """OUTCOMES order; a stage this version does not know (a newer writer's) after them."""
    return (OUTCOMES.index(stage) if stage in OUTCOMES else len(OUTCOMES), stage)


@dataclass
class Run:
    """One run's samples against its denominator: the records of the suite's tasks, and the suite's
    tasks that have none."""
    label: str
    records: list[EvalRecord]
    missing: dict[str, int]       # task id -> level
    level_of: dict[str, int]      # task id -> level, every task of the denominator
    outside_suite: int = 0        # records of tasks not in the suite, left out of every number
    margin: float = DEFAULT_MARGIN
    source: str = ""
    git_commit: str = ""

    @property
    def levels(self) -> list[int]:
        return sorted(set(self.level_of.values()))

    def at_level(self, level: int) -> tuple[list[EvalRecord], int]:
        """The level's records and its count of missing tasks."""
        return ([r for r in self.records if self.level_of[r.task_id] == level],
                sum(lv == level for lv in self.missing.values()))


def make_run(records: list[EvalRecord], suite: dict[str, int] | None = None, label: str = "",
             margin: float = DEFAULT_MARGIN, source: str = "", git_commit: str = "") -> Run:
    """`suite` maps every task id of the denominator to its level; without one, the denominator is
    the task ids the run recorded."""
    level_of = dict(suite) if suite is not None else {r.task_id: r.task_level for r in records}
    kept = [r for r in records if r.task_id in level_of]
    seen = {r.task_id for r in kept}
    return Run(label=label, records=kept, missing={t: lv for t, lv in level_of.items() if t not in seen},
               level_of=level_of, outside_suite=len(records) - len(kept), margin=margin, source=source,
               git_commit=git_commit)


@dataclass
class RunSummary:
    """Per level and overall numbers of one run, with the most common failure reasons per stage."""
    label: str
    source: str
    git_commit: str
    margin: float
    outside_suite: int
    overall: Summary
    levels: dict[int, Summary]
    reasons: dict[str, list[tuple[str, int]]]


def summarize_run(run: Run, top: int = 3) -> RunSummary:
    levels = {}
    for lv in run.levels:
        records, missing = run.at_level(lv)
        levels[lv] = summarize(records, missing, run.margin, f"level {lv}")
    return RunSummary(label=run.label, source=run.source, git_commit=run.git_commit, margin=run.margin,
                      outside_suite=run.outside_suite,
                      overall=summarize(run.records, len(run.missing), run.margin), levels=levels,
                      reasons=top_reasons(run.records, top))


def top_reasons(records: list[EvalRecord], top: int = 3) -> dict[str, list[tuple[str, int]]]:
    """The `top` most common reasons per failed stage (first line, 120 characters), stages in order."""
    counts = Counter((r.failed_stage, (r.reason.splitlines() or [""])[0][:120]) for r in records if r.failed_stage)
    out: dict[str, list[tuple[str, int]]] = {}
    for (stage, reason), n in sorted(counts.items(), key=lambda kv: (_order(kv[0][0]), -kv[1], kv[0][1])):
        if len(out.setdefault(stage, [])) < top:
            out[stage].append((reason, n))
    return out


def stage_seconds(records: list[EvalRecord]) -> dict[str, float]:
    """Seconds per evaluation stage summed over the records: where a batch's time went."""
    totals: dict[str, float] = {}
    for r in records:
        for stage, seconds in json.loads(r.stage_seconds or "{}").items():
            totals[stage] = round(totals.get(stage, 0.0) + seconds, 1)
    return totals


# --- training curves (rows of hpc.results.training.read_steps) ----------------------------------------

FINAL_STEPS = 5     # a stage's final metrics average its last steps: one step's batch is noisy
FINAL_METRICS = ("reward_mean", "pass_rate", "faster_than_compile_rate", "kl_to_reference", "entropy",
                 "explained_variance", "sft_loss", "value_loss", "response_length_mean", "tokens_per_second")


def stage_segments(steps: list[dict]) -> list[tuple[str, list[dict]]]:
    """The step rows split where the stage changes, in order (a stage the recipe returns to is a
    new segment): the report's stages and the plot's boundaries."""
    segments: list[tuple[str, list[dict]]] = []
    for row in steps:
        if not segments or segments[-1][0] != row["stage"]:
            segments.append((row["stage"], []))
        segments[-1][1].append(row)
    return segments


@dataclass
class StageSummary:
    stage: str
    first_step: int
    last_step: int
    steps: int
    hours: float                  # summed step_s; NaN when no step was timed
    final: dict[str, float]       # FINAL_METRICS, each the mean over the last FINAL_STEPS steps that measured it


@dataclass
class TrainingSummary:
    label: str
    source: str
    steps: int
    stages: list[StageSummary]


def summarize_training(steps: list[dict], label: str = "", source: str = "") -> TrainingSummary:
    """Per stage segment its steps, hours and final metrics: where each stage of the recipe left the policy."""
    stages = []
    for stage, rows in stage_segments(steps):
        timed = [r["step_s"] for r in rows if math.isfinite(r["step_s"])]
        final = {}
        for key in FINAL_METRICS:
            last = [r[key] for r in rows if math.isfinite(r[key])][-FINAL_STEPS:]
            final[key] = sum(last) / len(last) if last else math.nan
        stages.append(StageSummary(stage=stage, first_step=rows[0]["step"], last_step=rows[-1]["step"],
                                   steps=len(rows), hours=sum(timed) / 3600 if timed else math.nan, final=final))
    return TrainingSummary(label=label, source=source, steps=len(steps), stages=stages)


def pass_rate_trend(rows: list[dict]) -> tuple[float, float, float]:
    """Whether a stage's pass rate rose from its start to its end: the pass rates of its first and
    last quarter of steps (each pooled over its samples) and the two-proportion z of the rise. A
    before/after measurement of a few dozen samples moves by chance (on the embedded default,
    0.26 reward between seeds with RL off); a quarter of a PPO stage holds over a hundred
    on-policy samples, so a z of 3 is not chance. NaN where the stage has under 4 steps or the
    pooled rate is 0 or 1."""
    quarter = len(rows) // 4
    if quarter == 0:
        return math.nan, math.nan, math.nan

    def pooled(part: list[dict]) -> tuple[float, float]:
        n = sum(r["samples"] for r in part)
        return (sum(r["pass_rate"] * r["samples"] for r in part) / n if n else math.nan), n

    (first, n1), (last, n2) = pooled(rows[:quarter]), pooled(rows[-quarter:])
    both = (first * n1 + last * n2) / (n1 + n2) if n1 + n2 else math.nan
    if not 0 < both < 1:
        return first, last, math.nan
    return first, last, (last - first) / math.sqrt(both * (1 - both) * (1 / n1 + 1 / n2))

"""A training step's metrics row, as the trainer and its stages build it.

The step columns are defined once, by `hpc.results.training.STEP_FIELDS` (name and type; their
meanings in results/SCHEMA.md, which tests/test_docs.py holds to it): `StepMetrics` takes only
those names, on every rank as a stage sets them, so a misspelt metric fails where it is made
rather than at the writer on rank 0. A new metric is one entry there, its row in the schema
document, and the code that measures it: the writer adds the column to a file that lacks it.
`rollout_metrics` is the row part of every step that samples episodes (ppo, rft, measure).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from hpc.results.training import unknown_step_metrics
from hpc.rl.rollout import RolloutStats, Sample


class StepMetrics:
    """One step's metrics, by column name; a name that is not a step column is a ValueError."""

    def __init__(self, **values: Any) -> None:
        self._values: dict[str, Any] = {}
        self.add(**values)

    def add(self, **values: Any) -> None:
        unknown = unknown_step_metrics(values)
        if unknown:
            raise ValueError(f"step metrics: unknown metric {unknown[0]!r} (the columns: STEP_FIELDS in "
                             "hpc/results/training.py)")
        self._values.update(values)

    def as_dict(self) -> dict[str, Any]:
        """The metrics set so far (a column never set is NaN in the results file)."""
        return dict(self._values)


def outcome(sample: Sample, margin: float) -> dict[str, Any]:
    """What the step's metrics count of one sample: its reward, whether it passed and beat each
    baseline by more than the reward margin, its length, clipped replies and malformed calls."""
    rec = sample.trajectory.record if sample.trajectory is not None else {}
    correct = bool(rec.get("correct"))
    return {"reward": sample.reward, "correct": correct,
            "faster_eager": correct and (rec.get("speedup_eager") or 0) > 1 + margin,
            "faster_compile": correct and (rec.get("speedup_compile") or 0) > 1 + margin,
            "generated": sample.generated_tokens, "clipped": sample.clipped_replies, "replies": sample.replies,
            "malformed": bool(sample.trajectory and sample.trajectory.malformed_calls)}


def rollout_metrics(outcomes: list[dict[str, Any]], stats: RolloutStats, timed: bool) -> StepMetrics:
    """The metrics of a step's sampled episodes (`outcomes`: every data-parallel replica's); the
    speed rates only when the reward `timed` the candidates (under the correctness reward nothing
    is timed: no rate, rather than a rate of 0)."""
    rewards = [o["reward"] for o in outcomes]
    return StepMetrics(
        samples=len(outcomes),
        reward_mean=statistics.fmean(rewards),
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        pass_rate=statistics.fmean(o["correct"] for o in outcomes),
        faster_than_eager_rate=statistics.fmean(o["faster_eager"] for o in outcomes) if timed else math.nan,
        faster_than_compile_rate=statistics.fmean(o["faster_compile"] for o in outcomes) if timed else math.nan,
        response_length_mean=statistics.fmean(o["generated"] for o in outcomes),
        response_clipped_ratio=sum(o["clipped"] for o in outcomes) / max(1, sum(o["replies"] for o in outcomes)),
        malformed_rate=statistics.fmean(o["malformed"] for o in outcomes),
        turns_mean=statistics.fmean(o["replies"] for o in outcomes),
        tokens_per_second=stats.generated_tokens / stats.generation_s if stats.generation_s else math.nan,
        generation_s=stats.generation_s, reward_s=stats.tools_s,
    )

"""The reward: what RL pays for a candidate.

Discrete (CUDA Agent, arXiv 2602.24286): -1 incorrect; 3 if faster than both eager and
torch.compile by more than the margin; 2 if faster than eager only; 1 if merely correct.
Continuous: the speedup over torch.compile for a correct candidate, -1 otherwise.
Correctness: 1 for a correct candidate, -1 otherwise; nothing is timed. For machines whose timing
cannot tell a 5% step apart from noise (the embedded default's 2-core CPU: docs/rl.md), where a
correct sample would be paid 1, 2 or 3 from run to run.
"""

from __future__ import annotations

import math

from hpc.config import RewardConfig


def compute_reward(correct: bool, speedup_eager: float, speedup_compile: float, cfg: RewardConfig) -> float:
    if not correct:
        return cfg.incorrect
    if cfg.kind == "correctness":
        return 1.0
    if cfg.kind == "continuous":
        return speedup_compile if math.isfinite(speedup_compile) else cfg.incorrect
    beats_eager = speedup_eager > 1.0 + cfg.margin
    beats_compile = speedup_compile > 1.0 + cfg.margin
    if beats_eager and beats_compile:
        return 3.0
    if beats_eager:
        return 2.0
    return 1.0

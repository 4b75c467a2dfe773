"""The RL algorithm's settings: a dataclass loaded from YAML, errors naming the key.

Defaults are CUDA Agent's (arXiv 2602.24286): PPO with a critic, GAE gamma 1 and lambda 0.95,
asymmetric clipping 0.2 / 0.28, actor learning rate 3e-6, critic 6e-6, gradients clipped to a global
norm of 1.0 (as verl and OpenRLHF). One rollout batch is one
optimizer step unless `ppo_epochs` / `minibatches` say otherwise (hpc.rl.update.ppo_epochs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hpc.config import build_config, read_yaml_mapping
from hpc.errors import ConfigError

ALGORITHMS = ("ppo", "grpo")
KL_KINDS = ("k1", "k3")


@dataclass
class RLConfig:
    algorithm: str = "ppo"          # ppo: critic + GAE; grpo: group-normalized rewards, no critic
    gamma: float = 1.0
    lam: float = 0.95
    clip_low: float = 0.2
    clip_high: float = 0.28
    value_clip: float = 0.0         # 0: plain squared error
    kl_coef: float = 0.0            # weight of KL(policy || reference) in the loss
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    actor_lr: float = 3e-6
    critic_lr: float = 6e-6
    clip_grad: float = 1.0          # max global grad norm of each optimizer step (verl, OpenRLHF); 0: no clipping
    whiten_advantages: bool = True  # ppo: GAE advantages to zero mean, unit variance over the batch (as verl)
    group_size: int = 8             # samples per task (GRPO's group)
    grpo_scale: bool = True         # divide by the group's std
    ppo_epochs: int = 1             # passes over each rollout batch (ppo and grpo alike)
    minibatches: int = 1            # optimizer steps per pass: the batch's rows, shuffled, split in this many parts

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"config rl.algorithm: expected one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.kl_kind not in KL_KINDS:
            raise ConfigError(f"config rl.kl_kind: expected one of {', '.join(KL_KINDS)}, got {self.kl_kind!r}")
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"config rl.{key}: must be in [0, 1], got {getattr(self, key)}")
        for key in ("clip_low", "clip_high", "value_clip", "kl_coef", "entropy_coef", "clip_grad"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config rl.{key}: must be >= 0, got {getattr(self, key)}")
        if self.clip_low >= 1.0:
            raise ConfigError(f"config rl.clip_low: must be < 1, got {self.clip_low}")
        for key in ("actor_lr", "critic_lr"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"config rl.{key}: must be > 0, got {getattr(self, key)}")
        if self.group_size < 1:
            raise ConfigError(f"config rl.group_size: must be >= 1, got {self.group_size}")
        for key in ("ppo_epochs", "minibatches"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config rl.{key}: must be an integer >= 1, got {value!r}")


def load_rl_config(source: str | os.PathLike | dict[str, Any] | None = None) -> RLConfig:
    """Defaults, then a YAML file or dict (its `rl:` section if it has one); validated."""
    data: Any = {}
    if isinstance(source, dict):
        data = source
    elif source is not None:
        data = read_yaml_mapping(source)
    if isinstance(data.get("rl"), dict):
        data = data["rl"]
    cfg = build_config(RLConfig, data, "rl.")
    cfg.validate()
    return cfg

"""The trainer's settings: model, tokenizer, agent, evaluator, RL algorithm and the staged recipe,
one YAML file onto typed dataclasses, validated at load with errors that name the key.

The recipe is CUDA Agent's, as a list of stages run in order (any subset, any order):
- `sft`: supervised fine-tuning on demonstrations (the shipped solutions as single-turn replies)
  or on the trajectories the last `rft` stage kept;
- `ppo`: RL (PPO with a critic, or GRPO) in single-turn or multi-turn mode;
- `rft`: rejection fine-tuning: sample trajectories, keep those with reward > `min_reward` and
  no loop or malformed tool call, fine-tune on them;
- `value`: value pretraining: fit the critic to the outcome of the last `rft` stage's samples;
- `measure`: sample and score without updating (the before/after of a run).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from hpc.agent.config import AgentConfig, agent_config
from hpc.config import EvalConfig, build_config, read_yaml_mapping
from hpc.errors import ConfigError
from hpc.policy.chat import FORMATS
from hpc.policy.config import PolicyModelConfig, policy_config
from hpc.rl.config import RLConfig, load_rl_config

STAGE_KINDS = ("sft", "ppo", "rft", "value", "measure")
SFT_DATA = ("solutions", "rft")
BPE_KINDS = ("bpe:", "bpe-spans:")   # tokenizers trained on the demonstrations


@dataclass
class StageConfig:
    name: str = ""
    kind: str = "ppo"
    steps: int = 1                 # optimizer steps (sft, value, ppo) or sampling rounds (rft, measure)
    mode: str = "single_turn"      # ppo, rft, measure: single_turn or multi_turn episodes
    lr: float = 0.0                # 0: the rl section's actor_lr (critic_lr for value)
    lr_end: float = 0.0            # > 0: the learning rate falls linearly from lr to this over the stage
    data: str = "solutions"        # sft: solutions or rft
    batch_size: int = 8            # sft, value: sequences per step
    min_reward: float = 0.0        # rft: keep trajectories whose reward exceeds this
    samples_per_task: int = 0      # ppo, rft, measure: 0 = rl.group_size


@dataclass
class RolloutConfig:
    tasks_per_step: int = 2        # tasks drawn per RL step (each sampled group_size times)
    temperature: float = 1.0
    top_p: float = 1.0
    concurrency: int = 2           # evaluations (and tool calls) running at once
    reward_cache: bool = True      # an identical state of the same task is evaluated once per run


@dataclass
class TrainConfig:
    seed: int = 0
    tasks: str = "kernels/tasks"
    only: list[str] = field(default_factory=list)     # task ids containing one of these (level1, 01_gelu)
    solutions: str = "kernels/solutions"              # sft demonstrations
    starter_demonstrations: bool = False              # also the reply that leaves the starter as it is
    init: str = ""                 # "": random weights; a HF directory or a checkpoint root
    tokenizer: str = "byte"        # byte, a HF directory / tokenizer.json, or bpe:N / bpe-spans:N (trained on
    #                                the demonstrations; spans: merges cross spaces and lines)
    chat_format: str = "auto"
    include_system: bool = True    # False: the instructions stay in the workdir only (tiny models)
    checkpoint_every: int = 10     # global steps between checkpoints (and one at the end)
    policy: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    stages: list[StageConfig] = field(default_factory=list)

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)


def _stage(data: Any, index: int) -> StageConfig:
    where = f"stages[{index}]."
    stage = build_config(StageConfig, data, where)
    stage.name = stage.name or f"{stage.kind}{index}"
    if stage.kind not in STAGE_KINDS:
        raise ConfigError(f"config {where}kind: expected one of {', '.join(STAGE_KINDS)}, got {stage.kind!r}")
    if stage.mode not in ("single_turn", "multi_turn"):
        raise ConfigError(f"config {where}mode: expected single_turn or multi_turn, got {stage.mode!r}")
    if stage.data not in SFT_DATA:
        raise ConfigError(f"config {where}data: expected one of {', '.join(SFT_DATA)}, got {stage.data!r}")
    if stage.samples_per_task < 0:
        raise ConfigError(f"config {where}samples_per_task: must be >= 0, got {stage.samples_per_task}")
    for key in ("steps", "batch_size"):
        if getattr(stage, key) < 1:
            raise ConfigError(f"config {where}{key}: must be >= 1, got {getattr(stage, key)}")
    if stage.lr < 0 or stage.lr_end < 0:
        raise ConfigError(f"config {where}lr and {where}lr_end: must be >= 0, got {stage.lr}, {stage.lr_end}")
    return stage


def train_config(data: dict[str, Any]) -> TrainConfig:
    """A validated config from a mapping (the YAML file's contents)."""
    data = dict(data)
    sections = {key: data.pop(key, None) for key in ("policy", "agent", "eval", "rl", "rollout", "stages")}
    cfg = build_config(TrainConfig, data, "")
    for key in ("policy", "agent", "eval", "rl", "rollout"):
        if sections[key] is not None and not isinstance(sections[key], dict):
            raise ConfigError(f"config {key}: expected a mapping, got {type(sections[key]).__name__}")
    cfg.policy = policy_config(sections["policy"] or {})
    cfg.agent = agent_config(sections["agent"] or {})
    cfg.eval = build_config(EvalConfig, sections["eval"] or {}, "eval.")
    cfg.eval.validate()
    cfg.rl = load_rl_config(sections["rl"] or {})
    cfg.rollout = build_config(RolloutConfig, sections["rollout"] or {}, "rollout.")
    stages = sections["stages"]
    if stages is None:
        stages = []
    if not isinstance(stages, list):
        raise ConfigError(f"config stages: expected a list, got {type(stages).__name__}")
    cfg.stages = [_stage(s, i) for i, s in enumerate(stages)]
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Cross-section checks (each section validated itself when built)."""
    if not cfg.stages:
        raise ConfigError("config stages: the recipe has no stage")
    names = [s.name for s in cfg.stages]
    if len(set(names)) != len(names):
        raise ConfigError(f"config stages: stage names repeat ({', '.join(names)})")
    if cfg.chat_format not in FORMATS:
        raise ConfigError(f"config chat_format: expected one of {', '.join(FORMATS)}, got {cfg.chat_format!r}")
    if cfg.tokenizer.startswith(BPE_KINDS):
        size = cfg.tokenizer.partition(":")[2]
        if not size.isdigit() or int(size) < 300:
            raise ConfigError(f"config tokenizer: {cfg.tokenizer.partition(':')[0]}:N needs a vocabulary size "
                              f"N >= 300, got {cfg.tokenizer!r}")
    r = cfg.rollout
    if r.tasks_per_step < 1 or r.concurrency < 1:
        raise ConfigError("config rollout.tasks_per_step and rollout.concurrency: must be >= 1")
    if r.temperature <= 0 or not 0 < r.top_p <= 1:
        raise ConfigError("config rollout.temperature must be > 0 and rollout.top_p in (0, 1]")
    if cfg.checkpoint_every < 1:
        raise ConfigError(f"config checkpoint_every: must be >= 1, got {cfg.checkpoint_every}")
    if cfg.agent.max_context_tokens > cfg.policy.max_seq_len:
        raise ConfigError(f"config agent.max_context_tokens: {cfg.agent.max_context_tokens} exceeds "
                          f"policy.max_seq_len {cfg.policy.max_seq_len}")
    for i, s in enumerate(cfg.stages):
        if s.kind == "ppo" and cfg.rl.algorithm == "grpo" and s.samples_per_task == 1:
            raise ConfigError(f"config stages[{i}].samples_per_task: grpo needs groups of 2 or more")
        episodes = r.tasks_per_step * (s.samples_per_task or cfg.rl.group_size)
        if s.kind == "ppo" and episodes < cfg.rl.minibatches:
            raise ConfigError(f"config rl.minibatches: {cfg.rl.minibatches} minibatches, but stages[{i}] samples "
                              f"{episodes} episodes per step (rollout.tasks_per_step x samples per task)")
        if s.kind in ("sft", "value") and s.data == "rft" or s.kind == "value":
            if not any(p.kind == "rft" for p in cfg.stages[:i]):
                raise ConfigError(f"config stages[{i}]: {s.kind} on rft data needs an rft stage before it")


def load_train_config(path: str | os.PathLike) -> TrainConfig:
    return train_config(read_yaml_mapping(path))


def train_config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain data (stored with the run and its checkpoints); `saved_train_config` reads it back."""
    return dataclasses.asdict(cfg)


def saved_train_config(data: dict[str, Any]) -> TrainConfig:
    """A config `train_config_dict` stored, whichever version of it: a checkpoint saved while the
    evaluator's rules were `eval.policy` reads them as `eval.rules` (a user's YAML file that still
    says `policy` there is refused instead, naming the new key)."""
    section = data.get("eval")
    if isinstance(section, dict) and "policy" in section and "rules" not in section:
        data = {**data, "eval": {("rules" if key == "policy" else key): value for key, value in section.items()}}
    return train_config(data)

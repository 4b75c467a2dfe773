"""Typed agent-environment config: turn and context limits, tool limits, final-state selection.

Loaded from a mapping or YAML with the evaluation config's rules (unknown keys and wrong types
are errors naming the key, e.g. `config agent.max_turns: expected int`). A `preset` key picks
the starting point: `tiny` (the default: a CPU-sized episode), `train` (150 turns, as CUDA
Agent trains) or `eval` (200 turns, as it evaluates); other keys override it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from hpc.config import build_config, read_yaml_mapping
from hpc.errors import ConfigError

MODES = ("multi_turn", "single_turn")
STATES = ("final", "best")
OBSERVATION_ROLES = ("user", "tool")


@dataclass
class BashConfig:
    """Limits of one `bash` tool call (it runs in the project's sandbox, confined to the workdir)."""

    timeout_s: float = 60.0               # wall clock; the whole process group is killed after it
    memory_gb: float = 8.0                # what the command's cgroup may hold, and its address space off the GPU
    cpu_seconds: int = 600
    max_processes: int = 4096             # tasks in the command's cgroup (and RLIMIT_NPROC, per user)
    max_file_mb: int = 256                # largest file a command may write
    require_isolation: bool = True        # refuse to run when this machine cannot confine writes and network
    confine_reads: bool = True            # read only the system, Python, the toolkit package and the episode
    readable: list[str] = field(default_factory=list)   # more folders commands may read (confine_reads)
    gpu: bool = False                     # cuda backend: let commands see the node's GPUs (the pool measures)


@dataclass
class AgentConfig:
    """One episode's rules. The defaults are the `tiny` preset."""

    preset: str = "tiny"
    mode: str = "multi_turn"              # single_turn: one reply that writes the whole solution (warm-up)
    max_turns: int = 12                   # policy replies per episode
    max_context_tokens: int = 32768       # the episode ends when the prompt plus one reply would not fit
    max_response_tokens: int = 4096       # room kept for the next reply
    max_calls_per_turn: int = 8           # tool calls beyond this in one reply are not run
    observation_chars: int = 8000         # one tool result is cut in the middle beyond this
    max_file_bytes: int = 1 << 20         # largest file write_file / edit_file may produce
    state: str = "final"                  # which workdir state earns the reward: final, or best (by
    #                                       speedup over torch.compile among correct profiled states)
    rescore_best: bool = False            # best: evaluate the chosen state again for the reward
    loop_repeats: int = 4                 # the same call this many times in a row is a loop (0: off)
    stop_on_loop: bool = True             # end the episode at a loop (else only flag it)
    end_without_tool_call: bool = True    # a reply without a tool call ends the episode (else a reminder)
    observation_role: str = "user"        # chat role of tool-result messages: user, or tool
    bash: BashConfig = field(default_factory=BashConfig)

    def validate(self) -> None:
        """Raise UserError naming the first bad key."""
        for key, value, choices in (("preset", self.preset, tuple(PRESETS)), ("mode", self.mode, MODES),
                                    ("state", self.state, STATES),
                                    ("observation_role", self.observation_role, OBSERVATION_ROLES)):
            if value not in choices:
                raise ConfigError(f"config agent.{key}: expected one of {', '.join(choices)}, got {value!r}")
        positive = {"max_turns": self.max_turns, "max_context_tokens": self.max_context_tokens,
                    "max_response_tokens": self.max_response_tokens, "max_calls_per_turn": self.max_calls_per_turn,
                    "observation_chars": self.observation_chars, "max_file_bytes": self.max_file_bytes,
                    "bash.timeout_s": self.bash.timeout_s, "bash.memory_gb": self.bash.memory_gb,
                    "bash.cpu_seconds": self.bash.cpu_seconds, "bash.max_processes": self.bash.max_processes,
                    "bash.max_file_mb": self.bash.max_file_mb}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"config agent.{key}: must be > 0, got {value}")
        if self.loop_repeats < 0 or self.loop_repeats == 1:
            raise ConfigError(f"config agent.loop_repeats: must be 0 (off) or >= 2, got {self.loop_repeats}")
        if self.observation_chars < 200:
            raise ConfigError(f"config agent.observation_chars: must be >= 200, got {self.observation_chars}")
        if self.max_response_tokens >= self.max_context_tokens:
            raise ConfigError(f"config agent.max_response_tokens: must be below max_context_tokens "
                              f"({self.max_context_tokens}), got {self.max_response_tokens}")


# Starting points for `preset:`. Turn limits are CUDA Agent's (150 in training, 200 in evaluation);
# 128K tokens of context.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "train": dict(max_turns=150, max_context_tokens=131072, max_response_tokens=8192, observation_chars=16000,
                  bash={"timeout_s": 120.0}),
    "eval": dict(max_turns=200, max_context_tokens=131072, max_response_tokens=8192, observation_chars=16000,
                 state="best", bash={"timeout_s": 120.0}),
}


def agent_config(data: dict[str, Any] | None = None, **overrides: Any) -> AgentConfig:
    """A validated config from a mapping (optionally with `preset:`), then keyword overrides."""
    data = dict(data or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    preset = data.get("preset", "tiny")
    if preset not in PRESETS:
        raise ConfigError(f"config agent.preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    merged = {**PRESETS[preset], **data, "preset": preset}
    if isinstance(data.get("bash"), dict):
        merged["bash"] = {**PRESETS[preset].get("bash", {}), **data["bash"]}
    cfg = build_config(AgentConfig, merged, "agent.")
    cfg.validate()
    return cfg


def load_agent_config(path: str | os.PathLike | None = None, **overrides: Any) -> AgentConfig:
    """A validated config from a YAML file (or the defaults), then keyword overrides (None: unset)."""
    return agent_config(read_yaml_mapping(path) if path is not None else {}, **overrides)


def agent_config_dict(cfg: AgentConfig) -> dict[str, Any]:
    """Plain data (recorded with each trajectory); `agent_config` reads it back."""
    return dataclasses.asdict(cfg)

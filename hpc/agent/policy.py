"""A policy that replays fixed replies: re-running a recorded episode, or a scripted one.

Replaying a trajectory's replies through a fresh episode re-executes every tool call and
re-evaluates the states it reaches (a recorded rollout re-scored on other hardware, or a bug
reproduced); a hand-written list of replies drives the environment end to end without a model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hpc.errors import DataFileError, read_reason


class ReplayPolicy:
    """Answers the n-th prompt with the n-th reply; running out is an error (the episode would
    otherwise continue on replies nobody wrote)."""

    def __init__(self, replies: Sequence[str]):
        self.replies = list(replies)
        self.calls = 0

    def respond(self, messages: list[dict[str, str]]) -> str:
        if self.calls >= len(self.replies):
            raise RuntimeError(f"replay policy: no reply left for turn {self.calls + 1} "
                               f"(it holds {len(self.replies)})")
        self.calls += 1
        return self.replies[self.calls - 1]

    @classmethod
    def from_file(cls, path: str | Path) -> "ReplayPolicy":
        """A JSON list of replies, or a trajectory (`Trajectory.to_dict()`) whose assistant
        messages are replayed."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise DataFileError(f"replies {path}: {read_reason(e)}") from None
        except json.JSONDecodeError as e:
            raise DataFileError(f"replies {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            data = [m.get("content") for m in data["messages"] if isinstance(m, dict) and m.get("role") == "assistant"]
        if not isinstance(data, list) or not all(isinstance(r, str) for r in data):
            raise DataFileError(f"replies {path}: expected a JSON list of strings or a trajectory with messages")
        return cls(data)

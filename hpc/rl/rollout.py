"""Rollouts: the policy plays agent episodes, in batches, and each becomes a training sample.

All episodes of a step advance together: every live episode's conversation is a prompt of one
batched `generate` call, then the replies' tool calls run (in threads: compile / verify /
profile wait on the evaluator), then the next turn. A sample's tokens are built by appending,
turn after turn, the chat template's tokens of each new message and the tokens the policy
actually sampled (never re-encoded), so the PPO ratio is taken on exactly what was generated.
Ended episodes are scored (`Episode.finish`) in threads as well.

Under tensor parallelism the ranks of a TP group sample the same tokens (`generate` broadcasts
them from the group's source rank), so they play the same episodes: the source rank alone runs
the tools and scores, and the others take its new messages and trajectories (`_ToolRank`). Each
episode is scored once, and every rank's next prompt, the next collective forward's input, is
the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hpc.agent.episode import Episode, Trajectory
from hpc.policy.chat import ChatFormat
from hpc.policy.config import PolicyModelConfig
from hpc.policy.generate import SamplingParams, generate


@dataclass
class Sample:
    """One episode as a token sequence with its outcome."""

    task_id: str
    group: int                       # samples of the same task in the same step share a group
    tokens: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    trajectory: Trajectory | None = None
    replies: int = 0
    clipped_replies: int = 0         # replies cut at the token limit

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        self.tokens += list(ids)
        self.generated += [logprobs is not None] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def trim(self) -> None:
        """Drop what follows the last generated token (the final tool results teach nothing)."""
        last = max((i for i, g in enumerate(self.generated) if g), default=-1)
        del self.tokens[last + 1:], self.generated[last + 1:], self.logprobs[last + 1:]

    @property
    def generated_tokens(self) -> int:
        return sum(self.generated)


@dataclass
class RolloutStats:
    generation_s: float = 0.0
    tools_s: float = 0.0
    generated_tokens: int = 0
    turns: int = 0


@dataclass
class _ToolRank:
    """This process's place in its TP group for the tool side of a rollout (see the module docstring)."""

    group: Any
    src: int
    runs_tools: bool

    @classmethod
    def of_this_process(cls) -> _ToolRank | None:
        """None unless megatron is set up with a TP size above 1."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
            return None
        return cls(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank(),
                   ps.get_tensor_model_parallel_rank() == 0)

    def share(self, obj: Any) -> Any:
        """The source rank's `obj` on every rank of the group."""
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def _add_messages(sample: Sample, fmt: ChatFormat, messages: Sequence[dict[str, str]]) -> None:
    for m in messages:
        sample.extend(fmt.message(m["role"], m["content"]))


def rollout(model: torch.nn.Module, model_cfg: PolicyModelConfig, fmt: ChatFormat,
            episodes: Sequence[Episode], groups: Sequence[int], params: SamplingParams,
            concurrency: int = 2, on_turn: Callable[[int], None] | None = None) -> tuple[list[Sample], RolloutStats]:
    """Play `episodes` to their end with `model`; samples in the order of `episodes`.

    `params.max_new_tokens` caps each reply (further capped so prompt + reply fit the model's
    context); `params.seed`, when set, is advanced per turn so a run is reproducible.
    """
    import time

    stats = RolloutStats()
    tp = _ToolRank.of_this_process()
    runs_tools = tp is None or tp.runs_tools
    samples = []
    for episode, group in zip(episodes, groups):
        sample = Sample(episode.task.task_id, group)
        sample.extend(fmt.begin())
        _add_messages(sample, fmt, episode.messages)
        sample.extend(fmt.header("assistant"))
        samples.append(sample)
    turn = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        while True:
            live = [i for i, e in enumerate(episodes) if not e.done]
            room = model_cfg.max_seq_len - max((len(samples[i].tokens) for i in live), default=0)
            for i in [i for i in live if len(samples[i].tokens) >= model_cfg.max_seq_len]:
                episodes[i].end_reason = "context"
            live = [i for i in live if not episodes[i].done]
            if not live:
                break
            turn += 1
            step_params = SamplingParams(
                max_new_tokens=max(1, min(params.max_new_tokens, room)), temperature=params.temperature,
                top_p=params.top_p, stop=list(params.stop), stop_token_ids=[fmt.stop_id],
                seed=None if params.seed is None else params.seed + 7919 * turn)
            t0 = time.monotonic()
            outs = generate(model, model_cfg, fmt.tokenizer, [samples[i].tokens for i in live], step_params)
            stats.generation_s += time.monotonic() - t0
            for i, out in zip(live, outs):
                s = samples[i]
                s.extend(out.tokens, out.logprobs)
                s.replies += 1
                stats.generated_tokens += len(out.tokens)
                if out.finish_reason == "length":
                    s.clipped_replies += 1
                    s.extend([fmt.stop_id])
                s.extend(fmt.after_reply())
            t0 = time.monotonic()
            before = {i: len(episodes[i].messages) for i in live}
            if runs_tools:
                list(pool.map(lambda pair: episodes[pair[0]].step(pair[1].text), zip(live, outs)))
            if tp is not None:
                news = tp.share([(episodes[i].messages[before[i]:], episodes[i].end_reason) for i in live]
                                if runs_tools else None)
                if not runs_tools:
                    for i, (messages, end_reason) in zip(live, news):
                        episodes[i].messages.extend(messages)
                        episodes[i].end_reason = end_reason
            stats.tools_s += time.monotonic() - t0
            for i in live:
                # step() appended the reply itself (already in the sample as sampled tokens), then results.
                _add_messages(samples[i], fmt, episodes[i].messages[before[i] + 1:])
                if not episodes[i].done:
                    samples[i].extend(fmt.header("assistant"))
            if on_turn is not None:
                on_turn(turn)
        t0 = time.monotonic()
        trajectories = list(pool.map(lambda e: e.finish(), episodes)) if runs_tools else None
        if tp is not None:
            trajectories = tp.share(trajectories)
        stats.tools_s += time.monotonic() - t0
    stats.turns = turn
    for s, t in zip(samples, trajectories):
        s.trajectory, s.reward = t, t.reward
        s.trim()
    return samples, stats

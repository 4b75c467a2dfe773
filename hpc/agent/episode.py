"""One agent episode: the multi-turn loop between a policy and the workdir's tools, its limits,
and the reward of the chosen final state.

Any policy drives it. `Episode.run(policy)` asks `policy.respond(messages)` (`ask`) until the
episode ends; a trainer that batches generation over many episodes calls `step(reply)` on each
instead and `finish()` at the end. Messages are chat messages (`{"role", "content"}`): the system
message holds the instructions, the first user message the task, then replies and tool results
alternate.

The episode ends when the policy calls `finish` (or replies without a tool call, unless
configured otherwise), after `max_turns` replies, when the prompt plus room for one reply would
no longer fit `max_context_tokens`, at a loop (the same call `loop_repeats` times in a row), or
when the policy's endpoint fails (`EndpointError`, after its retries: the turns so far are kept).
The context is counted as the model counted it where the policy reports that (an endpoint's
usage: everything up to its last reply), the rest with the caller's `count_tokens`. Then the
final state is evaluated; the reward is that of the final state, or of the best state (the
correct one fastest against torch.compile among those profiled and the final one), as configured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from hpc.agent.backend import EvalBackend
from hpc.agent.config import AgentConfig, agent_config_dict
from hpc.agent.instructions import render_instructions, task_prompt
from hpc.agent.openai_client import EndpointError
from hpc.agent.toolcall import CallError, ToolCall, parse_tool_calls, render_result, truncate
from hpc.agent.tools import SINGLE_TURN_TOOLS, TOOLS, Toolbox
from hpc.agent.workdir import EpisodeWorkdir
from hpc.results.record import EvalRecord
from hpc.task import Task

Message = dict[str, str]
MESSAGE_OVERHEAD_TOKENS = 4   # role and separators a chat template adds around each message

_CALL_HINT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'

END_REASONS = ("finished", "no_tool_call", "max_turns", "context", "loop", "single_turn", "endpoint_error",
               "stopped")


class Policy(Protocol):
    """Anything that answers a conversation: a model server client, a local model, a replay. One
    that knows how its model counted the conversation (`OpenAIChatPolicy`: the endpoint's usage)
    also has `last_usage`: (prompt_tokens, completion_tokens) of its last reply, or None."""

    def respond(self, messages: list[Message]) -> str: ...


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate (about 4 bytes per token for code and English); pass the
    model's own `lambda s: len(tokenizer.encode(s))` wherever the limit must be exact."""
    return (len(text.encode("utf-8")) + 3) // 4


@dataclass
class ToolEvent:
    """One tool call of a reply and what came back."""

    name: str
    arguments: dict[str, Any]
    ok: bool
    observation: str
    error: str = ""          # malformed | unknown_tool | bad_arguments | not_run ("" for a call that ran)
    seconds: float = 0.0
    state: str = ""          # the evaluated state (compile, verify, profile)
    reward: float | None = None   # profile
    restored: list[str] = field(default_factory=list)   # protected files the call changed (reverted)


@dataclass
class Turn:
    index: int               # 1-based
    response: str
    prompt_tokens: int       # the conversation the reply answered
    events: list[ToolEvent] = field(default_factory=list)
    loop: bool = False


@dataclass
class Evaluation:
    """A full evaluation of one state (a profile call, or the final state at the end)."""

    turn: int                # 0: the final state, evaluated after the last turn
    state: str
    correct: bool
    speedup_eager: float
    speedup_compile: float
    reward: float


@dataclass
class Trajectory:
    task_id: str
    mode: str
    messages: list[Message]
    turns: list[Turn]
    end_reason: str
    malformed_calls: int      # not JSON, not an object, no name, unclosed block
    unknown_tool_calls: int
    bad_argument_calls: int
    loop_detected: bool
    state_selection: str      # final | best
    final_state: str          # sha256 of the final workdir state ("" when it was no candidate)
    selected_state: str       # the state whose record pays the reward
    final_reward: float       # the final state's reward (== reward under `final`)
    reward: float
    record: dict[str, Any]    # the selected state's EvalRecord
    evaluations: list[Evaluation]
    seconds: float
    config: dict[str, Any]
    end_detail: str = ""      # endpoint_error: the endpoint's message

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN and infinities become None."""
        return _jsonable(dataclasses.asdict(self))

    def eval_record(self) -> EvalRecord:
        """The rewarded state's record, for the results HDF5 and the analysis tools."""
        return EvalRecord(**self.record)


class Episode:
    """One task, one workdir under `root`, one backend; see the module docstring."""

    def __init__(self, task: Task, backend: EvalBackend, cfg: AgentConfig, root: str | Path,
                 count_tokens: Callable[[str], int] = approx_tokens, system_in_context: bool = True):
        self.task, self.backend, self.cfg = task, backend, cfg
        self.count_tokens = count_tokens
        self.system_in_context = system_in_context   # False: the policy's prompt leaves the instructions out
        self.t0 = time.monotonic()
        instructions = render_instructions(backend.config, cfg)
        self.workdir = EpisodeWorkdir(Path(root), task, instructions)
        self.toolbox = Toolbox(self.workdir, task, backend, cfg)
        self.messages: list[Message] = []
        self._tokens: list[int] = []
        self.turns: list[Turn] = []
        self.end_reason = ""
        self.end_detail = ""
        self._reported = (0, 0)   # (messages, tokens): the first messages as long as the model counted them
        self.loop_detected = False
        self._last_key, self._repeats = "", 0
        self._profiles: list[tuple[int, str, EvalRecord]] = []
        self._trajectory: Trajectory | None = None
        self._append("system", instructions)
        self._append("user", task_prompt(task, backend.config, cfg))
        self._check_limits()

    # -- the loop ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return bool(self.end_reason)

    def context_tokens(self) -> int:
        """The conversation's length: as the model counted it up to its last reply where the
        policy reported that, the messages after it with `count_tokens`."""
        messages, tokens = self._reported
        return tokens + sum(self._tokens[messages:])

    def run(self, policy: Policy) -> Trajectory:
        """Ask `policy` until the episode ends, then evaluate; returns the trajectory."""
        while not self.done:
            self.ask(policy)
        return self.finish()

    def ask(self, policy: Policy) -> None:
        """One turn: `policy`'s reply to the conversation, stepped with the usage it reports. An
        endpoint that fails (after the client's retries) ends the episode as `endpoint_error`, its
        message in `end_detail`; the turns so far stay, and `finish()` evaluates their state."""
        try:
            reply = policy.respond([dict(m) for m in self.messages])
        except EndpointError as e:
            self.end_reason, self.end_detail = "endpoint_error", str(e)
            return
        self.step(reply, getattr(policy, "last_usage", None))

    def step(self, response: str, usage: tuple[int, int] | None = None) -> list[Message]:
        """Take one reply: run its tool calls, append the reply and the results; returns the
        conversation (the next prompt unless `done`). `usage`: (prompt_tokens, completion_tokens)
        as the model counted the prompt and this reply, which then replace the estimate."""
        if self.done:
            raise RuntimeError(f"the episode has ended ({self.end_reason})")
        turn = Turn(len(self.turns) + 1, response, usage[0] if usage else self.context_tokens())
        self.turns.append(turn)
        self._append("assistant", response)
        if usage:
            self._reported = (len(self.messages), sum(usage))
        calls = parse_tool_calls(response, TOOLS)
        if self.cfg.mode == "single_turn":
            for call in calls:
                allowed = isinstance(call, ToolCall) and call.name in SINGLE_TURN_TOOLS
                self._run_call(turn, call, "" if allowed else
                               f"not run: only {', '.join(SINGLE_TURN_TOOLS)} are available in single-turn mode")
            self.end_reason = "single_turn"
            return self.messages
        if not calls:
            if self.cfg.end_without_tool_call:
                self.end_reason = "no_tool_call"
                return self.messages
            results = [f"No tool call found in your reply. Call a tool with {_CALL_HINT}; call finish to end "
                       f"the episode."]
        else:
            results = [self._run_call(turn, call, self._skip_reason(k)) for k, call in enumerate(calls)]
        if not self.done:
            self._append(self.cfg.observation_role, "\n".join(results))
            self._check_limits()
        return self.messages

    def finish(self) -> Trajectory:
        """Evaluate the final state, choose the rewarded one, and return the trajectory."""
        if self._trajectory is not None:
            return self._trajectory
        self.end_reason = self.end_reason or "stopped"
        final_state, final = self.toolbox.evaluate("profile")
        candidates = [(turn, state, rec) for turn, state, rec in self._profiles] + [(0, final_state, final)]
        chosen_state, chosen = final_state, final
        if self.cfg.state == "best":
            correct = [(state, rec) for _, state, rec in candidates
                       if rec.correct and rec.status == "ok" and math.isfinite(rec.speedup_compile)]
            if correct:
                chosen_state, chosen = max(correct, key=lambda c: c[1].speedup_compile)
            if self.cfg.rescore_best and chosen_state:
                chosen = self.backend.evaluate(self.task, self.toolbox.paths[chosen_state], "profile")
        evaluations = [Evaluation(turn, state, rec.correct, rec.speedup_eager, rec.speedup_compile, rec.reward)
                       for turn, state, rec in candidates]
        self._trajectory = Trajectory(
            task_id=self.task.task_id, mode=self.cfg.mode, messages=[dict(m) for m in self.messages],
            turns=self.turns, end_reason=self.end_reason,
            malformed_calls=self._count_errors("malformed"), unknown_tool_calls=self._count_errors("unknown_tool"),
            bad_argument_calls=self._count_errors("bad_arguments"), loop_detected=self.loop_detected,
            state_selection=self.cfg.state, final_state=final_state, selected_state=chosen_state,
            final_reward=final.reward, reward=chosen.reward, record=dataclasses.asdict(chosen),
            evaluations=evaluations, seconds=time.monotonic() - self.t0, config=agent_config_dict(self.cfg),
            end_detail=self.end_detail)
        return self._trajectory

    def close(self) -> None:
        """Remove the episode's folder (the trajectory keeps the selected state's sources)."""
        self.workdir.cleanup()

    def __enter__(self) -> "Episode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _skip_reason(self, k: int) -> str:
        if self.done:
            return f"not run: the episode ended ({self.end_reason})"
        if k >= self.cfg.max_calls_per_turn:
            return f"not run: at most {self.cfg.max_calls_per_turn} tool calls per reply"
        return ""

    def _run_call(self, turn: Turn, call: ToolCall | CallError, skip: str) -> str:
        """Run (or refuse) one call, record it, and return its rendered result."""
        name = call.name or "?"
        arguments = call.arguments if isinstance(call, ToolCall) else {}
        if skip:
            event = ToolEvent(name, arguments, False, skip, "not_run")
        else:
            looping = self._note_repeat(turn, call.key())
            if looping and self.cfg.stop_on_loop:
                self.end_reason = "loop"
                event = ToolEvent(name, arguments, False, f"not run: the same call {self._repeats} times in a row "
                                                          f"(a loop); the episode ends", "not_run")
            elif isinstance(call, CallError):
                event = ToolEvent(name, {}, False, call.message, call.kind)
            else:
                event = self._execute(turn, call)
            if looping and not self.done:
                event.observation += (f"\nnote: you made this same call {self._repeats} times in a row; change "
                                      f"something or finish.")
        event.observation = truncate(event.observation, self.cfg.observation_chars)   # what the policy sees
        turn.events.append(event)
        return render_result(event.name, event.observation, event.ok, self.cfg.observation_chars)

    def _execute(self, turn: Turn, call: ToolCall) -> ToolEvent:
        t0 = time.monotonic()
        outcome = self.toolbox.run(call)
        profiled = call.name == "profile" and outcome.record is not None
        event = ToolEvent(call.name, call.arguments, outcome.ok, outcome.text, "", time.monotonic() - t0,
                          outcome.state, outcome.record.reward if profiled else None, outcome.restored)
        if profiled and outcome.state and outcome.record.status != "error" and all(
                state != outcome.state for _, state, _ in self._profiles):   # a state's first profile only
            self._profiles.append((turn.index, outcome.state, outcome.record))
        if call.name == "finish":
            self.end_reason = "finished"
        return event

    def _note_repeat(self, turn: Turn, key: str) -> bool:
        """Count identical consecutive calls across replies; True when they make a loop."""
        self._repeats = self._repeats + 1 if key == self._last_key else 1
        self._last_key = key
        looping = bool(self.cfg.loop_repeats) and self._repeats >= self.cfg.loop_repeats
        if looping:
            turn.loop = self.loop_detected = True
        return looping

    def _append(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})
        counted = role != "system" or self.system_in_context
        self._tokens.append(self.count_tokens(content) + MESSAGE_OVERHEAD_TOKENS if counted else 0)

    def _check_limits(self) -> None:
        if self.done:
            return
        if len(self.turns) >= self.cfg.max_turns:
            self.end_reason = "max_turns"
        elif self.context_tokens() + self.cfg.max_response_tokens > self.cfg.max_context_tokens:
            self.end_reason = "context"

    def _count_errors(self, kind: str) -> int:
        return sum(e.error == kind for t in self.turns for e in t.events)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value

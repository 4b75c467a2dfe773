"""OpenAI's chat-completions protocol as `hpc serve` speaks it: a request body validated into a
`ChatRequest` (or refused with a `RequestError`: an HTTP status and OpenAI's error JSON), and the
objects an answer is made of (a completion, a stream's chunks, log-prob entries).

Every request field is either honoured, accepted because it changes nothing in an answer, or
refused with a 400 that names it: none is silently ignored (`FIELDS`). A field OpenAI's API does
not have is refused as OpenAI refuses it ("Unrecognized request argument supplied: X"); so is an
unknown key of a message or of `stream_options`. A field the server does not implement is
accepted only with the value that asks for nothing (`presence_penalty: 0`, `logit_bias: {}`,
`response_format: {"type": "text"}`, ...; null everywhere), any other value is a 400 naming it.

`tools` and `functions` are refused: the policy calls tools in its reply's own text
(`<tool_call>` blocks, `hpc.agent.toolcall`) and learnt the agent's tool list from the agent's
instructions, not from schemas a client sends, so a client's tools would be neither shown to it
nor followed. So are a message carrying `tool_calls` (or a `name`, `tool_call_id`, `audio` or
`refusal`: the chat format has no place for them), a content part other than text, and a role
other than system, user, assistant and tool (tool messages are text, as the agent sends its tool
results). Sampling values must be finite numbers in OpenAI's ranges (the JSON parser reads `NaN`
and `Infinity`; they are 400s).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_SEED = 1 << 63                 # torch's generators take 64-bit seeds
LOGPROB_FLOOR = -9999.0            # what OpenAI sends for a log-prob of -inf (JSON has no infinity)


class RequestError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A validated chat-completions request."""

    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    n: int
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False    # stream_options.include_usage: a last chunk with the usage


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{key}: expected a number, got {type(value).__name__}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(400, f"{key}: must be a finite number, got {value}", key)
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(400, f"{key}: must be in {interval}, got {value}", key)
    return float(value)


def _integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{key}: expected an integer, got {type(value).__name__}", key)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(400, f"{key}: must be {bound}, got {value}", key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"{key}: expected true or false, got {type(value).__name__}", key)
    return value


def _content(value: Any, k: int) -> str:
    """A message's content: a string, or OpenAI's list of parts of which text parts are kept."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{k}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"messages[{k}].content: expected a string or a list of text parts, "
                            f"got {type(value).__name__}", "messages")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError(400, "messages: required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of messages", "messages")
    parsed = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{k}]: expected an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(400, f"messages[{k}].role: expected a non-empty string", "messages")
        if role not in ROLES:
            raise RequestError(400, f"messages[{k}].role: expected one of {', '.join(ROLES)}, got {role!r}",
                               "messages")
        _unrecognized(m, MESSAGE_FIELDS, f"messages[{k}].")
        for key in ("name", "tool_call_id", "audio", "refusal"):
            if m.get(key) is not None:
                raise RequestError(400, f"messages[{k}].{key}: not supported (the chat format has no place for it)",
                                   "messages", "unsupported_parameter")
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise RequestError(400, f"messages[{k}].{key}: tool calls are not supported (the policy writes "
                                        f"its tool calls in the content)", "messages")
        parsed.append({"role": role, "content": _content(m.get("content"), k)})
    return parsed


# OpenAI's chat-completions request fields (its API reference) by what this server does with them.
HONOURED = ("messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
            "n", "logprobs", "top_logprobs", "stream", "stream_options")
# Accepted with any value of their JSON type: they ask OpenAI to track, cache or file a request, and
# an answer of this server is the same with them or without them (it keeps no cache, stores nothing).
NO_EFFECT: dict[str, type] = {"user": str, "safety_identifier": str, "prompt_cache_key": str,
                              "prompt_cache_retention": str, "prompt_cache_options": dict, "metadata": dict}
# Not implemented: accepted only with null or a value that asks for nothing (listed), else a 400.
NOTHING: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
    "response_format": ({"type": "text"},), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "function_call": ("none",), "parallel_tool_calls": (), "modalities": (["text"],), "audio": (),
    "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": (),
    "store": (False,), "service_tier": ("auto", "default")}
FIELDS = HONOURED + tuple(NO_EFFECT) + tuple(NOTHING)
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "function_call", "tool_call_id", "refusal", "audio")
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _unrecognized(body: dict, known: tuple[str, ...], where: str = "") -> None:
    """A key OpenAI's API does not have is a 400, worded as OpenAI words it."""
    for key in body:
        if key not in known:
            raise RequestError(400, f"Unrecognized request argument supplied: {where}{key}", f"{where}{key}")


def _means_nothing(value: Any, nothing: tuple[Any, ...]) -> bool:
    """`value` is null or one of `nothing`, as JSON values (0 and 0.0 alike, false not 0)."""
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in nothing)


def _check_no_effect(body: dict) -> None:
    """The `NO_EFFECT` fields have their JSON type."""
    for key, kind in NO_EFFECT.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            name = "a string" if kind is str else "an object"
            raise RequestError(400, f"{key}: expected {name}, got {type(body[key]).__name__}", key)


def _refuse_unimplemented(body: dict) -> None:
    """A field of `NOTHING` that asks for something is a 400 that names it (tools first: see the
    module docstring)."""
    _refuse_tools(body)
    for key in ("frequency_penalty", "presence_penalty"):
        _number(body, key, 0.0, -2.0, 2.0)
    for key, nothing in NOTHING.items():
        if not _means_nothing(body.get(key), nothing):
            allowed = " or ".join(json.dumps(n) for n in nothing + (None,))
            raise RequestError(400, f"{key}: not supported by this server (got {json.dumps(body[key])[:80]}); "
                                    f"leave it out or send {allowed}", key, "unsupported_parameter")


def _refuse_tools(body: dict) -> None:
    """`tools` / `functions` (and a choice of them) are a 400, never ignored: see the module docstring."""
    for key in ("tools", "functions"):
        if body.get(key):
            raise RequestError(400, f"{key}: not supported: this policy calls tools in its reply's text "
                                    f"(<tool_call> blocks) and knows only the agent's own tools; send no {key}",
                               key, "tools_not_supported")
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none"):
            raise RequestError(400, f"{key}: not supported (no tools can be given)", key, "tools_not_supported")


def parse_request(body: Any, max_n: int) -> ChatRequest:
    """The request's fields, validated (see the module docstring)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _unrecognized(body, FIELDS)
    messages = _messages(body)
    _refuse_unimplemented(body)
    _check_no_effect(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop: expected a non-empty string or a list of them", "stop")
    n = _integer(body, "n", 1) or 1
    if n > max_n:
        raise RequestError(400, f"n: at most {max_n} samples per request, got {n}", "n")
    logprobs = _flag(body, "logprobs")
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise RequestError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise RequestError(400, "stream_options: an object, and only with stream: true", "stream_options")
    _unrecognized(options or {}, STREAM_OPTIONS, "stream_options.")
    if _flag(options or {}, "include_obfuscation"):
        raise RequestError(400, "stream_options.include_obfuscation: not supported (chunks carry no padding)",
                           "stream_options", "unsupported_parameter")
    include_usage = _flag(options or {}, "include_usage")
    return ChatRequest(messages, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                       _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), stop,
                       _integer(body, "seed", 0, MAX_SEED - 1), n, logprobs, top_logprobs or 0, stream, include_usage)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprob_entry(token: tuple[str, bytes], logprob: float,
                  top: list[tuple[tuple[str, bytes], float]]) -> dict[str, Any]:
    """One token of `choices[].logprobs.content` from (its text, its bytes), its log-prob and the
    alternatives' ((text, bytes), log-prob)."""
    def entry(tok: tuple[str, bytes], lp: float) -> dict[str, Any]:
        return {"token": tok[0], "logprob": lp if math.isfinite(lp) else LOGPROB_FLOOR, "bytes": list(tok[1])}

    return entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}


def chunk(completion_id: str, created: int, model: str, index: int, delta: dict[str, Any],
          finish_reason: str | None = None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk` of a stream, for one choice."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                         "finish_reason": finish_reason}]}

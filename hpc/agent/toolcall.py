"""The tool-call format: how a policy's reply names tools, and how results go back to it.

A reply calls a tool with a block holding one JSON object, the format Qwen-family (Hermes)
chat templates use, so such models call our tools the way they were trained to:

    <tool_call>
    {"name": "write_file", "arguments": {"path": "kernels/relu.cpp", "content": "..."}}
    </tool_call>

Several blocks in one reply run in order. Text inside <think>...</think> is reasoning and is
never parsed. Results go back as `<tool_result name="..." status="ok|error">...</tool_result>`.
A block that is not one JSON object with a known tool and exactly the tool's arguments parses to
a `CallError` whose message becomes the observation: a malformed call never ends an episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_THINK = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|(?=" + re.escape(OPEN) + r")|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```(?:json)?\s*\n?(.*?)\n?```\Z", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TYPES = {"string": str, "integer": int, "boolean": bool}


@dataclass(frozen=True)
class Param:
    name: str
    type: str                 # string | integer | boolean
    required: bool
    doc: str


@dataclass(frozen=True)
class ToolSpec:
    name: str
    doc: str
    params: tuple[Param, ...] = ()

    def usage(self) -> str:
        """One line per tool for the instructions: its arguments with types."""
        args = ", ".join(f"{p.name}: {p.type}{'' if p.required else ' (optional)'}" for p in self.params)
        return f"{self.name}({args})"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str

    def key(self) -> str:
        """Canonical form: equal keys are the same call (loop detection)."""
        return self.name + json.dumps(self.arguments, sort_keys=True)


@dataclass(frozen=True)
class CallError:
    kind: str                 # malformed | unknown_tool | bad_arguments
    message: str
    raw: str
    name: str = ""

    def key(self) -> str:
        return "error:" + self.raw.strip()


def strip_thinking(text: str) -> str:
    """The reply without its reasoning blocks (an unclosed <think> runs to the end)."""
    return _THINK.sub("", text)


def parse_tool_calls(text: str, tools: Mapping[str, ToolSpec]) -> list[ToolCall | CallError]:
    """Every tool-call block of a reply, in order, each a valid call or the error to report."""
    calls: list[ToolCall | CallError] = []
    for match in _BLOCK.finditer(strip_thinking(text)):
        raw = match.group(0)
        if match.group(2) != CLOSE:
            calls.append(CallError("malformed", f"a {OPEN} block has no closing {CLOSE}", raw))
            continue
        calls.append(_parse_block(match.group(1).strip(), raw, tools))
    return calls


def _parse_block(body: str, raw: str, tools: Mapping[str, ToolSpec]) -> ToolCall | CallError:
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj = json.loads(body, strict=False)   # strict=False: raw newlines inside strings are accepted
    except json.JSONDecodeError as e:
        return CallError("malformed", f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                         raw)
    if not isinstance(obj, dict):
        return CallError("malformed", f"the tool call must be a JSON object, got {_json_type(obj)}", raw)
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return CallError("malformed", f"unexpected key(s) {', '.join(map(repr, extra))} in the tool call "
                                      f"(expected \"name\" and \"arguments\")", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return CallError("malformed", "the tool call has no \"name\" string", raw)
    if name not in tools:
        return CallError("unknown_tool", f"unknown tool {name!r} (tools: {', '.join(tools)})", raw, name)
    args = obj.get("arguments", {})
    if isinstance(args, str):   # OpenAI-style: arguments encoded as a JSON string
        try:
            args = json.loads(args, strict=False) if args.strip() else {}
        except json.JSONDecodeError as e:
            return CallError("malformed", f"\"arguments\" is a string that is not valid JSON ({e.msg})", raw, name)
    if not isinstance(args, dict):
        return CallError("malformed", f"\"arguments\" must be a JSON object, got {_json_type(args)}", raw, name)
    problem = _check_arguments(tools[name], args)
    if problem:
        return CallError("bad_arguments", f"{name}: {problem} (usage: {tools[name].usage()})", raw, name)
    return ToolCall(name, args, raw)


def _check_arguments(spec: ToolSpec, args: dict[str, Any]) -> str:
    known = {p.name: p for p in spec.params}
    extra = sorted(set(args) - set(known))
    if extra:
        return f"unexpected argument(s) {', '.join(map(repr, extra))}"
    for p in spec.params:
        if p.name not in args:
            if p.required:
                return f"missing argument {p.name!r}"
            continue
        value, want = args[p.name], _TYPES[p.type]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            article = "an" if p.type == "integer" else "a"
            return f"argument {p.name!r} must be {article} {p.type}, got {_json_type(value)}"
    return ""


def _json_type(value: Any) -> str:
    for name, tp in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float), ("string", str),
                     ("array", list), ("object", dict)):
        if isinstance(value, tp):
            return name
    return type(value).__name__


def truncate(text: str, limit: int, hidden: int = 0) -> str:
    """`text` cut in the middle to at most about `limit` characters: the start and the end of a
    long output (a compiler's first error, a command's last lines) are what matter. `hidden`
    counts characters already left out between the two halves of `text` (an output read in part)."""
    if len(text) <= limit and not hidden:
        return text
    marker = "\n[... {} characters omitted ...]\n"
    keep = min(max(limit - len(marker) - 8, 0), len(text))
    head, tail = keep * 3 // 5, keep - keep * 3 // 5
    omitted = len(text) - head - tail + hidden
    return text[:head] + marker.format(omitted) + (text[len(text) - tail:] if tail else "")


def render_result(name: str, body: str, ok: bool, limit: int) -> str:
    """One tool result as the policy sees it, cut to `limit` characters of body."""
    status = "ok" if ok else "error"
    name = name if _NAME.fullmatch(name) else "?"
    return f'<tool_result name="{name}" status="{status}">\n{truncate(body.rstrip(), limit)}\n</tool_result>'

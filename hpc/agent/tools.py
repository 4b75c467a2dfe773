"""The agent's tools: files of the workdir, a sandboxed shell, and compile / verify / profile
served by an evaluation backend (in-process or the reward pool).

Every tool returns an observation rather than raising: a refused path, a missing file, a failed
command or a failed evaluation are things the agent reads and reacts to. compile, verify and
profile evaluate a snapshot of the workdir, and an episode remembers each (state, tool) result:
asking again about an unchanged state returns the same record, so repeating profile cannot fish
for a lucky timing that best-state selection would then pick.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hpc.agent.backend import EvalBackend, failed_record
from hpc.agent.config import AgentConfig
from hpc.agent.shell import ShellUnavailable, run_bash
from hpc.agent.toolcall import Param, ToolCall, ToolSpec
from hpc.agent.workdir import EpisodeWorkdir, PathRefused
from hpc.errors import UserError
from hpc.results.record import STOP_AFTER, EvalRecord, StopAfter
from hpc.task import Task

_PATH = Param("path", "string", True, "relative to the workdir")
TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
    ToolSpec("read_file", "Read a text file of the workdir; optionally only lines start_line..end_line "
                          "(1-based, inclusive).",
             (_PATH, Param("start_line", "integer", False, "first line"),
              Param("end_line", "integer", False, "last line"))),
    ToolSpec("write_file", "Create or overwrite a file of the workdir (folders are created).",
             (_PATH, Param("content", "string", True, "the whole new content"))),
    ToolSpec("edit_file", "Replace old_text, which must occur exactly once unless replace_all is true, "
                          "with new_text.",
             (_PATH, Param("old_text", "string", True, "exact text to replace, whitespace included"),
              Param("new_text", "string", True, "replacement"),
              Param("replace_all", "boolean", False, "replace every occurrence"))),
    ToolSpec("bash", "Run a shell command in the workdir (no network; writes only inside the workdir; "
                     "time-limited; see below).",
             (Param("command", "string", True, "passed to bash -c"),)),
    ToolSpec("compile", "Build kernels/ into the library model_new.py loads, after the static checks."),
    ToolSpec("verify", "compile, then check ModelNew against Model on fresh random inputs."),
    ToolSpec("profile", "verify, then time ModelNew against eager PyTorch and torch.compile; "
                        "returns the speedups and the reward."),
    ToolSpec("finish", "End the episode; the final state of the workdir is evaluated."),
)}
EVAL_TOOLS = STOP_AFTER   # each evaluates up to the stage it is named for
SINGLE_TURN_TOOLS = ("write_file", "edit_file")
_ORDER = {tool: k for k, tool in enumerate(EVAL_TOOLS)}
_READ_LIMIT = 16 << 20   # read_file loads a file whole; larger ones are for bash


@dataclass
class ToolOutcome:
    ok: bool
    text: str
    state: str = ""                        # sha256 of the evaluated snapshot (evaluation tools)
    record: EvalRecord | None = None
    restored: list[str] = field(default_factory=list)


class Toolbox:
    """Runs parsed tool calls against one episode's workdir and backend."""

    def __init__(self, workdir: EpisodeWorkdir, task: Task, backend: EvalBackend, cfg: AgentConfig):
        self.workdir, self.task, self.backend, self.cfg = workdir, task, backend, cfg
        self.records: dict[tuple[str, str], EvalRecord] = {}   # (state sha, tool) -> record
        self.paths: dict[str, Path] = {}                       # state sha -> its snapshot folder

    def run(self, call: ToolCall) -> ToolOutcome:
        """Run one valid call; everything that goes wrong comes back as a failed outcome."""
        if call.name not in TOOLS:
            return ToolOutcome(False, f"unknown tool {call.name!r}")
        try:
            outcome = getattr(self, "_" + call.name)(**call.arguments)
        except PathRefused as e:
            outcome = ToolOutcome(False, f"refused: {e}")
        except OSError as e:
            outcome = ToolOutcome(False, f"{call.name} failed: {e.strerror or e}")
        outcome.restored = self.workdir.check_protected()
        if outcome.restored:
            outcome.text += (f"\nnote: {', '.join(outcome.restored)} is protected; your change to it was "
                             f"reverted.")
        return outcome

    # -- files -------------------------------------------------------------------------------
    def _read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> ToolOutcome:
        target = self.workdir.resolve(path)
        if not target.exists():
            return ToolOutcome(False, f"{path}: no such file")
        if target.is_dir():
            entries = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
            return ToolOutcome(False, f"{path}: is a directory ({', '.join(entries) or 'empty'}); read a file")
        size = target.stat().st_size
        if size > _READ_LIMIT:
            return ToolOutcome(False, f"{path}: {size} bytes is too large to read whole; look at parts with bash "
                                      f"(head, tail, sed -n, grep)")
        data = target.read_bytes()
        if b"\0" in data[:8192]:
            return ToolOutcome(False, f"{path}: binary file ({len(data)} bytes)")
        text = data.decode("utf-8", "replace")
        if start_line is None and end_line is None:
            return ToolOutcome(True, text if text else f"{path}: empty file")
        lines = text.splitlines(keepends=True)
        first, last = start_line or 1, end_line or len(lines)
        if first < 1 or last < first:
            return ToolOutcome(False, f"{path}: bad line range {first}..{last} (the file has {len(lines)} lines)")
        return ToolOutcome(True, f"[{path}: lines {first}-{min(last, len(lines))} of {len(lines)}]\n"
                                 + "".join(lines[first - 1:last]))

    def _write_file(self, path: str, content: str) -> ToolOutcome:
        target = self.workdir.resolve(path, write=True)
        data = content.encode("utf-8")
        if len(data) > self.cfg.max_file_bytes:
            return ToolOutcome(False, f"{path}: {len(data)} bytes is over the limit of {self.cfg.max_file_bytes}")
        target.parent.mkdir(parents=True, exist_ok=True)
        _replace(target, data)
        return ToolOutcome(True, f"wrote {len(data)} bytes ({len(content.splitlines())} lines) to "
                                 f"{self.workdir.relative(target)}")

    def _edit_file(self, path: str, old_text: str, new_text: str, replace_all: bool = False) -> ToolOutcome:
        target = self.workdir.resolve(path, write=True)
        if not target.is_file():
            return ToolOutcome(False, f"{path}: no such file (write_file creates files)")
        if not old_text:
            return ToolOutcome(False, "old_text is empty")
        text = target.read_bytes().decode("utf-8", "replace")
        count = text.count(old_text)
        if count == 0:
            return ToolOutcome(False, f"{path}: old_text not found (it must match exactly, whitespace included)")
        if count > 1 and not replace_all:
            return ToolOutcome(False, f"{path}: old_text occurs {count} times; include more context to make it "
                                      f"unique, or set replace_all")
        data = text.replace(old_text, new_text).encode("utf-8")
        if len(data) > self.cfg.max_file_bytes:
            return ToolOutcome(False, f"{path}: the result, {len(data)} bytes, is over the limit of "
                                      f"{self.cfg.max_file_bytes}")
        _replace(target, data)
        return ToolOutcome(True, f"edited {self.workdir.relative(target)}: replaced {count} occurrence"
                                 f"{'s' if count > 1 else ''}")

    # -- shell -------------------------------------------------------------------------------
    def _bash(self, command: str) -> ToolOutcome:
        try:
            result = run_bash(command, self.workdir.work, self.workdir.scratch, self.workdir.log, self.cfg.bash,
                              self.backend.config.backend, self.cfg.observation_chars)
        except ShellUnavailable as e:
            return ToolOutcome(False, str(e))
        if result.timed_out:
            head = (f"timed out after {self.cfg.bash.timeout_s:g} s: the command and everything it started "
                    f"were killed")
        else:
            head = f"exit code {result.exit_code}"
        return ToolOutcome(result.exit_code == 0, head + ("\n" + result.output if result.output else ""))

    # -- evaluation --------------------------------------------------------------------------
    def _compile(self) -> ToolOutcome:
        return self._evaluation_tool("compile")

    def _verify(self) -> ToolOutcome:
        return self._evaluation_tool("verify")

    def _profile(self) -> ToolOutcome:
        return self._evaluation_tool("profile")

    def _finish(self) -> ToolOutcome:
        return ToolOutcome(True, "finished: the final state of the workdir will be evaluated")

    def _evaluation_tool(self, tool: StopAfter) -> ToolOutcome:
        state, rec = self.evaluate(tool)
        text = describe(tool, rec, self.backend.config.reward.margin)
        return ToolOutcome(rec.status == "ok", (f"state {state[:12]}\n" if state else "") + text, state, rec)

    def evaluate(self, tool: StopAfter) -> tuple[str, EvalRecord]:
        """The workdir's current state and its record for `tool` (compile, verify or profile).

        Known results are reused: the same (state, tool), a failure of the same state at an
        earlier tool (a state that does not compile does not profile either), or a success at a
        later one (a profiled state compiled and verified)."""
        self.workdir.check_protected()
        try:
            snap = self.workdir.snapshot()
        except UserError as e:
            return "", failed_record(self.task, self.backend.config, str(e))
        except OSError as e:   # e.g. a command made kernels/ unreadable
            return "", failed_record(self.task, self.backend.config, f"cannot read the workdir: {e}")
        self.paths[snap.sha256] = snap.path
        for earlier, order in _ORDER.items():
            known = self.records.get((snap.sha256, earlier))
            if known and (earlier == tool or (order < _ORDER[tool] and known.status == "failed")
                          or (order > _ORDER[tool] and known.status == "ok")):
                return snap.sha256, known
        rec = self.backend.evaluate(self.task, snap.path, tool)
        if rec.status != "error":   # a harness fault is worth asking again
            self.records[(snap.sha256, tool)] = rec
        return snap.sha256, rec


def _replace(target: Path, data: bytes) -> None:
    """Write through a new file and a rename: a hard link made by a command to another file
    (a protected one) is replaced, never written through."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".write-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def describe(tool: StopAfter, rec: EvalRecord, margin: float) -> str:
    """An evaluation record as the agent reads it: what passed, what failed and why, the numbers."""
    if rec.status == "error":
        return f"the evaluator failed at {rec.failed_stage} (not caused by your code; try again): {rec.reason}"
    if rec.failed_stage:
        where = {"static": "rejected before compiling", "compile": "compile failed", "load": "loading failed",
                 "verify": "wrong output", "profile": "timing rejected"}.get(rec.failed_stage,
                                                                         f"{rec.failed_stage} failed")
        text = f"{where}: {rec.reason}"
        if rec.failed_stage == "compile" and rec.compile_log.strip():
            text += "\ncompiler output:\n" + rec.compile_log.strip()
        return text + (f"\nreward {rec.reward:g}" if tool == "profile" else "")
    if tool == "compile":
        return f"compiled ({'cached' if rec.compile_cached else f'{rec.compile_seconds:.1f} s'})"
    checked = f"correct: {rec.trials} trials on fresh inputs match the reference"
    if math.isfinite(rec.max_abs_error):
        checked += f" (max abs error {rec.max_abs_error:.3g}, max rel error {rec.max_rel_error:.3g})"
    if tool == "verify":
        return checked
    lines = [checked, f"timed at scale {rec.scale} on {rec.hardware or rec.backend} (median of the timed calls):",
             f"  yours          {rec.candidate_ms:.4g} ms (cv {100 * rec.candidate_cv:.1f}%)",
             f"  eager PyTorch  {rec.eager_ms:.4g} ms   speedup {rec.speedup_eager:.3g}x",
             f"  torch.compile  {rec.compile_ms:.4g} ms   speedup {rec.speedup_compile:.3g}x",
             f"reward {rec.reward:g}"]
    if rec.reward_kind == "discrete":
        lines[-1] += (f" (-1 wrong, 1 correct, 2 faster than eager by >{100 * margin:g}%, 3 faster than both "
                      f"eager and torch.compile by >{100 * margin:g}%)")
    return "\n".join(lines)

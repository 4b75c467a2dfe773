"""Tasks: KernelBench problem files (`Model`, `get_inputs`, `get_init_inputs`), at a chosen scale.

The harness process only reads a task's source (to validate and hash it); the task is executed
in the sandboxed reference and candidate processes through `load_task_module`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpc.errors import TaskError, read_input, shown, utf8_name
from hpc.parsing import parse

REQUIRED = ("Model", "get_inputs", "get_init_inputs")
SCALES = ("cpu", "gpu")
MAX_BYTES = 4 << 20          # a problem file is source code: KernelBench's are a few KiB


@dataclass(frozen=True)
class Task:
    path: Path
    task_id: str            # level<N>/<stem>
    level: int
    sha256: str
    declared_scales: tuple[str, ...]   # scales with explicit overrides in SCALES

    @property
    def name(self) -> str:
        return self.path.stem


def load_task(path: str | Path) -> Task:
    """Validate a problem file by its syntax tree and describe it; raises TaskError if malformed."""
    path = Path(path)
    what = f"task {shown(path)}"
    source = read_input(path, MAX_BYTES, what, TaskError)
    if path.suffix != ".py":
        raise TaskError(f"{what}: expected a .py problem file")
    if not utf8_name(path.name):
        raise TaskError(f"{what}: file name is not valid UTF-8 (the task id is stored as text)")
    try:
        tree = parse(source, filename=shown(path))
    except (SyntaxError, ValueError) as e:   # ValueError: NUL bytes, on some Python versions
        line = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise TaskError(f"{what}: syntax error{line}: {getattr(e, 'msg', e)}") from None
    except (RecursionError, MemoryError):
        raise TaskError(f"{what}: cannot be parsed (nested too deeply)") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = [name for name in REQUIRED if name not in defined]
    if missing:
        raise TaskError(f"{what}: not a KernelBench problem file (missing {', '.join(missing)})")
    declared = _declared_scales(tree, path)
    task_id, level = task_identity(path)
    return Task(Path(os.path.realpath(path)), task_id, level, hashlib.sha256(source).hexdigest(), declared)


def task_identity(path: Path) -> tuple[str, int]:
    """A problem file's task id (`level<N>/<stem>` inside a level folder, else `<stem>`) and level."""
    match = re.fullmatch(r"level(\d+)", path.parent.name)
    if match:
        return f"{path.parent.name}/{shown(path.stem)}", int(match.group(1))
    return shown(path.stem), 0


def _declared_scales(tree: ast.Module, path: Path) -> tuple[str, ...]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SCALES" for t in node.targets):
            value = node.value
            if not (isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                        and isinstance(v, ast.Dict)
                                                        for k, v in zip(value.keys, value.values))):
                raise TaskError(f"task {shown(path)}: SCALES must be a dict literal mapping scale name to a dict "
                                "of overrides")
            names = {k.value for k in value.keys}
            unknown = names - set(SCALES)
            if unknown:
                raise TaskError(f"task {shown(path)}: SCALES has unknown scale(s) {', '.join(sorted(unknown))}")
            return tuple(sorted(names))
    return ()


def load_task_module(path: str | Path, scale: str, module_name: str = "hpc_task") -> types.ModuleType:
    """Execute the problem file and apply its SCALES overrides for `scale` (in a sandboxed child)."""
    spec = importlib.util.spec_from_file_location(module_name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    overrides = getattr(module, "SCALES", {}).get(scale, {})
    for name, value in overrides.items():
        if not hasattr(module, name):
            raise ValueError(f"SCALES[{scale!r}] overrides {name!r}, which the task does not define")
        setattr(module, name, value)
    return module


@dataclass(frozen=True)
class BadTask:
    """A problem file of a suite that failed validation (or repeats a task id): the suite records
    it as an error with this reason and goes on with the other tasks."""
    path: Path
    task_id: str
    level: int
    reason: str


def discover_suite(root: str | Path) -> list[Task | BadTask]:
    """Every problem file under a folder (a suite; one file is a suite of one), in a stable order,
    each loaded or, when malformed, a BadTask. Candidates are matched by task id, so a task id met
    a second time is a BadTask too. TaskError only when `root` holds no problem files at all."""
    root = Path(root)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*.py") if not p.name.startswith("_"))
        if not files:
            raise TaskError(f"tasks {shown(root)}: no problem files (*.py) found")
    elif os.path.lexists(root):
        raise TaskError(f"tasks {shown(root)}: not a regular file or folder (a FIFO, a device, a link loop?)")
    else:
        raise TaskError(f"tasks {shown(root)}: no such file or folder")
    suite: list[Task | BadTask] = []
    first: dict[str, Path] = {}
    for path in files:
        try:
            item: Task | BadTask = load_task(path)
        except TaskError as e:
            item = BadTask(path, *task_identity(path), str(e))
        if item.task_id in first:
            item = BadTask(path, item.task_id, item.level,
                           f"task {shown(path)}: task id {item.task_id} is also {shown(first[item.task_id])}")
        first.setdefault(item.task_id, path)
        suite.append(item)
    return suite


def discover_tasks(root: str | Path) -> list[Task]:
    """The tasks of a suite (`discover_suite`); TaskError at the first malformed one."""
    suite = discover_suite(root)
    for item in suite:
        if isinstance(item, BadTask):
            raise TaskError(item.reason)
    return suite


TaskLike = TypeVar("TaskLike", bound="Task | BadTask")


def select_tasks(tasks: Sequence[TaskLike], only: Sequence[str] | None, where: str | os.PathLike) -> list[TaskLike]:
    """The tasks whose id contains one of `only` (all when it is empty): what --only and a config's
    `only:` mean everywhere. TaskError when none is left, naming `where` the tasks came from."""
    chosen = [t for t in tasks if not only or any(s in t.task_id for s in only)]
    if not chosen:
        raise TaskError(f"tasks {shown(where)}: no task id contains {' or '.join(only)}" if only
                        else f"tasks {shown(where)}: no tasks")
    return chosen

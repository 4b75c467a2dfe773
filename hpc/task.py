"""Tasks: KernelBench problem files (`Model`, `get_inputs`, `get_init_inputs`), at a chosen scale.

The harness process only reads a task's source (to validate and hash it); the task is executed
in the sandboxed reference and candidate processes through `load_task_module`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import UserError

REQUIRED = ("Model", "get_inputs", "get_init_inputs")
SCALES = ("cpu", "gpu")


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
    """Validate a problem file by its syntax tree and describe it; raises UserError if malformed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"task {path}: no such file")
    if path.suffix != ".py":
        raise UserError(f"task {path}: expected a .py problem file")
    source = path.read_bytes()
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise UserError(f"task {path}: syntax error at line {e.lineno}: {e.msg}") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = [name for name in REQUIRED if name not in defined]
    if missing:
        raise UserError(f"task {path}: not a KernelBench problem file (missing {', '.join(missing)})")
    declared = _declared_scales(tree, path)
    match = re.fullmatch(r"level(\d+)", path.parent.name)
    level = int(match.group(1)) if match else 0
    task_id = f"{path.parent.name}/{path.stem}" if match else path.stem
    return Task(path.resolve(), task_id, level, hashlib.sha256(source).hexdigest(), declared)


def _declared_scales(tree: ast.Module, path: Path) -> tuple[str, ...]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SCALES" for t in node.targets):
            value = node.value
            if not (isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                        and isinstance(v, ast.Dict)
                                                        for k, v in zip(value.keys, value.values))):
                raise UserError(f"task {path}: SCALES must be a dict literal mapping scale name to a dict of overrides")
            names = {k.value for k in value.keys}
            unknown = names - set(SCALES)
            if unknown:
                raise UserError(f"task {path}: SCALES has unknown scale(s) {', '.join(sorted(unknown))}")
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


def discover_tasks(root: str | Path) -> list[Task]:
    """Every problem file under a folder (a suite), in a stable order; one file is a suite of one."""
    root = Path(root)
    if root.is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise UserError(f"tasks {root}: no such file or folder")
    files = sorted(p for p in root.rglob("*.py") if not p.name.startswith("_"))
    if not files:
        raise UserError(f"tasks {root}: no problem files (*.py) found")
    return [load_task(p) for p in files]

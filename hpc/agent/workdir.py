"""The episode's folders: the agent's workdir, its scratch space and the evaluated snapshots.

    ROOT/work/            the agent's workdir (cwd of bash, root of every file tool path)
        model.py          the task's source            (protected)
        INSTRUCTIONS.md   workflow, rules, reward      (protected)
        model_new.py      starter: ModelNew with Model's constructor, forward left to write
        kernels/          empty: the agent's kernel sources
    ROOT/scratch/         bash's TMPDIR and caches (writable by bash, never evaluated)
    ROOT/snapshots/<sha>/ immutable copies of evaluated states (model_new.py + kernels/)
    ROOT/bash.log         the running command's output

Protected files are read-only, file tools refuse to write them, and after every command they are
checked and restored (a command may chmod or delete them: they sit in a folder it may write).
They only inform the agent: the evaluator always uses the task's own file, and evaluates a
snapshot taken outside the agent's reach, so nothing in the workdir can alter what is judged.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import stat
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from hpc.candidate import MODEL_FILE, Candidate, load_candidate
from hpc.parsing import parse
from hpc.task import Task
from hpc.verify.static import import_defect

TASK_FILE = "model.py"
INSTRUCTIONS_FILE = "INSTRUCTIONS.md"
PROTECTED = (TASK_FILE, INSTRUCTIONS_FILE)


class PathRefused(Exception):
    """A file tool's path is outside the workdir or names a protected file; the message says which."""


@dataclass(frozen=True)
class Snapshot:
    """One evaluated state of the workdir: what the backends read (immutable once written)."""

    sha256: str
    path: Path
    files: tuple[str, ...]


class EpisodeWorkdir:
    """Creates the layout above for one task and guards it for the episode's length."""

    def __init__(self, root: Path, task: Task, instructions: str):
        self.root = Path(root)
        self.work = self.root / "work"
        self.scratch = self.root / "scratch"
        self.snapshots = self.root / "snapshots"
        self.log = self.root / "bash.log"
        self.task = task
        self._protected = {TASK_FILE: task.path.read_bytes(), INSTRUCTIONS_FILE: instructions.encode()}
        if self.work.exists():
            raise FileExistsError(f"{self.root}: already holds an episode; every episode needs its own folder")
        for d in (self.work / "kernels", self.scratch, self.snapshots):
            d.mkdir(parents=True, exist_ok=True)
        (self.work / MODEL_FILE).write_text(starter_model_new(self._protected[TASK_FILE].decode("utf-8", "replace"),
                                                              task.task_id))
        self.check_protected()

    # -- paths -------------------------------------------------------------------------------
    def resolve(self, path: str, write: bool = False) -> Path:
        """The absolute path a tool argument names; PathRefused when it leaves the workdir
        (absolute, `..`, or through a link pointing out) or, for writes, names a protected file."""
        if not path or "\0" in path:
            raise PathRefused("empty or invalid path")
        rel = Path(path)
        if rel.is_absolute() or path.startswith("~"):
            raise PathRefused(f"{path}: absolute paths are not allowed; use a path relative to the workdir")
        if ".." in rel.parts:
            raise PathRefused(f"{path}: '..' is not allowed; paths stay inside the workdir")
        root = self.work.resolve()
        target = (root / rel).resolve()
        if target != root and not target.is_relative_to(root):
            raise PathRefused(f"{path}: resolves outside the workdir (through a symbolic link)")
        if write:
            if target.is_dir():
                raise PathRefused(f"{path}: is a directory")
            if target.relative_to(root).as_posix() in PROTECTED:
                raise PathRefused(f"{path}: {target.name} is protected (read-only); write model_new.py and "
                                  f"kernels/ instead")
        return target

    def relative(self, target: Path) -> str:
        return target.relative_to(self.work.resolve()).as_posix()

    # -- protection --------------------------------------------------------------------------
    def check_protected(self) -> list[str]:
        """Restore protected files that were changed, removed, replaced or made writable; returns
        the names restored (the agent is told)."""
        self.work.chmod(0o755)   # a command may chmod the workdir itself (not remove it: its parent is closed)
        restored = []
        for name, data in self._protected.items():
            p = self.work / name
            if _intact(p, data):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()
            p.write_bytes(data)
            p.chmod(0o444)
            restored.append(name)
        return restored

    # -- states ------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Freeze the workdir's candidate (model_new.py + kernels/) into snapshots/<sha>/.

        Raises hpc.errors.UserError when it is no candidate (no model_new.py, too large): the
        message is the observation."""
        candidate = load_candidate(self.work)
        dest = self.snapshots / candidate.sha256[:24]
        if not dest.is_dir():
            _materialize_atomically(candidate, dest)
        return Snapshot(candidate.sha256, dest, tuple(sorted(candidate.files)))

    def cleanup(self) -> None:
        """Remove the whole episode folder, also what a command made unwritable (chmod)."""
        folders = [self.root]
        while folders:
            folder = folders.pop()
            try:
                folder.chmod(0o700)
                folders += [Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
        shutil.rmtree(self.root, ignore_errors=True)


def _intact(p: Path, data: bytes) -> bool:
    try:
        st = p.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o222 or st.st_size != len(data):
        return False
    try:
        return hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256(data).digest()
    except OSError:
        return False


def _materialize_atomically(candidate: Candidate, dest: Path) -> None:
    """Write into a fresh folder, then rename: a reader (a pool worker) never sees half a state."""
    tmp = Path(tempfile.mkdtemp(prefix=".snap-", dir=dest.parent))
    candidate.materialize(tmp)
    try:
        tmp.rename(dest)
    except OSError:   # the same state was written meanwhile: identical content
        shutil.rmtree(tmp, ignore_errors=True)


def starter_model_new(task_source: str, task_id: str = "") -> str:
    """model_new.py to start from: Model's imports (those the policy allows), its helper classes
    and constructor, so the parameters carry Model's names (the reference weights load into
    them); forward is left to write. Falls back to a bare skeleton for an unusual task file."""
    try:
        tree = parse(task_source)
    except SyntaxError:
        tree = ast.Module(body=[], type_ignores=[])
    imports = ["import torch", "import torch.nn as nn"]
    helpers, init, forward_args = [], None, "self, x"
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom) and _allowed_import(node):
            line = ast.unparse(node)
            if line not in imports:
                imports.append(line)
        elif isinstance(node, ast.ClassDef) and node.name == "Model":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    init = ast.unparse(item)
                elif isinstance(item, ast.FunctionDef) and item.name == "forward":
                    forward_args = ast.unparse(item.args)
        elif isinstance(node, ast.ClassDef):
            helpers.append(ast.unparse(node))
    init = init or "def __init__(self):\n    super().__init__()"
    title = f"ModelNew for {task_id}" if task_id else "ModelNew"
    cls = ("class ModelNew(nn.Module):\n" + textwrap.indent(init, "    ") + "\n\n"
           f"    def forward({forward_args}):\n"
           "        # Allocate outputs (torch.empty...), then call kernels.<your function>(out, x, ...).\n"
           "        raise NotImplementedError(\"ModelNew.forward: call your kernels here\")")
    return (f'"""{title}: Model (model.py) with its computation in your own kernels (see INSTRUCTIONS.md)."""\n'
            + "\n".join(imports + ["from hpc.runtime import load_kernels"]) + "\n\n"
            + 'kernels = load_kernels(__file__)   # every extern "C" function of your kernels/ sources\n\n\n'
            + "\n\n\n".join(helpers + [cls]) + "\n")


def _allowed_import(node: ast.Import | ast.ImportFrom) -> bool:
    """The evaluator's own rule (hpc.verify.static): a starter never begins with a refused import."""
    return not import_defect(node)

"""Demonstrations for supervised warm-up: a solution folder as the single-turn reply that writes
it (one `write_file` call per file), paired with the task the reply answers.

Only the files the backend compiles go into the reply (a CPU solution's .cu is dead weight to a
CPU policy); the evaluator's own check of the demonstration is left to the caller (the shipped
solutions are evaluated by the test suite).

With `with_starter`, each task also gets the reply that writes the episode's starter model_new.py
unchanged (no kernel: the evaluator fails it): a warm-up on both leaves a policy that hesitates
between doing the work and not, and RL has to learn which one pays (the CPU-scale default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpc.agent.toolcall import CLOSE, OPEN
from hpc.errors import DataFileError
from hpc.suite import find_candidate
from hpc.task import Task

BACKEND_SOURCES = {"cpu": (".cpp", ".h", ".hpp"), "cuda": (".cu", ".cuh", ".h", ".hpp")}


@dataclass(frozen=True)
class Demonstration:
    task: Task
    reply: str


def solution_files(folder: Path, backend: str) -> dict[str, str]:
    """model_new.py and the kernel sources `backend` compiles, by workdir-relative path."""
    files = {"model_new.py": (folder / "model_new.py").read_text()}
    kernels = folder / "kernels"
    if kernels.is_dir():
        for path in sorted(kernels.rglob("*")):
            if path.is_file() and path.suffix in BACKEND_SOURCES[backend]:
                files[path.relative_to(folder).as_posix()] = path.read_text()
    return files


def write_reply(files: dict[str, str]) -> str:
    """The single-turn reply that writes `files`."""
    return "".join(f"{OPEN}{json.dumps({'name': 'write_file', 'arguments': {'path': path, 'content': text}})}{CLOSE}\n"
                   for path, text in files.items())


def demonstrations(tasks: list[Task], solutions: str | Path, backend: str,
                   with_starter: bool = False) -> list[Demonstration]:
    """One demonstration per task with a workdir solution under `solutions` (level/name/), and
    with `with_starter` one more writing the starter model_new.py."""
    from hpc.agent.workdir import starter_model_new

    root = Path(solutions)
    if not root.is_dir():
        raise DataFileError(f"solutions {root}: no such folder")
    found = []
    for task in tasks:
        folder = find_candidate(task, root)
        if folder is not None and folder.is_dir() and (folder / "model_new.py").is_file():
            found.append(Demonstration(task, write_reply(solution_files(folder, backend))))
            if with_starter:
                starter = starter_model_new(task.path.read_text(encoding="utf-8", errors="replace"), task.task_id)
                found.append(Demonstration(task, write_reply({"model_new.py": starter})))
    if not found:
        raise DataFileError(f"solutions {root}: no workdir solution for any of the {len(tasks)} tasks")
    return found

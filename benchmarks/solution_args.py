"""Arguments of the benchmarks that evaluate the shipped solutions: which tasks, where their
solutions are, which backend; and the tasks they select."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc.suite import find_candidate
from hpc.task import Task, discover_tasks

ROOT = Path(__file__).resolve().parents[1]


def solution_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tasks", default=str(ROOT / "kernels/tasks"))
    ap.add_argument("--solutions", default=str(ROOT / "kernels/solutions"))
    ap.add_argument("--only", action="append", default=[], help="task-id prefix (repeatable)")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cuda")
    return ap


def solved_tasks(args: argparse.Namespace) -> list[Task]:
    """The tasks under --tasks matching --only that have a solution under --solutions."""
    tasks = [t for t in discover_tasks(Path(args.tasks)) if (not args.only or any(
        t.task_id.startswith(p) for p in args.only)) and find_candidate(t, Path(args.solutions))]
    if not tasks:
        raise SystemExit(f"no task under {args.tasks} matching {args.only} has a solution in {args.solutions}")
    return tasks

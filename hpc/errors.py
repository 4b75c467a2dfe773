"""Errors that reach the user as one line, never as a traceback."""

from __future__ import annotations

import os
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (a task, candidate, config, file or argument): print and exit non-zero."""


def check_out_folder(path: str | os.PathLike, option: str = "--out") -> Path:
    """A run folder a command will create or fill: refuse one that is, or lies under, a file
    (mkdir would raise deep inside the run, after work was done)."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "exists and" if folder == path else f"{folder}"
                raise UserError(f"{option} {path}: {where} is not a folder")
            break
    return path

"""Finding one MPI rank's process among its siblings: what a fault drill kills (the pool tests,
benchmarks/full_scale.py)."""

from __future__ import annotations

from pathlib import Path


def process_with(command_part: bytes, *env: str) -> int | None:
    """The pid of a process whose command line holds `command_part` and whose environment holds
    every `NAME=value` of `env` (e.g. "OMPI_COMM_WORLD_RANK=2"); None when there is none."""
    wanted = [e.encode() for e in env]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if command_part in cmd and all(w in environ for w in wanted):
            return int(entry.name)
    return None

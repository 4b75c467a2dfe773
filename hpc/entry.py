"""What the entry points share at their boundary: an argument parser whose usage errors are
UsageErrors, so that they end like any bad input (one `error:` line, exit 2), and the way out of
an MPI rank that must not wait in MPI_Finalize."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from hpc.errors import UsageError


def summary(doc: str | None) -> str:
    """A command's description for --help: its docstring's first paragraph as one line (its first
    line alone can stop mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


class Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors raised as UsageError(`PROG: message`) instead of
    printed with the usage and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def exit_now(code: int) -> NoReturn:
    """Leave without MPI_Finalize (it would wait for a lost rank). Children this process started
    through multiprocessing (megatron's checkpoint writer) are killed first: they would outlive
    it holding mpirun's output pipes, and mpirun waits for those to close."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

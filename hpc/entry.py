"""What the entry points share at their boundary: an argument parser whose usage errors are
UsageErrors, so that they end like any bad input (one `error:` line, exit 2), and the ways out of
an MPI rank: one that must not wait in MPI_Finalize, and one that leaves with an error its other
ranks share."""

from __future__ import annotations

import argparse
import os
import sys
import time
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


def exit_together(code: int, wait_s: float = 10.0) -> int:
    """The way out of an entry point's `main` with `code`, under MPI too. Under `python -m
    mpi4py` a non-zero exit is an MPI_Abort, which kills the other ranks at once: maybe before
    rank 0 has written the error line that stands for all of them. So a rank leaving with an
    error waits (up to `wait_s`) in a barrier for the others to come too, then all finalize and
    leave with `code`; if one does not come (it failed elsewhere, or not at all), `code` is
    returned and the abort ends the job as before."""
    mpi = sys.modules.get("mpi4py.MPI")
    if not code or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() < 2:
        return code
    arrived = mpi.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + wait_s
    while not arrived.Test():
        if time.monotonic() > deadline:
            return code
        time.sleep(0.01)
    return exit_finalized(code)


def exit_finalized(code: int) -> int:
    """Leave with a non-zero `code` through MPI_Finalize rather than mpi4py's MPI_Abort (which
    would kill ranks that are themselves leaving cleanly). For a rank whose others all reach
    MPI_Finalize (a coordinator whose workers were stopped). Returns a zero `code`, or one
    outside MPI, for `main` to return."""
    mpi = sys.modules.get("mpi4py.MPI")
    if not code or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return code
    mpi.Finalize()
    exit_now(code)

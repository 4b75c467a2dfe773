"""Logging for every entry point: one handler on the root logger writing plain lines to stderr
(`pool: 5 to evaluate ...`, `error: ...`: the lines the prints they replace wrote), and a rank
filter, so that in a job of many MPI or torch.distributed ranks rank 0 speaks for all.

Status lines are INFO (`--quiet`: warnings and errors only), details DEBUG (`--verbose`). On a
rank other than 0, records below WARNING are dropped, and those kept are prefixed `[rank N]`;
`--verbose` keeps every rank's records (prefixed), for a look at what each rank did. A record
every rank logs alike (an error in the arguments or config they all read) passes
`extra=ON_EVERY_RANK`: rank 0's stands for all.

Libraries' records are shown as before this handler existed (Python's last-resort handler): their
warnings and errors, unless a handler of their own shows them (submitit's).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# The project's loggers (`logging.getLogger(__name__)`): modules of hpc and jobs, and the one run as
# a script or with `python -m` (__main__). Their level is the entry point's; other loggers keep the
# root's WARNING.
PROJECT_LOGGERS = ("hpc", "jobs", "__main__")

# The variables a launcher sets to this process's rank, the first one set wins: MPI's own (Open
# MPI, MPICH / PMI, PMIx) are set by the launcher that started this very process; torchrun's RANK
# is the process's own too; SLURM_PROCID last, since whatever an srun task or a batch script
# starts inherits it (every rank mpirun starts inside a batch script sees the script's 0, every
# process of one torchrun per node sees its node's task).
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")

# `extra` of a record every rank logs alike: only rank 0's is shown.
ON_EVERY_RANK = {"on_every_rank": True}


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """`--verbose/-v` and `--quiet/-q`, one or neither, for `setup_logging`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true",
                       help="debug lines too, and every rank's lines (not only rank 0's)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="only warnings and errors, no status lines")


def detect_rank() -> int | None:
    """This process's rank in a multi-process job (RANK_VARIABLES says which variable wins and
    why); None outside one."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def setup_logging(verbose: bool = False, quiet: bool = False, rank: int | None = None) -> None:
    """Configure logging for an entry point, right after it parsed its arguments. The root logger
    gets its handler once; a later call (another entry point run in the same process, as tests
    do) sets the level and rank again."""
    if rank is None:
        rank = detect_rank()
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        handler.addFilter(_LibraryFilter())
        root.addHandler(handler)
    handler.rank_filter.rank, handler.rank_filter.every_rank = rank, verbose
    handler.setFormatter(logging.Formatter("%(message)s" if not rank else f"[rank {rank}] %(message)s"))
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)


class JobLogging:
    """A submitit job's logging (mixed into the callable that is pickled to the node): the
    --verbose/--quiet of the command that submitted it travel with it, so that the job's log holds
    the lines the user asked for. Without a handler of its own the job's process would show only
    warnings (Python's last-resort handler) and lose its status lines."""

    def __init__(self, verbose: bool = False, quiet: bool = False) -> None:
        self.verbose, self.quiet = verbose, quiet

    def setup_logging(self) -> None:
        setup_logging(self.verbose, self.quiet)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes (pytest's capture, redirect_stderr), as
    Python's last-resort handler does."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.rank_filter = _RankFilter()
        self.addFilter(self.rank_filter)

    @property
    def stream(self):
        return sys.stderr


class _RankFilter(logging.Filter):
    """On a rank other than 0: drop records below WARNING (unless `every_rank`) and those logged
    ON_EVERY_RANK."""

    def __init__(self) -> None:
        super().__init__()
        self.rank: int | None = None
        self.every_rank = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.rank:
            return True
        if getattr(record, "on_every_rank", False):
            return False
        return self.every_rank or record.levelno >= logging.WARNING


class _LibraryFilter(logging.Filter):
    """A library's record passes as Python's last-resort handler would pass it: a warning or an
    error, of a logger without a handler of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] in PROJECT_LOGGERS:
            return True
        return record.levelno >= logging.WARNING and not _handled_below_root(record.name)


def _handled_below_root(name: str) -> bool:
    logger = logging.getLogger(name)
    while logger.parent is not None:
        if logger.handlers or not logger.propagate:
            return True
        logger = logger.parent
    return False

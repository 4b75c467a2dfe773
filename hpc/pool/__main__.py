"""A standalone evaluation job on the reward pool: rank 0 coordinates and writes HDF5, every
other rank is a worker with one device.

    mpirun -n 5 --enable-recovery python -m mpi4py -m hpc.pool TASKS CANDIDATES --out r.h5
    srun --mpi=pmix -n 5 python -m mpi4py -m hpc.pool TASKS CANDIDATES --out r.h5

Re-running with the same --out evaluates only what is missing (task + candidate content).
With --status-file, rank 0 says at its end how the pool ended (finished and unfinished counts, or
its error), so a job script can tell a pool that ended from one that died (under
`mpirun --enable-recovery` the exit status is 0 whatever the ranks did).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from hpc.entry import exit_finalized, exit_now, exit_together, summary
from hpc.errors import UsageError, UserError, check_results_name
from hpc.logs import ON_EVERY_RANK, add_logging_args, setup_logging

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mpi4py -m hpc.pool", description=summary(__doc__))
    p.add_argument("tasks", help="folder of problem files")
    p.add_argument("candidates", help="folder of candidates laid out like the tasks")
    p.add_argument("--out", required=True, help="HDF5 results file (appended; finished records are skipped)")
    p.add_argument("--only", action="append", help="task ids containing this (repeatable)")
    p.add_argument("--backend", choices=("cpu", "cuda"))
    p.add_argument("--scale", choices=("cpu", "gpu"))
    p.add_argument("--config", help="YAML evaluation config")
    p.add_argument("--iterations", type=int, help="timed iterations")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take on a worker")
    p.add_argument("--dead-after", type=float, default=30.0, help="seconds without a heartbeat before a rank is lost")
    p.add_argument("--coordinator-silent", type=float, default=60.0,
                   help="seconds without a word from the coordinator before a worker rank takes it for dead and leaves")
    p.add_argument("--status-file", help="JSON written (atomically) when rank 0 ends: items, finished, unfinished "
                                         "(no record, or a harness error) and error (null, or the error line)")
    p.add_argument("--retries", type=int, default=1, help="re-runs of a request whose worker rank was lost")
    p.add_argument("--concurrency", type=int, default=None,
                   help="evaluations at once per worker rank (they share its device; timings take turns; "
                        "default 6 on cuda, 1 on cpu)")
    p.add_argument("--prestart", type=int, default=None,
                   help="evaluations whose worker processes start ahead, while others run "
                        "(0: none; default one more than --concurrency, with 4 or more cores)")
    add_logging_args(p)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The bounds argparse does not check, as UserErrors (said once logging is set up: by rank 0)."""
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"--concurrency: must be >= 1, got {args.concurrency}")
    if args.prestart is not None and args.prestart < 0:
        raise UsageError(f"--prestart: must be >= 0, got {args.prestart}")
    for flag, value in (("--dead-after", args.dead_after), ("--coordinator-silent", args.coordinator_silent)):
        if not value > 0:
            raise UsageError(f"{flag}: must be > 0 seconds, got {value:g}")


def _config(args):
    from hpc.config import command_line_config

    return command_line_config(args.config, args.backend, args.scale, args.iterations)


def coordinate(comm, args, cfg) -> int:
    from hpc.config import config_to_dict
    from hpc.engine import Item, run_items
    from hpc.pool.coordinator import Coordinator
    from hpc.pool.messages import WorkItem
    from hpc.results.hdf5 import RecordStore, provenance
    from hpc.results.record import EvalRecord
    from hpc.suite import evaluate_entry, one_line, suite_entries, find_candidate
    from hpc.task import discover_tasks, select_tasks

    pool = Coordinator(comm, list(range(1, comm.Get_size())), args.dead_after, args.retries)
    answered: dict[str, tuple[int, float]] = {}   # task id -> (worker rank, seconds)

    def on_the_pool(todo, stop):
        """Requests for the entries with a candidate; the others' records made here."""
        sent = {}
        for item in todo:
            entry = item.payload
            if entry.candidate is None:
                yield item, evaluate_entry(entry, cfg)
                continue
            sent[entry.task.task_id] = item
            key = {"task_id": entry.task.task_id, "task_level": entry.task.level, "task_sha256": entry.task.sha256,
                   "candidate_sha256": entry.candidate.sha256, "candidate_kind": entry.candidate.kind,
                   "backend": cfg.backend, "scale": cfg.scale, "reward_kind": cfg.reward.kind}
            pool.submit(WorkItem(id=entry.task.task_id, task=str(entry.task.path), candidate=str(entry.path),
                                 timeout_s=args.timeout, meta=key))
        log.info("pool: %d to evaluate, %d already recorded, %d worker ranks", len(sent), len(items) - len(todo),
                 len(pool.live))
        for result in pool.results():
            answered[result.id] = (result.rank, result.seconds)
            yield sent[result.id], EvalRecord(**result.record)

    def describe(item, rec) -> str:
        state = rec.reason if rec.failed_stage else f"reward {rec.reward:g}"
        rank, seconds = answered.get(rec.task_id, (0, 0.0))
        return one_line(f"{rec.task_id} (rank {rank}, {seconds:.1f} s): {state}")

    code, run, error = 0, None, None
    try:
        check_results_name(args.out)
        tasks = select_tasks(discover_tasks(args.tasks), args.only, args.tasks)
        entries = suite_entries([(t, find_candidate(t, Path(args.candidates))) for t in tasks], args.candidates)
        items = [Item(e.record_key(), e) for e in entries]
        with RecordStore(args.out, provenance(config_to_dict(cfg))) as store:   # a damaged file repaired or refused
            run = run_items(items, on_the_pool, store, describe=describe, label="pool")
    except UserError as e:   # said once, on this rank; the worker ranks are stopped below, not aborted
        log.error("error: %s", e)
        code, error = 2, str(e)
    if args.status_file:
        finished = run.skipped + sum(r.status != "error" for r in run.written) if run else 0
        write_status(args.status_file, len(items) if run else 0, finished, error)
    clean = pool.close()
    log.info("pool: %s", pool.usage_line())
    for rank, reason in sorted(pool.dead.items()):
        log.warning("pool: lost %s", reason)
    if not clean:   # MPI_Finalize would wait for the lost ranks
        exit_now(code or (0 if pool.live else 3))
    return exit_finalized(code)   # with the stopped workers


def write_status(path: str, items: int, finished: int, error: str | None) -> None:
    """The --status-file, written aside and switched in with one rename: a reader sees it whole."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"items": items, "finished": finished, "unfinished": items - finished, "error": error}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.error("error: --status-file %s: cannot write (%s)", path, e.strerror)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    args = None
    try:
        args = parse_args(argv)
        setup_logging(args.verbose, args.quiet, comm.Get_rank())
        check_args(args)
        cfg = _config(args)
        if comm.Get_size() < 2:
            raise UsageError("the pool needs at least 2 ranks (1 coordinator + workers)")
    except UserError as e:   # every rank reads the same arguments and config
        log.error("error: %s", e, extra=ON_EVERY_RANK)
        if comm.Get_rank() == 0 and args is not None and args.status_file:
            write_status(args.status_file, 0, 0, str(e))
        return exit_together(2)
    workers = comm.Split(0 if comm.Get_rank() == 0 else 1, comm.Get_rank())
    if comm.Get_rank() == 0:
        return coordinate(comm, args, cfg)
    from hpc.pool.worker import pin_device, run_worker

    if cfg.backend == "cuda":
        pin_device(workers)
    if not run_worker(comm, 0, cfg, concurrency=args.concurrency, prestart=args.prestart,
                      coordinator_silent_s=args.coordinator_silent):
        exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A worker rank of the pool: asks for work, evaluates it, sends the result, repeats.

One worker per GPU: `pin_device` picks it from the rank's place among its node's workers.
While it evaluates, a thread sends heartbeats so the coordinator can tell a slow evaluation from
a dead rank; the coordinator pings back, and a worker that hears nothing from it for
`coordinator_silent_s` leaves (exit 3, its evaluations' processes with it) rather than wait on a
coordinator that is gone: under `mpirun --enable-recovery` nothing else would end it. Several
requests run at once (`concurrency`), sharing the device except while one is timed, and the next
request's compilation starts while they run, so the GPU does not wait on the compiler.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path

from hpc.candidate import load_candidate
from hpc.compile.native import compile_workdir, default_toolchain
from hpc.config import EvalConfig
from hpc.entry import exit_now
from hpc.errors import UserError
from hpc.pipeline import evaluate
from hpc.pool.messages import BEAT, BYE, READY, RESULT, STOP, STOP_NOW, WORK, Result, WorkItem
from hpc.results.record import EvalRecord
from hpc.sandbox.prestart import default_depth, prestarted_workers
from hpc.task import load_task
from hpc.verify.static import link_flags

log = logging.getLogger(__name__)

def local_device(worker_index_on_node: int) -> str:
    """The GPU this worker owns: the n-th of CUDA_VISIBLE_DEVICES (or of all GPUs) on its node."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if visible:
        return visible[worker_index_on_node % len(visible)]
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    return str(worker_index_on_node % count) if count else ""


def pin_device(workers_comm, first: int = 0) -> str:
    """Give this worker rank its own GPU: the (first + n)-th visible one, n its index among its
    node's workers (a collective call over `workers_comm`; `first`: GPUs of the node other ranks
    use, e.g. a trainer's). Returns the device, "" without GPUs."""
    from mpi4py import MPI

    node = workers_comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = local_device(first + node.Get_rank())
    node.Free()
    if device:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    return device


def warn_if_one_core(rank: int) -> None:
    """A worker rank's compiles and evaluation processes run on the cores it may use. Open MPI
    binds each rank to one core when it starts 2 ranks or fewer (and srun binds a rank to
    --cpus-per-task cores): say so, since all of them on one core take several times longer."""
    cores, total = len(os.sched_getaffinity(0)), os.cpu_count() or 1
    if cores == 1 and total > 1:
        log.warning("pool worker rank %d: bound to 1 of %d cores, which its compiles and evaluation processes will "
                    "share (launch with mpirun --bind-to none, or srun --cpus-per-task=N)", rank, total)


def default_concurrency(backend: str) -> int:
    """Evaluations at once on one worker rank: on an H200, 6 at once (with 7 started ahead)
    evaluated 26.6 level-1 candidates a minute, 4 at once 18.2, 1 at once 6.2 (docs/benchmarks.md);
    a CPU backend's timing wants its cores."""
    return 6 if backend == "cuda" else 1


COORDINATOR_LOST = 3   # the exit status of a worker whose coordinator went silent
FIRST_CONTACT_S = 600.0   # how long a coordinator may take to start (its imports, on a slow shared filesystem)


def _receive(comm, source: int, heard: list[float], block: bool):
    """The next work message from `source` (a WorkItem, STOP or STOP_NOW), reading the pings before
    it (each sets heard[0]); None when nothing came and `block` is False. Polls rather than waits
    in MPI, so a coordinator that is gone cannot hold the thread."""
    from mpi4py import MPI

    while True:
        status = MPI.Status()
        if comm.Iprobe(source=source, tag=MPI.ANY_TAG, status=status):
            message = comm.recv(source=source, tag=status.Get_tag())
            heard[0] = time.monotonic()
            if status.Get_tag() == WORK:
                return message
        elif not block:
            return None
        else:
            time.sleep(0.005)


def run_worker(comm, coordinator: int, cfg: EvalConfig, beat_s: float = 2.0, concurrency: int | None = None,
               prestart: int | None = None, coordinator_silent_s: float = 60.0) -> bool:
    """Serve requests from `coordinator` until told to stop.

    Up to `concurrency` (None: `default_concurrency`) requests are evaluated at once on this
    rank's device (their compiles, correctness runs and transfers overlap; each timing holds the
    device alone through hpc.profile.device_lock), and one more waits with its workdir compiling. Returns False when
    the coordinator said to skip MPI_Finalize (a rank of the job was lost). `prestart` evaluations'
    worker processes are kept started ahead (hpc.sandbox.prestart; 0: each starts its own; None:
    `default_depth(concurrency)`).
    """
    warn_if_one_core(comm.Get_rank())
    concurrency = concurrency or default_concurrency(cfg.backend)
    prestart = default_depth(concurrency) if prestart is None else prestart
    stop = threading.Event()
    send_lock = threading.Lock()

    def send(obj, tag: int) -> None:
        with send_lock:
            comm.send(obj, dest=coordinator, tag=tag)

    def beat() -> None:
        while not stop.wait(beat_s):
            send(time.time(), BEAT)

    started = time.monotonic()
    heard = [started]   # when a message from the coordinator last came
    said_bye = threading.Event()

    def watch() -> None:
        while not said_bye.wait(1.0):
            silent = time.monotonic() - heard[0]
            if silent > (coordinator_silent_s if heard[0] > started else max(coordinator_silent_s, FIRST_CONTACT_S)):
                log.error("error: worker rank %d: nothing from the coordinator (rank %d) for %.0f s: it is gone; "
                          "leaving", comm.Get_rank(), coordinator, silent)
                exit_now(COORDINATOR_LOST)   # the main thread may be stuck in a send to it

    beater = threading.Thread(target=beat, name="heartbeat", daemon=True)
    beater.start()
    threading.Thread(target=watch, name="coordinator-watch", daemon=True).start()
    pending: deque[WorkItem] = deque()
    running: dict[Future, WorkItem] = {}
    executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="evaluate")
    stopped_by = None
    with prestarted_workers(prestart):
        try:
            for _ in range(concurrency + 1):
                send(None, READY)
            while True:
                # take every request that has arrived; block for one only when nothing is running or waiting
                while stopped_by is None:
                    item = _receive(comm, coordinator, heard, block=not pending and not running)
                    if item is None:
                        break
                    if item in (STOP, STOP_NOW):
                        stopped_by = item
                    else:
                        pending.append(item)
                        precompile(item.candidate, cfg)
                while pending and len(running) < concurrency:
                    item = pending.popleft()
                    running[executor.submit(_timed_run, item, cfg)] = item
                if not running:
                    break
                finished, _ = wait(running, timeout=0.05, return_when=FIRST_COMPLETED)
                for future in finished:
                    item = running.pop(future)
                    rec, seconds = future.result()
                    send(Result(item.id, item.kind, asdict(rec), comm.Get_rank(), seconds, item.meta), RESULT)
                    if stopped_by is None:
                        send(None, READY)
        finally:
            executor.shutdown(wait=True)
            stop.set()
            beater.join()
    send(None, BYE)   # after the last heartbeat: the coordinator may exit once every rank said this
    said_bye.set()
    return stopped_by != STOP_NOW


def _timed_run(item: WorkItem, cfg: EvalConfig) -> tuple[EvalRecord, float]:
    t0 = time.monotonic()
    return _run(item, cfg), time.monotonic() - t0


def _run(item: WorkItem, cfg: EvalConfig) -> EvalRecord:
    try:
        task, candidate = load_task(item.task), load_candidate(item.candidate)
    except UserError as e:
        rec = EvalRecord(candidate_path=item.candidate, reward=cfg.reward.incorrect,
                         reward_kind=cfg.reward.kind).fail("static", str(e))
        rec.task_id = item.meta.get("task_id", "")
        return rec
    return evaluate(task, candidate, cfg, item.kind)


def precompile(candidate_path: str, cfg: EvalConfig) -> Future | None:
    """Build a workdir candidate into the compile cache in the background (a later evaluate hits it)."""
    path = Path(candidate_path)
    if not path.is_dir():
        return None
    toolchain = default_toolchain(cfg.backend, cfg.compile.cuda_arch, link_flags(cfg.rules.libraries))
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(compile_workdir, path, toolchain, cfg.cache_path(), cfg.compile.timeout_s,
                         max_library_mb=cfg.compile.max_library_mb, run_as_uid=cfg.sandbox.run_as_uid,
                         memory_gb=cfg.compile.memory_gb)
    pool.shutdown(wait=False)
    return future

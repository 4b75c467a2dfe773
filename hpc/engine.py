"""The one engine that runs a set of evaluations: `eval-suite`, the reward pool, both sharded jobs of
jobs/evaluate.py, a policy's evaluation and synthesis all run their items through
`run_items`.

What it does for every one of them, in one place:
  - resume: an item whose key its `Store` already holds is skipped (a requeued array task, a
    re-submission, a re-run with the same --out evaluate only what is missing);
  - evaluate: the rest go to an `Evaluate` (threads in this process, worker ranks of the pool,
    batched agent rollouts), whose results arrive in completion order;
  - write: each result goes to the store as it arrives, so a kill loses at most those in flight;
  - progress: one line per result and a summary line with the time left (hpc.progress);
  - preemption: once `stop` is set (SIGTERM from Slurm) no item starts, and no result that
    finishes afterwards is written: its worker processes may have died with the job, so the
    requeued task evaluates it again.

An `Evaluate` may also leave an item unrun (its result None: a time budget spent, a stop); such an
item is neither written nor counted, and a later run does it.
"""

from __future__ import annotations

import io
import logging
import threading
from contextlib import contextmanager, nullcontext
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Generic, Protocol, TextIO, TypeVar

from hpc.progress import Progress

P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Item(Generic[P]):
    """One unit of a run: `key` finds its result in a store (resume), `payload` is what the
    evaluate function needs (a task and a candidate, a sample index, a synthesis proposal)."""

    key: Hashable
    payload: P


class Store(Protocol[P, R]):
    """Where a run's results are kept: one file of one writer."""

    def finished(self) -> set[Hashable]:
        """The keys of the results already kept: their items are skipped."""

    def append(self, item: Item[P], result: R) -> None:
        """Keep one result (durably, before the next is handed over)."""


class Unkept:
    """The store of a run whose results only its caller sees (no output file): nothing is finished
    before it starts, nothing is written."""

    def finished(self) -> set[Hashable]:
        return set()

    def append(self, item: Item, result: object) -> None:
        return None


Evaluate = Callable[[Sequence[Item[P]], threading.Event], Iterator[tuple[Item[P], R | None]]]


@dataclass
class RunSummary(Generic[R]):
    """How a run ended: `written` results in item order (skipped ones are not among them)."""

    items: int
    skipped: int
    written: list[R] = field(default_factory=list)
    stopped: bool = False       # `stop` was set: items were left for the next run
    unrun: int = 0              # items the evaluate function left (a budget spent, a stop)

    @property
    def evaluated(self) -> int:
        return len(self.written)


def run_items(items: Sequence[Item[P]], evaluate: Evaluate, store: Store[P, R], *,
              describe: Callable[[Item[P], R], str], label: str, stop: threading.Event | None = None,
              stream: TextIO | None = None, progress_every_s: float = 60.0) -> RunSummary[R]:
    """Evaluate the items `store` lacks and write each result as it arrives; see the module doc.
    `describe` says in one line how an item ended; `label` names the run in the progress lines."""
    stop = stop or threading.Event()
    finished = store.finished()
    todo = [item for item in items if item.key not in finished]
    summary: RunSummary[R] = RunSummary(len(items), len(items) - len(todo))
    order = {id(item): i for i, item in enumerate(todo)}
    written: dict[int, R] = {}
    if logging.getLogger("hpc").level > logging.INFO:   # --quiet (hpc.logs): warnings and errors only
        stream = io.StringIO()
    with Progress(len(todo), label, stream, every_s=progress_every_s) as progress:
        for item, result in evaluate(todo, stop):
            if stop.is_set():
                summary.stopped = True
                continue   # drained, not written: the requeued run evaluates it again
            if result is None:
                summary.unrun += 1
                continue
            store.append(item, result)
            written[order[id(item)]] = result
            progress.advance(f"{label}: [{len(written)}/{len(todo)}] {describe(item, result)}")
    summary.stopped = summary.stopped or stop.is_set()
    summary.written = [written[i] for i in sorted(written)]
    return summary


def in_threads(evaluate_one: Callable[[Item[P]], R | None], jobs: int = 1, prestart: bool = True) -> Evaluate:
    """An `Evaluate` running `evaluate_one` on up to `jobs` items at once in this process, results
    in completion order. An item not started when `stop` is set is left unrun. With `prestart`, the
    worker processes of the next evaluations start while these run (hpc.sandbox.prestart)."""
    def evaluate(todo: Sequence[Item[P]], stop: threading.Event) -> Iterator[tuple[Item[P], R | None]]:
        from hpc.sandbox.prestart import default_depth, prestarted_workers

        def one(item: Item[P]) -> R | None:
            if stop.is_set():
                return None
            try:
                return evaluate_one(item)
            except Exception:
                if stop.is_set():   # its processes were killed with the job: the requeued run does it again
                    return None
                raise

        if not todo:
            return
        workers = max(1, min(jobs, len(todo)))   # more threads than items would only start idle workers
        with (prestarted_workers(default_depth(workers)) if prestart else nullcontext()), \
                ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(one, item): item for item in todo}
            for future in as_completed(futures):
                yield futures[future], future.result()
    return evaluate


@dataclass(eq=False)
class Turn:
    """One item's evaluation under the gate: `beside` is set once another ran at the same time."""

    beside: bool = False


class Gate:
    """A run's items are evaluated side by side (`shared`), except one evaluated again `alone`: it
    waits for the evaluations in flight to finish, and none starts until it is done (new shared
    holders queue behind a waiting one). Threads of one process (`in_threads`), unlike the device's
    flock (hpc.profile.device_lock), which the evaluations hold inside."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turns: set[Turn] = set()
        self._alone = False
        self._queued = 0     # items waiting to run alone, waiting for the shared holders to finish

    @contextmanager
    def shared(self) -> Iterator[Turn]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._queued)
            turn = Turn(beside=bool(self._turns))
            for other in self._turns:
                other.beside = True
            self._turns.add(turn)
        try:
            yield turn
        finally:
            with self._cond:
                self._turns.discard(turn)
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._queued += 1
            try:
                self._cond.wait_for(lambda: not self._alone and not self._turns)
            finally:
                self._queued -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


def again_alone(first: Callable[[Item[P]], R | None], again: Callable[[Item[P], R], R | None],
                needs_again: Callable[[R], bool]) -> Callable[[Item[P]], R | None]:
    """An evaluate-one function for `in_threads` with several jobs on one device: each item is
    evaluated by `first` side by side with the others, and one whose result `needs_again` (it ran
    out of memory, say, which may have been a neighbour's) while another ran beside it is handed to
    `again(item, first result)` alone: no other evaluation runs meanwhile. What `again` returns is
    the item's result, the only one written. With one job nothing runs beside an item, and none is
    evaluated again."""
    gate = Gate()

    def one(item: Item[P]) -> R | None:
        with gate.shared() as turn:
            result = first(item)
        if result is None or not (turn.beside and needs_again(result)):
            return result
        with gate.alone():
            return again(item, result)
    return one

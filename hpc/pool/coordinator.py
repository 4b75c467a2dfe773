"""The pool's coordinator: one rank that queues requests, hands them to idle worker ranks and
streams results back as they finish.

A worker rank that stops sending heartbeats is declared dead: its in-flight request is re-queued
(up to `retries` times, then recorded as failed with the reason), and no more work goes to it.
Open MPI must be told not to end the job when a rank dies (`mpirun --enable-recovery`;
`srun` without --kill-on-bad-exit), otherwise the job ends with the rank and only the results
already streamed survive, which a resumed run then skips.

The other way round, a thread pings every live worker each `beat_s`, whatever the coordinator's
own loop is doing (a trainer's step takes minutes): a worker that hears nothing for a while takes
the coordinator for dead and leaves (hpc.pool.worker), instead of waiting on it forever.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from dataclasses import asdict, fields
from typing import Iterator

from hpc.pool.messages import BYE, KINDS, PING, READY, RENAMED_KINDS, RESULT, STOP, STOP_NOW, WORK, Result, WorkItem
from hpc.results.record import EvalRecord


class Coordinator:
    def __init__(self, comm, workers: list[int], dead_after_s: float = 30.0, retries: int = 1,
                 max_queued: int = 10_000, beat_s: float = 2.0):
        self.comm = comm
        self.live = set(workers)
        self.dead_after_s = dead_after_s
        self.retries = retries
        self.max_queued = max_queued
        self.idle: list[int] = []                      # one entry per free slot of a rank
        self.inflight: dict[int, list[list]] = {r: [] for r in workers}   # rank -> [[item, since]]
        self.last_seen = {r: time.monotonic() for r in workers}
        self.dead: dict[int, str] = {}
        self._queue: list[tuple[int, int, WorkItem]] = []
        self._seq = itertools.count()
        self._ready: list[Result] = []
        self.said_bye: set[int] = set()
        self.started = time.monotonic()
        self.busy_s = {r: 0.0 for r in workers}        # seconds each rank held at least one request
        self._busy_since: dict[int, float] = {}
        self.answered = 0                                # results from worker ranks (not given up)
        self._stop_pinging = threading.Event()
        self._pinger = threading.Thread(target=self._ping, args=(beat_s,), name="pool-ping", daemon=True)
        self._pinger.start()

    # -- client side -------------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        """Queue one request; blocks (serving the pool) while `max_queued` requests wait."""
        if item.kind not in KINDS:   # caught here, not as a crashed worker rank
            now = f" ({item.kind!r} is now {RENAMED_KINDS[item.kind]!r})" if item.kind in RENAMED_KINDS else ""
            raise ValueError(f"request {item.id}: kind must be one of {KINDS}, got {item.kind!r}{now}")
        while len(self._queue) >= self.max_queued and self.live:
            self._serve(0.01)
        heapq.heappush(self._queue, (item.priority, next(self._seq), item))

    def pending(self) -> int:
        return len(self._queue) + sum(map(len, self.inflight.values())) + len(self._ready)

    def poll(self, timeout_s: float = 0.01) -> list[Result]:
        """Serve the pool for up to `timeout_s` (less when results are waiting) and return the
        results finished meanwhile, in completion order; maybe none."""
        if self.pending() and not self._ready:
            if self.live:
                self._serve(timeout_s)
            else:
                self._fail_everything_queued("no live worker rank left")
        ready, self._ready = self._ready, []
        return ready

    def results(self, poll_s: float = 0.01) -> Iterator[Result]:
        """Every submitted request's result, in completion order, until none is pending."""
        while self.pending():
            yield from self.poll(poll_s)

    def close(self) -> bool:
        """Stop every live worker and wait until each has said so (or is declared lost).

        Returns True when every rank stopped cleanly; False when some rank was lost, in which case
        the workers were told to skip MPI_Finalize and so should the caller.
        """
        # A rank that died unnoticed is found first (each live rank heard from since now, or
        # declared dead): plain STOP lets the others enter MPI_Finalize, which would wait forever
        # for a dead rank.
        asked = time.monotonic()
        while any(self.last_seen[r] < asked for r in self.live):
            self._receive(0.05)
            self._check_liveness()
        stopping, waiting = set(self.live), set(self.live)
        while waiting:
            message = STOP_NOW if self.dead else STOP
            for rank in set(self.idle) & stopping:
                self.comm.send(message, dest=rank, tag=WORK)
                stopping.discard(rank)
            self.idle = [r for r in self.idle if r in stopping]
            self._receive(0.01)
            self._check_liveness()
            waiting = (waiting - self.said_bye) & self.live
            stopping &= self.live
        self._stop_pinging.set()
        self._pinger.join()
        return not self.dead

    def _ping(self, beat_s: float) -> None:
        """Every `beat_s`, a PING to each live rank that has not said bye. Sent without waiting
        (a dead rank's send may never complete); a rank whose last ping is still in flight is
        skipped."""
        inflight: dict[int, object] = {}
        while not self._stop_pinging.wait(beat_s):
            for rank in self.live.copy() - self.said_bye.copy():   # set.copy holds the GIL: no torn read
                last = inflight.get(rank)
                if last is None or last.Test():
                    inflight[rank] = self.comm.isend(None, dest=rank, tag=PING)

    # -- the loop ----------------------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        """Since the coordinator started: results answered by worker ranks, and the share of the
        worker ranks' time (all of them, live or not) spent holding a request."""
        now = time.monotonic()
        busy = sum(self.busy_s.values()) + sum(now - t for t in self._busy_since.values())
        wall = now - self.started
        return {"workers": len(self.busy_s), "wall_s": wall, "answered": self.answered,
                "busy_fraction": busy / (wall * len(self.busy_s)) if wall > 0 and self.busy_s else 0.0}

    def usage_line(self) -> str:
        """`usage()` as the line a pool's log ends with."""
        u = self.usage()
        per_min = 60 * u["answered"] / u["wall_s"] if u["wall_s"] > 0 else 0.0
        return (f"{u['answered']} answered by {u['workers']} worker rank(s) in {u['wall_s']:.0f} s "
                f"({per_min:.2f}/min), workers busy {100 * u['busy_fraction']:.0f}% of the time")

    def _mark(self, rank: int) -> None:
        """Keep the rank's busy time: it started or stopped holding requests."""
        if self.inflight[rank] and rank not in self._busy_since:
            self._busy_since[rank] = time.monotonic()
        elif not self.inflight[rank] and rank in self._busy_since:
            self.busy_s[rank] += time.monotonic() - self._busy_since.pop(rank)

    def _serve(self, poll_s: float) -> None:
        self._receive(poll_s)
        self._check_liveness()
        while self.idle and self._queue:
            _, _, item = heapq.heappop(self._queue)
            rank = self.idle.pop(0)
            item.attempts += 1
            self.inflight[rank].append([item, time.monotonic()])
            self._mark(rank)
            self.comm.send(item, dest=rank, tag=WORK)

    def _receive(self, poll_s: float) -> None:
        from mpi4py import MPI

        deadline = time.monotonic() + poll_s
        while True:
            status = MPI.Status()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                rank, tag = status.Get_source(), status.Get_tag()
                msg = self.comm.recv(source=rank, tag=tag)
                self.last_seen[rank] = time.monotonic()
                if rank not in self.live:
                    continue   # declared dead, then heard from: its work was already given away
                if tag == BYE:
                    self.said_bye.add(rank)
                elif tag == READY:
                    self.idle.append(rank)
                elif tag == RESULT:
                    held = self.inflight[rank]
                    if any(entry[0].id == msg.id for entry in held):
                        self.inflight[rank] = held = [e for e in held if e[0].id != msg.id]
                        if held:   # the rank's next request starts now
                            held[0][1] = time.monotonic()
                        self._mark(rank)
                        self.answered += 1
                        self._ready.append(msg)
            elif time.monotonic() >= deadline:
                return
            else:
                time.sleep(0.001)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for rank in list(self.live):
            held = self.inflight[rank]
            if now - self.last_seen[rank] > self.dead_after_s:
                self._retire(rank, f"worker rank {rank} stopped responding (no heartbeat for "
                                   f"{now - self.last_seen[rank]:.0f} s)")
            elif held and now - held[0][1] > held[0][0].timeout_s:
                self._retire(rank, f"timed out after {held[0][0].timeout_s:g} s on worker rank {rank}",
                             retry_first=False)

    def _retire(self, rank: int, reason: str, retry_first: bool = True) -> None:
        """No more work for `rank`; what it held is re-queued (the timed-out request is not)."""
        self.live.discard(rank)
        self.dead[rank] = reason
        self.idle = [r for r in self.idle if r != rank]
        held, self.inflight[rank] = self.inflight[rank], []
        self._mark(rank)
        for k, (item, _) in enumerate(held):
            if (retry_first or k > 0) and item.attempts <= self.retries:
                heapq.heappush(self._queue, (item.priority, next(self._seq), item))
            else:
                self._ready.append(_failed(item, reason))

    def _fail_everything_queued(self, reason: str) -> None:
        while self._queue:
            self._ready.append(_failed(heapq.heappop(self._queue)[2], reason))
        for rank, held in self.inflight.items():
            self._ready.extend(_failed(item, reason) for item, _ in held)
            held.clear()
            self._mark(rank)


def _failed(item: WorkItem, reason: str) -> Result:
    """The record of a request given up on (rank -1): status error, no reward (results/SCHEMA.md),
    and whatever record fields the submitter put in `meta` (task and candidate hash: the key a
    worker's record would have, so a later evaluation of it replaces this one in a merge, and a
    resumed run evaluates it again)."""
    known = {f.name for f in fields(EvalRecord)}
    rec = EvalRecord(candidate_path=item.candidate, **{k: v for k, v in item.meta.items() if k in known})
    rec = rec.fail("pool", reason, "error")
    rec.reward = math.nan
    return Result(item.id, item.kind, asdict(rec), -1, 0.0, item.meta)

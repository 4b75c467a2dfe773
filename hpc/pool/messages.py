"""What travels between the pool's coordinator and its worker ranks (pickled by mpi4py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc.results.record import STOP_AFTER, StopAfter

# MPI tags
READY = 1      # worker -> coordinator: idle, send work
WORK = 2       # coordinator -> worker: a WorkItem, or STOP / STOP_NOW
RESULT = 3     # worker -> coordinator: a Result
BEAT = 4       # worker -> coordinator: heartbeat (the rank is alive)
BYE = 5        # worker -> coordinator: stopped (heartbeats too); nothing more will come
PING = 6       # coordinator -> worker: the coordinator is alive (a worker that hears nothing leaves)

# stop messages (in place of a WorkItem): finish and return; with STOP_NOW the process should also
# skip MPI_Finalize, which would wait for ranks that died
STOP, STOP_NOW = "stop", "stop-now"

KINDS = STOP_AFTER   # a request's kind is the stage its evaluation stops after
RENAMED_KINDS = {"evaluate": "profile"}   # a kind's name before the stages had one vocabulary


@dataclass
class WorkItem:
    """One request: evaluate `candidate` (a single file or workdir) on `task` up to stage `kind`.

    `profile` runs the whole pipeline and its reward, `verify` stops after the correctness trials
    (the agent's verify tool), `compile` after compilation. Lower `priority` runs first; equal
    priorities run in submission order.
    """
    id: str
    task: str
    candidate: str
    kind: StopAfter = "profile"
    priority: int = 0
    timeout_s: float = 900.0
    attempts: int = 0
    meta: dict = field(default_factory=dict)   # passed back untouched (e.g. rollout / sample ids)


@dataclass
class Result:
    id: str
    kind: StopAfter
    record: dict               # an EvalRecord as a dict; failures included
    rank: int                  # the worker rank that produced it (-1: the coordinator gave up on it)
    seconds: float
    meta: dict = field(default_factory=dict)

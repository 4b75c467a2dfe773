"""Where compile / verify / profile run: in this process, or on the MPI reward pool.

Both take an immutable snapshot folder of the workdir and return the evaluator's record
(`hpc.pipeline.evaluate` stopped after the stage the tool is named for: compile, verify, or
profile, which runs to the reward), so an agent sees the same checks and numbers that pay its
reward.

- `LocalBackend(cfg)`: `hpc.pipeline.evaluate` here (tests, a single machine, CPU runs).
- `PoolBackend(client, cfg)`: a request to the pool's worker ranks (training: the GPUs that
  measure are not the trainer's). The snapshot must be on a filesystem the worker ranks see.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Protocol

from hpc.candidate import load_candidate
from hpc.config import EvalConfig, config_to_dict
from hpc.errors import UserError
from hpc.pipeline import evaluate
from hpc.pool.messages import Result, WorkItem
from hpc.results.record import EvalRecord, StopAfter
from hpc.task import Task

class EvalBackend(Protocol):
    """What the tools need: the evaluation config in force, and one evaluation of a snapshot."""

    config: EvalConfig

    def evaluate(self, task: Task, candidate_dir: Path, tool: StopAfter) -> EvalRecord:
        """`tool` is compile, verify or profile; never raises for anything the candidate does."""
        ...


def failed_record(task: Task, cfg: EvalConfig, reason: str) -> EvalRecord:
    """The record of a workdir that is no candidate at all (no model_new.py, too large)."""
    rec = EvalRecord(task_id=task.task_id, task_level=task.level, task_sha256=task.sha256, scale=cfg.scale,
                     candidate_kind="workdir", backend=cfg.backend, config=json.dumps(config_to_dict(cfg)),
                     reward=cfg.reward.incorrect, reward_kind=cfg.reward.kind, timestamp=time.time())
    return rec.fail("static", reason)


class LocalBackend:
    """The evaluator in this process (its workers are sandboxed subprocesses, as always)."""

    def __init__(self, cfg: EvalConfig):
        self.config = cfg

    def evaluate(self, task: Task, candidate_dir: Path, tool: StopAfter) -> EvalRecord:
        try:
            candidate = load_candidate(candidate_dir)
        except UserError as e:
            return failed_record(task, self.config, str(e))
        return evaluate(task, candidate, self.config, tool)


class PoolClient:
    """A thread-safe front of one `hpc.pool.coordinator.Coordinator` for many episodes.

    The coordinator yields results in completion order for everything submitted; `request`
    submits one item and waits for its own result, keeping the others for their waiters. Only
    one thread talks to the coordinator (and MPI) at a time.
    """

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self._lock = threading.Lock()
        self._done: dict[str, Result] = {}
        self._ids = itertools.count()
        self._prefix = f"agent-{os.getpid()}-{uuid.uuid4().hex[:8]}-"

    def new_id(self) -> str:
        return self._prefix + str(next(self._ids))

    def request(self, item: WorkItem) -> Result:
        """Submit `item` and block until its result arrives."""
        with self._lock:
            self.coordinator.submit(item)
        while True:
            with self._lock:
                if item.id in self._done:
                    return self._done.pop(item.id)
                if not self.coordinator.pending():   # cannot happen unless the coordinator lost it
                    raise RuntimeError(f"pool request {item.id}: no result and nothing pending")
                for result in self.coordinator.poll(0.01):
                    self._done[result.id] = result
            time.sleep(0)   # let a waiting thread take the lock (to submit, or to collect its result)


class PoolBackend:
    """Evaluations as requests to the reward pool's worker ranks."""

    def __init__(self, client: PoolClient, cfg: EvalConfig, timeout_s: float = 900.0, priority: int = 0):
        self.client, self.config, self.timeout_s, self.priority = client, cfg, timeout_s, priority
        self.served: Counter[int] = Counter()   # worker rank -> requests it answered (-1: given up)

    def evaluate(self, task: Task, candidate_dir: Path, tool: StopAfter) -> EvalRecord:
        item = WorkItem(id=self.client.new_id(), task=str(task.path), candidate=str(Path(candidate_dir).resolve()),
                        kind=tool, priority=self.priority, timeout_s=self.timeout_s,
                        meta={"task_id": task.task_id, "tool": tool})
        result = self.client.request(item)
        self.served[result.rank] += 1
        rec = EvalRecord(**result.record)
        if result.rank < 0:   # given up on (a lost rank, a timeout): no reward in a file, the incorrect one to RL
            rec.reward = self.config.reward.incorrect
        return rec


def state_digest(candidate_dir: Path) -> str:
    """sha256 over a candidate folder's files (relative paths and bytes)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in Path(candidate_dir).rglob("*") if p.is_file()):
        digest.update(path.relative_to(candidate_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class CachedBackend:
    """Another backend's records, each (task, state, tool) evaluated once: RL samples the same
    solution many times, and re-timing it would only let noise pick its reward. Thread-safe; a
    state being evaluated is waited for, not evaluated twice."""

    def __init__(self, backend: EvalBackend):
        self.backend, self.config = backend, backend.config
        self._records: dict[tuple[str, str, str], EvalRecord] = {}
        self._busy: dict[tuple[str, str, str], threading.Event] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def evaluate(self, task: Task, candidate_dir: Path, tool: StopAfter) -> EvalRecord:
        key = (task.sha256, state_digest(candidate_dir), tool)
        while True:
            with self._lock:
                if key in self._records:
                    self.hits += 1
                    return self._records[key]
                waiting = self._busy.get(key)
                if waiting is None:
                    self._busy[key] = threading.Event()
                    self.misses += 1
                    break
            waiting.wait()
        try:
            rec = self.backend.evaluate(task, candidate_dir, tool)
            with self._lock:
                self._records[key] = rec
            return rec
        finally:
            with self._lock:
                self._busy.pop(key).set()

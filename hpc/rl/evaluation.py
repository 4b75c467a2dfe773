"""Evaluate a trained policy as an agent over a task suite (`jobs/evaluate.py TASKS --policy CKPT`).

Each array task loads the policy of a training run's checkpoint
(`hpc.policy.serve.load_served_policy`: its weights, with the tokenizer and chat format the run
trained with), plays its share of the (task, sample) pairs as agent episodes with `rollout`
(batched generation, multi- or single-turn, the run's agent limits unless overridden), has the
evaluator score them, and writes to its shard file, per sample, the record of the rewarded state
(the best by speedup over torch.compile, or the final one) and the trajectory
(`EvaluationWriter`). A sample's record has the candidate path `policy:<checkpoint>#<task id>/<k>`,
which is its key (`hpc.results.merge.record_key`): a re-run skips the samples its file holds, and
the merge keeps each sample once. The file's attributes name the checkpoint and the model label
(`RUN@STEP`) under which `jobs/analyze.py` reports it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from hpc.agent.config import AgentConfig, agent_config, agent_config_dict
from hpc.config import EvalConfig
from hpc.errors import ResultsFileError, UsageError
from hpc.results.record import POLICY_SAMPLE, EvalRecord
from hpc.rl.checkpoints import PolicyCheckpoint, find_policy_checkpoint
from hpc.task import Task

log = logging.getLogger(__name__)

STAGE = "evaluate"   # the trajectories' stage in /train/trajectories (their step: the checkpoint's)


@dataclass
class PolicyEvaluation:
    """What every array task of one evaluation does, settled once by the submitter."""

    checkpoint: PolicyCheckpoint
    agent: AgentConfig          # the run's agent config with this evaluation's mode, state and limits
    samples: int                # episodes per task
    temperature: float
    top_p: float
    batch: int                  # episodes generated together
    seed: int

    def sample_path(self, task_id: str, k: int) -> str:
        """Sample k of a task: its records' candidate path, which names it for resume and merge."""
        return f"{POLICY_SAMPLE}{self.checkpoint.directory}#{task_id}/{k:04d}"

    def attrs(self) -> dict[str, str]:
        """Shard file attributes: the checkpoint, its label for reports, how it was sampled."""
        sampling = {"samples": self.samples, "temperature": self.temperature, "top_p": self.top_p,
                    "max_new_tokens": self.agent.max_response_tokens, "batch": self.batch, "seed": self.seed}
        return {"model": self.checkpoint.label, "checkpoint": str(self.checkpoint.directory),
                "checkpoint_step": str(self.checkpoint.step), "agent": json.dumps(agent_config_dict(self.agent)),
                "sampling": json.dumps(sampling)}


def policy_evaluation(checkpoint: str, samples: int = 1, mode: str = "multi_turn", state: str = "best",
                      max_turns: int | None = None, max_response_tokens: int | None = None,
                      temperature: float | None = None, top_p: float | None = None, batch: int = 8,
                      seed: int = 0) -> PolicyEvaluation:
    """The settings, validated (UsageError, one line). By default CUDA Agent's evaluation: multi-turn
    episodes paid by their best state; limits, temperature and top-p left None are the run's."""
    ckpt = find_policy_checkpoint(checkpoint)
    for name, value, low in (("--samples", samples, 1), ("--batch", batch, 1)):
        if value < low:
            raise UsageError(f"{name}: must be >= {low}, got {value}")
    agent = agent_config(agent_config_dict(ckpt.config.agent), mode=mode, state=state, max_turns=max_turns,
                         max_response_tokens=max_response_tokens)
    temperature = ckpt.config.rollout.temperature if temperature is None else temperature
    top_p = ckpt.config.rollout.top_p if top_p is None else top_p
    if temperature < 0 or not 0 < top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 (0: greedy) and --top-p in (0, 1], got {temperature}, {top_p}")
    return PolicyEvaluation(ckpt, agent, samples, temperature, top_p, batch, seed)


def work_items(tasks: list[Task], samples: int) -> list[tuple[str, int]]:
    """(problem file, sample index) for every sample; shard s takes items s, s + shards, ..."""
    return [(str(t.path), k) for t in tasks for k in range(samples)]


def check_out(out: Path, ev: PolicyEvaluation) -> None:
    """Refuse a run folder whose shards hold another checkpoint's samples or a candidate set's
    records: the merge would mix them under one label."""
    from hpc.results.hdf5 import file_attrs

    for shard in sorted(out.glob("shard-*.h5")):
        try:
            theirs = file_attrs(shard).get("checkpoint")
        except OSError as e:
            raise ResultsFileError(f"results {shard}: cannot read as HDF5 ({e})") from None
        if theirs != str(ev.checkpoint.directory):
            raise UsageError(f"--out {out}: {shard.name} holds results of {theirs or 'a candidate set'}; "
                             "evaluate this checkpoint into another folder")


class SampleStore:
    """A shard file of a policy evaluation as the store of its run (hpc.engine): per sample, the
    trajectory and then the record, so a sample whose record a crash lost is played again, and the
    merge keeps only the trajectory of the record it keeps."""

    def __init__(self, path: Path, attrs: dict[str, str], step: int):
        from hpc.results.hdf5 import RecordStore
        from hpc.results.training import EvaluationWriter

        self.records = RecordStore(path, attrs, EvaluationWriter)
        self.step = step

    def finished(self) -> set:
        return self.records.finished()

    def append(self, item, result: tuple[dict, EvalRecord]) -> None:
        trajectory, record = result
        self.records.writer.append_trajectories(self.step, STAGE, [trajectory])
        self.records.append(item, record)

    def close(self) -> None:
        self.records.close()


def evaluate_shard(ev: PolicyEvaluation, items: list[tuple[str, int]], shard: int, shards: int, out: Path,
                   cfg: EvalConfig, preempted: threading.Event) -> dict:
    """Play and score this shard's samples that its file lacks, `ev.batch` episodes generated
    together, recording each sample as its batch ends. Stops once `preempted` is set (the requeued
    task plays the rest). Returns the summary jobs/evaluate.py prints."""
    from hpc.agent.backend import CachedBackend, LocalBackend
    from hpc.agent.episode import Episode
    from hpc.config import config_to_dict
    from hpc.engine import Item, run_items
    from hpc.policy.generate import SamplingParams
    from hpc.policy.serve import ServerConfig, load_served_policy
    from hpc.results.hdf5 import provenance
    from hpc.rl.rollout import rollout
    from hpc.sandbox.prestart import prestarted_workers
    from hpc.task import load_task

    path = out / f"shard-{shard:04d}.h5"
    mine = [item for i, item in enumerate(items) if i % shards == shard]
    tasks = {p: load_task(p) for p in dict.fromkeys(p for p, _ in mine)}
    samples = [Item((tasks[p].task_id, ev.sample_path(tasks[p].task_id, k)), (tasks[p], k)) for p, k in mine]
    folder = out / f"episodes-{shard:04d}"
    run_cfg = ev.checkpoint.config
    turns: dict = {}   # sample key -> (how its episode ended, replies)

    def play(todo, stop):
        """The samples' episodes, a batch at a time; the policy loads only when one is left to play."""
        if not todo:
            return
        policy = load_served_policy(ServerConfig(checkpoint=str(ev.checkpoint.directory),
                                                 model_name=ev.checkpoint.label, seed=run_cfg.seed))
        backend = CachedBackend(LocalBackend(cfg))   # an identical state of a task is scored once
        count = lambda text: len(policy.tokenizer.encode(text))  # noqa: E731
        with prestarted_workers():   # the next evaluation's processes start while one runs
            for start in range(0, len(todo), ev.batch):
                if stop.is_set():
                    return
                batch = todo[start:start + ev.batch]
                shutil.rmtree(folder, ignore_errors=True)   # a killed run's episodes
                episodes = [Episode(item.payload[0], backend, ev.agent, folder / f"{i:04d}", count_tokens=count,
                                    system_in_context=run_cfg.include_system) for i, item in enumerate(batch)]
                params = SamplingParams(max_new_tokens=ev.agent.max_response_tokens, temperature=ev.temperature,
                                        top_p=ev.top_p, seed=ev.seed * 1_000_003 + shard * 7919 + start)
                try:
                    played, _ = rollout(policy.model, policy.cfg, policy.format, episodes, list(range(len(batch))),
                                        params, run_cfg.rollout.concurrency)
                finally:
                    for e in episodes:
                        e.close()
                    shutil.rmtree(folder, ignore_errors=True)
                for item, sample in zip(batch, played):
                    task, k = item.payload
                    sample.trajectory.record["candidate_path"] = ev.sample_path(task.task_id, k)
                    turns[item.key] = (sample.trajectory.end_reason, sample.replies)
                    yield item, ({**sample.trajectory.to_dict(), "sample": k}, sample.trajectory.eval_record())

    def describe(item, result) -> str:
        task, k = item.payload
        rec = result[1]
        end, replies = turns[item.key]
        outcome = rec.reason if rec.failed_stage else f"reward {rec.reward:g}"
        return f"{task.task_id} sample {k} ({end}, {replies} turns): {outcome}"

    store = SampleStore(path, {**provenance(config_to_dict(cfg)), **ev.attrs()}, ev.checkpoint.step)
    try:
        run = run_items(samples, play, store, describe=describe, label=f"shard {shard}", stop=preempted,
                        stream=sys.stdout)
    finally:
        store.close()
    if run.stopped:
        log.info("shard %d: preempted; its unrecorded samples run again after the requeue", shard)
    return {"shard": shard, "file": str(path), "evaluated": run.evaluated, "skipped": run.skipped}

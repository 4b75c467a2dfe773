"""The training loop: the recipe's stages in order, a metrics row per step, checkpoints, resume.

One `Trainer` per trainer process. It owns the policy and the critic (megatron-core models,
tensor-parallel over its TP group and pipelined over its PP group, data-parallel over the rest),
their optimizers (megatron's DDP and mixed-precision Adam with fp32 master weights, gradients
clipped to `rl.clip_grad`, losses a token mean over every data-parallel rank: docs/rl.md), and
an evaluation backend that scores episodes (in this process's sandboxed workers, or on the MPI
reward pool). Every global step is one of: an SFT step, an RL step
(sample episodes, score them, update), a rejection-sampling round, a value-pretraining step, or
a measurement.

Under pipeline parallelism the updates run megatron's pipeline schedule (`hpc.rl.staged`), and
rollouts sample from a whole replica of the policy on each rank of the pipeline group, its
weights gathered from the stages before each rollout: the pipeline's ranks each play a share of
the step's episodes and exchange the finished samples, so every rank holds the same batch. A
pipelined decode would hold one copy of the weights, but would send each generated token's
activations through every stage and keep the stages waiting on one another's tools; the replica
costs one gather of the weights per rollout, and its ranks sample, and run tools, in parallel.
It holds the whole model's weights on each rank, but no gradients or optimizer state, which are
most of what the stages split.

Reproducible resume: each step's tasks and sampling seeds are functions of (seed, step), and
a checkpoint holds the models, the optimizers, the rejection-sampled data and the position in
the recipe; the metrics file is cut back to the checkpoint's step. A resumed run therefore
continues with the same next step (the same tasks and seeds; rewards come from fresh timings).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from hpc.agent.backend import EvalBackend
from hpc.agent.config import agent_config, agent_config_dict
from hpc.agent.episode import Episode
from hpc.errors import UserError, os_reason
from hpc.policy.chat import ChatFormat, chat_format
from hpc.policy.generate import SamplingParams
from hpc.policy.model import load_stages
from hpc.policy.optimizer import ModelOptimizer
from hpc.policy.tokenizer import Tokenizer, load_tokenizer, train_bpe
from hpc.rl.batch import RolloutBatch, pack
from hpc.rl.demonstrations import Demonstration, demonstrations
from hpc.rl.rollout import RolloutStats, Sample, rollout
from hpc.rl.staged import pipeline_gather
from hpc.rl.supervised import reference_logprobs, sft_step, value_step
from hpc.rl.train_config import BPE_KINDS, StageConfig, TrainConfig, saved_train_config, train_config_dict
from hpc.rl.update import ppo_epochs
from hpc.task import Task, discover_tasks, select_tasks

if TYPE_CHECKING:
    from hpc.policy.serve import ServedPolicy

log = logging.getLogger(__name__)

STATE_FILE = "trainer.json"
CHECKPOINTS = "checkpoints"    # RUN/checkpoints/{policy,critic,reference}/ and STATE_FILE.N
TOKENIZER = "tokenizer"        # RUN/tokenizer/: the vocabulary trained for a bpe tokenizer


@dataclass
class Position:
    """Where the run is in its recipe: the next step to run is `step + 1`."""

    step: int = 0              # global steps done
    stage: int = 0             # index of the current stage
    stage_step: int = 0        # steps done in it


@dataclass
class PolicyCheckpoint:
    """One saved policy of a training run, with the run's config: sampling from it again needs
    the tokenizer, chat format and agent limits it was trained with."""

    run: Path
    step: int
    config: TrainConfig

    @property
    def root(self) -> Path:
        return self.run / CHECKPOINTS / "policy"

    @property
    def directory(self) -> Path:
        from hpc.policy.checkpoint import checkpoint_dir

        return checkpoint_dir(self.root, self.step)

    @property
    def tokenizer(self) -> str:
        """The run's trained vocabulary (bpe), else the config's tokenizer."""
        return str(self.run / TOKENIZER) if self.config.tokenizer.startswith(BPE_KINDS) else self.config.tokenizer

    @property
    def label(self) -> str:
        """How reports name it: the run folder and the step."""
        return f"{self.run.name}@{self.step}"


def find_policy_checkpoint(path: str | Path) -> PolicyCheckpoint:
    """The policy checkpoint at `path`: a training run folder, its checkpoints/ or
    checkpoints/policy/ folder (each meaning the latest step), or one step's folder
    (checkpoints/policy/iter_N). UserError (one line) for anything else."""
    from hpc.policy.checkpoint import META, checkpoint_dir, latest_step

    given = Path(path).resolve()
    if not given.is_dir():
        raise UserError(f"policy {path}: no such folder")
    if (given / META).is_file() and given.name.startswith("iter_") and given.name[5:].isdigit():
        root, step = given.parent, int(given.name[5:])
    else:
        root = next((r for r in (given / CHECKPOINTS / "policy", given / "policy", given)
                     if (r / "latest").is_file()), None)
        if root is None:
            raise UserError(f"policy {path}: no policy checkpoint there (give a training run folder of "
                            "jobs/train.py or one of its checkpoints)")
        step = latest_step(root)
    if root.name != "policy" or root.parent.name != CHECKPOINTS:
        raise UserError(f"policy {path}: not a checkpoint of a training run (RUN/{CHECKPOINTS}/policy/iter_N)")
    ckpt_state = root.parent / f"{STATE_FILE}.{step}"
    if not ckpt_state.is_file() or not (checkpoint_dir(root, step) / META).is_file():
        raise UserError(f"policy {path}: step {step} is not a complete checkpoint (no {ckpt_state.name} or {META})")
    config = saved_train_config(json.loads(ckpt_state.read_text())["config"])
    return PolicyCheckpoint(root.parent.parent, step, config)


def load_policy(ckpt: PolicyCheckpoint) -> ServedPolicy:
    """The checkpoint's policy for sampling, in this process alone (TP = PP = 1), with its
    tokenizer and chat format: what `hpc serve` loads."""
    from hpc.policy.serve import ServerConfig, load_served_policy

    cfg = ckpt.config
    return load_served_policy(ServerConfig(checkpoint=str(ckpt.root), step=ckpt.step, tokenizer=ckpt.tokenizer,
                                           chat_format=cfg.chat_format, model_name=ckpt.label,
                                           include_system=cfg.include_system, seed=cfg.seed))


def complete_step(root: Path) -> int | None:
    """The newest step checkpointed whole under `root` (RUN/checkpoints): the one with a trainer
    state file. Each model's `latest` moves as that model's part is saved, so it may name a step
    whose other parts a kill cut short."""
    steps = [int(p.suffix[1:]) for p in root.glob(f"{STATE_FILE}.*") if p.suffix[1:].isdigit()]
    return max(steps, default=None)


class DataParallel:
    """Metric and sample gathering over the data-parallel group (a no-op alone). Gradients are
    reduced by megatron's DDP inside the optimizers (`hpc.policy.optimizer`)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.group = ps.get_data_parallel_group()
        self.size = ps.get_data_parallel_world_size()
        self.rank = ps.get_data_parallel_rank()

    def gather(self, items: list) -> list:
        if self.size == 1:
            return items
        out: list = [None] * self.size
        torch.distributed.all_gather_object(out, items, group=self.group)
        return [x for part in out for x in part]


class Trainer:
    """See the module docstring. `backend` scores episodes; where the run stands is logged."""

    def __init__(self, cfg: TrainConfig, out: str | Path, backend: EvalBackend):
        from hpc.policy.parallel import init_parallel

        self.cfg, self.out, self.backend = cfg, Path(out), backend
        self.layout = init_parallel(tensor=cfg.policy.parallel.tensor, pipeline=cfg.policy.parallel.pipeline,
                                    seed=cfg.seed)
        self.is_writer = self.layout.rank == 0
        self.device = torch.device(self.layout.device)
        self.dp = DataParallel()
        self.tasks = select_tasks(discover_tasks(cfg.tasks), cfg.only, cfg.tasks)
        self._check_minibatches()
        self.demos: list[Demonstration] = []
        if any(s.kind == "sft" and s.data == "solutions" for s in cfg.stages) or cfg.tokenizer.startswith(BPE_KINDS):
            self.demos = demonstrations(self.tasks, cfg.solutions, cfg.eval.backend, cfg.starter_demonstrations)
        self.tokenizer = self._tokenizer()
        self.fmt: ChatFormat = chat_format(self.tokenizer, cfg.chat_format, cfg.include_system)
        self._build_models()
        self.position = Position()
        self.rft_samples: list[Sample] = []
        self.reference: torch.nn.Module | None = None
        self._resume()

    # -- set-up -----------------------------------------------------------------------------
    def _check_minibatches(self) -> None:
        """Every trainer rank takes the same ppo_epochs x minibatches optimizer steps per RL step
        (their gradients are summed at each): so each rank's share of a step's episodes must
        split into rl.minibatches parts. Said here, not at the first RL step."""
        tasks = max(1, min(self.cfg.rollout.tasks_per_step, len(self.tasks)) // self.dp.size)
        for stage in self.cfg.stages:
            rows = tasks * (stage.samples_per_task or self.cfg.rl.group_size)
            if stage.kind == "ppo" and rows < self.cfg.rl.minibatches:
                raise UserError(f"config rl.minibatches: {self.cfg.rl.minibatches} minibatches, but stage "
                                f"{stage.name} gives a trainer rank as few as {rows} episodes per step "
                                f"(tasks selected: {len(self.tasks)}, trainer ranks: {self.dp.size})")

    def _tokenizer(self) -> Tokenizer:
        spec = self.cfg.tokenizer
        if not spec.startswith(BPE_KINDS):
            return load_tokenizer(spec)
        folder = self.out / TOKENIZER
        if self.is_writer and not (folder / "tokenizer.json").exists():
            texts = [self._prompt_text(d.task) for d in self.demos] + [d.reply for d in self.demos]
            kind, _, size = spec.partition(":")
            train_bpe(texts, int(size), folder, split_words=kind == "bpe")
        self._barrier()
        return load_tokenizer(folder)

    def _prompt_text(self, task: Task) -> str:
        from hpc.agent.instructions import task_prompt

        return task_prompt(task, self.cfg.eval, agent_config(agent_config_dict(self.cfg.agent), mode="single_turn"))

    def _build_models(self) -> None:
        from hpc.policy import model

        cfg = self.cfg
        init = Path(cfg.init) if cfg.init else None
        if init is not None and (init / "config.json").exists():
            from hpc.policy.hf_convert import hf_policy_config

            mcfg = hf_policy_config(init, tensor=cfg.policy.parallel.tensor, pipeline=cfg.policy.parallel.pipeline)
        else:
            mcfg = copy.deepcopy(cfg.policy)
            if init is None:
                mcfg.vocab_size = self.tokenizer.vocab_size
        if mcfg.vocab_size < self.tokenizer.vocab_size:
            raise UserError(f"tokenizer {cfg.tokenizer}: {self.tokenizer.vocab_size} tokens, the policy has "
                            f"{mcfg.vocab_size}")
        mcfg.validate(self.layout.world_size)
        self.model_cfg = mcfg
        torch.manual_seed(cfg.seed)
        self.policy = model.build_policy(mcfg).to(self.device)
        if init is not None and (init / "config.json").exists():
            from hpc.policy.hf_convert import load_hf

            load_hf(self.policy, init, mcfg)
        elif init is not None:
            from hpc.policy.checkpoint import load_checkpoint

            load_checkpoint(init, self.policy)
        self.critic = model.build_critic(mcfg).to(self.device)
        if init is not None:
            state = model.critic_state_from_policy(self.policy.state_dict())
            self.critic.load_state_dict(state, strict=False)
        self.actor_opt = ModelOptimizer(self.policy, cfg.rl.actor_lr, cfg.rl.clip_grad)
        self.critic_opt = ModelOptimizer(self.critic, cfg.rl.critic_lr, cfg.rl.clip_grad)
        pipeline = self.layout.pp_size
        self.microbatches = mcfg.parallel.microbatches or pipeline
        self.replica = model.build_replica(mcfg).to(self.device) if pipeline > 1 else None

    def _frozen_copy(self) -> torch.nn.Module:
        """A second policy holding the current weights, without gradients (megatron modules hold
        process groups, so they are rebuilt rather than deep-copied)."""
        from hpc.policy import model

        ref = model.build_policy(self.model_cfg).to(self.device)
        ref.load_state_dict(self.policy.state_dict())
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out / CHECKPOINTS

    def _resume(self) -> None:
        from hpc.policy.checkpoint import load_checkpoint

        step = complete_step(self.checkpoint_root)
        if step is None:
            return
        load_checkpoint(self.checkpoint_root / "policy", self.policy, self.actor_opt, step)
        load_checkpoint(self.checkpoint_root / "critic", self.critic, self.critic_opt, step)
        state = json.loads((self.checkpoint_root / f"{STATE_FILE}.{step}").read_text())
        self.position = Position(**state["position"])
        rft = self.checkpoint_root / f"rft.{step}.pt"
        if rft.exists():
            self.rft_samples = torch.load(rft, weights_only=False)
        if state.get("reference"):
            self.reference = self._frozen_copy()
            load_checkpoint(self.checkpoint_root / "reference", self.reference, None, step)
        if self.position.stage >= len(self.cfg.stages):
            log.info("the run is complete (%d steps): nothing to train", self.position.step)
        else:
            log.info("resumed at step %d (stage %s, step %d of it)", self.position.step,
                     self.cfg.stages[self.position.stage].name, self.position.stage_step)

    def save(self) -> Path:
        """Checkpoint the models, the optimizers and the run's position (collective). The trainer
        state file, renamed into place last, publishes the step (`complete_step`): a save killed
        before it leaves the previous checkpoint as the one a resume takes."""
        from hpc.policy.checkpoint import save_checkpoint, write_durably

        step = self.position.step
        root = self.checkpoint_root
        save_checkpoint(root / "policy", step, self.policy, self.actor_opt, self.model_cfg)
        save_checkpoint(root / "critic", step, self.critic, self.critic_opt, self.model_cfg)
        if self.reference is not None:
            save_checkpoint(root / "reference", step, self.reference, None, self.model_cfg)
        if self.is_writer:
            state = {"position": vars(self.position), "reference": self.reference is not None,
                     "config": train_config_dict(self.cfg)}
            try:
                if self.rft_samples:
                    torch.save(self.rft_samples, root / f"rft.{step}.pt")
                write_durably(root / f"{STATE_FILE}.{step}", json.dumps(state, indent=1, default=str))
            except OSError as e:
                raise UserError(f"checkpoint {root}: step {step} cannot be written ({os_reason(e)}); the "
                                f"checkpoints saved before it are whole: make room and run again to resume "
                                f"from the last") from None
        self._barrier()
        return root / "policy"

    # -- the loop ---------------------------------------------------------------------------
    def run(self, on_step: Callable[[dict[str, Any], list[Sample]], None] | None = None) -> Position:
        """Run the recipe from where it stands to its end; `on_step(metrics, samples)` after each
        step, with the samples of every data-parallel replica (metrics rows and trajectories go
        to the results file there)."""
        cfg, pos = self.cfg, self.position
        while pos.stage < len(cfg.stages):
            stage = cfg.stages[pos.stage]
            if pos.stage_step == 0:
                self._enter(stage)
            t0 = time.monotonic()
            self._set_lr(stage)
            metrics, samples = self._step(stage)
            pos.step += 1
            pos.stage_step += 1
            metrics.update(step=pos.step, stage=stage.name, stage_step=pos.stage_step,
                           step_s=time.monotonic() - t0, timestamp=time.time())
            if pos.stage_step == stage.steps:   # a checkpoint holds the next step's position
                pos.stage += 1
                pos.stage_step = 0
            episodes = self.dp.gather(samples)   # every data-parallel replica's, for the writer
            if on_step is not None:
                on_step(metrics, episodes)
            if pos.step % cfg.checkpoint_every == 0 or pos.stage == len(cfg.stages):
                self.save()
        return pos

    def _stage_lr(self, stage: StageConfig) -> float:
        lr = stage.lr or (self.cfg.rl.critic_lr if stage.kind == "value" else self.cfg.rl.actor_lr)
        if stage.lr_end > 0:
            lr += (stage.lr_end - lr) * self.position.stage_step / max(1, stage.steps - 1)
        return lr

    def _set_lr(self, stage: StageConfig) -> float:
        lr = self._stage_lr(stage)
        for group in (self.critic_opt if stage.kind == "value" else self.actor_opt).param_groups:
            group["lr"] = lr
        return lr

    def _enter(self, stage: StageConfig) -> None:
        lr = self._set_lr(stage)
        if stage.kind == "ppo":
            for group in self.critic_opt.param_groups:
                group["lr"] = self.cfg.rl.critic_lr
            self.reference = self._frozen_copy()   # KL is measured against the policy the stage began with
        log.info("stage %s: %s, %d steps, lr %g", stage.name, stage.kind, stage.steps, lr)

    def _step(self, stage: StageConfig) -> tuple[dict[str, Any], list[Sample]]:
        if stage.kind == "sft":
            return self._sft(stage), []
        if stage.kind == "value":
            return self._value(stage), []
        samples, metrics = self._sample(stage)
        t0 = time.monotonic()
        if stage.kind == "ppo":
            metrics.update(self._ppo(samples, stage.samples_per_task or self.cfg.rl.group_size))
        elif stage.kind == "rft":
            self.rft_samples += samples
            kept = [s for s in self.rft_samples if _keep(s, stage.min_reward)]
            metrics["samples_kept"] = len(kept)
        metrics.setdefault("optimizer_steps", 0)     # rft, measure: sampled only
        metrics["update_s"] = time.monotonic() - t0
        return metrics, samples

    def _rng(self, salt: int = 0) -> random.Random:
        return random.Random(self.cfg.seed * 1_000_003 + (self.position.step + 1) * 7919 + salt)

    # -- supervised steps ---------------------------------------------------------------------
    def _sft_data(self, stage: StageConfig) -> list[tuple[list[int], list[bool]]]:
        if stage.data == "solutions":
            out = []
            for d in self.demos:
                prompt = self.fmt.render(_first_messages(d.task, self))
                reply = self.tokenizer.encode(d.reply) + [self.fmt.stop_id]
                out.append((prompt + reply, [False] * len(prompt) + [True] * len(reply)))
            return out
        kept = [s for s in self.rft_samples if _keep(s, self._rft_stage().min_reward)]
        if not kept:
            raise UserError(f"stage {stage.name}: rejection sampling kept no trajectory (none with reward > "
                            f"{self._rft_stage().min_reward} and no loop or malformed call)")
        return [(s.tokens, s.generated) for s in kept]

    def _rft_stage(self) -> StageConfig:
        return [s for s in self.cfg.stages[:self.position.stage] if s.kind == "rft"][-1]

    def _minibatch(self, data: list, size: int, salt: int) -> list:
        rng = self._rng(salt)
        picks = [data[rng.randrange(len(data))] for _ in range(size)]
        return picks[self.dp.rank::self.dp.size] or picks[:1]

    def _sft(self, stage: StageConfig) -> dict[str, Any]:
        rows = self._minibatch(self._sft_data(stage), stage.batch_size, 1)
        batch = pack([r[0] for r in rows], [r[1] for r in rows], [[0.0] * len(r[0]) for r in rows],
                     [0.0] * len(rows), self.tokenizer.pad_id, self.device)
        t0 = time.monotonic()
        loss, opt = sft_step(self.policy, self.actor_opt, batch, self.model_cfg.vocab_size, self.microbatches)
        return {"sft_loss": loss, "update_s": time.monotonic() - t0, "samples": len(rows), "optimizer_steps": 1,
                "update_tokens": _tokens(batch), "actor_grad_norm": opt.grad_norm,
                "actor_update_ratio": opt.update_ratio}

    def _value(self, stage: StageConfig) -> dict[str, Any]:
        rows = self._minibatch(self.rft_samples, stage.batch_size, 2)
        batch = _batch(rows, self.tokenizer.pad_id, self.device)
        t0 = time.monotonic()
        loss, ev, opt = value_step(self.critic, self.critic_opt, batch, self.microbatches)
        return {"value_loss": loss, "explained_variance": ev, "update_s": time.monotonic() - t0,
                "samples": len(rows), "optimizer_steps": 1, "critic_grad_norm": opt.grad_norm,
                "critic_update_ratio": opt.update_ratio}

    # -- sampling and RL ----------------------------------------------------------------------
    def _step_tasks(self) -> list[Task]:
        n = min(self.cfg.rollout.tasks_per_step, len(self.tasks))
        picked = self._rng(3).sample(self.tasks, n)
        return picked[self.dp.rank::self.dp.size] or picked[:1]

    def _sample(self, stage: StageConfig) -> tuple[list[Sample], dict[str, Any]]:
        cfg = self.cfg
        agent = agent_config(agent_config_dict(cfg.agent), mode=stage.mode)
        group = stage.samples_per_task or cfg.rl.group_size
        tasks = self._step_tasks()
        folder = self.out / "episodes" / f"step_{self.position.step + 1:06d}_rank{self.layout.rank}"
        shutil.rmtree(folder, ignore_errors=True)
        # Under pipeline parallelism each stage's rank plays every pp-th episode on the replica.
        pp, stage = self.layout.pp_size, self.layout.pp_rank
        plays = [(g, k) for g in range(len(tasks)) for k in range(group)][stage::pp]
        count = lambda text: len(self.tokenizer.encode(text))  # noqa: E731
        episodes = [Episode(tasks[g], self.backend, agent, folder / f"{g:03d}_{k:03d}", count_tokens=count,
                            system_in_context=cfg.include_system) for g, k in plays]
        params = SamplingParams(max_new_tokens=agent.max_response_tokens, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, seed=self._rng(4).randrange(1 << 30) + 7907 * stage)
        if self.replica is not None:
            load_stages(self.replica, self.policy)
        try:
            samples, stats = rollout(self.replica or self.policy, self.model_cfg, self.fmt, episodes,
                                     [g for g, _ in plays], params, cfg.rollout.concurrency)
        finally:
            for e in episodes:
                e.close()
            shutil.rmtree(folder, ignore_errors=True)
        if pp > 1:
            shares = pipeline_gather((samples, stats))
            samples = [None] * sum(len(part) for part, _ in shares)
            for r, (part, _) in enumerate(shares):
                samples[r::pp] = part
            stats = RolloutStats(generation_s=max(s.generation_s for _, s in shares),
                                 tools_s=max(s.tools_s for _, s in shares),
                                 generated_tokens=sum(s.generated_tokens for _, s in shares),
                                 turns=max(s.turns for _, s in shares))
        everything = self.dp.gather([_outcome(s, cfg.eval.reward.margin) for s in samples])
        rewards = [o["reward"] for o in everything]
        metrics: dict[str, Any] = {
            "samples": len(everything),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "pass_rate": statistics.fmean(o["correct"] for o in everything),
            # nothing is timed under the correctness reward: no rate, rather than a rate of 0
            "faster_than_eager_rate": (statistics.fmean(o["faster_eager"] for o in everything)
                                       if cfg.eval.reward.kind != "correctness" else math.nan),
            "faster_than_compile_rate": (statistics.fmean(o["faster_compile"] for o in everything)
                                         if cfg.eval.reward.kind != "correctness" else math.nan),
            "response_length_mean": statistics.fmean(o["generated"] for o in everything),
            "response_clipped_ratio": sum(o["clipped"] for o in everything) / max(1, sum(o["replies"] for o in everything)),
            "malformed_rate": statistics.fmean(o["malformed"] for o in everything),
            "turns_mean": statistics.fmean(o["replies"] for o in everything),
            "tokens_per_second": stats.generated_tokens / stats.generation_s if stats.generation_s else math.nan,
            "generation_s": stats.generation_s, "reward_s": stats.tools_s,
        }
        return samples, metrics

    def _ppo(self, samples: list[Sample], group: int) -> dict[str, Any]:
        rl = dataclasses.replace(self.cfg.rl, group_size=group)
        batch = _batch(samples, self.tokenizer.pad_id, self.device)
        ref = reference_logprobs(self.reference, batch, self.model_cfg.vocab_size) if self.reference is not None else None
        stats = ppo_epochs(self.policy, self.actor_opt, batch, rl, self.model_cfg.vocab_size,
                           critic=self.critic if rl.algorithm == "ppo" else None,
                           critic_opt=self.critic_opt if rl.algorithm == "ppo" else None, ref_logprobs=ref,
                           rng=self._rng(5), microbatches=self.microbatches)
        out = stats.as_dict()
        out.pop("reward_mean")
        out["update_tokens"] = _tokens(batch) * rl.ppo_epochs   # each epoch passes the batch once, in minibatches
        return out

    def _barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def _first_messages(task: Task, trainer: Trainer) -> list[dict[str, str]]:
    """The system and user messages a single-turn episode of `task` starts with."""
    from hpc.agent.instructions import render_instructions

    agent = agent_config(agent_config_dict(trainer.cfg.agent), mode="single_turn")
    return [{"role": "system", "content": render_instructions(trainer.cfg.eval, agent)},
            {"role": "user", "content": trainer._prompt_text(task)}]


def _keep(sample: Sample, min_reward: float) -> bool:
    """Rejection sampling's filter: reward above the bar, no loop, no malformed call."""
    t = sample.trajectory
    return (sample.reward > min_reward and t is not None and not t.loop_detected and t.malformed_calls == 0
            and sample.generated_tokens > 0)


def _outcome(sample: Sample, margin: float) -> dict[str, Any]:
    rec = sample.trajectory.record if sample.trajectory is not None else {}
    correct = bool(rec.get("correct"))
    return {"reward": sample.reward, "correct": correct,
            "faster_eager": correct and (rec.get("speedup_eager") or 0) > 1 + margin,
            "faster_compile": correct and (rec.get("speedup_compile") or 0) > 1 + margin,
            "generated": sample.generated_tokens, "clipped": sample.clipped_replies, "replies": sample.replies,
            "malformed": bool(sample.trajectory and sample.trajectory.malformed_calls)}


def _tokens(batch: RolloutBatch) -> int:
    """Tokens of `batch` a forward pass computes on, padding excluded."""
    return int((~batch.pad_mask).sum())


def _batch(samples: list[Sample], pad_id: int, device: torch.device) -> RolloutBatch:
    return pack([s.tokens for s in samples], [s.generated for s in samples], [s.logprobs for s in samples],
                [s.reward for s in samples], pad_id, device)

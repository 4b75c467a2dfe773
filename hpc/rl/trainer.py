"""The training loop: the recipe's stages in order, a metrics row per step, checkpoints, resume.

One `Trainer` per trainer process. It owns the policy and the critic (megatron-core models,
tensor-parallel over its TP group and pipelined over its PP group, data-parallel over the rest),
their optimizers (megatron's DDP and mixed-precision Adam with fp32 master weights, gradients
clipped to `rl.clip_grad`, losses a token mean over every data-parallel rank: docs/rl.md), and
an evaluation backend that scores episodes (in this process's sandboxed workers, or on the MPI
reward pool). Every global step is one step of the current stage, run by its kind's handler
(`hpc.rl.stages`: an SFT step, an RL step (sample episodes, score them, update), a
rejection-sampling round, a value-pretraining step, or a measurement); checkpoints are
`hpc.rl.checkpoints`'.

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
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hpc.agent.backend import EvalBackend
from hpc.errors import ConfigError
from hpc.policy.chat import ChatFormat, chat_format
from hpc.policy.optimizer import ModelOptimizer
from hpc.policy.parallel import DataParallel, barrier
from hpc.policy.tokenizer import Tokenizer, load_tokenizer, train_bpe
from hpc.rl.checkpoints import REFERENCE, TOKENIZER, Position, RunCheckpoints, TrainerState
from hpc.rl.demonstrations import Demonstration, demonstrations
from hpc.rl.rollout import Sample
from hpc.rl.stages import HANDLERS, StageHandler, prompt_text
from hpc.rl.train_config import BPE_KINDS, StageConfig, TrainConfig
from hpc.task import discover_tasks, select_tasks

log = logging.getLogger(__name__)


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
        self.checkpoints = RunCheckpoints(self.out, self.is_writer)
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
                raise ConfigError(f"config rl.minibatches: {self.cfg.rl.minibatches} minibatches, but stage "
                                  f"{stage.name} gives a trainer rank as few as {rows} episodes per step "
                                  f"(tasks selected: {len(self.tasks)}, trainer ranks: {self.dp.size})")

    def _tokenizer(self) -> Tokenizer:
        spec = self.cfg.tokenizer
        if not spec.startswith(BPE_KINDS):
            return load_tokenizer(spec)
        folder = self.out / TOKENIZER
        if self.is_writer and not (folder / "tokenizer.json").exists():
            texts = [prompt_text(self.cfg, d.task) for d in self.demos] + [d.reply for d in self.demos]
            kind, _, size = spec.partition(":")
            train_bpe(texts, int(size), folder, split_words=kind == "bpe")
        barrier()
        return load_tokenizer(folder)

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
            raise ConfigError(f"tokenizer {cfg.tokenizer}: {self.tokenizer.vocab_size} tokens, the policy has "
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
        overlap = mcfg.parallel.overlap_grad_reduce
        self.actor_opt = ModelOptimizer(self.policy, cfg.rl.actor_lr, cfg.rl.clip_grad, overlap)
        self.critic_opt = ModelOptimizer(self.critic, cfg.rl.critic_lr, cfg.rl.clip_grad, overlap)
        pipeline = self.layout.pp_size
        self.microbatches = mcfg.parallel.microbatches or pipeline
        self.replica = model.build_replica(mcfg).to(self.device) if pipeline > 1 else None

    def frozen_copy(self) -> torch.nn.Module:
        """A second policy holding the current weights, without gradients (megatron modules hold
        process groups, so they are rebuilt rather than deep-copied): a PPO stage's KL reference."""
        from hpc.policy import model

        ref = model.build_policy(self.model_cfg).to(self.device)
        ref.load_state_dict(self.policy.state_dict())
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # -- checkpoints ------------------------------------------------------------------------
    def _resume(self) -> None:
        step = self.checkpoints.latest()
        if step is None:
            return
        self.checkpoints.load_model("policy", step, self.policy, self.actor_opt)
        self.checkpoints.load_model("critic", step, self.critic, self.critic_opt)
        state = self.checkpoints.load_state(step)
        self.position, self.rft_samples = state.position, state.rft_samples
        if state.reference:
            self.reference = self.frozen_copy()
            self.checkpoints.load_model(REFERENCE, step, self.reference)
        if self.position.stage >= len(self.cfg.stages):
            log.info("the run is complete (%d steps): nothing to train", self.position.step)
        else:
            log.info("resumed at step %d (stage %s, step %d of it)", self.position.step,
                     self.cfg.stages[self.position.stage].name, self.position.stage_step)

    def save(self) -> Path:
        """Checkpoint the models, the optimizers and the run's position (collective): see
        `hpc.rl.checkpoints.RunCheckpoints.save`. The policy's checkpoint root."""
        models: dict[str, tuple[torch.nn.Module, ModelOptimizer | None]] = {
            "policy": (self.policy, self.actor_opt), "critic": (self.critic, self.critic_opt)}
        if self.reference is not None:
            models[REFERENCE] = (self.reference, None)
        state = TrainerState(self.position, self.rft_samples, self.reference is not None)
        return self.checkpoints.save(state, models, self.model_cfg, self.cfg)

    # -- the loop ---------------------------------------------------------------------------
    def run(self, on_step: Callable[[dict[str, Any], list[Sample]], None] | None = None) -> Position:
        """Run the recipe from where it stands to its end; `on_step(metrics, samples)` after each
        step, with the samples of every data-parallel replica (metrics rows and trajectories go
        to the results file there)."""
        cfg, pos = self.cfg, self.position
        while pos.stage < len(cfg.stages):
            stage = cfg.stages[pos.stage]
            handler = HANDLERS[stage.kind]
            if pos.stage_step == 0:
                self._enter(stage, handler)
            t0 = time.monotonic()
            self._set_lr(stage, handler)
            metrics, samples = handler.step(self, stage)
            pos.step += 1
            pos.stage_step += 1
            metrics.add(step=pos.step, stage=stage.name, stage_step=pos.stage_step,
                        step_s=time.monotonic() - t0, timestamp=time.time())
            if pos.stage_step == stage.steps:   # a checkpoint holds the next step's position
                pos.stage += 1
                pos.stage_step = 0
            episodes = self.dp.gather(samples)   # every data-parallel replica's, for the writer
            if on_step is not None:
                on_step(metrics.as_dict(), episodes)
            if pos.step % cfg.checkpoint_every == 0 or pos.stage == len(cfg.stages):
                self.save()
        return pos

    def _stage_lr(self, stage: StageConfig, handler: StageHandler) -> float:
        lr = stage.lr or (self.cfg.rl.critic_lr if handler.trains_critic else self.cfg.rl.actor_lr)
        if stage.lr_end > 0:
            lr += (stage.lr_end - lr) * self.position.stage_step / max(1, stage.steps - 1)
        return lr

    def _set_lr(self, stage: StageConfig, handler: StageHandler) -> float:
        lr = self._stage_lr(stage, handler)
        for group in (self.critic_opt if handler.trains_critic else self.actor_opt).param_groups:
            group["lr"] = lr
        return lr

    def _enter(self, stage: StageConfig, handler: StageHandler) -> None:
        lr = self._set_lr(stage, handler)
        handler.enter(self, stage)
        log.info("stage %s: %s, %d steps, lr %g", stage.name, stage.kind, stage.steps, lr)

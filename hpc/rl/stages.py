"""What each kind of stage does (`stages[].kind`, hpc.rl.train_config): one handler per kind,
which the trainer calls when a stage begins (`enter`) and at each of its steps (`step`: the
step's metrics and the samples it played, every data-parallel replica's metrics alike).

- `sft`: one optimizer step of cross-entropy on demonstrations or on what rejection sampling kept;
- `value`: one optimizer step fitting the critic to the outcomes of the rft stages' samples;
- `ppo`: sample and score episodes, then a PPO / GRPO update (`hpc.rl.update.ppo_epochs`), the KL
  measured against the policy the stage began with;
- `rft`: sample and score, the samples added to the rejection-sampled data;
- `measure`: sample and score, nothing learned.

Every step's draws (tasks, minibatches, sampling seeds) come from `step_rng`, a function of the
run's seed and the step: a resumed run repeats them.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc.agent.config import agent_config, agent_config_dict
from hpc.agent.episode import Episode
from hpc.errors import TrainingError
from hpc.policy.generate import SamplingParams
from hpc.policy.model import load_stages
from hpc.rl.batch import RolloutBatch, pack
from hpc.rl.metrics import StepMetrics, outcome, rollout_metrics
from hpc.rl.rollout import RolloutStats, Sample, rollout
from hpc.rl.staged import pipeline_gather
from hpc.rl.supervised import reference_logprobs, sft_step, value_step
from hpc.rl.train_config import StageConfig, TrainConfig
from hpc.rl.update import ppo_epochs
from hpc.task import Task

if TYPE_CHECKING:
    import torch

    from hpc.agent.backend import EvalBackend
    from hpc.policy.chat import ChatFormat
    from hpc.policy.config import PolicyModelConfig
    from hpc.policy.optimizer import ModelOptimizer
    from hpc.policy.parallel import DataParallel, Layout
    from hpc.policy.tokenizer import Tokenizer
    from hpc.rl.checkpoints import Position
    from hpc.rl.demonstrations import Demonstration


class StageContext(Protocol):
    """What a stage uses of the trainer running it (`hpc.rl.trainer.Trainer`, which imports this
    module): the config, the run's data, the models and optimizers, and where the run stands."""

    cfg: TrainConfig
    out: Path
    backend: EvalBackend
    layout: Layout
    device: torch.device
    dp: DataParallel
    tasks: list[Task]
    demos: list[Demonstration]
    tokenizer: Tokenizer
    fmt: ChatFormat
    model_cfg: PolicyModelConfig
    microbatches: int
    policy: torch.nn.Module
    critic: torch.nn.Module
    actor_opt: ModelOptimizer
    critic_opt: ModelOptimizer
    replica: torch.nn.Module | None          # the whole policy to sample from under pipeline parallelism
    reference: torch.nn.Module | None        # the KL reference of a PPO stage
    position: Position
    rft_samples: list[Sample]                # every rft stage's samples so far

    def frozen_copy(self) -> torch.nn.Module: ...


class StageHandler:
    """One kind of stage. `trains_critic`: the stage's learning rate is the critic's optimizer's
    (from `rl.critic_lr` unless the stage sets one), else the policy's (`rl.actor_lr`)."""

    trains_critic = False

    def enter(self, trainer: StageContext, stage: StageConfig) -> None:
        """When the stage begins (a run resumed midway through it does not enter it again)."""

    def step(self, trainer: StageContext, stage: StageConfig) -> tuple[StepMetrics, list[Sample]]:
        raise NotImplementedError


class SupervisedFineTuning(StageHandler):
    """`sft`: one optimizer step of the policy's cross-entropy on a minibatch of replies."""

    def step(self, trainer: StageContext, stage: StageConfig) -> tuple[StepMetrics, list[Sample]]:
        rows = minibatch(trainer, _sft_data(trainer, stage), stage.batch_size, 1)
        batch = pack([r[0] for r in rows], [r[1] for r in rows], [[0.0] * len(r[0]) for r in rows],
                     [0.0] * len(rows), trainer.tokenizer.pad_id, trainer.device)
        t0 = time.monotonic()
        loss, opt = sft_step(trainer.policy, trainer.actor_opt, batch, trainer.model_cfg.vocab_size,
                             trainer.microbatches)
        return StepMetrics(sft_loss=loss, update_s=time.monotonic() - t0, samples=len(rows), optimizer_steps=1,
                           update_tokens=_tokens(batch), actor_grad_norm=opt.grad_norm,
                           actor_update_ratio=opt.update_ratio), []


class ValuePretraining(StageHandler):
    """`value`: one optimizer step fitting the critic to a minibatch of rejection-sampled outcomes."""

    trains_critic = True

    def step(self, trainer: StageContext, stage: StageConfig) -> tuple[StepMetrics, list[Sample]]:
        rows = minibatch(trainer, trainer.rft_samples, stage.batch_size, 2)
        batch = _batch(rows, trainer.tokenizer.pad_id, trainer.device)
        t0 = time.monotonic()
        loss, ev, opt = value_step(trainer.critic, trainer.critic_opt, batch, trainer.microbatches)
        return StepMetrics(value_loss=loss, explained_variance=ev, update_s=time.monotonic() - t0,
                           samples=len(rows), optimizer_steps=1, critic_grad_norm=opt.grad_norm,
                           critic_update_ratio=opt.update_ratio), []


class SampledStage(StageHandler):
    """A stage whose step samples and scores episodes (`sample`), then `learn`s from them: as it
    is, `measure`, which learns nothing."""

    def step(self, trainer: StageContext, stage: StageConfig) -> tuple[StepMetrics, list[Sample]]:
        samples, metrics = sample(trainer, stage)
        t0 = time.monotonic()
        metrics.add(**self.learn(trainer, stage, samples))
        metrics.add(update_s=time.monotonic() - t0)
        return metrics, samples

    def learn(self, trainer: StageContext, stage: StageConfig, samples: list[Sample]) -> dict[str, Any]:
        """What the stage does with this replica's samples; its metrics."""
        return {"optimizer_steps": 0}


class RejectionSampling(SampledStage):
    """`rft`: the samples join the rejection-sampled data (a later sft stage with `data: rft`
    fine-tunes on those `keep` passes, a value stage fits the critic to all of them)."""

    def learn(self, trainer: StageContext, stage: StageConfig, samples: list[Sample]) -> dict[str, Any]:
        trainer.rft_samples += samples
        return {"samples_kept": len([s for s in trainer.rft_samples if keep(s, stage.min_reward)]),
                "optimizer_steps": 0}


class PolicyOptimization(SampledStage):
    """`ppo`: an update of `rl.ppo_epochs` x `rl.minibatches` optimizer steps on the samples
    (PPO with the critic, or GRPO over each task's group), the KL measured against the policy
    the stage began with."""

    def enter(self, trainer: StageContext, stage: StageConfig) -> None:
        for group in trainer.critic_opt.param_groups:
            group["lr"] = trainer.cfg.rl.critic_lr
        trainer.reference = trainer.frozen_copy()

    def learn(self, trainer: StageContext, stage: StageConfig, samples: list[Sample]) -> dict[str, Any]:
        rl = dataclasses.replace(trainer.cfg.rl, group_size=stage.samples_per_task or trainer.cfg.rl.group_size)
        batch = _batch(samples, trainer.tokenizer.pad_id, trainer.device)
        vocab = trainer.model_cfg.vocab_size
        temperature = trainer.cfg.rollout.temperature   # the samples' log-probs are at it: so are the trainer's
        ref = (reference_logprobs(trainer.reference, batch, vocab, temperature) if trainer.reference is not None
               else None)
        stats = ppo_epochs(trainer.policy, trainer.actor_opt, batch, rl, vocab,
                           critic=trainer.critic if rl.algorithm == "ppo" else None,
                           critic_opt=trainer.critic_opt if rl.algorithm == "ppo" else None, ref_logprobs=ref,
                           rng=step_rng(trainer, 5), microbatches=trainer.microbatches, temperature=temperature)
        out = stats.as_dict()
        out.pop("reward_mean")   # the rollout's, over every replica's samples, is the step's
        out["update_tokens"] = _tokens(batch) * rl.ppo_epochs   # each epoch passes the batch once, in minibatches
        return out


HANDLERS: dict[str, StageHandler] = {"sft": SupervisedFineTuning(), "value": ValuePretraining(),
                                     "ppo": PolicyOptimization(), "rft": RejectionSampling(),
                                     "measure": SampledStage()}


def step_rng(trainer: StageContext, salt: int = 0) -> random.Random:
    """The draws of the step about to run: a function of (seed, step, salt), so a resumed run repeats them."""
    return random.Random(trainer.cfg.seed * 1_000_003 + (trainer.position.step + 1) * 7919 + salt)


def minibatch(trainer: StageContext, data: list, size: int, salt: int) -> list:
    """`size` rows drawn from `data` for the step, this data-parallel replica's share of them."""
    rng = step_rng(trainer, salt)
    picks = [data[rng.randrange(len(data))] for _ in range(size)]
    return picks[trainer.dp.rank::trainer.dp.size] or picks[:1]


def keep(sample: Sample, min_reward: float) -> bool:
    """Rejection sampling's filter: reward above the bar, no loop, no malformed call."""
    t = sample.trajectory
    return (sample.reward > min_reward and t is not None and not t.loop_detected and t.malformed_calls == 0
            and sample.generated_tokens > 0)


def prompt_text(cfg: TrainConfig, task: Task) -> str:
    """The user message a single-turn episode of `task` starts with."""
    from hpc.agent.instructions import task_prompt

    return task_prompt(task, cfg.eval, agent_config(agent_config_dict(cfg.agent), mode="single_turn"))


def first_messages(cfg: TrainConfig, task: Task) -> list[dict[str, str]]:
    """The system and user messages a single-turn episode of `task` starts with."""
    from hpc.agent.instructions import render_instructions

    agent = agent_config(agent_config_dict(cfg.agent), mode="single_turn")
    return [{"role": "system", "content": render_instructions(cfg.eval, agent)},
            {"role": "user", "content": prompt_text(cfg, task)}]


def _rft_stage(trainer: StageContext) -> StageConfig:
    """The last rft stage before the current one (the config makes sure there is one)."""
    return [s for s in trainer.cfg.stages[:trainer.position.stage] if s.kind == "rft"][-1]


def _sft_data(trainer: StageContext, stage: StageConfig) -> list[tuple[list[int], list[bool]]]:
    """(tokens, which of them are trained on) per sequence: each demonstration's prompt and reply,
    or each trajectory rejection sampling kept."""
    if stage.data == "solutions":
        out = []
        for d in trainer.demos:
            prompt = trainer.fmt.render(first_messages(trainer.cfg, d.task))
            reply = trainer.tokenizer.encode(d.reply) + [trainer.fmt.stop_id]
            out.append((prompt + reply, [False] * len(prompt) + [True] * len(reply)))
        return out
    min_reward = _rft_stage(trainer).min_reward
    kept = [s for s in trainer.rft_samples if keep(s, min_reward)]
    if not kept:
        raise TrainingError(f"stage {stage.name}: rejection sampling kept no trajectory (none with reward > "
                            f"{min_reward} and no loop or malformed call)")
    return [(s.tokens, s.generated) for s in kept]


def _step_tasks(trainer: StageContext) -> list[Task]:
    n = min(trainer.cfg.rollout.tasks_per_step, len(trainer.tasks))
    picked = step_rng(trainer, 3).sample(trainer.tasks, n)
    return picked[trainer.dp.rank::trainer.dp.size] or picked[:1]


def sample(trainer: StageContext, stage: StageConfig) -> tuple[list[Sample], StepMetrics]:
    """Play and score the step's episodes: this data-parallel replica's tasks, each
    `samples_per_task` (default `rl.group_size`) times. Returns its samples and the rollout's
    metrics over every replica's."""
    cfg = trainer.cfg
    agent = agent_config(agent_config_dict(cfg.agent), mode=stage.mode)
    group = stage.samples_per_task or cfg.rl.group_size
    tasks = _step_tasks(trainer)
    folder = trainer.out / "episodes" / f"step_{trainer.position.step + 1:06d}_rank{trainer.layout.rank}"
    shutil.rmtree(folder, ignore_errors=True)
    # Under pipeline parallelism each pipeline stage's rank plays every pp-th episode on the replica.
    pp, pp_rank = trainer.layout.pp_size, trainer.layout.pp_rank
    plays = [(g, k) for g in range(len(tasks)) for k in range(group)][pp_rank::pp]
    count = lambda text: len(trainer.tokenizer.encode(text))  # noqa: E731
    episodes = [Episode(tasks[g], trainer.backend, agent, folder / f"{g:03d}_{k:03d}", count_tokens=count,
                        system_in_context=cfg.include_system) for g, k in plays]
    params = SamplingParams(max_new_tokens=agent.max_response_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, seed=step_rng(trainer, 4).randrange(1 << 30) + 7907 * pp_rank)
    if trainer.replica is not None:
        load_stages(trainer.replica, trainer.policy)
    try:
        samples, stats = rollout(trainer.replica or trainer.policy, trainer.model_cfg, trainer.fmt, episodes,
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
    outcomes = trainer.dp.gather([outcome(s, cfg.eval.reward.margin) for s in samples])
    return samples, rollout_metrics(outcomes, stats, timed=cfg.eval.reward.kind != "correctness")


def _tokens(batch: RolloutBatch) -> int:
    """Tokens of `batch` a forward pass computes on, padding excluded."""
    return int((~batch.pad_mask).sum())


def _batch(samples: list[Sample], pad_id: int, device: torch.device) -> RolloutBatch:
    return pack([s.tokens for s in samples], [s.generated for s in samples], [s.logprobs for s in samples],
                [s.reward for s in samples], pad_id, device)

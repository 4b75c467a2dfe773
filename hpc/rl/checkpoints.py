"""A training run's checkpoints: how a trainer saves a step whole or not at all and resumes from
the newest whole one, and how an evaluation (or `hpc serve`) finds a run's policy and what it was
trained with.

RUN/checkpoints/ holds one megatron dist-checkpoint root per model (policy/, critic/, and
reference/ while a PPO stage's KL reference exists: iter_N folders, each written to a staging
folder and renamed into place, and a `latest` pointer; `hpc.policy.checkpoint`), the
rejection-sampled data of step N (rft.N.pt) and the trainer state file trainer.json.N (the
position in the recipe, whether a reference was saved, the config). The state file, fsync'd and
renamed into place last, publishes step N (`complete_step`): each model's `latest` moves as that
model's part is saved, so a save killed midway leaves the previous published step as the one a
resume takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpc.errors import CheckpointError, os_reason
from hpc.policy.parallel import barrier
from hpc.rl.train_config import BPE_KINDS, TrainConfig, saved_train_config, train_config_dict

if TYPE_CHECKING:
    from hpc.policy.config import PolicyModelConfig
    from hpc.rl.rollout import Sample

STATE_FILE = "trainer.json"
CHECKPOINTS = "checkpoints"    # RUN/checkpoints/{policy,critic,reference}/ and STATE_FILE.N
TOKENIZER = "tokenizer"        # RUN/tokenizer/: the vocabulary trained for a bpe tokenizer
REFERENCE = "reference"        # the KL reference's checkpoint root, saved while it exists


@dataclass
class Position:
    """Where the run is in its recipe: the next step to run is `step + 1`."""

    step: int = 0              # global steps done
    stage: int = 0             # index of the current stage
    stage_step: int = 0        # steps done in it


@dataclass
class TrainerState:
    """What a checkpoint holds besides the models: the position, the rejection-sampled data, and
    whether a KL reference was saved with it."""

    position: Position = field(default_factory=Position)
    rft_samples: list[Sample] = field(default_factory=list)
    reference: bool = False


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
    (checkpoints/policy/iter_N). CheckpointError (one line) for anything else."""
    from hpc.policy.checkpoint import META, checkpoint_dir, latest_step

    given = Path(path).resolve()
    if not given.is_dir():
        raise CheckpointError(f"policy {path}: no such folder")
    if (given / META).is_file() and given.name.startswith("iter_") and given.name[5:].isdigit():
        root, step = given.parent, int(given.name[5:])
    else:
        root = next((r for r in (given / CHECKPOINTS / "policy", given / "policy", given)
                     if (r / "latest").is_file()), None)
        if root is None:
            raise CheckpointError(f"policy {path}: no policy checkpoint there (give a training run folder of "
                                  "jobs/train.py or one of its checkpoints)")
        step = latest_step(root)
    if root.name != "policy" or root.parent.name != CHECKPOINTS:
        raise CheckpointError(f"policy {path}: not a checkpoint of a training run (RUN/{CHECKPOINTS}/policy/iter_N)")
    ckpt_state = root.parent / f"{STATE_FILE}.{step}"
    if not ckpt_state.is_file() or not (checkpoint_dir(root, step) / META).is_file():
        raise CheckpointError(f"policy {path}: step {step} is not a complete checkpoint (no {ckpt_state.name} or {META})")
    config = saved_train_config(json.loads(ckpt_state.read_text())["config"])
    return PolicyCheckpoint(root.parent.parent, step, config)


def complete_step(root: Path) -> int | None:
    """The newest step checkpointed whole under `root` (RUN/checkpoints): the one with a trainer
    state file. Each model's `latest` moves as that model's part is saved, so it may name a step
    whose other parts a kill cut short."""
    steps = [int(p.suffix[1:]) for p in root.glob(f"{STATE_FILE}.*") if p.suffix[1:].isdigit()]
    return max(steps, default=None)


class RunCheckpoints:
    """The checkpoints of one run folder, as its trainer saves and resumes them. Saves and loads
    are collective over the trainer ranks (each holds its shards); `is_writer` (rank 0) writes the
    trainer state file and the rejection-sampled data."""

    def __init__(self, run: Path, is_writer: bool) -> None:
        self.root = run / CHECKPOINTS
        self.is_writer = is_writer

    def latest(self) -> int | None:
        """The step to resume from: the newest published one (`complete_step`), None before any."""
        return complete_step(self.root)

    def load_model(self, name: str, step: int, model: torch.nn.Module, optimizer=None) -> None:
        """Model `name`'s weights (and its optimizer's state, when given) at `step`."""
        from hpc.policy.checkpoint import load_checkpoint

        load_checkpoint(self.root / name, model, optimizer, step)

    def load_state(self, step: int) -> TrainerState:
        state = json.loads((self.root / f"{STATE_FILE}.{step}").read_text())
        rft = self.root / f"rft.{step}.pt"
        return TrainerState(Position(**state["position"]),
                            torch.load(rft, weights_only=False) if rft.exists() else [],
                            bool(state.get("reference")))

    def save(self, state: TrainerState, models: dict[str, tuple[torch.nn.Module, object]],
             model_cfg: PolicyModelConfig, config: TrainConfig) -> Path:
        """Checkpoint `models` (name -> (model, its optimizer or None), saved in that order), then
        publish the step with the trainer state file (collective); the policy's checkpoint root.
        A state file that cannot be written (a full disk) is a CheckpointError: the checkpoints saved
        before it are whole."""
        from hpc.policy.checkpoint import save_checkpoint, write_durably

        step = state.position.step
        root = self.root
        for name, (model, optimizer) in models.items():
            save_checkpoint(root / name, step, model, optimizer, model_cfg)
        if self.is_writer:
            saved = {"position": vars(state.position), "reference": state.reference,
                     "config": train_config_dict(config)}
            try:
                if state.rft_samples:
                    torch.save(state.rft_samples, root / f"rft.{step}.pt")
                write_durably(root / f"{STATE_FILE}.{step}", json.dumps(saved, indent=1, default=str))
            except OSError as e:
                raise CheckpointError(f"checkpoint {root}: step {step} cannot be written ({os_reason(e)}); the "
                                      f"checkpoints saved before it are whole: make room and run again to resume "
                                      f"from the last") from None
        barrier()
        return root / "policy"

"""Policy / critic checkpoints in megatron's `dist_checkpointing` format, with a step counter.

Layout under a root directory:

    ROOT/iter_0000100/     one dist_checkpointing checkpoint (model, optimizer, step)
    ROOT/iter_0000100/hpc_policy.json   step, model config and the TP/PP layout that saved it
    ROOT/latest            the step of the newest complete checkpoint

Every tensor is stored with its global shape and each rank's slice of it, so a checkpoint
saved under one TP/PP layout loads under another (resharding). A save is written to
`iter_N.partial` and renamed to `iter_N` once every rank finished; `latest` moves after that,
so a save killed half-way leaves the previous checkpoint as the one to resume from.

The optimizer is any torch.optim optimizer whose per-parameter state is tensors shaped like
the parameter plus a scalar `step` shared by all parameters (SGD, Adam, AdamW, ...): its state
is sharded exactly like the parameters, so it reshards too. The trainer's optimizer
(`hpc.policy.optimizer.ModelOptimizer`, megatron's) gives its own sharded state (moments, fp32
master weights, step: `sharded_state_dict`), sharded like the parameters as well.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc.errors import CheckpointError, read_reason, storage_reason
from hpc.policy.config import PolicyModelConfig, config_dict, policy_config

if TYPE_CHECKING:
    from hpc.policy.optimizer import ModelOptimizer

META = "hpc_policy.json"


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """Where step `step` lives under ROOT."""
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | os.PathLike) -> int | None:
    """The step in ROOT/latest, or None when nothing was saved there."""
    try:
        return int((Path(root) / "latest").read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        raise CheckpointError(f"{Path(root) / 'latest'}: not a step number") from None


def _resolve_step(root: str | os.PathLike, step: int | None) -> int:
    if step is not None:
        return step
    latest = latest_step(root)
    if latest is None:
        raise CheckpointError(f"{root}: no checkpoint (no 'latest' file)")
    return latest


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))


def _optimizer_sharded(optimizer: torch.optim.Optimizer, model_sharded: dict, state_keys: list[str]) -> dict:
    """The optimizer's state as sharded tensors mirroring the model parameters' sharding."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = _optimizer_params(optimizer)
    state = optimizer.state_dict()
    for index, param in enumerate(params):
        # A parameter without state yet (never stepped) gets zeros, so every rank saves and
        # loads the same set of keys.
        per_param = state["state"].setdefault(index, {})
        for key in state_keys:
            if key != "step" and key not in per_param:
                per_param[key] = torch.zeros_like(param)
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError("checkpoint: the optimizer's step differs between parameters")
    id_map = get_param_id_to_sharded_param_map(model_sharded, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    state["common_step"] = steps.pop() if steps else None
    return state


def _is_megatron(optimizer: Any) -> bool:
    """Whether `optimizer` shards its own state (the trainer's ModelOptimizer), not a torch.optim one."""
    return optimizer is not None and hasattr(optimizer, "sharded_state_dict")


def _state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    return sorted({k for s in optimizer.state.values() for k in s})


def write_durably(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all, and on disk before this returns (a file that names a
    finished step must not reach the disk before the step does)."""
    from hpc.results.journal import replace_durably

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    replace_durably(tmp, path)


def _no_room(folder: Path) -> str | None:
    """"no space left on device" when the file system of `folder` has under 1 MiB left."""
    try:
        st = os.statvfs(folder if folder.exists() else folder.parent)
    except OSError:
        return None
    return "no space left on device" if st.f_bavail * st.f_frsize < 1 << 20 else None


def _die_with(parent: int) -> None:
    """In a child process: SIGKILL when `parent` ends (PR_SET_PDEATHSIG), or now if it already has."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


_writer_manager = None


def _writer_results_queue() -> None:
    """Hand megatron's checkpoint writer a results queue whose server dies with this process.

    The writer collects its results through a queue served by a process spawned at the first save
    (a multiprocessing Manager, ~570 MB) that lives as long as the trainer, and nothing ends it
    when the trainer is killed (SIGKILL, the OOM killer): one outlived its trainer by 20+ minutes,
    holding the job's log open. megatron keeps the queue in a module global, made on first use, so
    the one made here, by a manager started with PR_SET_PDEATHSIG, is the one it uses."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _writer_manager
    if filesystem_async._results_queue is None:
        _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        _writer_manager.start(initializer=_die_with, initargs=(os.getpid(),))
        filesystem_async._results_queue = _writer_manager.Queue()


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | ModelOptimizer | None = None,
                    cfg: PolicyModelConfig | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Save model (+ optimizer) at `step` under ROOT; collective over all ranks.

    `extra` is small JSON-able data stored with the checkpoint (returned by load).
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    directory = checkpoint_dir(root, step)
    staging = directory.with_name(directory.name + ".partial")
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    torch.distributed.barrier()
    model_sharded = model.sharded_state_dict()
    state: dict[str, Any] = {"model": model_sharded, "step": step, "extra": extra or {}}
    if _is_megatron(optimizer):
        state["optimizer"] = optimizer.sharded_state_dict(model_sharded)
        state["optimizer_state_keys"] = []
    elif optimizer is not None:
        keys = _state_keys(optimizer)
        state["optimizer"] = _optimizer_sharded(optimizer, model_sharded, keys)
        state["optimizer_state_keys"] = keys
    _writer_results_queue()
    try:
        dist_checkpointing.save(state, str(staging))
    except BaseException as e:   # torch's CheckpointException is a BaseException, wrapping the writers' errors
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        reason = storage_reason(e) or _no_room(staging)   # torch's writer may say only "unexpected pos"
        if reason is None:
            raise
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)   # what it wrote gives the room back
        raise CheckpointError(f"checkpoint {directory}: cannot write ({reason}); the checkpoints saved before it "
                              f"are whole: make room and run again to resume from the last") from None
    torch.distributed.barrier()
    if rank == 0:
        meta = {"step": step, "optimizer": optimizer is not None,
                "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
                "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
                "config": config_dict(cfg) if cfg is not None else None}
        write_durably(staging / META, json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(staging, directory)
        write_durably(Path(root) / "latest", f"{step}\n")
    torch.distributed.barrier()
    return directory


def load_checkpoint(root: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | ModelOptimizer | None = None,
                    step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Load ROOT's checkpoint at `step` (default: latest) into model (+ optimizer), whatever
    TP/PP layout saved it. Returns (step, extra). Collective over all ranks."""
    from megatron.core import dist_checkpointing

    step = _resolve_step(root, step)
    directory = checkpoint_dir(root, step)
    if not (directory / META).exists():
        raise CheckpointError(f"{directory}: not a complete checkpoint (no {META})")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if optimizer is not None and "optimizer" not in common:
        raise CheckpointError(f"{directory}: saved without optimizer state")
    model_sharded = model.sharded_state_dict()
    request: dict[str, Any] = {"model": model_sharded}
    if _is_megatron(optimizer):
        request["optimizer"] = optimizer.sharded_state_dict(model_sharded, is_loading=True)
    elif optimizer is not None:
        request["optimizer"] = _optimizer_sharded(optimizer, model_sharded, common["optimizer_state_keys"])
    loaded = dist_checkpointing.load(request, str(directory))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if _is_megatron(optimizer):
        optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        state = loaded["optimizer"]
        common_step = state.pop("common_step", None)
        if common_step is not None:
            for per_param in state["state"].values():
                per_param["step"] = torch.tensor(common_step)
        state["param_groups"] = deepcopy(state["param_groups"])
        optimizer.load_state_dict(state)
    return int(loaded["step"]), dict(loaded.get("extra", {}))


def checkpoint_config(root: str | os.PathLike, step: int | None = None) -> PolicyModelConfig:
    """The model config a checkpoint was saved with (its parallel sizes are the saving run's;
    set them to the loading run's before building the model)."""
    meta_file = checkpoint_dir(root, _resolve_step(root, step)) / META
    try:
        meta = json.loads(meta_file.read_text())
    except OSError as e:
        raise CheckpointError(f"{meta_file}: {read_reason(e)}") from None
    if not meta.get("config"):
        raise CheckpointError(f"{meta_file}: saved without a model config")
    return policy_config(meta["config"])

"""The trainer's optimizer: megatron-core's DistributedDataParallel and mixed-precision Adam.

A model's parameters may be bf16 (the GPU default). Adam stepping bf16 weights directly loses
the update: at |w| ~ 0.02 a bf16 step is ~1e-4, and a learning rate of 3e-6 moves a weight by
about the learning rate, so the update rounds to nothing. megatron's optimizer keeps an fp32
master copy of each bf16 parameter (and fp32 moments), steps the master and copies it back
rounded. Its DDP wrapper gathers each parameter's gradient into an fp32 bucket (`main_grad`,
grad_reduce_in_fp32) and all-reduces the buckets over the data-parallel group.

With more than one data-parallel rank the all-reduce overlaps the backward pass (megatron's
`overlap_grad_reduce`, `policy.parallel.overlap_grad_reduce`): a bucket's all-reduce starts,
asynchronously, as soon as the backward has produced every gradient in it, and `step()` waits
for it. Over several microbatches (gradient accumulation, `hpc.rl.staged.train_pass`) only the
last one's backward may start it: the wrapper is wired into the model's TransformerConfig as
megatron's training loop does, `no_sync_func` (megatron's schedules run every other microbatch
under it) and `grad_sync_func` (pipeline stages after the first start their all-reduce when
their last backward is done, aligned with the others, as megatron's `align_grad_reduce`).
The first step of an optimizer does not overlap: megatron counts in it which gradients each
bucket waits for, and all-reduces after the backward.

The gradients are summed over data-parallel ranks, not averaged (the model's TransformerConfig
says `calculate_per_token_loss`, `hpc.policy.model`): each rank's loss is its token sum divided
by the step's token count over every rank (`hpc.rl.staged.train_pass`), so the sum is the
gradient of the global token mean, and a rank with more tokens weighs more.

With pipeline stages and tied embeddings the first stage's embedding and the last stage's output
layer are one weight: after the data-parallel all-reduce, `step()` sums their gradients over the
embedding group (megatron's finalize_model_grads order: `sum_tied_embedding_grads`).

`step()` clips the gradients to the global norm `clip_grad` (0: no clipping) and returns the
norm measured before clipping and the update-to-weight ratio ||w_after - w_before|| / ||w_before||
over the fp32 master weights, both over the whole model (every tensor- and pipeline-parallel
shard, each replicated parameter once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hpc.policy import cpu_shim


@dataclass(frozen=True)
class StepStats:
    """One optimizer step's measurements (NaN where an optimizer does not measure them)."""

    grad_norm: float
    update_ratio: float


NOT_MEASURED = StepStats(math.nan, math.nan)


def step_stats(optimizer: Any) -> StepStats:
    """Step `optimizer`; its StepStats (a plain torch optimizer's: NOT_MEASURED)."""
    out = optimizer.step()
    return out if isinstance(out, StepStats) else NOT_MEASURED


class ModelOptimizer:
    """`model` wrapped in megatron's DDP and stepped by megatron's optimizer (see the module
    docstring). Forward and backward run on `model` itself: the DDP wrapper's hooks catch its
    gradients. `param_groups` are the optimizer's (set `lr` there). One per model: the wrapper's
    hooks and the model config's sync functions are this optimizer's.

    `overlap_grad_reduce`: start the data-parallel all-reduce during the backward pass (only
    where there is more than one data-parallel rank; `overlapped` says whether it does)."""

    def __init__(self, model: torch.nn.Module, lr: float, clip_grad: float, overlap_grad_reduce: bool = True) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = model
        self.overlapped = overlap_grad_reduce and ps.get_data_parallel_world_size() > 1
        if self.overlapped and model.config.no_sync_func is not None:
            raise ValueError("the model already has an optimizer that overlaps its gradient all-reduce")
        bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
        with cpu_shim.megatron_on_cpu():
            self.ddp = DistributedDataParallel(
                model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                            overlap_grad_reduce=self.overlapped), model)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=bf16, clip_grad=clip_grad,
                                params_dtype=torch.bfloat16 if bf16 else torch.float32),
                [self.ddp])
        if self.overlapped:      # what megatron's schedules call (megatron's training loop sets them so)
            model.config.no_sync_func = self.ddp.no_sync
            model.config.grad_sync_func = self.ddp.start_grad_sync

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the optimizer steps (the master copies of bf16 parameters)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the DDP gradient buckets (and the masters' gradients) before a backward pass."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> StepStats:
        """Finish the all-reduce of the gradients over data-parallel ranks (wait for it when it
        overlapped the backward), sum the tied embedding's, clip, step; the step's StepStats."""
        params = self.master_params()
        before = [p.detach().clone() for p in params]
        with cpu_shim.megatron_on_cpu():
            self.ddp.finish_grad_sync()
            sum_tied_embedding_grads(self.model)
            _, grad_norm, _ = self.optimizer.step()
        delta = torch._foreach_sub(params, before)
        counted = [_counted(p) for p in params]
        squares = torch.stack([
            sum((d.float().square().sum() for d, c in zip(delta, counted) if c), torch.zeros(())),
            sum((b.float().square().sum() for b, c in zip(before, counted) if c), torch.zeros(()))])
        group = self.optimizer.get_grad_stats_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            squares = squares.to(params[0].device)
            torch.distributed.all_reduce(squares, group=group)
        moved, weight = squares.sqrt().tolist()
        return StepStats(float(grad_norm) if grad_norm is not None else math.nan,
                         moved / weight if weight > 0 else math.nan)

    def state_dict(self) -> dict:
        with cpu_shim.megatron_on_cpu():
            return self.optimizer.state_dict()

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool = False) -> dict:
        """The optimizer's state (moments, fp32 masters, step) sharded like `model_sharded`, for
        `dist_checkpointing` (`hpc.policy.checkpoint`): it reshards with the model.

        megatron 0.16.1's Float16OptimizerWithFloat16Params numbers its optimizer state over its
        bf16 parameters alone, which misnames the state when some parameters stay fp32 (the norm
        weights here: "Param id N does not match any model sharded param"); so the state is keyed
        here by each optimizer tensor's own model parameter, in the optimizer's order."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor,
                                                                optim_state_to_sharding_state)

        (inner,) = self.optimizer.chained_optimizers
        with cpu_shim.megatron_on_cpu():
            if is_loading:
                inner.init_state_fn(inner.optimizer, inner.config)
            state = inner.state_dict()
        if not hasattr(inner, "float16_groups"):        # fp32 parameters: the optimizer's params are the model's
            optim, masters = state, None
        else:
            optim, masters = state["optimizer"], state["fp32_from_fp16_params"]
        owner = {id(p.main_param): p for group in getattr(inner, "float16_groups", []) for p in group}
        model_params = [owner.get(id(p), p) for group in inner.optimizer.param_groups for p in group["params"]]
        ids = get_param_id_to_sharded_param_map(model_sharded, model_params)
        # A model that never stepped (the critic before its first PPO stage) saves zero moments
        # at step 0, so every checkpoint holds, and every load asks for, the same keys.
        stepped = [p for group in inner.optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(stepped):
            if not optim["state"].get(index):
                optim["state"][index] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        step = inner._extract_common_per_param_step(optim)
        optim_state_to_sharding_state(optim, ids, exclude_keys="step")
        optim["state"]["common_step"] = step if step is not None else torch.tensor(0.0)
        if masters is not None:
            by_param = {id(p): i for i, p in enumerate(model_params)}
            # A dict, not megatron's list of lists: dist_checkpointing's load does not merge
            # lists whose every item is sharded ("Cannot merge two lists with different lengths").
            state["fp32_from_fp16_params"] = {
                f"{g}.{i}": make_sharded_optimizer_tensor(ids[by_param[id(p)]], master,
                                                          prefix="optimizer.state.fp32_param")
                for g, (group, group_masters) in enumerate(zip(inner.float16_groups, masters))
                for i, (p, master) in enumerate(zip(group, group_masters))}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what `state_dict()` gave, or what `dist_checkpointing` loaded for `sharded_state_dict`."""
        masters = state_dict.get("fp32_from_fp16_params") if isinstance(state_dict, dict) else None
        if isinstance(masters, dict):
            groups = self.optimizer.chained_optimizers[0].float16_groups
            state_dict["fp32_from_fp16_params"] = [[masters[f"{g}.{i}"] for i in range(len(group))]
                                                   for g, group in enumerate(groups)]
        with cpu_shim.megatron_on_cpu():
            self.optimizer.load_state_dict(state_dict)


def sum_tied_embedding_grads(model: torch.nn.Module) -> None:
    """With pipeline stages, the first stage's embedding and the last stage's output layer are
    one tied weight: each gets the sum of both gradients (megatron's finalize_model_grads). Under
    megatron's DDP the gradient is in its fp32 bucket (`main_grad`) and this must follow the
    data-parallel all-reduce of that bucket (`ModelOptimizer.step`); without it, `.grad`."""
    from megatron.core import parallel_state as ps

    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if ps.get_pipeline_model_parallel_world_size() == 1 or not tied or not ps.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if hasattr(weight, "main_grad"):
        torch.distributed.all_reduce(weight.main_grad, group=ps.get_embedding_group())
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())


def _counted(param: torch.Tensor) -> bool:
    """Whether a norm over the model counts `param` on this rank: once per tensor-parallel group
    for replicated parameters, once for a tied embedding's two pipeline copies (megatron's rule
    for the grad norm)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)

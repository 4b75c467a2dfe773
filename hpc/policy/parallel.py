"""torch.distributed and megatron `parallel_state` for the policy, from the launcher's environment.

One call sets up the process group (NCCL with CUDA, gloo without), megatron's tensor-,
pipeline- and data-parallel groups, and the model-parallel RNG seeds. The rank layout comes
from whichever launcher started the process:

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- srun / sbatch (and submitit, which runs under srun): SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID, the first host of SLURM_JOB_NODELIST as master, a port derived from the job id;
- nothing: a single process on 127.0.0.1 with a free port.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from hpc.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """Where this process sits: global rank and its coordinates in the TP x PP x DP grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: str


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Rank, world size and rendezvous address as set by torchrun, srun or nobody."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "")) or "127.0.0.1"
        port = int(env.get("MASTER_PORT") or 20000 + job % 20000)
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         addr, port)
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port())


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[03-05,09],cpu1" -> "gpu03"); scontrol if
    present, else the compressed syntax parsed here."""
    if not nodelist:
        return ""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` ("" for every interface: a rendezvous other nodes reach)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_world(tensor: int, pipeline: int, world: int) -> None:
    """ConfigError unless `world` processes hold whole tensor x pipeline grids."""
    if world % (tensor * pipeline):
        raise ConfigError(f"config policy.parallel: tensor {tensor} x pipeline {pipeline} does not divide the {world} "
                          f"trainer process(es) started (start a multiple of {tensor * pipeline}: torchrun "
                          f"--nproc-per-node, srun -n, or --pool --trainers under mpirun)")


def init_parallel(tensor: int = 1, pipeline: int = 1, seed: int = 1234,
                  timeout_minutes: int = 30, environ: dict[str, str] | None = None) -> Layout:
    """Start torch.distributed (if not started) and megatron's model-parallel groups.

    Without CUDA this applies the CPU shim and uses gloo; with CUDA it binds the local rank's
    GPU and uses NCCL. `seed` seeds the default and tensor-parallel RNGs the megatron way
    (same across TP ranks for replicated weights, different per TP rank for sharded dropout).
    """
    from megatron.core import parallel_state, tensor_parallel

    from hpc.policy import cpu_shim

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_shim.apply()
    env = launch_env(environ)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else env.world_size
    check_world(tensor, pipeline, world)
    device = None
    if cuda:
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if cuda else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank, world_size=env.world_size, timeout=timedelta(minutes=timeout_minutes),
            device_id=device)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
        distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    """The layout of the already initialized process (see `init_parallel`)."""
    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    return Layout(
        rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")


class DataParallel:
    """Metric and sample gathering over this process's data-parallel group (a no-op alone).
    Gradients are reduced by megatron's DDP inside the optimizers (`hpc.policy.optimizer`)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.group = ps.get_data_parallel_group()
        self.size = ps.get_data_parallel_world_size()
        self.rank = ps.get_data_parallel_rank()

    def gather(self, items: list) -> list:
        """Every replica's `items`, in replica order, on every replica."""
        if self.size == 1:
            return items
        out: list = [None] * self.size
        torch.distributed.all_gather_object(out, items, group=self.group)
        return [x for part in out for x in part]


def barrier() -> None:
    """Wait for every process of torch.distributed (nothing when it is not started)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run_local(fn: Callable[..., Any], nprocs: int, *args: Any, threads_per_proc: int = 1) -> None:
    """Run `fn(*args)` in `nprocs` fresh local processes wired up as torchrun would (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), for TP/PP on one machine without a launcher.
    `fn` must be importable (a module-level function). Raises if any process fails."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_local_entry, args=(fn, nprocs, port, threads_per_proc, args), nprocs=nprocs,
                       join=True, start_method="spawn")


def _local_entry(rank: int, fn: Callable[..., Any], nprocs: int, port: int, threads: int,
                 args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    fn(*args)


def teardown() -> None:
    """Destroy megatron's groups and the process group, and remove the CPU shim, so a process
    can initialize again and the rest of it sees torch unpatched."""
    from megatron.core import parallel_state

    from hpc.policy import cpu_shim

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    cpu_shim.restore()

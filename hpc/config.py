"""Typed evaluation config: dataclasses with defaults, loaded from YAML, validated at load.

Every error names the offending key (e.g. `timing.iterations: expected int >= 1, got 0`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from hpc.errors import ConfigError, read_input

Backend = Literal["cpu", "cuda"]   # where an evaluation runs
BACKENDS: tuple[Backend, ...] = get_args(Backend)


def default_cache_dir() -> Path:
    """Compile objects and baseline timings live here unless the config says otherwise."""
    root = os.environ.get("HPC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hpc")
    return Path(root)


@dataclass
class CorrectnessConfig:
    trials: int = 5                      # fresh-seed trials of the task's own input distribution
    distributions: list[str] = field(default_factory=lambda: ["wide", "small"])  # one extra trial each
    atol_fp32: float = 1e-4               # in units of max(1, mean |reference output|)
    rtol_fp32: float = 1e-4
    atol_half: float = 1e-2               # fp16 and bf16
    rtol_half: float = 1e-2
    timed_checks: int = 10                # timed frames whose calls' outputs are all copied out and checked (secret)


@dataclass
class TimingConfig:
    warmup: int = 10
    iterations: int = 100
    flush_cache: bool = True
    flush_bytes_cpu: int = 128 << 20     # read through before each frame: 4x this machine's 32 MiB L3
    flush_bytes_cuda: int = 256 << 20
    calibration_calls: int = 30           # timed calls of the empty program: the handshake's fixed cost
    rounds: int = 10                      # the window's rounds: each times a share of every program's calls
    handshake: str = "auto"               # spin | block | auto (spin on cuda with 8+ cores, else block); cpu
                                          # spin: a window's program cores kept awake, everything polls
    batch_mb_cpu: int = 512               # inputs made ahead (and outputs copied out) per batch of calls
    batch_mb_cuda: int = 4096
    frame_ms_cpu: float = 2.0             # a timed frame runs calls back to back for about this long (at the
    frame_ms_cuda: float = 2.0            # reference's speed): the handshake is paid once a frame; 0: one call
    burst_max: int = 64                   # the most calls in one frame
    input_shifts_cpu: int = 32            # cpu: each frame's inputs this many places apart within 4 KiB, in
                                          # turn (4096/n bytes apart): a call's time can hang on where its output
                                          # lies against its input (4K aliasing), which each process's heap draws
    processes_cpu: int = 1                # cpu: each program (candidate, eager, torch.compile) timed in this many
                                          # processes of its own in one window, its figure its fastest one's: one
                                          # process's memory can run one program 2x slow for a whole window
    graphs: bool = True                   # cuda: each program's frame replayed as one CUDA graph (its figure
                                          # is the device's work, no host path) when every program of the window
                                          # can be recorded; else all are timed by calls


@dataclass
class FloorConfig:
    """Hardware ceilings for the floor check: a candidate faster than bytes/bandwidth or
    FLOPs/peak cannot be real (0 disables a backend's check). cuda defaults: H200 datasheet peaks,
    upper bounds of what it can do: HBM3e 4.8 TB/s, and for FLOPs dense TF32 on the tensor cores
    (495 TFLOP/s), not fp32 on the CUDA cores (67): fp32-accurate products are made of tf32 or bf16
    tensor-core products (3xTF32, the shipped GEMMs: ~130 TFLOP/s), and none of those schemes gets
    past tolerance with less than one TF32-rate product per fp32 product."""

    bandwidth_gb_s_cuda: float = 4800.0
    tflops_cuda: float = 495.0
    bandwidth_gb_s_cpu: float = 0.0
    tflops_cpu: float = 0.0

    def ceilings(self, backend: str) -> tuple[float, float]:
        return (self.bandwidth_gb_s_cuda, self.tflops_cuda) if backend == "cuda" else (
            self.bandwidth_gb_s_cpu, self.tflops_cpu)


@dataclass
class RewardConfig:
    kind: str = "discrete"                # discrete (CUDA Agent), continuous (speedup vs compile) or
                                          # correctness (1 correct, -1 not; nothing timed)
    margin: float = 0.05                  # "faster" means faster by more than this fraction
    incorrect: float = -1.0


@dataclass
class SandboxConfig:
    timeout_s: float = 300.0              # wall limit for one sandboxed process
    memory_gb: float = 16.0               # what a worker's cgroup may hold (every page of its processes, memfd
                                          # and tmpfs included, swap off); also its address space on cpu
    cpu_seconds: int = 1200
    max_open_files: int = 1024
    max_processes: int = 4096             # tasks (processes and threads) in a worker's cgroup
    max_file_mb: int = 1024
    isolate_network: bool = True
    restrict_writes: bool = True          # Landlock: writes only in the workdir and a private tmp
    restrict_reads: bool = True           # Landlock: reads only the system, Python, hpc and the workdir
    run_as_uid: int = 65534               # a root harness runs workers and compilers as this uid (-1: stay
    #                                       uid 0, without capabilities); only where it can read what they need


@dataclass
class RulesConfig:
    """What a candidate may use: the evaluator's op and library rules (not the LLM policy)."""

    allowed_torch_ops: list[str] = field(default_factory=list)  # extra aten ops allowed in forward
    require_custom_kernel: bool = True    # a forward that calls none of its own kernels fails
    libraries: list[str] = field(default_factory=list)  # vendor libraries kernels may use, e.g. [cublas]


@dataclass
class CompileConfig:
    cuda_arch: str = "sm_90a"              # Hopper with its arch-specific instructions (wgmma)
    timeout_s: float = 180.0
    max_library_mb: int = 256             # largest object, library or source set a compile may produce or read
    memory_gb: float = 8.0                # what each compiler run's cgroup may hold (cc1plus, cicc, ptxas, ...)


@dataclass
class BaselineConfig:
    # []: eager alone (no torch.compile in the window; the discrete reward then tops out at 2)
    compile_modes: list[str] = field(default_factory=lambda: ["default"])


@dataclass
class EvalConfig:
    backend: str = "cpu"
    scale: str = "cpu"
    seed: int = -1                        # -1: fresh random seeds per evaluation (recorded); >= 0: fixed
    cache_dir: str = ""                   # empty: $HPC_CACHE_DIR or ~/.cache/hpc
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    floor: FloorConfig = field(default_factory=FloorConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)

    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def validate(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("scale", self.scale, ("cpu", "gpu"))
        _check_choice("reward.kind", self.reward.kind, ("discrete", "continuous", "correctness"))
        _check_choice("timing.handshake", self.timing.handshake, ("auto", "spin", "block"))
        for d in self.correctness.distributions:
            _check_choice("correctness.distributions[]", d, tuple(DISTRIBUTIONS))
        from hpc.verify.static import LIBRARIES

        for lib in self.rules.libraries:
            _check_choice("rules.libraries[]", lib, tuple(LIBRARIES))
        for m in self.baseline.compile_modes:
            _check_choice("baseline.compile_modes[]", m,
                          ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
        if not self.baseline.compile_modes and self.reward.kind == "continuous":
            raise ConfigError("config baseline.compile_modes: the continuous reward is the speedup over torch.compile, "
                              "so it needs at least one mode")
        positive = {"correctness.trials": self.correctness.trials, "timing.iterations": self.timing.iterations,
                    "sandbox.timeout_s": self.sandbox.timeout_s, "sandbox.memory_gb": self.sandbox.memory_gb,
                    "timing.calibration_calls": self.timing.calibration_calls, "timing.rounds": self.timing.rounds,
                    "timing.batch_mb_cpu": self.timing.batch_mb_cpu, "timing.batch_mb_cuda": self.timing.batch_mb_cuda,
                    "timing.burst_max": self.timing.burst_max, "compile.timeout_s": self.compile.timeout_s,
                    "compile.memory_gb": self.compile.memory_gb,
                    "compile.max_library_mb": self.compile.max_library_mb}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"config {key}: must be > 0, got {value}")
        for key, value in {"timing.warmup": self.timing.warmup, "reward.margin": self.reward.margin,
                           "timing.frame_ms_cpu": self.timing.frame_ms_cpu,
                           "timing.frame_ms_cuda": self.timing.frame_ms_cuda,
                           "floor.bandwidth_gb_s_cuda": self.floor.bandwidth_gb_s_cuda,
                           "floor.tflops_cuda": self.floor.tflops_cuda, "floor.tflops_cpu": self.floor.tflops_cpu,
                           "floor.bandwidth_gb_s_cpu": self.floor.bandwidth_gb_s_cpu,
                           "correctness.timed_checks": self.correctness.timed_checks}.items():
            if value < 0:
                raise ConfigError(f"config {key}: must be >= 0, got {value}")
        if self.sandbox.run_as_uid < -1:
            raise ConfigError(f"config sandbox.run_as_uid: must be a uid >= 0, or -1 (stay uid 0), "
                              f"got {self.sandbox.run_as_uid}")
        shifts = self.timing.input_shifts_cpu
        if shifts not in (1, 2, 4, 8, 16, 32, 64):
            raise ConfigError(f"config timing.input_shifts_cpu: must be a power of two from 1 to 64 (at least 64 "
                              f"bytes apart, torch's alignment), got {shifts}")
        if not 1 <= self.timing.processes_cpu <= 4:
            raise ConfigError(f"config timing.processes_cpu: must be 1 to 4, got {self.timing.processes_cpu}")
        if self.timing.processes_cpu > self.timing.iterations:
            raise ConfigError("config timing.processes_cpu: must not exceed timing.iterations (each process needs a "
                              "timed frame)")
        if self.correctness.timed_checks > self.timing.iterations:
            raise ConfigError("config correctness.timed_checks: must not exceed timing.iterations")


# Extra input distributions for correctness trials, applied to floating-point inputs (see
# hpc.runner.inputs): rescaled by a constant, or multiplied elementwise by a positive heavy-tailed
# (Pareto, alpha 1.5) factor so that a kernel computing on part of the data shows. All keep signs,
# so tasks needing positive inputs stay valid.
DISTRIBUTIONS = {"wide": 8.0, "small": 1.0 / 64, "heavy": "pareto"}


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"config {key}: expected one of {', '.join(map(str, choices))}, got {value!r}")


# Keys that existed once, by the config class that had them: a config that still sets one gets a
# line saying what replaced it, wherever that class sits (`policy` of an evaluation config is
# `eval.policy` in a training config, whose own top-level `policy` is the LLM and stays valid).
REMOVED_KEYS: dict[tuple[type, str], str] = {
    **{(TimingConfig, k): "removed: every call is now timed on a clock outside the candidate's process "
                          "(docs/evaluator.md), so there is no in-process clock to check"
       for k in ("host_check_calls", "host_check_ratio", "host_check_attempts")},
    (TimingConfig, "start_gate_timeout_us"): "removed: calls are timed from outside the program's process, "
                                             "with no start gate (docs/evaluator.md)",
    (SandboxConfig, "share_outputs"): "removed: the reference worker always reads a candidate's outputs itself "
                                      "(CUDA IPC on cuda, process memory on cpu)",
    (EvalConfig, "policy"): "renamed to rules (the candidate's op and library rules)",
}


def build_config(cls, data: Any, prefix: str, also_known: tuple[str, ...] = ()):
    """A config dataclass from plain data (YAML), checking every key and type on the way; errors
    name the key by its dotted path under `prefix`. Shared by every config of the project.
    `also_known`: keys the caller took out before (`preset`), named with the known ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"config {prefix or 'top level'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            if (cls, key) in REMOVED_KEYS:
                raise ConfigError(f"config {path}: {REMOVED_KEYS[cls, key]}")
            raise ConfigError(f"config {path}: unknown key (known: {', '.join(sorted(names | set(also_known)))})")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(tp, value: Any, path: str):
    if dataclasses.is_dataclass(tp):
        return build_config(tp, value, path + ".")
    if get_origin(tp) is list:
        (inner,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config {path}: expected a list, got {type(value).__name__}")
        return [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"config {path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """A YAML config file's top-level mapping (empty file: {}); one-line ConfigError otherwise."""
    raw = read_input(Path(path), 16 << 20, f"config {path}", ConfigError)
    try:
        data = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping, got {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> EvalConfig:
    """Defaults, then the YAML file (if any), then non-None keyword overrides; validated."""
    data = read_yaml_mapping(path) if path is not None else {}
    cfg = build_config(EvalConfig, data, "")
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    cfg.validate()
    return cfg


def command_line_config(path: str | os.PathLike | None, backend: str | None = None, scale: str | None = None,
                        iterations: int | None = None, seed: int | None = None) -> EvalConfig:
    """The config a command asks for: the YAML file (or the defaults), then its flags on top. The
    scale follows --scale, else the backend named by --backend, else the file's."""
    cfg = load_config(path, backend=backend, seed=seed)
    if scale:
        cfg.scale = scale
    elif backend:
        cfg.scale = "gpu" if backend == "cuda" else "cpu"
    if iterations is not None:
        cfg.timing.iterations = iterations
        cfg.correctness.timed_checks = min(cfg.correctness.timed_checks, iterations)
        cfg.timing.processes_cpu = max(1, min(cfg.timing.processes_cpu, iterations))
    cfg.validate()
    return cfg


def config_to_dict(cfg: EvalConfig) -> dict:
    return dataclasses.asdict(cfg)

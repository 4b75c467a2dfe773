"""Typed synthesis config: dataclasses with defaults, loaded from YAML, validated at load.

Keys not given keep their defaults (nested sections too); unknown keys and wrong types are errors
that name the key, as in hpc.config (`config filters.runtime_ms_cpu: ...`). The `eval` section is
an evaluation config (docs/config.md): the filters run candidates under its backend, scale,
sandbox, timing protocol and cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.config import CorrectnessConfig, EvalConfig, TimingConfig, build_config, read_yaml_mapping
from hpc.errors import ConfigError, UsageError, UserError
from hpc.synthesis.context import FAMILIES

# The filter chain (hpc.synthesis.filters), in the order it runs: the names `filters.skip` may give.
FILTERS = ("load", "stochastic", "contaminated", "duplicate", "eager", "finite", "constant", "variation", "structure",
           "memory", "runtime", "compile")


@dataclass
class ComposeConfig:
    min_ops: int = 1                      # operators per task (views such as flatten not counted)
    max_ops: int = 5
    families: list[str] = field(default_factory=lambda: ["matrix", "sequence", "image", "volume", "signal",
                                                         "tokens"])
    # Sizes: the batch of each scale is chosen so a roofline estimate of eager lands near the target
    # (steering only; the runtime filter measures), within these per-tensor and per-operator caps.
    target_ms_gpu: float = 5.0
    target_ms_cpu: float = 1.0
    max_elements_gpu: int = 1 << 29
    max_elements_cpu: int = 1 << 22
    max_flops_gpu: float = 4e12
    max_flops_cpu: float = 2e9


@dataclass
class FilterConfig:
    skip: list[str] = field(default_factory=list)   # filters not to run (all but `load` may be skipped)
    runtime_ms_gpu: list[float] = field(default_factory=lambda: [1.0, 100.0])   # eager window at the gpu scale
    runtime_ms_cpu: list[float] = field(default_factory=lambda: [0.1, 50.0])   # and at the cpu scale
    similarity: float = 0.9               # AST similarity to a benchmark task at or above which it is contaminated
    # An output whose std / (|mean| + std) is below this is nearly constant (SELU of a log-softmax:
    # std 0.005 around -1.744): little to learn, and a kernel returning about the mean comes close.
    min_variation: float = 0.01
    # Along each axis of length >= 2, the fraction of adjacent slices that differ; below it the output
    # repeats a smaller tensor (an upsample of a length-1 signal: 0; each slice 4 times: < 0.25; by 2,
    # a nearest upsample's, just under 0.5 passes, as does a running max, whose late slices often repeat).
    min_slice_change: float = 0.25
    signature_match: bool = True          # same operator sequence as a benchmark task: contaminated
    # The bound on the eager run's peak memory (its parameters, inputs, intermediates, outputs), by
    # the run's scale; measured on its backend: the GPU's allocator on cuda, the resident set on cpu.
    max_memory_mib_gpu: int = 16384
    max_memory_mib_cpu: int = 2048

    def window(self, scale: str) -> tuple[float, float]:
        lo, hi = self.runtime_ms_gpu if scale == "gpu" else self.runtime_ms_cpu
        return lo, hi

    def max_memory_mib(self, scale: str) -> int:
        return self.max_memory_mib_gpu if scale == "gpu" else self.max_memory_mib_cpu


def _filter_eval_config() -> EvalConfig:
    """The evaluation config filters run under: the evaluator's, timing fewer iterations (a
    window check needs a median, not a 1% figure)."""
    return EvalConfig(timing=TimingConfig(warmup=3, iterations=20), correctness=CorrectnessConfig(timed_checks=3))


@dataclass
class SynthesisConfig:
    seed: int = 0                         # the dataset's seed: candidate i is composed from (seed, i)
    count: int = 0                        # candidates: composed (must be > 0), or the first rows of `source` (0: all)
    source: str = ""                      # "": the rule-based composer; else an Ops-6K .jsonl/.parquet file
    benchmark: str = ""                   # folder of benchmark problem files to decontaminate against
    workers: int = 1                      # candidates filtered at once in one shard
    data_source: str = "hpc-synthesis"    # the manifest's data_source of composed tasks
    compose: ComposeConfig = field(default_factory=ComposeConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    eval: EvalConfig = field(default_factory=_filter_eval_config)

    def validate(self) -> None:
        c, f = self.compose, self.filters
        if self.count < 0:
            raise ConfigError(f"config count: must be >= 0, got {self.count}")
        if not self.source and self.count == 0:
            raise ConfigError("config count: the composer needs a number of candidates (count > 0, or --count N)")
        if self.workers < 1:
            raise ConfigError(f"config workers: must be >= 1, got {self.workers}")
        if c.min_ops < 1 or c.max_ops < c.min_ops:
            raise ConfigError(f"config compose.min_ops/max_ops: need 1 <= min_ops <= max_ops, "
                              f"got {c.min_ops}, {c.max_ops}")
        if not c.families:
            raise ConfigError("config compose.families: must name at least one family")
        for name in c.families:
            if name not in FAMILIES:
                raise ConfigError(f"config compose.families[]: expected one of {', '.join(FAMILIES)}, got {name!r}")
        for key in ("target_ms_gpu", "target_ms_cpu", "max_elements_gpu", "max_elements_cpu", "max_flops_gpu",
                    "max_flops_cpu"):
            if getattr(c, key) <= 0:
                raise ConfigError(f"config compose.{key}: must be > 0, got {getattr(c, key)}")
        for name in f.skip:
            if name not in FILTERS or name == "load":
                raise ConfigError(f"config filters.skip[]: expected one of {', '.join(FILTERS[1:])}, got {name!r}")
        for key in ("runtime_ms_gpu", "runtime_ms_cpu"):
            window = getattr(f, key)
            if len(window) != 2 or not 0 <= window[0] < window[1]:
                raise ConfigError(f"config filters.{key}: expected [low, high] with 0 <= low < high, got {window}")
        for key in ("max_memory_mib_gpu", "max_memory_mib_cpu"):
            if getattr(f, key) <= 0:
                raise ConfigError(f"config filters.{key}: must be > 0, got {getattr(f, key)}")
        if not 0 <= f.min_variation < 1:
            raise ConfigError(f"config filters.min_variation: must be in [0, 1), got {f.min_variation}")
        if not 0 <= f.min_slice_change <= 1:
            raise ConfigError(f"config filters.min_slice_change: must be in [0, 1], got {f.min_slice_change}")
        if not 0 < f.similarity <= 1:
            raise ConfigError(f"config filters.similarity: must be in (0, 1], got {f.similarity}")
        if self.source and not Path(self.source).is_file():
            raise ConfigError(f"config source: {self.source}: no such file")
        if self.benchmark and not Path(self.benchmark).is_dir():
            raise ConfigError(f"config benchmark: {self.benchmark}: no such folder")
        try:
            self.eval.validate()
        except UserError as e:   # the evaluation config names its keys from its own top level
            raise ConfigError(str(e).replace("config ", "config eval.", 1)) from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _merge(base: dict, data: Any) -> Any:
    """`data` laid over the defaults, so a nested section keeps the defaults of keys it omits."""
    if not isinstance(base, dict) or not isinstance(data, dict):
        return data
    merged = dict(base)
    for key, value in data.items():
        merged[key] = _merge(base[key], value) if key in base else value
    return merged


def load_synthesis_config(path: str | os.PathLike | None = None, *, backend: str | None = None,
                          scale: str | None = None, **overrides: Any) -> SynthesisConfig:
    """Defaults, then the YAML file (if any), then non-None overrides (top-level keys; `backend` and
    `scale` set the eval section's, the scale following the backend unless given); validated."""
    data = read_yaml_mapping(path) if path is not None else {}
    cfg = build_config(SynthesisConfig, _merge(dataclasses.asdict(SynthesisConfig()), data), "")
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    if backend:
        cfg.eval.backend = backend
        cfg.eval.scale = scale or ("gpu" if backend == "cuda" else "cpu")
    elif scale:
        cfg.eval.scale = scale
    cfg.validate()
    return cfg


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `hpc synthesize` and jobs/synthesize.py share."""
    p.add_argument("--out", required=True, help="run folder: shard files, then dataset/ (tasks and manifest)")
    p.add_argument("--count", type=int, help="candidates to compose (with --from: the first N rows; default all)")
    p.add_argument("--seed", type=int, help="the dataset's seed (default 0)")
    p.add_argument("--config", help="YAML synthesis config (docs/synthesis.md)")
    p.add_argument("--from", dest="source", metavar="FILE",
                   help="candidates from an Ops-6K file (.jsonl or .parquet) instead of the composer")
    p.add_argument("--import-only", action="store_true",
                   help="with --from: convert to the task format, skipping every filter but load")
    p.add_argument("--validate", metavar="DATASET",
                   help="check a synthesized dataset's tasks (DATASET/manifest.jsonl) at the scale training runs "
                        "them (default: --backend cuda, --scale gpu): the filters that run a task, with that "
                        "scale's runtime window and memory bound; contaminated, duplicate and compile skipped (done when "
                        "it was made)")
    p.add_argument("--benchmark", help="decontaminate against the problem files under this folder (e.g. KernelBench)")
    p.add_argument("--backend", choices=("cpu", "cuda"), help="where candidates run (default: config, cpu)")
    p.add_argument("--scale", choices=("cpu", "gpu"), help="problem size (default: the backend's own)")
    p.add_argument("--workers", type=int, help="candidates checked at once (default 1)")


def config_from_args(args: argparse.Namespace) -> SynthesisConfig:
    """The config the flags ask for: the YAML file (or the defaults), then the flags on top."""
    if args.import_only and not args.source:
        raise UsageError("--import-only: needs --from FILE")
    backend, scale, source = args.backend, args.scale, args.source
    if args.validate:
        if args.source or args.import_only:
            raise UsageError("--validate: takes its tasks from the dataset; not with --from or --import-only")
        source = str(Path(args.validate) / "manifest.jsonl")
        if not Path(source).is_file():
            raise UsageError(f"--validate {args.validate}: no manifest.jsonl (a synthesized dataset folder, "
                            "RUN/dataset, expected)")
        backend = backend or "cuda"   # the scale follows it unless given: gpu on cuda
    absolute = {key: str(Path(value).resolve()) if value else None
                for key, value in (("source", source), ("benchmark", args.benchmark))}
    cfg = load_synthesis_config(args.config, backend=backend, scale=scale, seed=args.seed,
                                count=args.count, workers=args.workers, **absolute)
    if args.import_only:
        cfg.filters.skip = [name for name in FILTERS if name != "load"]
    if args.validate:
        cfg.filters.skip = [name for name in FILTERS if name in {"contaminated", "duplicate", "compile"}
                            or name in cfg.filters.skip]
    return cfg

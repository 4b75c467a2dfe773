"""The filter chain: every candidate task either passes all filters or is rejected by the first it
fails, with that filter's name and a reason (docs/synthesis.md has the table).

- load: a KernelBench problem file (hpc.task.load_task);
- stochastic: no random ops, by a static scan of `Model`, then two calls on the same inputs;
- contaminated: not a benchmark task, by normalized-AST similarity of the models or the same
  operator signature (hpc.synthesis.similarity);
- duplicate: not the normalized AST of a task accepted at a lower index (again at the merge);
- eager: builds and runs in the sandboxed reference worker, float32 outputs;
- finite: no NaN or Inf, on default inputs and the evaluator's extra distributions;
- constant: outputs for two different inputs differ beyond the evaluator's tolerance;
- variation: no output nearly constant relative to its scale (std / (|mean| + std));
- structure: no output that repeats a smaller tensor along an axis (adjacent slices equal);
- memory: the eager run's peak memory, as the reference worker reports it, within the scale's bound;
- runtime: the eager median (the evaluator's timing protocol) inside the scale's window;
- compile: torch.compile builds it and agrees with eager.

The task code is generated (or imported): it runs only in sandboxed workers (hpc.sandbox), never
in this process. Cheap filters come first; the runtime filter comes before compile because a
compile costs seconds and the window rejects many.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpc.baseline import measure_program
from hpc.errors import UserError
from hpc.parsing import parse
from hpc.profile.device_lock import DeviceLock
from hpc.sandbox.messages import Outputs, ReferenceSetup, Repeatable
from hpc.sandbox.prestart import WorkerPair, harness_file, worker_pair
from hpc.sandbox.process import SandboxedProcess, SandboxError
from hpc.sandbox.tempdirs import owned_temporary
from hpc.synthesis.config import SynthesisConfig
from hpc.synthesis.similarity import (BenchmarkIndex, ast_hash, canonical_op, import_aliases, model_tokens,
                                      normalized_tokens, op_signature)
from hpc.task import Task, load_task
from hpc.verify.compare import compare_outputs

STOCHASTIC = frozenset(canonical_op(n) for n in """
rand rand_like randn randn_like randint randint_like randperm bernoulli multinomial normal poisson
uniform_ normal_ bernoulli_ exponential_ geometric_ cauchy_ log_normal_ random_
dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu gumbel_softmax
Dropout Dropout1d Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout RReLU
""".split())


@dataclass
class Verdict:
    """What the chain decided about one candidate."""

    accepted: bool = True
    filter: str = ""                     # the filter that rejected it
    kind: str = ""                       # the class of its reason ("too slow", "nearly constant"): what reports count
    reason: str = ""
    ast_hash: str = ""
    signature: list[str] = field(default_factory=list)
    eager_ms: float = math.nan
    peak_mib: float = math.nan           # the eager run's peak memory (the reference worker's); NaN where it did not run
    outputs: list[dict] = field(default_factory=list)        # per output on the default inputs (output_stats)
    seconds: dict[str, float] = field(default_factory=dict)   # per filter that ran
    ran: list[str] = field(default_factory=list)              # filters that ran, in order of entry

    def reject(self, name: str, kind: str, reason: str) -> "Verdict":
        self.accepted, self.filter, self.kind, self.reason = False, name, kind, reason
        return self


class _Rejected(Exception):
    def __init__(self, name: str, kind: str, reason: str):
        super().__init__(reason)
        self.name, self.kind, self.reason = name, kind, reason


_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt|Exit))\b")


def _error_kind(reason: str) -> str:
    """The exception type a sandboxed worker's reason names ("task Model failed: RuntimeError:
    ..."), else "error"."""
    found = _EXCEPTION.search(reason)
    return found.group(1) if found else "error"


def output_stats(out: torch.Tensor) -> dict:
    """What the reports and the variation filter read of one output: shape, mean, std and the
    variation std / (|mean| + std) (0 for an all-zero output; None for fewer than 2 values, a
    scalar loss say, which has no spread to judge), in float64."""
    t = out.detach().to(torch.float64)
    mean = float(t.mean()) if t.numel() else 0.0
    std = float(t.std(correction=0)) if t.numel() else 0.0
    scale = abs(mean) + std
    variation = None if t.numel() < 2 else std / scale if scale > 0 else 0.0
    return {"shape": list(out.shape), "mean": mean, "std": std, "variation": variation}


def repeated_axis(out: torch.Tensor, minimum: float) -> tuple[int, float] | None:
    """The first axis (of length >= 2) along which fewer than `minimum` of the adjacent slices
    differ, and that fraction: the output repeats a smaller tensor along it (0: a broadcast of
    one slice); None when there is none. Whole slices are compared, so a running max (cummax),
    whose values repeat within a row but whose rows differ, is not a repeat."""
    if out.numel() == 0:
        return None
    for axis, n in enumerate(out.shape):
        if n < 2:
            continue
        differs = out.narrow(axis, 1, n - 1) != out.narrow(axis, 0, n - 1)
        changed = differs.movedim(axis, 0).reshape(n - 1, -1).any(dim=1)
        fraction = float(changed.sum()) / (n - 1)
        if fraction < minimum:
            return axis, fraction
    return None


def stochastic_calls(source: str) -> str:
    """The first random operation `Model` uses outside `__init__` (seeded parameter init is fine),
    or a stochastic module it builds; "" when there is none."""
    tree = parse(source)
    aliases = import_aliases(tree)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return ""
    for method in model.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        for node in ast.walk(method):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute):
                name = func.attr
            elif isinstance(func, ast.Name):
                name = aliases.get(func.id, func.id)
            else:
                continue
            if canonical_op(name) not in STOCHASTIC:
                continue
            is_module = name.rsplit(".", 1)[-1][:1].isupper()
            if method.name != "__init__" or is_module:
                return f"{name} (line {node.lineno})"
    return ""


class FilterChain:
    """Runs the filters on one candidate at a time; safe to call from several threads at once
    (the shard's workers), timed runs taking the device alone (hpc.profile.device_lock)."""

    def __init__(self, cfg: SynthesisConfig, benchmark: BenchmarkIndex | None = None):
        self.cfg = cfg
        self.eval = cfg.eval
        self.skip = set(cfg.filters.skip)
        self.benchmark = benchmark
        self.lock = DeviceLock(cfg.eval.backend)
        self.accepted: dict[str, int] = {}     # normalized-AST hash -> lowest accepted index
        self._accepted_lock = threading.Lock()
        self.inductor_cache = cfg.eval.cache_path() / "inductor"
        self._compare_on = "cuda" if cfg.eval.backend == "cuda" else "cpu"   # GPU-scale outputs: seconds on the host

    def remember(self, digest: str, index: int) -> None:
        """An accepted candidate: later duplicates of it are rejected."""
        with self._accepted_lock:
            if digest not in self.accepted or index < self.accepted[digest]:
                self.accepted[digest] = index

    def check(self, index: int, code: str, filename: str) -> Verdict:
        """Every filter in order until one rejects; an accepted candidate is remembered."""
        verdict = Verdict()
        with owned_temporary("hpc-synth-") as tmp:
            path = Path(tmp) / f"{filename}.py"
            path.write_text(code)
            try:
                self._static(index, code, path, verdict)
                self._run(path, index, verdict)
            except _Rejected as r:
                return verdict.reject(r.name, r.kind, r.reason)
        self.remember(verdict.ast_hash, index)
        return verdict

    def _timed(self, name: str, verdict: Verdict, started: float) -> None:
        verdict.seconds[name] = round(verdict.seconds.get(name, 0.0) + time.monotonic() - started, 4)

    @staticmethod
    def _enter(name: str, verdict: Verdict) -> float:
        if name not in verdict.ran:
            verdict.ran.append(name)
        return time.monotonic()

    def _static(self, index: int, code: str, path: Path, verdict: Verdict) -> None:
        t0 = self._enter("load", verdict)
        try:
            load_task(path)
        except UserError as e:
            self._timed("load", verdict, t0)
            raise _Rejected("load", "not a task", str(e).replace(str(path), path.name)) from None
        except RecursionError:
            self._timed("load", verdict, t0)
            raise _Rejected("load", "nested too deeply", "nested too deeply to parse") from None
        try:
            verdict.ast_hash = ast_hash(normalized_tokens(code))
            verdict.signature = list(op_signature(code))
        except (ValueError, RecursionError) as e:   # parses, but too deep or odd to normalize
            raise _Rejected("load", "cannot normalize", f"cannot normalize: {type(e).__name__}: {e}") from None
        finally:
            self._timed("load", verdict, t0)
        if "stochastic" not in self.skip:
            t0 = self._enter("stochastic", verdict)
            found = stochastic_calls(code)
            self._timed("stochastic", verdict, t0)
            if found:
                raise _Rejected("stochastic", "random operation", f"random operation {found}")
        if "contaminated" not in self.skip and self.benchmark is not None:
            t0 = self._enter("contaminated", verdict)
            similar = self.benchmark.most_similar(model_tokens(code), self.cfg.filters.similarity)
            same = self.benchmark.same_signature(tuple(verdict.signature)) if self.cfg.filters.signature_match \
                else None
            self._timed("contaminated", verdict, t0)
            if similar:
                raise _Rejected("contaminated", "AST similarity", f"AST similarity {similar[1]:.3f} to benchmark {similar[0]}")
            if same:
                raise _Rejected("contaminated", "operator signature", f"operator signature ({', '.join(verdict.signature)}) "
                                                f"matches benchmark {same}")
        if "duplicate" not in self.skip:
            self._enter("duplicate", verdict)
            with self._accepted_lock:
                first = self.accepted.get(verdict.ast_hash)
            if first is not None and first < index:
                raise _Rejected("duplicate", "same AST", f"duplicate of candidate {first} (same normalized AST)")

    def _seed(self, index: int) -> int:
        return self.eval.seed if self.eval.seed >= 0 else (self.cfg.seed * 1_000_003 + index * 7919) % (1 << 30)

    def _run(self, path: Path, index: int, verdict: Verdict) -> None:
        """The filters that run the task: eager in the reference process of a worker pair, runtime
        in its program process (the pair prestarted within `prestarted_workers`, as an
        evaluation's), compile in a process of its own (it writes the shared inductor cache, so
        none is started ahead for it). Skipping `eager` skips the reference's work, and with it
        `finite`, `constant`, `memory` and the dynamic half of `stochastic`, which read its replies."""
        if not {"eager", "runtime", "compile"} - self.skip:
            return
        task = load_task(path)
        seed = self._seed(index)
        expected = None
        if {"eager", "runtime"} - self.skip:
            pair = worker_pair(self.eval.sandbox, self.eval.backend)
            try:
                if "eager" not in self.skip:
                    expected = self._reference(task, seed, verdict, pair.reference)
                if "runtime" not in self.skip:
                    self._runtime(task, seed, verdict, pair)
            finally:
                pair.kill()   # first: an orderly exit waits for a process still starting
                pair.close()
        if "compile" not in self.skip:
            self._compile(task, seed, expected, verdict)

    def _reference(self, task: Task, seed: int, verdict: Verdict, ref: SandboxedProcess) -> list:
        """eager, finite, constant, memory and the dynamic stochastic check, in the reference process
        `ref`; one trial's outputs at a time (GPU-scale outputs are large). Returns the first trial's
        outputs."""
        cfg = self.eval
        trials = [{"seed": seed + 1, "distribution": "default"}, {"seed": seed + 2, "distribution": "default"}]
        trials += [{"seed": seed + 1, "distribution": d} for d in cfg.correctness.distributions]
        kept: list[list] = []
        peak_bytes = 0
        nonfinite, nonfinite_kind = "", ""
        for k, trial in enumerate(trials):
            t0 = self._enter("eager", verdict)
            try:
                with self.lock.shared():
                    if k == 0:
                        ref.request(ReferenceSetup(str(harness_file(task.path, ref.workdir, "task.py")), cfg.scale,
                                                   seed, cfg.backend, probe_seed=seed + 1))
                    reply = ref.request(Outputs([trial]))
            except SandboxError as e:
                raise _Rejected("eager", _error_kind(e.reason), e.reason) from None
            finally:
                self._timed("eager", verdict, t0)
            outputs, peak_bytes = reply.outputs[0], max(peak_bytes, reply.peak_bytes)
            del reply
            for i, out in enumerate(outputs):
                if not isinstance(out, torch.Tensor):
                    raise _Rejected("eager", "not a tensor", f"output {i} is a {type(out).__name__}, not a tensor")
                if out.dtype != torch.float32:
                    raise _Rejected("eager", "not float32", f"output {i} is {out.dtype}; tasks are float32")
                if not nonfinite and not bool(torch.isfinite(out).all()):
                    nonfinite_kind = f"NaN or Inf on {trial['distribution']} inputs"
                    nonfinite = (f"output {i} has NaN or Inf on {trial['distribution']} inputs "
                                 f"(seed {trial['seed']})")
            if k < 2:
                kept.append(outputs)
            del outputs
        verdict.peak_mib = peak_bytes / (1 << 20)
        if "finite" not in self.skip:
            self._enter("finite", verdict)
            if nonfinite:
                raise _Rejected("finite", nonfinite_kind, nonfinite)
        if "constant" not in self.skip:
            t0 = self._enter("constant", verdict)
            with self.lock.shared():
                same = compare_outputs(kept[0], kept[1], cfg.correctness, self._compare_on)
            self._timed("constant", verdict, t0)
            if same.ok:
                raise _Rejected("constant", "agree across inputs", "outputs for two different inputs agree within the evaluator's "
                                            "tolerance: a constant would pass")
        self._output_checks(kept[0], verdict)
        if "memory" not in self.skip:
            self._enter("memory", verdict)
            bound = self.cfg.filters.max_memory_mib(cfg.scale)
            if verdict.peak_mib > bound:
                raise _Rejected("memory", "too much memory", f"peak memory {verdict.peak_mib:.1f} MiB > {bound} MiB "
                                                             f"({cfg.scale} scale)")
        if "stochastic" not in self.skip:
            t0 = self._enter("stochastic", verdict)
            try:
                with self.lock.shared():
                    again = ref.request(Repeatable(seed + 1, dataclasses.asdict(cfg.correctness)))
            except SandboxError as e:
                raise _Rejected("eager", _error_kind(e.reason), e.reason) from None
            finally:
                self._timed("stochastic", verdict, t0)
            if not again.same:
                raise _Rejected("stochastic", "calls differ", "two calls on the same inputs differ beyond the evaluator's "
                                              f"tolerance ({again.reason})")
        return kept[0]

    def _output_checks(self, outputs: list[torch.Tensor], verdict: Verdict) -> None:
        """The outputs' statistics into the verdict (whichever filters run: the reports read
        them); then variation (an output nearly constant relative to its scale) and structure (an
        output that repeats a smaller tensor along an axis), on the outputs of the default inputs."""
        f = self.cfg.filters
        t0 = self._enter("variation", verdict) if "variation" not in self.skip else time.monotonic()
        with self.lock.shared():
            verdict.outputs = [output_stats(out.to(self._compare_on)) for out in outputs]
        if "variation" not in self.skip:
            self._timed("variation", verdict, t0)
            for i, st in enumerate(verdict.outputs):
                if st["variation"] is not None and st["variation"] < f.min_variation:
                    raise _Rejected("variation", "nearly constant",
                                    f"output {i} varies little: std {st['std']:.3g} around {st['mean']:.4g} "
                                    f"(std / (|mean| + std) = {st['variation']:.3g} < {f.min_variation:g})")
        if "structure" in self.skip:
            return
        t0 = self._enter("structure", verdict)
        with self.lock.shared():
            repeats = [repeated_axis(out.to(self._compare_on), f.min_slice_change) for out in outputs]
        self._timed("structure", verdict, t0)
        for i, found in enumerate(repeats):
            if found is not None:
                axis, fraction = found
                raise _Rejected("structure", "broadcast along an axis" if fraction == 0 else "repeated slices",
                                f"output {i} {tuple(outputs[i].shape)} repeats along axis {axis}: {fraction:.0%} "
                                f"of adjacent slices differ (< {f.min_slice_change:.0%}), a repeat of a smaller "
                                "tensor")

    def _runtime(self, task: Task, seed: int, verdict: Verdict, pair: WorkerPair) -> None:
        t0 = self._enter("runtime", verdict)
        try:
            stats, _ = measure_program(task, "eager", self.eval, seed, self.lock, pair)
        except SandboxError as e:
            self._timed("runtime", verdict, t0)
            raise _Rejected("runtime", "timing failed", f"eager timing failed: {e.reason}") from None
        self._timed("runtime", verdict, t0)
        verdict.eager_ms = stats.median_ms
        lo, hi = self.cfg.filters.window(self.eval.scale)
        if stats.median_ms < lo:
            raise _Rejected("runtime", "too fast", f"too fast: eager {stats.median_ms:.4g} ms < {lo:g} ms "
                                       f"({self.eval.scale} scale window)")
        if stats.median_ms > hi:
            raise _Rejected("runtime", "too slow", f"too slow: eager {stats.median_ms:.4g} ms > {hi:g} ms "
                                       f"({self.eval.scale} scale window)")

    def _compile(self, task: Task, seed: int, expected: list | None, verdict: Verdict) -> None:
        """torch.compile (default mode) in a sandboxed worker sharing the config's inductor cache;
        its outputs must match eager's (when the eager filter ran)."""
        cfg = self.eval
        self.inductor_cache.mkdir(parents=True, exist_ok=True)
        t0 = self._enter("compile", verdict)
        with owned_temporary("hpc-synth-compile-") as workdir, \
                SandboxedProcess("reference", Path(workdir), cfg.sandbox, cfg.backend, trusted=True,
                                 env={"TORCHINDUCTOR_CACHE_DIR": str(self.inductor_cache)},
                                 writable=[self.inductor_cache]) as proc:
            try:
                with self.lock.autotuning():   # its picks land in the cache the baselines read
                    proc.request(ReferenceSetup(str(harness_file(task.path, proc.workdir, "task.py")), cfg.scale,
                                                seed, cfg.backend, probe_seed=seed + 1, compile="default"))
                    got = proc.request(Outputs([{"seed": seed + 1, "distribution": "default"}])).outputs[0]
            except SandboxError as e:
                raise _Rejected("compile", "failed", f"torch.compile failed: {e.reason}") from None
            finally:
                self._timed("compile", verdict, t0)
        if expected is None:
            return
        with self.lock.shared():
            same = compare_outputs(expected, got, cfg.correctness, self._compare_on)
        if not same.ok:
            raise _Rejected("compile", "differs from eager", f"torch.compile output differs from eager: {same.reason}")

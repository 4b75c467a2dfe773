"""The rule-based composer: 1-5 catalog operators stacked into one KernelBench `Model`.

Candidate `index` of a dataset with seed `seed` comes from its own generator seeded with both, so
it is the same whichever shard composes it, in whatever order. The chain is built by shape and
range inference (hpc.synthesis.shapes): each step is picked among the catalog entries that apply
to the tensor it receives, so every composed file is consistent by construction. The problem
size of each scale (the file's globals for `gpu`, SCALES["cpu"] for `cpu`) then has its batch set
so a roofline estimate of eager lands near the configured target; the runtime filter measures.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hpc.synthesis.catalog import CATALOG, CATEGORIES, CATEGORY_WEIGHTS, Step
from hpc.synthesis.config import ComposeConfig
from hpc.synthesis.context import FAMILIES, INITIAL_BATCH, Context
from hpc.synthesis.shapes import SCALE_NAMES, Range, TensorSpec

# Steering constants for the batch size only (achievable rates, not peaks): eager PyTorch on an
# H200 (HBM ~3 TB/s, fp32 ~40 TFLOP/s without TF32) and on 2 cores of a CPU.
_ROOFLINE = {"gpu": (3.0e12, 40e12, 0.01), "cpu": (8e9, 30e9, 0.005)}   # bytes/s, FLOP/s, ms per call


@dataclass(frozen=True)
class Composed:
    """One composed candidate task."""

    index: int
    name: str                       # e.g. "Conv2d_GELU_Sum"
    level: int                      # 1: one operator, 2: a fused sequence
    family: str
    ops: list[str]                  # the torch APIs, in order (the Ops-6K `ops` field)
    categories: list[str]           # each operator's catalog category, in order (the reports' histogram)
    code: str
    output_shapes: dict[str, tuple[int, ...]]   # what forward returns at each scale (by inference)

    @property
    def stem(self) -> str:
        return f"{self.index:06d}_{self.name}"


def compose(seed: int, index: int, cfg: ComposeConfig) -> Composed:
    """Candidate `index` of the dataset with seed `seed`: always the same file for the same inputs."""
    rng = random.Random(f"hpc-synthesis/{seed}/{index}")
    ctx = Context(rng)
    family = family_of(seed, index, cfg.families)
    x = FAMILIES[family](ctx)
    maker = "randint" if x.dtype == "int64" else ("rand" if rng.random() < 0.2 else "randn")
    if maker == "rand":
        x = x.with_range(Range(0.0, 1.0))
    ctx.inputs.append(("x", x, maker))
    wanted = rng.randint(cfg.min_ops, cfg.max_ops)
    steps: list[tuple[Step, TensorSpec]] = []
    categories: list[str] = []
    while sum(s.compute for s, _ in steps) < wanted:
        found = _next_step(ctx, x, steps, cfg)
        if found is None:
            break
        step, category = found
        steps.append((step, x))
        if step.compute:
            categories.append(category)
        x = step.out
    if not any(s.compute for s, _ in steps):
        raise RuntimeError(f"composer found no operator for a {family} input (seed {seed}, index {index})")
    batch = _set_batch(ctx, steps, cfg)
    names = [s.name for s, _ in steps if s.compute]
    out = {scale: (batch[scale],) + x.shape(scale)[1:] for scale in SCALE_NAMES}
    return Composed(index, "_".join(names), 1 if len(names) == 1 else 2, family,
                    [s.api for s, _ in steps if s.compute], categories, _render(ctx, steps, seed, index), out)


def family_of(seed: int, index: int, families: list[str]) -> str:
    """The input family of candidate `index`: each run of len(families) consecutive candidates
    has every family once, in an order of its own (seeded), so no family (and with `tokens` no
    first operator, Embedding) is drawn more than its share: 3 of 7 starting with Embedding, as
    independent draws gave, cannot happen."""
    block, position = divmod(index, len(families))
    order = list(families)
    random.Random(f"hpc-synthesis/{seed}/families/{block}").shuffle(order)
    return order[position]


def _next_step(ctx: Context, x: TensorSpec, steps: list, cfg: ComposeConfig) -> tuple[Step, str] | None:
    """A step for `x` and its category: categories in random order (a view now and then between
    operators), each category's entries in random order, the first that applies and fits the size caps."""
    previous = steps[-1][0].name if steps else ""
    # weighted order without replacement (Efraimidis-Spirakis keys)
    keys = {c: ctx.rng.random() ** (1.0 / CATEGORY_WEIGHTS[c]) for c in CATEGORIES if c != "view"}
    categories = sorted(keys, key=keys.get, reverse=True)
    if x.dtype == "int64":
        categories = ["embedding"]
    elif steps and ctx.rng.random() < 0.15:
        categories.insert(0, "view")
    for category in categories:
        entries = [spec for spec in CATALOG if spec.category == category and spec.name != previous]
        ctx.rng.shuffle(entries)
        for spec in entries:
            saved = ctx.snapshot()
            step = spec.build(ctx, x, "x")
            if step is not None and _fits(step, cfg):
                return step, category
            ctx.restore(saved)
    return None


def _fits(step: Step, cfg: ComposeConfig) -> bool:
    return all(step.out.numel(s) <= _cap(cfg, "max_elements", s) and f <= _cap(cfg, "max_flops", s)
               for s, f in zip(SCALE_NAMES, step.flops))


def _cap(cfg: ComposeConfig, key: str, scale: str) -> float:
    return getattr(cfg, f"{key}_{scale}")


def _set_batch(ctx: Context, steps: list[tuple[Step, TensorSpec]], cfg: ComposeConfig) -> dict[str, int]:
    """Scale each scale's batch (a power-of-two factor) so the roofline estimate of one eager call
    is near the target, within the caps; every tensor and cost is linear in the batch."""
    name = next(iter(ctx.globals))      # the batch is the first global of every family
    chosen = {}
    for k, scale in enumerate(SCALE_NAMES):
        bandwidth, peak, launch = _ROOFLINE[scale]
        scalable_ms, fixed_ms, elements, flops = 0.0, 0.0, 1, 1.0
        for step, inp in steps:
            if not step.compute:
                continue
            nbytes = 4 * (inp.numel(scale) + step.out.numel(scale))
            scalable_ms += 1e3 * max(nbytes / bandwidth, step.flops[k] / peak)
            fixed_ms += launch
            elements = max(elements, inp.numel(scale), step.out.numel(scale))
            flops = max(flops, step.flops[k])
        batch = INITIAL_BATCH[scale]
        target = max(getattr(cfg, f"target_ms_{scale}") - fixed_ms, 1e-6)
        factor = 2.0 ** round(math.log2(target / scalable_ms)) if scalable_ms > 0 else 1.0
        cap = min(_cap(cfg, "max_elements", scale) / elements, _cap(cfg, "max_flops", scale) / flops)
        while factor > cap and factor * batch > 1:
            factor /= 2
        chosen[scale] = max(1, int(batch * factor))
    ctx.globals[name] = [chosen["gpu"], chosen["cpu"]]
    return chosen


def _render(ctx: Context, steps: list[tuple[Step, TensorSpec]], seed: int, index: int) -> str:
    names = " -> ".join(s.name for s, _ in steps)
    params = ", ".join(["self", *ctx.params])
    lines = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", "", "",
             "class Model(nn.Module):",
             f'    """{names} (hpc.synthesis seed {seed}, candidate {index})."""', "",
             f"    def __init__({params}):", "        super().__init__()"]
    lines += [f"        self.{attr} = {expr}" for attr, expr in ctx.modules]
    lines += ["", f"    def forward({', '.join(['self'] + [name for name, _, _ in ctx.inputs])}):"]
    lines += [f"        x = {step.expr}" for step, _ in steps]
    lines += ["        return x", "", ""]
    lines += [f"{name} = {gpu}" for name, (gpu, _) in ctx.globals.items()]
    lines += ["", "", "def get_inputs():"]
    for name, spec, maker in ctx.inputs:
        shape = ", ".join(d.expr for d in spec.dims)
        if maker == "randint":
            lines.append(f"    {name} = torch.randint(0, {ctx.vocab.expr}, ({shape},))")
        else:
            lines.append(f"    {name} = torch.{maker}({shape})")
    lines += [f"    return [{', '.join(name for name, _, _ in ctx.inputs)}]", "", "",
              "def get_init_inputs():", f"    return [{', '.join(ctx.params.values())}]", "", ""]
    overrides = ", ".join(f'"{name}": {cpu}' for name, (_, cpu) in ctx.globals.items())
    lines.append(f'SCALES = {{"cpu": {{{overrides}}}}}')
    return "\n".join(_wrap(line) for line in lines) + "\n"


def _wrap(line: str, width: int = 110) -> str:
    """Long SCALES lines broken after commas (the file stays readable; the value is unchanged)."""
    if len(line) <= width or not line.startswith("SCALES"):
        return line
    out, current = [], ""
    for part in line.split(", "):
        if current and len(current) + len(part) + 2 > width:
            out.append(current + ",")
            current = "    " + part
        else:
            current = f"{current}, {part}" if current else part
    return "\n".join(out + [current])


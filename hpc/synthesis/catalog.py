"""The seed operator catalog: torch nn modules and functional ops with valid constructor arguments
and input specifications (ranks, sizes at both scales, value ranges).

Each entry builds one step of a chain from the tensor it receives: it picks its hyperparameters
with the composer's seeded generator, declares the constructor arguments, parameters and extra
inputs it needs through the composer's context, and infers its output (hpc.synthesis.shapes).
An entry that cannot apply to the tensor it is given (wrong rank, an axis too small, a value
range outside its domain) returns None, and the composer picks another; nothing is run to decide.
Entries with per-channel meaning (a bias, a norm's affine weights, a convolution's or a pool's
channel axis) apply only where the tensor's channel axis is the one the operator broadcasts along
(TensorSpec.channel): a BiasAdd after an Embedding is per embedding dimension, never per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from hpc.synthesis.context import Context
from hpc.synthesis.shapes import (NONNEG, REAL, TINY, UNIT, Dim, Range, TensorSpec, conv_out, monotone,
                                  product, scale_range, scaled, sum_range)


@dataclass(frozen=True)
class Step:
    """One composed operator: how forward applies it and what comes out."""

    name: str                        # display name, used in task names ("Conv2d", "Sum")
    api: str                         # the torch API it exercises ("nn.Conv2d", "torch.sum"): the task's ops
    expr: str                        # forward expression, input variable substituted
    out: TensorSpec
    flops: tuple[float, float] = (0.0, 0.0)   # at the gpu and cpu scale (matmul/conv family)
    compute: bool = True             # False for views (flatten, transpose): not counted as an operator


Builder = Callable[[Context, TensorSpec, str], "Step | None"]


@dataclass(frozen=True)
class OpSpec:
    name: str
    category: str
    build: Builder


CATALOG: list[OpSpec] = []


def op(name: str, category: str):
    def register(fn: Builder) -> Builder:
        CATALOG.append(OpSpec(name, category, fn))
        return fn
    return register


def _flops(x: TensorSpec, per_element: Callable[[str], float]) -> tuple[float, float]:
    return (x.numel("gpu") * per_element("gpu"), x.numel("cpu") * per_element("cpu"))


def _axis(ctx: Context, x: TensorSpec, minimum: int = 2) -> int | None:
    """A non-batch axis at least `minimum` long at both scales (reducing a length-1 axis is a no-op,
    normalizing over it gives a constant)."""
    axes = [a for a in range(1, x.rank) if x.dims[a].min() >= minimum]
    return ctx.rng.choice(axes) if axes else None


def _spatial_ok(dims: list[Dim], minimum: int = 2) -> bool:
    return all(d.min() >= minimum for d in dims)


def _channels_first(x: TensorSpec) -> bool:
    """Axis 1 holds the channels: where NCHW-style operators (convolutions, pools, BatchNorm and
    its kin, whose weights broadcast over axis 1) mean what they do."""
    return x.channel == 1


def _features_last(x: TensorSpec) -> bool:
    """The last axis holds the features: where LayerNorm and RMSNorm (weights over it) mean what they do."""
    return x.channel == x.rank - 1


# ---- elementwise activations: (module form, functional form, range map, domain check) ----

def _gelu_range(r: Range) -> Range:
    return Range(-0.17 if r.lo < 0 else 0.0, max(r.hi, 0.0))


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v > -80 else 0.0


# Sigmoid, softplus, exp and softmax are positive in exact arithmetic and marked so (log and rsqrt
# may follow them); where float32 underflows to 0 in a particular task, the finite filter rejects it.


_ACTIVATIONS: dict[str, tuple[str | None, str, Callable[[Range], Range], Callable[[Range], bool]]] = {
    "ReLU": ("nn.ReLU()", "torch.relu({x})", lambda r: Range(max(r.lo, 0.0), max(r.hi, 0.0)), lambda r: True),
    "GELU": ("nn.GELU()", "F.gelu({x})", _gelu_range, lambda r: True),
    "SiLU": ("nn.SiLU()", "F.silu({x})", lambda r: Range(-0.28 if r.lo < 0 else 0.0, max(r.hi, 0.0)),
             lambda r: True),
    "Tanh": ("nn.Tanh()", "torch.tanh({x})", lambda r: monotone(r, math.tanh), lambda r: True),
    "Sigmoid": ("nn.Sigmoid()", "torch.sigmoid({x})",
                lambda r: Range(max(_sigmoid(r.lo), TINY), _sigmoid(r.hi) if r.hi < 80 else 1.0),
                lambda r: True),
    "Softplus": ("nn.Softplus()", "F.softplus({x})", lambda r: Range(TINY, max(r.hi, 0.0) + 1.0),
                 lambda r: True),
    "ELU": ("nn.ELU()", "F.elu({x})", lambda r: Range(max(r.lo, -1.0), r.hi), lambda r: True),
    "SELU": ("nn.SELU()", "torch.selu({x})", lambda r: Range(max(r.lo * 1.06, -1.76), r.hi * 1.06), lambda r: True),
    "Mish": ("nn.Mish()", "F.mish({x})", lambda r: Range(-0.31 if r.lo < 0 else 0.0, max(r.hi, 0.0)), lambda r: True),
    "Hardswish": ("nn.Hardswish()", "F.hardswish({x})", lambda r: Range(-0.375 if r.lo < 0 else 0.0, max(r.hi, 0.0)),
                  lambda r: True),
    "Hardsigmoid": ("nn.Hardsigmoid()", "F.hardsigmoid({x})", lambda r: UNIT, lambda r: True),
    "Softsign": ("nn.Softsign()", "F.softsign({x})", lambda r: Range(max(r.lo, -1.0), min(r.hi, 1.0)), lambda r: True),
    "Abs": (None, "torch.abs({x})", lambda r: Range(0.0 if r.lo <= 0 <= r.hi else min(abs(r.lo), abs(r.hi)),
                                                    max(abs(r.lo), abs(r.hi))), lambda r: True),
    "Square": (None, "torch.square({x})", lambda r: Range(0.0, max(r.lo * r.lo, r.hi * r.hi)), lambda r: True),
    "Exp": (None, "torch.exp({x})", lambda r: Range(max(math.exp(r.lo), TINY) if r.lo > -80 else TINY,
                                                    math.exp(r.hi)), lambda r: r.hi <= 20.0),
    "Log": (None, "torch.log({x})", lambda r: Range(math.log(r.lo), math.log(r.hi) if r.hi < math.inf else math.inf),
            lambda r: r.positive()),
    "Sqrt": (None, "torch.sqrt({x})", lambda r: monotone(r, math.sqrt), lambda r: r.nonnegative()),
    "Rsqrt": (None, "torch.rsqrt({x})", lambda r: Range(1 / math.sqrt(r.hi) if r.hi < math.inf else 0.0,
                                                        1 / math.sqrt(r.lo)), lambda r: r.positive()),
}


def _activation(name: str) -> Builder:
    module, function, out_range, domain = _ACTIVATIONS[name]

    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        if x.dtype != "float32" or not domain(x.range):
            return None
        if module and ctx.rng.random() < 0.5:
            attr = ctx.module(name.lower(), module)
            return Step(name, module.split("(")[0], f"{attr}({v})", x.with_range(out_range(x.range)))
        api = function.split("(")[0]
        return Step(name, api, function.format(x=v), x.with_range(out_range(x.range)))
    return build


for _name in _ACTIVATIONS:
    op(_name, "activation")(_activation(_name))


@op("LeakyReLU", "activation")
def _leaky_relu(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    slope = ctx.rng.choice((0.01, 0.1, 0.2))
    out = x.with_range(monotone(x.range, lambda t: t if t >= 0 else t * slope))
    if ctx.rng.random() < 0.5:
        return Step("LeakyReLU", "nn.LeakyReLU", f"{ctx.module('leaky_relu', f'nn.LeakyReLU({slope})')}({v})", out)
    return Step("LeakyReLU", "F.leaky_relu", f"F.leaky_relu({v}, negative_slope={slope})", out)


@op("Hardtanh", "activation")
def _hardtanh(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    lo, hi = ctx.rng.choice(((-1.0, 1.0), (-0.5, 0.5), (0.0, 6.0)))
    out = x.with_range(Range(min(max(x.range.lo, lo), hi), max(min(x.range.hi, hi), lo)))
    return Step("Hardtanh", "F.hardtanh", f"F.hardtanh({v}, min_val={lo}, max_val={hi})", out)


@op("Clamp", "activation")
def _clamp(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    lo, hi = ctx.rng.choice(((-1.0, 1.0), (-0.5, 0.5), (0.0, 1.0), (-2.0, 2.0)))
    if x.range.hi <= lo or x.range.lo >= hi:
        return None   # everything clamped to one bound: a constant
    out = x.with_range(Range(max(x.range.lo, lo), min(x.range.hi, hi)))
    return Step("Clamp", "torch.clamp", f"torch.clamp({v}, min={lo}, max={hi})", out)


# ---- scalar and broadcast arithmetic ----

@op("Scale", "arithmetic")
def _scale(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    c = ctx.rng.choice((0.5, 2.0, 1.5, -1.0, 0.1))
    return Step("Scale", "torch.mul", f"{v} * {c}", x.with_range(scale_range(x.range, c)))


@op("BiasAdd", "arithmetic")
def _bias_add(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    """A learned bias per channel (the tensor's channel axis: 1 for NCHW-style tensors, the last
    for features), broadcast over the rest; none where no axis holds channels."""
    if x.rank < 2 or x.channel is None or x.channel == 0:
        return None
    channels = ctx.param(x.dims[x.channel], "channels")
    trailing = ", 1" * (x.rank - 1 - x.channel)
    bias = ctx.module("bias", f"nn.Parameter(torch.randn({channels}{trailing}))")
    return Step("BiasAdd", "torch.add", f"{v} + {bias}", x.with_range(REAL))


def _binary(name: str, api: str, template: str, out_range: Callable[[Range], Range]) -> Builder:
    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        other = ctx.input("y", TensorSpec(x.dims), "randn")
        return Step(name, api, template.format(x=v, y=other), x.with_range(out_range(x.range)))
    return build


op("Add", "binary")(_binary("Add", "torch.add", "{x} + {y}", lambda r: REAL))
op("Mul", "binary")(_binary("Mul", "torch.mul", "{x} * {y}", lambda r: REAL))
op("Maximum", "binary")(_binary("Maximum", "torch.maximum", "torch.maximum({x}, {y})",
                                lambda r: Range(r.lo, math.inf)))
op("Minimum", "binary")(_binary("Minimum", "torch.minimum", "torch.minimum({x}, {y})",
                                lambda r: Range(-math.inf, r.hi)))


# ---- normalization ----

@op("LayerNorm", "norm")
def _layer_norm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank < 2 or x.dims[-1].min() < 8 or not _features_last(x):
        return None
    attr = ctx.module("layer_norm", f"nn.LayerNorm({ctx.param(x.dims[-1], 'normalized_size')})")
    return Step("LayerNorm", "nn.LayerNorm", f"{attr}({v})", x.with_range(REAL))


@op("RMSNorm", "norm")
def _rms_norm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank < 2 or x.dims[-1].min() < 8 or not _features_last(x):
        return None
    attr = ctx.module("rms_norm", f"nn.RMSNorm({ctx.param(x.dims[-1], 'normalized_size')})")
    return Step("RMSNorm", "nn.RMSNorm", f"{attr}({v})", x.with_range(REAL))


@op("BatchNorm", "norm")
def _batch_norm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if not 2 <= x.rank <= 5 or not _channels_first(x):
        return None
    kind = {2: "1d", 3: "1d", 4: "2d", 5: "3d"}[x.rank]
    attr = ctx.module("batch_norm", f"nn.BatchNorm{kind}({ctx.param(x.dims[1], 'num_features')})")
    return Step("BatchNorm", f"nn.BatchNorm{kind}", f"{attr}({v})", x.with_range(REAL))


@op("GroupNorm", "norm")
def _group_norm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank < 3 or product(list(x.dims[2:])).min() < 4 or not _channels_first(x):
        return None
    c = x.dims[1]
    groups = [g for g in (2, 4, 8, 16, 32) if c.gpu % g == 0 and c.cpu % g == 0 and c.min() // g >= 2]
    if not groups:
        return None
    g = ctx.rng.choice(groups)
    attr = ctx.module("group_norm", f"nn.GroupNorm({g}, {ctx.param(c, 'num_channels')})")
    return Step("GroupNorm", "nn.GroupNorm", f"{attr}({v})", x.with_range(REAL))


@op("InstanceNorm", "norm")
def _instance_norm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if not 3 <= x.rank <= 5 or product(list(x.dims[2:])).min() < 4 or not _channels_first(x):
        return None
    kind = {3: "1d", 4: "2d", 5: "3d"}[x.rank]
    attr = ctx.module("instance_norm", f"nn.InstanceNorm{kind}({ctx.param(x.dims[1], 'num_features')})")
    return Step("InstanceNorm", f"nn.InstanceNorm{kind}", f"{attr}({v})", x.with_range(REAL))


@op("Normalize", "norm")
def _normalize(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    axis = _axis(ctx, x, 4)
    if axis is None:
        return None
    return Step("Normalize", "F.normalize", f"F.normalize({v}, dim={axis})", x.with_range(Range(-1.0, 1.0)))


# ---- softmax family and scans ----

@op("Softmax", "softmax")
def _softmax(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    axis = _axis(ctx, x)
    if axis is None:
        return None
    if ctx.rng.random() < 0.5:
        return Step("Softmax", "nn.Softmax", f"{ctx.module('softmax', f'nn.Softmax(dim={axis})')}({v})",
                    x.with_range(Range(TINY, 1.0)))
    return Step("Softmax", "torch.softmax", f"torch.softmax({v}, dim={axis})", x.with_range(Range(TINY, 1.0)))


@op("LogSoftmax", "softmax")
def _log_softmax(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    axis = _axis(ctx, x)
    if axis is None:
        return None
    return Step("LogSoftmax", "F.log_softmax", f"F.log_softmax({v}, dim={axis})", x.with_range(Range(-math.inf, 0.0)))


@op("Cumsum", "scan")
def _cumsum(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    axis = _axis(ctx, x)
    if axis is None:
        return None
    n = max(x.dims[axis].gpu, x.dims[axis].cpu)
    return Step("Cumsum", "torch.cumsum", f"torch.cumsum({v}, dim={axis})", x.with_range(sum_range(x.range, n)))


@op("Cummax", "scan")
def _cummax(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    axis = _axis(ctx, x)
    if axis is None:
        return None
    return Step("Cummax", "torch.cummax", f"torch.cummax({v}, dim={axis}).values", x)


# ---- reductions over one non-batch axis ----

_REDUCTIONS: dict[str, tuple[str, Callable[[Range, int], Range]]] = {
    "Sum": ("torch.sum({x}, dim={a}, keepdim={k})", lambda r, n: sum_range(r, n)),
    "Mean": ("torch.mean({x}, dim={a}, keepdim={k})", lambda r, n: r),
    "Amax": ("torch.amax({x}, dim={a}, keepdim={k})", lambda r, n: r),
    "Amin": ("torch.amin({x}, dim={a}, keepdim={k})", lambda r, n: r),
    "LogSumExp": ("torch.logsumexp({x}, dim={a}, keepdim={k})", lambda r, n: REAL),
    "Var": ("torch.var({x}, dim={a}, keepdim={k})", lambda r, n: NONNEG),
    "Std": ("torch.std({x}, dim={a}, keepdim={k})", lambda r, n: NONNEG),
    "Norm": ("torch.linalg.vector_norm({x}, dim={a}, keepdim={k})", lambda r, n: NONNEG),
}


def _reduction(name: str) -> Builder:
    template, out_range = _REDUCTIONS[name]

    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        if x.rank < 2:
            return None
        axis = _axis(ctx, x)
        if axis is None:
            return None
        keep = ctx.rng.random() < 0.5
        dims = list(x.dims)
        n = max(dims[axis].gpu, dims[axis].cpu)
        channel = None if axis == x.channel else x.channel
        if keep:
            dims[axis] = Dim("1", 1, 1)
        else:
            del dims[axis]
            channel = channel - 1 if channel is not None and channel > axis else channel
        return Step(name, template.split("(")[0], template.format(x=v, a=axis, k=keep),
                    TensorSpec(tuple(dims), out_range(x.range, n), channel=channel))
    return build


for _name in _REDUCTIONS:
    op(_name, "reduce")(_reduction(_name))


# ---- matrix products ----

_FEATURES = ((1024, 64), (2048, 128), (4096, 256), (8192, 512))


@op("Linear", "linear")
def _linear(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank < 2 or x.dtype != "float32":
        return None
    k = x.dims[-1]
    n = ctx.size("out_features", _FEATURES)
    bias = ctx.rng.random() < 0.8
    attr = ctx.module("linear", f"nn.Linear({ctx.param(k, 'in_features')}, {ctx.param(n, 'out_features')}"
                                f"{'' if bias else ', bias=False'})")
    out = x.with_dims(x.dims[:-1] + (n,)).with_range(REAL).with_channel(x.rank - 1)
    return Step("Linear", "nn.Linear", f"{attr}({v})", out, _flops(x, lambda s: 2.0 * n.at(s)))


@op("Matmul", "linear")
def _matmul(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    """A product with a second input (a weight the caller passes)."""
    if x.rank < 2 or x.dtype != "float32":
        return None
    k = x.dims[-1]
    n = ctx.size("n", _FEATURES)
    w = ctx.input("w", TensorSpec((k, n)), "randn")
    out = x.with_dims(x.dims[:-1] + (n,)).with_range(REAL).with_channel(x.rank - 1)
    return Step("Matmul", "torch.matmul", f"torch.matmul({v}, {w})", out, _flops(x, lambda s: 2.0 * n.at(s)))


@op("Bmm", "linear")
def _bmm(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank != 3 or x.dtype != "float32":
        return None
    n = ctx.size("n", _FEATURES)
    y = ctx.input("y", TensorSpec((x.dims[0], x.dims[2], n)), "randn")
    out = x.with_dims((x.dims[0], x.dims[1], n)).with_range(REAL).with_channel(2)
    return Step("Bmm", "torch.bmm", f"torch.bmm({v}, {y})", out, _flops(x, lambda s: 2.0 * n.at(s)))


@op("Gram", "linear")
def _gram(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    """x @ x^T over the last two axes (attention-score shaped)."""
    if x.rank != 3 or x.dims[1].gpu > 4096:
        return None
    out = TensorSpec((x.dims[0], x.dims[1], x.dims[1]), REAL)   # scores: no axis holds channels
    return Step("Gram", "torch.matmul", f"torch.matmul({v}, {v}.transpose(1, 2))", out,
                _flops(x, lambda s: 2.0 * x.dims[1].at(s)))


@op("Attention", "linear")
def _attention(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    """Self-attention of a (batch, sequence, features) tensor with itself as query, key and value."""
    if x.rank != 3 or x.dims[1].gpu > 8192 or x.dims[1].min() < 4:
        return None
    causal = ctx.rng.random() < 0.5
    return Step("Attention", "F.scaled_dot_product_attention",
                f"F.scaled_dot_product_attention({v}, {v}, {v}{', is_causal=True' if causal else ''})",
                x.with_range(x.range), _flops(x, lambda s: 4.0 * x.dims[1].at(s)))


# ---- convolutions ----

_CHANNELS = ((16, 8), (32, 8), (64, 16), (128, 16))


def _conv(nd: int, transposed: bool, depthwise: bool = False) -> Builder:
    name = ("ConvTranspose" if transposed else "DepthwiseConv" if depthwise else "Conv") + f"{nd}d"
    api = f"nn.{'ConvTranspose' if transposed else 'Conv'}{nd}d"

    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        if x.rank != nd + 2 or x.dtype != "float32" or not _channels_first(x):
            return None
        spatial = list(x.dims[2:])
        if transposed:
            kernel, stride, padding = ctx.rng.choice(((2, 2, 0), (4, 2, 1), (3, 1, 1)))
            out_sp = [s if stride == 1 else scaled(s, 2) for s in spatial]
        else:
            kernel = ctx.rng.choice((1, 3, 5) if nd < 3 else (1, 3))
            stride = ctx.rng.choice((1, 1, 2))
            padding = ctx.rng.choice((0, kernel // 2))
            if not all(s.min() >= kernel for s in spatial):
                return None
            out_sp = [conv_out(s, kernel, stride, padding) for s in spatial]
            if not _spatial_ok(out_sp):
                return None
        cin = x.dims[1]
        cout = cin if depthwise else ctx.size("out_channels", _CHANNELS)
        args = [ctx.param(cin, "in_channels"), ctx.param(cout, "out_channels"), f"kernel_size={kernel}"]
        if stride != 1:
            args.append(f"stride={stride}")
        if padding:
            args.append(f"padding={padding}")
        if depthwise:
            args.append(f"groups={args[0]}")
        if ctx.rng.random() < 0.2:
            args.append("bias=False")
        attr = ctx.module("conv_transpose" if transposed else "conv", f"{api}({', '.join(args)})")
        out = TensorSpec((x.dims[0], cout, *out_sp), REAL, channel=1)
        per_in = 1 if depthwise else None

        def per_out(s: str) -> float:
            cin_group = per_in if per_in else cin.at(s)
            return 2.0 * cin_group * kernel ** nd

        if transposed:   # each input element spreads over kernel^nd outputs of every output channel
            flops = _flops(x, lambda s: 2.0 * cout.at(s) * kernel ** nd)
        else:
            flops = _flops(out, per_out)
        return Step(name, api, f"{attr}({v})", out, flops)
    return build


for _nd in (1, 2, 3):
    op(f"Conv{_nd}d", "conv")(_conv(_nd, False))
    op(f"ConvTranspose{_nd}d", "conv")(_conv(_nd, True))
op("DepthwiseConv2d", "conv")(_conv(2, False, depthwise=True))


# ---- pooling, resampling ----

def _pool(kind: str, nd: int) -> Builder:
    name = f"{kind}Pool{nd}d"

    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        if x.rank != nd + 2 or not _channels_first(x):
            return None
        kernel, stride, padding = ctx.rng.choice(((2, 2, 0), (3, 2, 1), (3, 1, 1)))
        spatial = list(x.dims[2:])
        out_sp = [conv_out(s, kernel, stride, padding) for s in spatial]
        if not _spatial_ok(spatial, kernel) or not _spatial_ok(out_sp):
            return None
        args = f"kernel_size={kernel}" + (f", stride={stride}" if stride != kernel else "") + (
            f", padding={padding}" if padding else "")
        attr = ctx.module(f"{kind.lower()}_pool", f"nn.{name}({args})")
        return Step(name, f"nn.{name}", f"{attr}({v})", x.with_dims((x.dims[0], x.dims[1], *out_sp)))
    return build


def _adaptive(kind: str, nd: int) -> Builder:
    name = f"Adaptive{kind}Pool{nd}d"

    def build(ctx: Context, x: TensorSpec, v: str) -> Step | None:
        if x.rank != nd + 2 or not _spatial_ok(list(x.dims[2:])) or not _channels_first(x):
            return None
        attr = ctx.module("global_pool", f"nn.{name}(1)")
        one = Dim("1", 1, 1)
        return Step(name, f"nn.{name}", f"{attr}({v})", x.with_dims((x.dims[0], x.dims[1]) + (one,) * nd))
    return build


for _nd in (1, 2, 3):
    op(f"MaxPool{_nd}d", "pool")(_pool("Max", _nd))
    op(f"AvgPool{_nd}d", "pool")(_pool("Avg", _nd))
    op(f"AdaptiveAvgPool{_nd}d", "pool")(_adaptive("Avg", _nd))
op("AdaptiveMaxPool2d", "pool")(_adaptive("Max", 2))


@op("Upsample", "pool")
def _upsample(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    # a length-1 axis upsampled is that value repeated (the output a broadcast): axes of 2 or more only
    if not 3 <= x.rank <= 5 or not _channels_first(x) or not _spatial_ok(list(x.dims[2:])):
        return None
    mode = ctx.rng.choice(("nearest", {3: "linear", 4: "bilinear", 5: "trilinear"}[x.rank]))
    extra = "" if mode == "nearest" else ", align_corners=False"
    out = x.with_dims((x.dims[0], x.dims[1], *(scaled(s, 2) for s in x.dims[2:])))
    return Step("Upsample", "F.interpolate", f"F.interpolate({v}, scale_factor=2, mode=\"{mode}\"{extra})", out)


@op("PixelShuffle", "pool")
def _pixel_shuffle(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    c = x.dims[1] if x.rank == 4 and _channels_first(x) else None
    if c is None or c.gpu % 4 or c.cpu % 4:
        return None
    attr = ctx.module("pixel_shuffle", "nn.PixelShuffle(2)")
    dims = (x.dims[0], c.derive(lambda n: n // 4, "{} // 4"), scaled(x.dims[2], 2), scaled(x.dims[3], 2))
    return Step("PixelShuffle", "nn.PixelShuffle", f"{attr}({v})", x.with_dims(dims))


# ---- the entry of token inputs ----

@op("Embedding", "embedding")
def _embedding(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.dtype != "int64" or ctx.vocab is None:
        return None
    dim = ctx.size("embedding_dim", ((1024, 64), (2048, 128), (4096, 128)))
    attr = ctx.module("embedding", f"nn.Embedding({ctx.param(ctx.vocab, 'num_embeddings')}, "
                                   f"{ctx.param(dim, 'embedding_dim')})")
    return Step("Embedding", "nn.Embedding", f"{attr}({v})", TensorSpec(x.dims + (dim,), REAL, channel=x.rank))


# ---- views: reshape the chain, not counted as operators ----

@op("Flatten", "view")
def _flatten(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank < 3:
        return None
    out = x.with_dims((x.dims[0], product(list(x.dims[1:])))).with_channel(1)   # one feature axis
    return Step("Flatten", "torch.flatten", f"torch.flatten({v}, 1)", out, compute=False)


@op("Transpose", "view")
def _transpose(ctx: Context, x: TensorSpec, v: str) -> Step | None:
    if x.rank != 3:
        return None
    return Step("Transpose", "torch.transpose", f"{v}.transpose(1, 2)",
                x.with_dims((x.dims[0], x.dims[2], x.dims[1])).with_channel({1: 2, 2: 1}.get(x.channel)),
                compute=False)


CATEGORIES = tuple(dict.fromkeys(spec.category for spec in CATALOG))
# How often the composer tries each category first (relative): compute-heavy and fusable
# operators more often than the many one-line activations would be drawn by count alone.
CATEGORY_WEIGHTS = {"activation": 3.0, "arithmetic": 1.0, "binary": 1.0, "norm": 2.0, "softmax": 1.0, "scan": 0.5,
                    "reduce": 1.5, "linear": 2.0, "conv": 2.0, "pool": 1.5, "embedding": 1.0, "view": 1.0}
BY_NAME = {spec.name: spec for spec in CATALOG}

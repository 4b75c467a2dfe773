"""Shape and value-range inference for composed tasks.

A tensor in a composed chain is known three ways at once: symbolically (each axis a Python
expression over the task's size globals, exactly as the emitted code computes it), concretely at
both scales (the `gpu` globals and the `cpu` overrides in SCALES), and by the interval its values
lie in. Operators map these forward, so a chain is consistent by construction: nothing is run to
find out whether the shapes fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

SCALE_NAMES = ("gpu", "cpu")


@dataclass(frozen=True)
class Dim:
    """One axis: `expr` is how the emitted code spells it (a global name or arithmetic over
    globals); `gpu` and `cpu` are its value at each scale."""

    expr: str
    gpu: int
    cpu: int

    def at(self, scale: str) -> int:
        return self.gpu if scale == "gpu" else self.cpu

    def is_name(self) -> bool:
        return self.expr.isidentifier()

    def term(self) -> str:
        """The expression, parenthesized unless atomic, for use inside a larger one."""
        return self.expr if self.expr.isidentifier() or self.expr.isdigit() else f"({self.expr})"

    def derive(self, fn: Callable[[int], int], template: str) -> "Dim":
        """A new axis computed from this one: `template` spells it with `{}` for this axis."""
        return Dim(template.format(self.term()), fn(self.gpu), fn(self.cpu))

    def min(self) -> int:
        return min(self.gpu, self.cpu)


def product(dims: list[Dim]) -> Dim:
    """The product of several axes (what flattening them yields)."""
    return Dim(" * ".join(d.term() for d in dims), math.prod(d.gpu for d in dims), math.prod(d.cpu for d in dims))


def conv_out(d: Dim, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> Dim:
    """Output length of a convolution or pooling window along `d` (PyTorch's floor formula)."""
    shrink = dilation * (kernel - 1) + 1 - 2 * padding

    def fn(n: int) -> int:
        return (n - shrink) // stride + 1

    if stride == 1:
        if shrink == 1:
            return d
        return d.derive(fn, f"{{}} - {shrink - 1}" if shrink > 1 else f"{{}} + {1 - shrink}")
    offset = f" - {shrink}" if shrink > 0 else (f" + {-shrink}" if shrink < 0 else "")
    return d.derive(fn, f"({{}}{offset}) // {stride} + 1")


def scaled(d: Dim, factor: int) -> Dim:
    return d.derive(lambda n: n * factor, f"{{}} * {factor}")


# Value ranges: closed intervals [lo, hi]; TINY marks "strictly positive" (the image of exp,
# sigmoid, softplus), which log and rsqrt need.
INF = math.inf
TINY = 1e-30


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float

    def positive(self) -> bool:
        return self.lo >= TINY

    def nonnegative(self) -> bool:
        return self.lo >= 0.0


REAL = Range(-INF, INF)
NONNEG = Range(0.0, INF)
UNIT = Range(0.0, 1.0)


def monotone(r: Range, fn: Callable[[float], float]) -> Range:
    """The image of [lo, hi] under a non-decreasing function."""
    return Range(fn(r.lo), fn(r.hi))


def scale_range(r: Range, c: float) -> Range:
    a, b = r.lo * c, r.hi * c
    return Range(min(a, b), max(a, b)) if not (math.isnan(a) or math.isnan(b)) else REAL


def sum_range(r: Range, n: int) -> Range:
    """Range of a sum of n values from r."""
    return Range(r.lo * n, r.hi * n)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor flowing through the chain: its axes (axis 0 is the batch), dtype, value range, and
    which axis holds its channels or features (1 in NCHW-style layouts, the last one after an
    Embedding or a Linear; None where no axis means that, e.g. attention scores): per-channel
    parameters (a bias, a norm's affine weights) broadcast along that axis and no other."""

    dims: tuple[Dim, ...]
    range: Range = REAL
    dtype: str = "float32"
    channel: int | None = None

    @property
    def rank(self) -> int:
        return len(self.dims)

    def numel(self, scale: str) -> int:
        return math.prod(d.at(scale) for d in self.dims)

    def with_dims(self, dims: tuple[Dim, ...] | list[Dim]) -> "TensorSpec":
        return replace(self, dims=tuple(dims))

    def with_channel(self, axis: int | None) -> "TensorSpec":
        return replace(self, channel=axis)

    def with_range(self, r: Range) -> "TensorSpec":
        return replace(self, range=r)

    def shape(self, scale: str) -> tuple[int, ...]:
        return tuple(d.at(scale) for d in self.dims)

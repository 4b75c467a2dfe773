"""What a chain under construction declares (Context), and the input families that start one.

The catalog's entries and the composer both work on a Context, and the config checks the family
names it is given: a module of their own, importing only hpc.synthesis.shapes, lets the catalog,
the composer and the config share them without importing one another.
"""

from __future__ import annotations

import copy
import keyword
import math
import random
from typing import Callable

from hpc.synthesis.shapes import Dim, Range, TensorSpec

# The batch every family starts from, per scale; the composer then scales it to the runtime target.
INITIAL_BATCH = {"gpu": 16, "cpu": 4}
# Names the rendered task file defines or imports itself: never given to a declared global.
_RESERVED = {"x", "self", "torch", "nn", "F", "Model", "SCALES", "get_inputs", "get_init_inputs", "super", "math"}


class Context:
    """What a chain under construction declares: size globals, constructor parameters, modules
    and extra inputs. Catalog entries call it; `snapshot`/`restore` undo an entry the composer
    turns down."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.globals: dict[str, list[int]] = {}     # name -> [gpu value, cpu value], in order of creation
        self.params: dict[str, str] = {}            # __init__ parameter -> expression over globals
        self.modules: list[tuple[str, str]] = []    # (attribute, constructor expression)
        self.inputs: list[tuple[str, TensorSpec, str]] = []   # (forward argument, spec, maker)
        self.vocab: Dim | None = None
        self._taken: set[str] = set(_RESERVED)

    def _unique(self, hint: str) -> str:
        name, k = hint, 2
        while name in self._taken or keyword.iskeyword(name):
            name, k = f"{hint}_{k}", k + 1
        self._taken.add(name)
        return name

    def size(self, hint: str, choices: tuple[tuple[int, int], ...]) -> Dim:
        """A new size global; `choices` are (gpu, cpu) pairs."""
        gpu, cpu = self.rng.choice(choices)
        name = self._unique(hint)
        self.globals[name] = [gpu, cpu]
        return Dim(name, gpu, cpu)

    def param(self, dim: Dim, hint: str) -> str:
        """The __init__ parameter carrying `dim` (get_init_inputs passes its expression)."""
        for name, expr in self.params.items():
            if expr == dim.expr:
                return name
        name = dim.expr if dim.is_name() else self._unique(hint)
        self.params[name] = dim.expr
        return name

    def module(self, hint: str, expr: str) -> str:
        attr = self._unique(hint)
        self.modules.append((attr, expr))
        return f"self.{attr}"

    def input(self, hint: str, spec: TensorSpec, maker: str) -> str:
        name = self._unique(hint)
        self.inputs.append((name, spec, maker))
        return name

    def snapshot(self) -> tuple:
        return copy.deepcopy((self.globals, self.params, self.modules, self.inputs, self._taken))

    def restore(self, state: tuple) -> None:
        self.globals, self.params, self.modules, self.inputs, self._taken = copy.deepcopy(state)


def _batch(ctx: Context) -> Dim:
    name = ctx._unique("batch_size")
    ctx.globals[name] = [INITIAL_BATCH["gpu"], INITIAL_BATCH["cpu"]]
    return Dim(name, INITIAL_BATCH["gpu"], INITIAL_BATCH["cpu"])


def _matrix(ctx: Context) -> TensorSpec:
    return TensorSpec((_batch(ctx), ctx.size("features", ((1024, 128), (2048, 256), (4096, 512), (8192, 1024)))),
                      channel=1)


def _sequence(ctx: Context) -> TensorSpec:
    b = _batch(ctx)
    return TensorSpec((b, ctx.size("seq_len", ((512, 32), (1024, 64), (2048, 128))),
                       ctx.size("hidden_size", ((512, 64), (1024, 128), (2048, 256), (4096, 256)))), channel=2)


def _image(ctx: Context) -> TensorSpec:
    b = _batch(ctx)
    c = ctx.size("in_channels", ((3, 3), (16, 8), (32, 16), (64, 16)))
    h = ctx.size("height", ((128, 32), (256, 32), (512, 64)))
    w = ctx.size("width", ((h.gpu, h.cpu),) * 3 + ((256, 32), (128, 64)))
    return TensorSpec((b, c, h, w), channel=1)


def _volume(ctx: Context) -> TensorSpec:
    b = _batch(ctx)
    c = ctx.size("in_channels", ((3, 3), (16, 4), (32, 8)))
    d = ctx.size("depth", ((16, 8), (32, 8), (64, 16)))
    h = ctx.size("height", ((64, 16), (128, 16)))
    w = ctx.size("width", ((h.gpu, h.cpu),))
    return TensorSpec((b, c, d, h, w), channel=1)


def _signal(ctx: Context) -> TensorSpec:
    b = _batch(ctx)
    return TensorSpec((b, ctx.size("in_channels", ((16, 8), (64, 16), (128, 32))),
                       ctx.size("length", ((4096, 256), (16384, 1024), (65536, 2048)))), channel=1)


def _tokens(ctx: Context) -> TensorSpec:
    b = _batch(ctx)
    ctx.vocab = ctx.size("vocab_size", ((32000, 1000), (50257, 2000)))
    return TensorSpec((b, ctx.size("seq_len", ((512, 32), (1024, 64), (2048, 64)))), Range(0, math.inf), "int64")


FAMILIES: dict[str, Callable[[Context], TensorSpec]] = {
    "matrix": _matrix, "sequence": _sequence, "image": _image, "volume": _volume, "signal": _signal,
    "tokens": _tokens,
}

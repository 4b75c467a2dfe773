"""Building the op monitor's library (hpc/runner/op_monitor.py) against the running torch.

The harness builds it, once per machine and torch version, outside the sandbox, into the
evaluator's cache; a worker loads the built library by path before any candidate code runs. The
build lives here, not beside the monitor in hpc.runner, because the harness never imports
hpc.runner (code that runs inside the workers); the C++ source stays there, with the code that
loads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hpc.compile.native import Toolchain, compile_workdir
from hpc.errors import ToolchainError

# The monitor's sources (kernels/op_monitor.cpp), a workdir of the worker-side package.
MONITOR_WORKDIR = Path(__file__).parent.parent / "runner" / "monitor_lib"


def _toolchain() -> Toolchain:
    root = Path(torch.__file__).parent
    return Toolchain(
        "cpu", os.environ.get("CXX", "g++"),
        ("-O2", "-std=c++20", "-fPIC", f"-I{root / 'include'}", f"-DHPC_TORCH_VERSION={torch.__version__}",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"),
        (f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}", "-Wl,--no-undefined"),
    )


def op_monitor_library(cache_dir: Path) -> Path:
    """The monitor's shared library for this torch, built into the evaluator's cache on first use."""
    result = compile_workdir(MONITOR_WORKDIR, _toolchain(), cache_dir, trusted=True)
    if not result.ok:
        raise ToolchainError(f"cannot build the op monitor against torch {torch.__version__}: "
                             f"{result.log.strip()[-300:]}")
    return result.library

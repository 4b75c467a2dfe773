"""Build the CUDA timing protocol's start gate (gate_kernel/kernels/start_gate.cu).

Built by the harness with the evaluator's own toolchain and cache (so once per machine and
compiler), outside any sandbox, and handed to each timed program by path.
"""

from __future__ import annotations

from pathlib import Path

from hpc.compile.native import compile_workdir, default_toolchain
from hpc.errors import UserError

GATE_WORKDIR = Path(__file__).parent / "gate_kernel"


def start_gate_library(cache_dir: Path, cuda_arch: str) -> Path:
    result = compile_workdir(GATE_WORKDIR, default_toolchain("cuda", cuda_arch), cache_dir)
    if not result.ok:
        raise UserError(f"cannot build the timing start gate with nvcc: {result.log.strip()[-300:]}")
    return result.library

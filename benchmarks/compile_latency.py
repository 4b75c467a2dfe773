"""Compile latency of a new single-kernel candidate: workdir format (g++/nvcc, no torch headers)
against KernelBench's load_inline, side by side in one run. Every sample is a cache miss (a
unique comment is appended to the source); one more call measures the cache hit.

    python benchmarks/compile_latency.py [--samples 10] [--inline-samples 2] [--backend cpu|cuda|both]

The load_inline side uses the C++ fixture, or the CUDA one with --backend cuda.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.compile.native import compile_workdir, default_toolchain  # noqa: E402

HONEST = ROOT / "tests" / "fixtures" / "honest_relu"
INLINE = {"cpu": ROOT / "tests" / "fixtures" / "honest_relu_inline.py",
          "cuda": ROOT / "tests" / "fixtures" / "honest_relu_inline_cuda.py"}


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def workdir_samples(backend: str, n: int, cache: Path) -> tuple[list[float], float]:
    suffix = ".cu" if backend == "cuda" else ".cpp"
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "w"
        shutil.copytree(HONEST, work)
        src = work / "kernels" / f"relu{suffix}"
        original = src.read_text()
        for _ in range(n):
            src.write_text(original + f"\n// {uuid.uuid4()}\n")
            r = compile_workdir(work, default_toolchain(backend), cache)
            assert r.ok and not r.cached, r.log
            times.append(r.seconds)
        hit = compile_workdir(work, default_toolchain(backend), cache)
        assert hit.cached
    return times, hit.seconds


def inline_samples(n: int, backend: str) -> list[float]:
    """load_inline in a fresh interpreter each time, with a fresh extensions dir (a true cold build)."""
    times = []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as ext:
            code = (f"import importlib.util, time, torch.utils.cpp_extension; t = time.perf_counter(); "
                    f"s = importlib.util.spec_from_file_location('m', {str(INLINE[backend])!r}); "
                    f"m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
                    f"print(time.perf_counter() - t)")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env={**os.environ, "TORCH_EXTENSIONS_DIR": ext})
            assert out.returncode == 0, out.stderr[-2000:]
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--inline-samples", type=int, default=2)
    ap.add_argument("--backend", choices=("cpu", "cuda", "both"), default="both")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for backend in (("cpu", "cuda") if args.backend == "both" else (args.backend,)):
            if backend == "cuda" and shutil.which("nvcc") is None:
                continue
            times, hit = workdir_samples(backend, args.samples, Path(cache))
            results[f"workdir_{backend}"] = {"p50_s": statistics.median(times), "p90_s": percentile(times, 0.9),
                                             "cache_hit_s": hit, "samples": len(times)}
    inline_backend = "cuda" if args.backend == "cuda" else "cpu"
    if args.inline_samples:
        times = inline_samples(args.inline_samples, inline_backend)
        results[f"load_inline_{inline_backend}"] = {"p50_s": statistics.median(times), "p90_s": percentile(times, 0.9),
                                      "samples": len(times)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

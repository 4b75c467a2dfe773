"""Synthesis throughput of one device: candidate tasks per hour through the filters, and the yield
of each filter.

Composes `--count` candidates and runs the whole filter chain on them in this process with
`--workers` at once (the device shared as in a shard: timed runs alone), from an empty cache
unless `--cache-dir` is given, so torch.compile starts cold as in a fresh array task.

    python benchmarks/synthesis_throughput.py --backend cuda --count 200 --workers 8 \
        [--benchmark KernelBench/KernelBench] [--config synth.yaml] [--out figures.json]
    python benchmarks/synthesis_throughput.py --scale cpu --count 8        # the CPU scale, on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.errors import UserError  # noqa: E402
from hpc.hardware import device_name, versions  # noqa: E402
from hpc.synthesis.config import load_synthesis_config  # noqa: E402
from hpc.synthesis.manifest import read_manifest  # noqa: E402
from hpc.synthesis.shards import DATASET, run_local  # noqa: E402


def _reason_class(rec: dict) -> str:
    """The filter, and for the runtime window which side of it."""
    if rec["filter"] == "runtime" and rec["reason"].startswith(("too fast", "too slow")):
        return f"runtime ({rec['reason'][:8]})"
    return rec["filter"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cpu", "cuda"))
    ap.add_argument("--scale", choices=("cpu", "gpu"))
    ap.add_argument("--count", type=int, default=100, help="candidates to compose (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4, help="candidates checked at once (default 4)")
    ap.add_argument("--benchmark", help="decontaminate against this folder of problem files")
    ap.add_argument("--config", help="YAML synthesis config")
    ap.add_argument("--cache-dir", help="compile and inductor cache (default: a fresh temporary one)")
    ap.add_argument("--run-dir", help="keep the run (shard file, dataset) here (default: a temporary folder)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    backend = args.backend or ("cpu" if args.scale == "cpu" else "cuda")
    scratch = tempfile.TemporaryDirectory(prefix="hpc-synth-bench-")
    try:
        cfg = load_synthesis_config(args.config, backend=backend, scale=args.scale, seed=args.seed, count=args.count,
                                    workers=args.workers, benchmark=args.benchmark)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg.eval.cache_dir = args.cache_dir or str(Path(scratch.name) / "cache")
    run = Path(args.run_dir) if args.run_dir else Path(scratch.name) / "run"
    started = time.perf_counter()
    stats = run_local(cfg, run)
    wall = time.perf_counter() - started
    records, _, _ = read_manifest(run / DATASET / "manifest.h5")
    rejected = Counter(_reason_class(r) for r in records if not r["accepted"])
    hours = wall / 3600
    figures = {
        "date": time.strftime("%Y-%m-%d"), "device": device_name(backend), "versions": versions(),
        "backend": backend, "scale": cfg.eval.scale, "seed": cfg.seed, "count": cfg.count, "workers": cfg.workers,
        "benchmark": cfg.benchmark, "timing_iterations": cfg.eval.timing.iterations, "wall_s": round(wall, 1),
        "candidates_per_hour": round(stats["candidates"] / hours, 1),
        "accepted_per_hour": round(stats["accepted"] / hours, 1),
        "yield": stats["yield"], "filters": stats["filters"], "rejected_by": dict(rejected.most_common()),
        "eager_ms": sorted(r["eager_ms"] for r in records if r["accepted"] and not math.isnan(r["eager_ms"])),
    }
    print(f"{stats['candidates']} candidates in {wall:.0f} s on {figures['device']} ({backend}, "
          f"{cfg.eval.scale} scale, {cfg.workers} workers): {figures['candidates_per_hour']:.0f} candidates/hour "
          f"through the filters, "
          f"{figures['accepted_per_hour']:.0f} accepted/hour, yield {100 * stats['yield']:.1f}%")
    print("| filter | entered | rejected | pass rate | seconds | s per candidate |")
    print("|---|---:|---:|---:|---:|---:|")
    for f in stats["filters"]:
        if f["entered"]:
            print(f"| {f['name']} | {f['entered']} | {f['rejected']} | {100 * f['passed'] / f['entered']:.1f}% | "
                  f"{f['seconds']:.1f} | {f['seconds'] / f['entered']:.2f} |")
    print("rejected by: " + ", ".join(f"{k} {v}" for k, v in rejected.most_common()))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Synthesis throughput of one device: candidate tasks per hour through the filters, and the yield
of each filter.

Composes `--count` candidates and runs the whole filter chain on them in this process with
`--workers` at once (the device shared as in a shard: timed runs alone), from an empty cache
unless `--cache-dir` is given, so torch.compile starts cold as in a fresh array task.

`--seconds S` is a time budget, for a machine that kills a command at a limit: after S seconds no
further candidate starts, those in flight finish, and the figures are those of the candidates
checked (the output says the budget cut the run, and how many of `--count` were checked). Leave
the limit room for the longest candidate (a cold torch.compile) after S.

    python benchmarks/synthesis_throughput.py --backend cuda --count 200 --workers 8 \
        [--seconds 420] [--benchmark KernelBench/KernelBench] [--config synth.yaml] [--out figures.json]
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
from hpc.synthesis.shards import DATASET, checked_stats, merge, run_shard  # noqa: E402


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
    ap.add_argument("--seconds", type=float, help="time budget: no candidate starts after this many seconds "
                                                  "(those in flight finish and count); default none")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.seconds is not None and not args.seconds >= 0:
        print(f"error: --seconds: must be >= 0, got {args.seconds}", file=sys.stderr)
        return 2
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
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    cut = run_shard(cfg, 0, 1, run, deadline=deadline)["cut_by_deadline"]
    merged = None if cut else merge(run, cfg)   # the merge needs every candidate checked
    wall = time.perf_counter() - started
    if merged is None:   # the merge's statistics over the candidates checked
        stats, records = checked_stats(run, cfg)
    else:
        stats, (records, _, _) = merged, read_manifest(run / DATASET / "manifest.h5")
    rejected = Counter(_reason_class(r) for r in records if not r["accepted"])
    hours = wall / 3600
    figures = {
        "date": time.strftime("%Y-%m-%d"), "device": device_name(backend), "versions": versions(),
        "backend": backend, "scale": cfg.eval.scale, "seed": cfg.seed, "count": cfg.count, "workers": cfg.workers,
        "benchmark": cfg.benchmark, "timing_iterations": cfg.eval.timing.iterations, "budget_s": args.seconds,
        "cut_by_budget": cut, "checked": stats["candidates"], "wall_s": round(wall, 1),
        "candidates_per_hour": round(stats["candidates"] / hours, 1),
        "accepted_per_hour": round(stats["accepted"] / hours, 1),
        "yield": stats["yield"], "filters": stats["filters"], "rejected_by": dict(rejected.most_common()),
        "eager_ms": sorted(r["eager_ms"] for r in records if r["accepted"] and not math.isnan(r["eager_ms"])),
    }
    if cut:
        print(f"cut by the --seconds {args.seconds:g} budget: {stats['candidates']} of {stats['count']} candidates "
              f"checked (none started after {args.seconds:g} s, those in flight finished)")
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
    print("summary: " + json.dumps({k: figures[k] for k in ("checked", "count", "cut_by_budget", "wall_s",
                                                          "candidates_per_hour", "accepted_per_hour", "yield")}))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

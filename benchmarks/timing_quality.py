"""How far the evaluator's timings can be trusted, in one run:

1. spread: one candidate evaluated `--repeats` times from scratch (fresh worker processes each
   time); the coefficient of variation of its median time across those evaluations.
2. bias: an eager-identical candidate (the task's own `Model` as `ModelNew`, its aten ops allowed
   by the rules for this measurement only) evaluated `--repeats` times; its speedup over the
   eager baseline should be 1.

    python benchmarks/timing_quality.py --backend cuda [--task ... --solution ... --ops gelu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.candidate import load_candidate  # noqa: E402
from hpc.config import load_config  # noqa: E402
from hpc.pipeline import evaluate  # noqa: E402
from hpc.task import load_task  # noqa: E402


def cv(xs: list[float]) -> float:
    return statistics.stdev(xs) / statistics.mean(xs) if len(xs) > 1 else float("nan")


def repeated(task, candidate, cfg, repeats: int) -> list:
    records = []
    for i in range(repeats):
        rec = evaluate(task, candidate, cfg)
        if rec.status != "ok":
            raise SystemExit(f"evaluation {i} of {candidate.path} failed at {rec.failed_stage}: {rec.reason}")
        records.append(rec)
        print(f"  {candidate.path.name} #{i}: {rec.candidate_ms:.4f} ms (within-run CV {rec.candidate_cv:.4f}, "
              f"handshake {rec.overhead_ms:.4f} ms), eager {rec.eager_ms:.4f} ms (CV {rec.eager_cv:.4f}), "
              f"{rec.wall_seconds:.1f} s {rec.stage_seconds}", flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(ROOT / "kernels/tasks/level1/08_gelu.py"))
    ap.add_argument("--solution", default=str(ROOT / "kernels/solutions/level1/08_gelu"))
    ap.add_argument("--ops", default="gelu", help="comma-separated aten ops the task's own forward uses")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--scale", default=None, help="default: gpu on cuda, cpu on cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    ap.add_argument("--correctness-trials", type=int, default=0,
                    help="only this many correctness trials, no extra distributions (shorter evaluations; "
                         "the timing protocol is unchanged)")
    args = ap.parse_args()

    cfg = load_config(backend=args.backend, scale=args.scale or ("gpu" if args.backend == "cuda" else "cpu"))
    if args.correctness_trials:
        cfg.correctness.trials, cfg.correctness.distributions = args.correctness_trials, []
    task = load_task(args.task)
    started = time.time()

    print(f"spread: {args.solution} x{args.repeats}", flush=True)
    solution = repeated(task, load_candidate(args.solution), cfg, args.repeats)
    times = [r.candidate_ms for r in solution]

    print(f"bias: eager-identical candidate x{args.repeats}", flush=True)
    cfg.rules.allowed_torch_ops = [op for op in args.ops.split(",") if op]
    cfg.rules.require_custom_kernel = False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"eager_identical_{task.path.stem}.py"
        src.write_text(task.path.read_text() + "\n\nclass ModelNew(Model):\n    pass\n")
        identical = repeated(task, load_candidate(src), cfg, args.repeats)
    ratios = [r.speedup_eager for r in identical]

    figures = {
        "task": task.task_id, "solution": args.solution, "backend": args.backend, "scale": cfg.scale,
        "hardware": solution[0].hardware, "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
        "solution_ms": times, "solution_cv_across_runs": cv(times),
        "solution_cv_within_run_mean": statistics.mean(r.candidate_cv for r in solution),
        "solution_overhead_ms": [r.overhead_ms for r in solution],
        "eager_identical_speedup": ratios, "eager_identical_speedup_median": statistics.median(ratios),
        "wall_seconds": time.time() - started,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    print(f"\n{'figure':44} value")
    print(f"{'solution median ms (min..max)':44} {statistics.median(times):.4f} ({min(times):.4f}..{max(times):.4f})")
    print(f"{'CV of the median across evaluations':44} {figures['solution_cv_across_runs']:.4f}")
    print(f"{'mean within-run CV':44} {figures['solution_cv_within_run_mean']:.4f}")
    print(f"{'eager-identical speedup median (min..max)':44} "
          f"{figures['eager_identical_speedup_median']:.3f} ({min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()

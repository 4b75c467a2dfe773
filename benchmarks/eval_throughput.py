"""Evaluation throughput of one process: candidates per minute through the full pipeline.

The shipped solutions of the selected tasks are evaluated twice in one run: the first pass starts
from empty caches (every compile and every eager / torch.compile baseline is new), the second
finds them cached, which is the steady state of an RL run where the same tasks recur.

    python benchmarks/eval_throughput.py --backend cuda --only level1 [--iterations 100]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.analysis.metrics import stage_seconds  # noqa: E402
from hpc.config import load_config  # noqa: E402
from hpc.suite import evaluate_suite  # noqa: E402
from solution_args import solution_parser, solved_tasks  # noqa: E402


def main() -> None:
    ap = solution_parser(__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()

    tasks = solved_tasks(args)
    figures: dict = {"tasks": [t.task_id for t in tasks], "backend": args.backend, "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="hpc-throughput-") as cache:
        cfg = load_config(backend=args.backend, scale="gpu" if args.backend == "cuda" else "cpu", cache_dir=cache)
        if args.iterations:
            cfg.timing.iterations = args.iterations
        cfg.validate()
        for name in ("cold", "warm"):
            started = time.perf_counter()
            records = evaluate_suite(tasks, Path(args.solutions), cfg)
            wall = time.perf_counter() - started
            ok = sum(r.status == "ok" for r in records)
            figures[name] = {"wall_s": wall, "candidates": len(records), "ok": ok,
                             "per_min": 60.0 * len(records) / wall,
                             "per_candidate_s": {r.task_id: r.wall_seconds for r in records},
                             "stage_s": stage_seconds(records)}
            print(f"{name}: {len(records)} candidates ({ok} ok) in {wall:.1f} s = "
                  f"{figures[name]['per_min']:.2f} candidates/min; seconds by stage {figures[name]['stage_s']}",
                  flush=True)
    figures["hardware"] = records[0].hardware if records else ""
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

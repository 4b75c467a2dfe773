"""What the reward's protections cost an evaluation: the same shipped solutions through `hpc
eval-suite` with this checkout and with a previous one, side by side in one run.

Both trees evaluate the same tasks with their own caches; a first run of each warms its baselines,
FLOP counts and compiles, then `--repeats` runs alternate previous/current. The figure is each
task's evaluation wall time (the record's `wall_seconds`) current over previous, and the suite's
total; the stage sums say where the difference goes.

    git worktree add /tmp/previous <commit>        # or: git archive <commit> hpc | tar -x -C DIR
    python benchmarks/protection_cost.py --previous /tmp/previous --backend cuda \\
        --only level1/01_matmul,level1/05_softmax,level1/08_gelu --repeats 2 --out cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def suite(tree: Path, backend: str, only: str, out: Path, cache: Path) -> tuple[float, list[dict]]:
    """One `hpc eval-suite` run of `tree`'s package (wall seconds, records as dicts)."""
    cmd = [sys.executable, "-m", "hpc.cli", "eval-suite", str(ROOT / "kernels" / "tasks"),
           str(ROOT / "kernels" / "solutions"), "--backend", backend, "--jobs", "1", "--out", str(out)]
    for name in only.split(","):
        cmd += ["--only", name]
    env = {**os.environ, "PYTHONPATH": str(tree), "HPC_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"eval-suite of {tree} exited {proc.returncode}: {proc.stderr[-2000:]}")
    read = subprocess.run([sys.executable, "-c", "import json, sys; from hpc.results.hdf5 import read_records; "
                           "print(json.dumps([{k: getattr(r, k) for k in ('task_id', 'status', 'reason', "
                           "'wall_seconds', 'stage_seconds', 'candidate_ms', 'eager_ms', 'reward')} "
                           "for r in read_records(sys.argv[1])]))", str(out)],
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    return wall, json.loads(read.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--previous", required=True, help="a checkout whose hpc package is the previous protocol")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default="level1", help="comma-separated task selections, as eval-suite --only takes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    trees = {"previous": Path(args.previous).resolve(), "current": ROOT}
    runs: dict[str, list] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="hpc-protection-cost-") as work:
        work = Path(work)
        for name, tree in trees.items():   # warm: baselines, costs and compiles cached per tree
            wall, records = suite(tree, args.backend, args.only, work / f"{name}-warm.h5", work / f"cache-{name}")
            print(f"warm {name}: {wall:.1f} s, {sum(r['status'] == 'ok' for r in records)}/{len(records)} ok",
                  flush=True)
        for k in range(args.repeats):
            for name, tree in trees.items():
                wall, records = suite(tree, args.backend, args.only, work / f"{name}-{k}.h5", work / f"cache-{name}")
                runs[name].append({"wall_s": wall, "records": records})
                print(f"run {k} {name}: {wall:.1f} s", flush=True)
    per_task: dict[str, dict[str, list[float]]] = {}
    for name, reps in runs.items():
        for rep in reps:
            for r in rep["records"]:
                per_task.setdefault(r["task_id"], {}).setdefault(name, []).append(r["wall_seconds"])
    print(f"{'task':<28} {'previous s':>11} {'current s':>10} {'ratio':>6}")
    ratios = []
    for task, walls in sorted(per_task.items()):
        prev, cur = statistics.median(walls["previous"]), statistics.median(walls["current"])
        ratios.append(cur / prev)
        print(f"{task:<28} {prev:11.2f} {cur:10.2f} {cur / prev:6.2f}")
    totals = {name: statistics.median(rep["wall_s"] for rep in reps) for name, reps in runs.items()}
    print(f"suite wall: previous {totals['previous']:.1f} s, current {totals['current']:.1f} s, "
          f"ratio {totals['current'] / totals['previous']:.2f}; per-task ratio median {statistics.median(ratios):.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "date": time.strftime("%Y-%m-%d"),
                                              "only": args.only, "repeats": args.repeats, "totals_s": totals,
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

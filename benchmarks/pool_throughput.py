"""Reward-pool throughput: evaluated candidates per minute per GPU, through the real MPI pool.

An RL step hands the pool many distinct candidates for tasks it has seen before. So this builds
`--candidates` distinct workdirs from the shipped solutions of the selected tasks (each a copy
with a marker comment in its kernels: new content, a real compile, nothing cached but the task's
eager and torch.compile baselines), warms those baselines once, then runs
`mpirun -n 2 --bind-to B python -m mpi4py -m hpc.pool` (one coordinator, one worker rank on one
GPU) for each combination of `--concurrency`, `--prestart` and `--bind` (Open MPI's default for
2 ranks is `core`: the worker rank and every process it starts on one core), each on its own fresh
candidate set, side by side in one run. The figure is
candidates / wall time of the whole mpirun, startup included; beside it the steady rate,
candidates / (last evaluation's end - first one's start) from the records, what a long-lived
pool (an RL job's) sustains once started; and the stage totals say where the time went (with
the device lock's waits and exclusive holds).

    python benchmarks/pool_throughput.py --backend cuda --only level1 --candidates 26 --concurrency 1,4 \
        --prestart 0,1 --bind none
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.analysis.metrics import stage_seconds  # noqa: E402
from hpc.results.hdf5 import read_records  # noqa: E402
from hpc.suite import find_candidate  # noqa: E402
from solution_args import solution_parser, solved_tasks  # noqa: E402

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def candidate_set(root: Path, tasks: list, solutions: Path, count: int, tag: str) -> tuple[Path, Path]:
    """`count` distinct candidates, cycling over `tasks`: task copies (same content, so the same
    compiled torch.compile code and counted cost) under new ids, each with its own solution copy marked `tag`."""
    task_dir, cand_dir = root / "tasks", root / "candidates"
    for k in range(count):
        task = tasks[k % len(tasks)]
        level = f"level{task.level}"
        name = f"{task.path.stem}_{tag}{k}"
        (task_dir / level).mkdir(parents=True, exist_ok=True)
        shutil.copy(task.path, task_dir / level / f"{name}.py")
        dst = cand_dir / level / name
        shutil.copytree(find_candidate(task, solutions), dst)
        for src in (dst / "kernels").glob("*.c*"):
            src.write_text(src.read_text() + f"\n// candidate {tag}{k}\n")
    return task_dir, cand_dir


def run_pool(tasks: Path, candidates: Path, out: Path, backend: str, concurrency: int, prestart: int, bind: str,
             log: Path) -> float:
    cmd = ["mpirun", "-n", "2", "--bind-to", bind, "--enable-recovery", sys.executable, "-m", "mpi4py",
           "-m", "hpc.pool", str(tasks), str(candidates), "--out", str(out), "--backend", backend,
           "--concurrency", str(concurrency), "--prestart", str(prestart)]
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT)}, stdout=f,
                              stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"pool exited {proc.returncode}; see {log}")
    return wall


def main() -> None:
    ap = solution_parser(__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=26, help="distinct candidates per concurrency setting")
    ap.add_argument("--concurrency", default="1,4", help="comma-separated evaluations at once on the worker rank")
    ap.add_argument("--prestart", default="1", help="comma-separated: evaluations whose processes start ahead "
                                                     "(each combined with each --concurrency; 0: none)")
    ap.add_argument("--bind", default="none", help="comma-separated Open MPI --bind-to values (none, core...)")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    ap.add_argument("--keep", default="", help="keep the candidate sets, logs and HDF5 here")
    ap.add_argument("--skip-warm", action="store_true",
                    help="the tasks' baselines and costs are cached already (carried cache)")
    args = ap.parse_args()
    try:
        settings = [(int(c), int(p), b) for c in args.concurrency.split(",") for p in args.prestart.split(",")
                    for b in args.bind.split(",")]
    except ValueError as e:
        raise SystemExit(f"--concurrency and --prestart take comma-separated integers ({e})") from None
    if args.candidates < 1 or not settings or min(s[0] for s in settings) < 1 or min(s[1] for s in settings) < 0:
        raise SystemExit("--candidates and every --concurrency must be >= 1, every --prestart >= 0")
    if len(set(settings)) != len(settings):
        raise SystemExit("each setting once: a repeated --concurrency, --prestart or --bind value would "
                         "reuse its run's folder")
    tasks = solved_tasks(args)
    work = Path(args.keep or tempfile.mkdtemp(prefix="hpc-pool-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {"backend": args.backend, "tasks": [t.task_id for t in tasks], "date": time.strftime("%Y-%m-%d"),
                     "candidates": args.candidates, "runs": {}}

    if not args.skip_warm:
        warm_tasks, warm_cands = candidate_set(work / "warm", tasks, Path(args.solutions), len(tasks), "warm")
        wall = run_pool(warm_tasks, warm_cands, work / "warm.h5", args.backend, 4, 1, "none", work / "warm.log")
        print(f"baselines warmed: {len(tasks)} tasks in {wall:.0f} s", flush=True)

    print(f"{'concurrency':>11} {'prestart':>8} {'bind':>5} {'candidates':>10} {'ok':>4} {'wall s':>8} "
          f"{'per min':>8} {'steady':>7}  stage totals (s)", flush=True)
    for c, pre, bind in settings:
        name = f"c{c}p{pre}{bind}"
        t_dir, c_dir = candidate_set(work / name, tasks, Path(args.solutions), args.candidates, f"{name}_")
        out = work / f"{name}.h5"
        wall = run_pool(t_dir, c_dir, out, args.backend, c, pre, bind, work / f"{name}.log")
        records = read_records(out)
        ok = sum(r.status == "ok" for r in records)
        totals = stage_seconds(records)
        rate = len(records) / wall * 60
        span = max(r.timestamp + r.wall_seconds for r in records) - min(r.timestamp for r in records)
        steady = len(records) / span * 60
        figures["runs"][name] = {"concurrency": c, "prestart": pre, "bind": bind, "wall_s": round(wall, 1),
                                 "evaluated": len(records), "ok": ok, "per_min": round(rate, 2),
                                 "evaluating_s": round(span, 1), "steady_per_min": round(steady, 2),
                                 "stage_seconds": totals}
        print(f"{c:>11} {pre:>8} {bind:>5} {len(records):>10} {ok:>4} {wall:8.1f} {rate:8.2f} "
              f"{steady:7.2f}  {totals}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Does one program's speed drift over minutes on this host while another's stays, in the same
processes, on the same buffers? Eager and torch.compile of a task, each in a process of its own
held on the timing core (one thread, the harness's malloc settings), take turns for `--minutes`;
between turns a small C probe on the same core times a dependent chain of integer multiply-adds
(the core's clock, and a hyperthread sibling's contention, alone) and a pointer chase through
64 MiB (the memory system's latency). Each block of rounds prints its medians: a ratio that moves
from block to block while the code, the processes and their buffers stay the same is the host's,
and what moves with it says which part of the host.

    python benchmarks/cpu_drift.py --only level1/03_sum_dim --minutes 4
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
sys.path.insert(0, str(ROOT))

from hpc.profile.cores import timing_cores  # noqa: E402
from hpc.sandbox.process import STEADY_MALLOC  # noqa: E402
from hpc.task import discover_tasks, select_tasks  # noqa: E402

PROBE_C = r"""
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  size_t n = (64u << 20) / sizeof(size_t);
  size_t *next = malloc(n * sizeof(size_t));
  for (size_t i = 0; i < n; i++) next[i] = i;
  uint64_t r = 88172645463325252ULL;
  for (size_t i = n - 1; i > 0; i--) {   /* Sattolo: one cycle through every slot */
    r ^= r << 13; r ^= r >> 7; r ^= r << 17;
    size_t j = r % i, t = next[i]; next[i] = next[j]; next[j] = t;
  }
  double alu = 1e9, chase = 1e9;
  for (int k = 0; k < 3; k++) {
    double a = now(); uint64_t x = k;
    for (long i = 0; i < 5000000L; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    double b = now(); size_t p = 0;
    for (long i = 0; i < 200000L; i++) p = next[p];
    double c = now();
    if (b - a < alu) alu = b - a;
    if (c - b < chase) chase = c - b;
    if (x == 1 && p == 1) puts("");
  }
  printf("%.4f %.2f\n", alu * 1e3, chase * 1e9 / 200000.0);
  return 0;
}
"""

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[4])
from hpc.task import load_task_module
m = load_task_module(sys.argv[1], "cpu")
torch.manual_seed(0)
fn = m.Model(*m.get_init_inputs()).eval()
if sys.argv[2] == "compile":
    fn = torch.compile(fn)
inputs, flush, calls = m.get_inputs(), torch.empty(32 << 20), int(sys.argv[3])
with torch.no_grad():
    for _ in range(5):
        fn(*inputs)
    print("ready", flush=True)
    for _ in sys.stdin:
        times = []
        for _ in range(calls):
            flush.zero_()
            t = time.perf_counter()
            fn(*inputs)
            times.append((time.perf_counter() - t) * 1e3)
        print(json.dumps(times), flush=True)
"""


def build_probe(where: Path) -> Path:
    source, binary = where / "probe.c", where / "probe"
    source.write_text(PROBE_C)
    subprocess.run(["cc", "-O2", "-o", str(binary), str(source)], check=True)
    return binary


def track(task, minutes: float, calls: int, probe: Path, cache: Path,
          program_cores: set[int], driver_cores: set[int]) -> list[dict]:
    """Rounds for `minutes`: each program `calls` flushed calls in turn, then the probe; the rows."""
    env = {**os.environ, **STEADY_MALLOC, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    procs = {name: subprocess.Popen([sys.executable, "-c", CHILD, str(task.path), name, str(calls), str(ROOT)],
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True,
                                    preexec_fn=lambda: os.sched_setaffinity(0, program_cores))
             for name in ("eager", "compile")}
    rows: list[dict] = []
    try:
        for proc in procs.values():
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"{task.task_id}: a measuring process did not start")
        os.sched_setaffinity(0, driver_cores)
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            row = {}
            for name, proc in procs.items():
                proc.stdin.write("\n")
                proc.stdin.flush()
                row[name] = statistics.median(json.loads(proc.stdout.readline()))
            out = subprocess.run([str(probe)], capture_output=True, text=True, check=True,
                                 preexec_fn=lambda: os.sched_setaffinity(0, program_cores)).stdout.split()
            row["alu_ms"], row["chase_ns"] = float(out[0]), float(out[1])
            rows.append(row)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return rows


def blocks(rows: list[dict], size: int) -> list[dict]:
    out = []
    for i in range(0, len(rows) - size + 1, size):
        chunk = rows[i:i + size]
        med = {k: statistics.median(r[k] for r in chunk) for k in chunk[0]}
        med["ratio"] = med["compile"] / med["eager"]
        out.append(med)
    return out


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r; nan where either side held one value throughout (statistics would raise)."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=4.0, help="per task")
    p.add_argument("--calls", type=int, default=3, help="each program's calls a turn")
    p.add_argument("--block", type=int, default=20, help="rounds a printed block")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--tasks", type=Path, default=ROOT / "kernels" / "tasks")
    p.add_argument("--out", type=Path, default=None, help="every round as JSON here")
    args = p.parse_args()
    tasks = select_tasks(discover_tasks(args.tasks), args.only, args.tasks)
    program_cores, driver_cores = timing_cores("cpu")
    if not program_cores:
        raise SystemExit("needs two cores: one for the programs and the probe, one for this driver")
    print(f"{args.minutes:g} minutes a task, blocks of {args.block} rounds, programs and probe on cores "
          f"{sorted(program_cores)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="cpu-drift-") as work:
        probe = build_probe(Path(work))
        for task in tasks:
            rows = track(task, args.minutes, args.calls, probe, Path(work) / "inductor",
                         program_cores, driver_cores)
            results[task.task_id] = rows
            table = blocks(rows, args.block)
            print(f"\n{task.task_id}: {len(rows)} rounds\n| block | eager ms | compile ms | compile/eager | "
                  "probe: chain ms | probe: chase ns |\n|---|---|---|---|---|---|")
            for k, b in enumerate(table):
                print(f"| {k} | {b['eager']:.3f} | {b['compile']:.3f} | {b['ratio']:.3f} | {b['alu_ms']:.2f} | "
                      f"{b['chase_ns']:.1f} |")
            if len(table) > 2:
                cols = {k: [b[k] for b in table] for k in ("eager", "compile", "ratio", "alu_ms", "chase_ns")}
                corr = {k: correlation(cols["ratio"], cols[k]) for k in ("alu_ms", "chase_ns")}
                print(f"spread over blocks: eager {100 * spread(cols['eager']):.1f}%, compile "
                      f"{100 * spread(cols['compile']):.1f}%, ratio {100 * spread(cols['ratio']):.1f}%, chain "
                      f"{100 * spread(cols['alu_ms']):.1f}%, chase {100 * spread(cols['chase_ns']):.1f}%; ratio's "
                      f"correlation with the chain {corr['alu_ms']:.2f}, with the chase {corr['chase_ns']:.2f}",
                      flush=True)
            if args.out:   # after each task: minutes of measurement kept whatever comes after
                args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

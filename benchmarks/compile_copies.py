"""Is torch.compile's per-run figure on the CPU the compile's, or the file's? Each task is compiled
`--compiles` times, each into a fresh inductor cache of its own (what each `eval-suite` run does),
and each cache is copied `--copies` times (the same bytes in a new file, so new page-cache pages).
Then one process per (compile, file) and a second process on each compile's own file, plus two
eager processes, are timed in one window: rounds, each process a chunk of calls in turn in a
shuffled order, every process held on the timing core and one thread each, the cache flushed
before every call, as the reward's window does (hpc/profile/cores.py).

With `--shifts N` each process moves its inputs, call after call, through N places 4096/N bytes
apart (the reward's input shifts) and each place's median is printed beside its whole median.

Spreads are (max - min) / median of the processes' medians within a group:
- same file:       two processes that load one compile's one file (what a run's processes share);
- copies:          processes that load copies of one compile's file (same bytes, other pages);
- compiles:        processes that load different compiles (what different runs get);
- eager:           two processes of eager PyTorch (a control).

    python benchmarks/compile_copies.py --only level1/12_mean_dim --compiles 3 --copies 2 [--shifts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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
from hpc.task import discover_tasks, load_task_module, select_tasks  # noqa: E402


def shifted(inputs: list, shifts: int) -> list[list]:
    """Each of `shifts` places for the inputs, 4096/shifts bytes apart from a 4 KiB boundary: each
    tensor copied into a buffer of its own at that offset (the reward's input shifts)."""
    import torch
    places = []
    for s in range(shifts):
        place = []
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                place.append(x)
                continue
            store = torch.empty(x.numel() * x.element_size() + 8192, dtype=torch.uint8)
            start = (-store.data_ptr()) % 4096 + s * (4096 // shifts)
            view = store[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            view.copy_(x)
            place.append(view)
        places.append(place)
    return places


def child(task_path: str, program: str, calls: int, shifts: int) -> None:
    """One timed process: builds the program, then on each line from stdin runs `calls` flushed
    calls and answers their times (ms) as a JSON line; call k of the process takes its inputs from
    place k % shifts. Its first line names the inductor files it mapped (which file it runs)."""
    import torch
    mod = load_task_module(task_path, "cpu")
    torch.manual_seed(0)
    fn = mod.Model(*mod.get_init_inputs()).eval()
    if program == "compile":
        fn = torch.compile(fn)
    places = shifted(mod.get_inputs(), shifts)
    inputs = places[0]
    made = 0
    flush = torch.empty(64 * 2**20 // 4)
    with torch.no_grad():
        for _ in range(5):
            fn(*inputs)
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
        mapped = sorted({line.split()[-1] for line in open("/proc/self/maps")
                         if cache and line.split()[-1].startswith(cache) and line.split()[-1].endswith(".so")})
        print(json.dumps({"mapped": mapped}), flush=True)
        for _ in sys.stdin:
            times = []
            for _ in range(calls):
                inputs = places[made % shifts]
                made += 1
                flush.zero_()
                t = time.perf_counter()
                fn(*inputs)
                times.append((time.perf_counter() - t) * 1e3)
            print(json.dumps(times), flush=True)


def compile_into(task_path: str, cache: Path) -> None:
    """A fresh process compiles the task into `cache` and runs it once."""
    env = {**os.environ, **STEADY_MALLOC, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    code = (f"import sys; sys.argv=['x']; sys.path.insert(0, {str(ROOT)!r})\n"
            "import torch\nfrom hpc.task import load_task_module\n"
            f"m = load_task_module({task_path!r}, 'cpu')\n"
            "f = torch.compile(m.Model(*m.get_init_inputs()).eval())\n"
            "with torch.no_grad(): f(*m.get_inputs())\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)


def spread(xs: list[float]) -> float:
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med


def measure(task, compiles: int, copies: int, rounds: int, calls: int, shifts: int, work: Path,
            programs: set[int], drivers: set[int]) -> dict:
    entrants: list[tuple[str, str, Path | None]] = [("eager", "eager/a", None), ("eager", "eager/b", None)]
    for k in range(compiles):
        cache = work / f"{task.task_id.replace('/', '_')}-{k}"
        compile_into(str(task.path), cache)
        entrants += [("compile", f"compile {k}/file/a", cache), ("compile", f"compile {k}/file/b", cache)]
        for j in range(copies):
            copy = work / f"{cache.name}-copy{j}"
            shutil.copytree(cache, copy, symlinks=True)
            entrants.append(("compile", f"compile {k}/copy {j}", copy))
    procs: dict[str, subprocess.Popen] = {}
    mapped: dict[str, list[str]] = {}
    for program, name, cache in entrants:
        env = {**os.environ, **STEADY_MALLOC, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, len(programs)))}
        if cache is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(task.path), program, str(calls),
                                 str(shifts)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, programs or drivers))
        procs[name] = proc
        mapped[name] = json.loads(proc.stdout.readline())["mapped"]
    os.sched_setaffinity(0, drivers or programs)
    times: dict[str, list[float]] = {name: [] for name in procs}
    order = list(procs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            procs[name].stdin.write("\n")
            procs[name].stdin.flush()
            times[name] += json.loads(procs[name].stdout.readline())
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    by_place = {name: [statistics.median(ts[s::shifts]) for s in range(shifts)] for name, ts in times.items()}
    groups = {"eager": [medians["eager/a"], medians["eager/b"]]}
    groups["same file"] = [spread([medians[f"compile {k}/file/a"], medians[f"compile {k}/file/b"]])
                           for k in range(compiles)]
    groups["copies"] = [spread([medians[f"compile {k}/file/a"]] + [medians[f"compile {k}/copy {j}"]
                                                                   for j in range(copies)]) for k in range(compiles)]
    groups["compiles"] = spread([medians[f"compile {k}/file/a"] for k in range(compiles)])
    return {"medians": medians, "by_place": by_place, "mapped": mapped, "eager spread": spread(groups["eager"]),
            "same file spreads": groups["same file"], "copies spreads": groups["copies"],
            "compiles spread": groups["compiles"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiles", type=int, default=3)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--shifts", type=int, default=1, help="places for the inputs within 4 KiB, call by call")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--tasks", type=Path, default=ROOT / "kernels" / "tasks")
    p.add_argument("--out", type=Path, default=None, help="every figure as JSON here")
    args = p.parse_args()
    tasks = select_tasks(discover_tasks(args.tasks), args.only, args.tasks)
    print(f"{args.compiles} fresh compiles per task, {args.copies} copies of each, {args.rounds} rounds of "
          f"{args.calls} calls, inputs at {args.shifts} places, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    results = {}
    programs, drivers = timing_cores("cpu")
    with tempfile.TemporaryDirectory(prefix="compile-copies-") as work:
        for task in tasks:
            r = measure(task, args.compiles, args.copies, args.rounds, args.calls, args.shifts, Path(work),
                        programs, drivers)
            results[task.task_id] = r
            print(f"\n{task.task_id}")
            for name, med in r["medians"].items():
                files = ", ".join(Path(m).name for m in r["mapped"][name]) or "-"
                places = r["by_place"][name]
                spans = f"   places {min(places):.4f}-{max(places):.4f}" if args.shifts > 1 else ""
                print(f"  {name:22s} {med:8.4f} ms{spans}   {files}")
            pct = lambda xs: " / ".join(f"{100 * x:.1f}%" for x in xs)  # noqa: E731
            print(f"  spread: eager {100 * r['eager spread']:.1f}%; same file {pct(r['same file spreads'])}; "
                  f"copies {pct(r['copies spreads'])}; compiles {100 * r['compiles spread']:.1f}%; "
                  f"compile/eager {r['medians']['compile 0/file/a'] / r['medians']['eager/a']:.3f}", flush=True)
            if args.out:   # after each task: what was measured is kept whatever comes after
                args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())

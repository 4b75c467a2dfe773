"""Why does the torch.compile baseline move from run to run? Each task is compiled `--compiles`
times, each time in a fresh process with an empty inductor cache (as every `hpc eval-suite` run of
reward_repeat.py does), and in that process eager and the compiled model are measured alike:

- code:    a hash of the code inductor wrote (its output code, kernels and the configs its
           autotuner chose, paths taken out): differs when a compile generated other code;
- configs: the launch configs its runtime autotuner picked (reductions try several);
- synced:  one call and a device synchronize, timed on the host: what the reward's timing sees;
- launch:  one call without the synchronize: the host path (guards, wrapper, launches);
- device:  the kernels' own time per call from the profiler (cuda only): no host in it;
- faults:  the process's page faults per call (flush included): memory the allocator handed back
           to the system and took again.

Cache flushed before each call (a buffer larger than the last-level cache rewritten), eager and
compiled alternating in chunks. `--load N` keeps N busy processes running beside the measurement
(what a loaded host does to each figure). Which figure moves between compiles names the cause: the
generated code (code/configs differ, device moves), the host path (launch moves, device does not),
or contention (everything moves with --load).

    python benchmarks/compile_spread.py --backend cuda --compiles 3 --only level1/08_gelu [--load 16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.task import discover_tasks, load_task_module, select_tasks  # noqa: E402

FIGURES = ("synced", "launch", "device", "faults")
IGNORED = ("triton_cache_hash", "found_by_coordesc", "time_taken_ms")   # a chosen config's, not its code's


def generated(cache: Path) -> tuple[str, list[str]]:
    """A hash of the code inductor wrote under `cache` (its own path taken out), and the autotuner's
    chosen configs."""
    digest, configs = hashlib.sha256(), []
    for path in sorted(cache.rglob("*")):
        if not path.is_file() or path.suffix not in (".py", ".cpp", ".best_config"):
            continue
        text = path.read_text(errors="replace").replace(str(cache), "")
        if path.suffix == ".best_config":
            chosen = {k: v for k, v in json.loads(text).items() if k not in IGNORED}
            text = json.dumps(chosen, sort_keys=True)
            configs.append(text)
        elif path.suffix == ".py" and "def call(" not in text and "@triton.jit" not in text:
            continue
        digest.update(text.encode())
    return digest.hexdigest()[:10], sorted(configs)


def measure(task_path: str, scale: str, device: str, mode: str, calls: int, chunks: int) -> dict:
    """In a fresh process: eager and torch.compile(mode) of one task, measured alike."""
    import torch
    mod = load_task_module(task_path, scale)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = mod.Model(*mod.get_init_inputs()).to(device).eval()
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
    programs = {"eager": model}
    t0 = time.perf_counter()
    programs["compile"] = torch.compile(model, mode=None if mode == "default" else mode)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    flush_buf = torch.empty(256 * 2**20 // 4 if device == "cuda" else 64 * 2**20 // 4, device=device)
    out: dict = {"threads": torch.get_num_threads()}
    with torch.no_grad():
        programs["compile"](*inputs)
        sync()
        out["compile_s"] = time.perf_counter() - t0
        for fn in programs.values():
            for _ in range(5):
                fn(*inputs)
        sync()
        times: dict[str, dict[str, list[float]]] = {p: {"synced": [], "launch": []} for p in programs}
        faults = dict.fromkeys(programs, 0)
        for _ in range(chunks):
            for name, fn in programs.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                for _ in range(max(1, calls // chunks)):
                    flush_buf.zero_()
                    sync()
                    t = time.perf_counter()
                    fn(*inputs)
                    launched = time.perf_counter()
                    sync()
                    done = time.perf_counter()
                    times[name]["launch"].append((launched - t) * 1e3)
                    times[name]["synced"].append((done - t) * 1e3)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        for name, fn in programs.items():
            row = {k: statistics.median(v) for k, v in times[name].items()}
            row["faults"] = faults[name] / len(times[name]["synced"])
            row["device"] = float("nan")
            if device == "cuda":
                from torch.profiler import ProfilerActivity, profile
                n = 20
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(n):
                        fn(*inputs)
                    sync()
                kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
                row["device"] = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels) / n / 1e3
            out[name] = row
    return out


def one_compile(task, scale: str, backend: str, mode: str, calls: int, chunks: int, pin: int) -> dict:
    """A child process with an empty inductor cache of its own; its figures and the code it generated."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--child", str(task.path), scale, backend, mode, str(calls), str(chunks)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              preexec_fn=(lambda: os.sched_setaffinity(0, {pin})) if pin >= 0 else None)
        if proc.returncode != 0:
            raise SystemExit(f"{task.task_id}: the measuring process failed: {proc.stderr.strip()[-800:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["code"], row["configs"] = generated(Path(cache))
    return row


def spread(xs: list[float]) -> float:
    """(max - min) / median: how far apart the compiles landed."""
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--scale", default=None, help="default: gpu on cuda, cpu on cpu")
    p.add_argument("--compiles", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--mode", default="default", help="torch.compile mode")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the measurement")
    p.add_argument("--pin", type=int, default=-1, help="run every measuring process on this one core")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--tasks", type=Path, default=ROOT / "kernels" / "tasks")
    p.add_argument("--out", type=Path, default=None, help="every figure as JSON here")
    args = p.parse_args()
    scale = args.scale or ("gpu" if args.backend == "cuda" else "cpu")
    tasks = select_tasks(discover_tasks(args.tasks), args.only, args.tasks)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict]] = {}
    try:
        print(f"{args.backend}, scale {scale}, {args.compiles} fresh compiles per task, {args.load} busy "
              f"processes beside, {'pinned to core %d' % args.pin if args.pin >= 0 else 'unpinned'}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print("\n| task | program | code per compile | synced ms | launch ms | device ms | faults per call | "
              "synced spread | launch spread | device spread |\n|---|---|---|---|---|---|---|---|---|---|")
        for task in tasks:
            rows = [one_compile(task, scale, args.backend, args.mode, args.calls, args.chunks, args.pin)
                    for _ in range(args.compiles)]
            results[task.task_id] = rows
            for program in ("eager", "compile"):
                codes = " / ".join(r["code"] for r in rows) if program == "compile" else "-"
                cells = [" / ".join(f"{r[program][f]:.4g}" for r in rows) for f in FIGURES]
                spreads = [f"{100 * spread([r[program][f] for r in rows]):.1f}%" for f in FIGURES[:3]]
                print(f"| {task.task_id} | {program} | {codes} | {' | '.join(cells)} | {' | '.join(spreads)} |",
                      flush=True)
            if len({r["code"] for r in rows}) > 1:
                for k, r in enumerate(rows):
                    print(f"  compile {k}: configs {r['configs']}")
    finally:
        for proc in load:
            proc.kill()
    if args.out:
        args.out.write_text(json.dumps({"backend": args.backend, "scale": scale, "load": args.load,
                                        "tasks": results}, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        path, scale, backend, mode, calls, chunks = sys.argv[2:8]
        print(json.dumps(measure(path, scale, backend, mode, int(calls), int(chunks))))
        sys.exit(0)
    sys.exit(main())

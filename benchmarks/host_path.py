"""Where the host side of one timed call goes, for a shipped CUDA solution next to eager.

Under the timing protocol a call costs max(device time, host time): a candidate whose host path
(module call, policy guard, allocation, ctypes launch) is slower than its kernel is paid for the
host path. This splits that path into its parts, each the median over many calls, then times
the candidate in the timed loop three ways: bare, under the policy guard, and through the
evaluator's own program worker in this process (everything but the sandboxed process around it).

    python benchmarks/host_path.py [--task kernels/tasks/level1/08_gelu.py --solution kernels/solutions/level1/08_gelu]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hpc import runtime  # noqa: E402
from hpc.compile.native import compile_workdir, default_toolchain  # noqa: E402
from hpc.config import load_config  # noqa: E402
from hpc.profile.start_gate import start_gate_library  # noqa: E402
from hpc.profile.timing import install_start_gate, time_calls  # noqa: E402
from hpc.baseline import timing_request, timing_setup  # noqa: E402
from hpc.runner.guard import ALLOWED_OPS, ForwardGuard, _PoisonFill  # noqa: E402
from hpc.runner.inputs import fingerprint, init_model, make_inputs, timed_inputs  # noqa: E402
from hpc.runner.op_monitor import OpMonitor, op_monitor_library  # noqa: E402
from hpc.runner.worker import ProgramWorker  # noqa: E402
from hpc.task import load_task_module  # noqa: E402


def host_us(fn, n: int = 500) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(ROOT / "kernels/tasks/level1/08_gelu.py"))
    ap.add_argument("--solution", default=str(ROOT / "kernels/solutions/level1/08_gelu"))
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    task = load_task_module(Path(args.task), "gpu")
    cfg = load_config(backend="cuda", scale="gpu")
    built = compile_workdir(Path(args.solution), default_toolchain("cuda"), cfg.cache_path())
    os.environ[runtime.LIBRARY_ENV], os.environ[runtime.BACKEND_ENV] = str(built.library), "cuda"
    spec = importlib.util.spec_from_file_location("model_new", str(Path(args.solution) / "model_new.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = make_inputs(task, 0, "default", device)
    eager = init_model(task.Model, task, 0, device)
    candidate = module.ModelNew(*task.get_init_inputs()).to(device).eval()
    monitor = OpMonitor(op_monitor_library(cfg.cache_path()), ALLOWED_OPS)
    guard = ForwardGuard(candidate, monitor, True, runtime.launch_count)
    x = inputs[0]

    def armed_only():
        monitor.arm()
        monitor.disarm()

    rows = {
        "eager Model(*inputs)": lambda: eager(*inputs),
        "candidate ModelNew(*inputs), no guard": lambda: candidate(*inputs),
        "candidate under the policy guard": lambda: guard(inputs),
        "op monitor arm + disarm, empty": armed_only,
        "poison-fill dispatch mode, empty": lambda: _PoisonFill(0.0).__enter__().__exit__(None, None, None),
        "torch.empty_like(x) on cuda": lambda: torch.empty_like(x),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
    }
    print(f"{'host path part, calls back to back':44} {'us':>8}")
    for name, fn in rows.items():
        print(f"{name:44} {host_us(fn):8.1f}", flush=True)

    install_start_gate(start_gate_library(cfg.cache_path(), cfg.compile.cuda_arch), cfg.timing.start_gate_timeout_us)
    base = make_inputs(task, 1, "default", device)
    programs = {"eager": lambda xs: eager(*xs), "candidate, no guard": lambda xs: candidate(*xs),
                "candidate under the guard": guard}
    print(f"\n{'in the timed loop (100 calls)':40} {'flush':>6} {'ms':>8} {'host us':>8}")
    for flush in (cfg.timing.flush_bytes_cuda, 0):
        for name, call in programs.items():
            times = time_calls(call, lambda i: timed_inputs(base, i), device, 10, 100, flush,
                               after_call=lambda i, out: fingerprint(out))
            ms = statistics.median(t.ms for t in times)
            host = statistics.median(t.host_ms for t in times) * 1e3
            print(f"{name:40} {'yes' if flush else 'no':>6} {ms:8.4f} {host:8.1f}", flush=True)
    worker = ProgramWorker()
    worker.setup({"task": args.task, "scale": "gpu", "init_seed": 1, "device": "cuda", **timing_setup(cfg),
                  "program": "candidate", "model_file": str(Path(args.solution) / "model_new.py"),
                  "op_monitor": str(op_monitor_library(cfg.cache_path())), "environment": {},
                  "policy": {"allowed_torch_ops": [], "require_custom_kernel": True}})
    reply = worker.time({**timing_request(cfg, seed=2), "iterations": 100})
    print(f"{'the evaluator program worker, in process':40} {'yes':>6} {statistics.median(reply['times_ms']):8.4f} "
          f"{statistics.median(reply['host_ms']) * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    with torch.no_grad():   # as in the evaluator's workers
        main()

"""How close the outside clock's figure is to a call's own duration (hpc.profile.timing).

Candidates whose one call spins for a known time T and then computes a small ReLU are evaluated
through the real pipeline (`hpc.pipeline.evaluate`: inputs from the reference, go/done frames,
the handshake's cost taken off); beside each, the same compiled call is timed in this process on
its own (CUDA events around the launch on cuda, the monotonic clock on cpu), the duration an honest
in-process timer would report. The difference is what the outside clock adds or loses per call.

    python benchmarks/outside_clock.py --backend cuda --spins-us 0,20,100,500,2000 --out protocol.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.candidate import load_candidate  # noqa: E402
from hpc.compile.native import compile_workdir, default_toolchain  # noqa: E402
from hpc.config import load_config  # noqa: E402
from hpc.pipeline import evaluate  # noqa: E402
from hpc.task import load_task  # noqa: E402

TASK = '''"""ReLU over 65536 floats at every scale: the work around a known spin is negligible."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(1 << 16)]


def get_init_inputs():
    return []
'''

MODEL = '''import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)
SPIN_NS = {ns}


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        kernels.spin_relu(out, x, x.numel(), SPIN_NS)
        return out
'''

CPU_KERNEL = '''#include <cstdint>
#include <ctime>

static int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

extern "C" void spin_relu(float* out, const float* x, int64_t n, int64_t ns) {
    int64_t until = now_ns() + ns;
    while (now_ns() < until) {}
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] > 0.f ? x[i] : 0.f;
}
'''

CUDA_KERNEL = '''#include <cstdint>
#include <cuda_runtime.h>

__device__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_relu_kernel(float* out, const float* x, int64_t n, int64_t ns) {
    if (threadIdx.x == 0) {
        uint64_t until = global_ns() + ns;
        while (global_ns() < until) {}
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = fmaxf(x[i], 0.f);
}

extern "C" void spin_relu(float* out, const float* x, int64_t n, int64_t ns, cudaStream_t stream) {
    spin_relu_kernel<<<1, 1024, 0, stream>>>(out, x, n, ns);
}
'''


def make_candidate(root: Path, ns: int) -> Path:
    work = root / f"spin_{ns}"
    (work / "kernels").mkdir(parents=True, exist_ok=True)
    (work / "model_new.py").write_text(MODEL.format(ns=ns))
    (work / "kernels" / "spin.cpp").write_text(CPU_KERNEL)
    (work / "kernels" / "spin.cu").write_text(CUDA_KERNEL)
    return work


def in_process_ms(library: Path, backend: str, ns: int, calls: int = 50) -> float:
    """The compiled call timed in this process: events around it on cuda, the clock on cpu."""
    import torch

    lib = ctypes.CDLL(str(library))
    device = "cuda" if backend == "cuda" else "cpu"
    x = torch.randn(1 << 16, device=device)
    out = torch.empty_like(x)
    args = [ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.numel()),
            ctypes.c_int64(ns)]
    times = []
    for _ in range(calls + 5):
        if backend == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream().cuda_stream
            start.record()
            lib.spin_relu(*args, ctypes.c_void_p(stream))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            lib.spin_relu(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--spins-us", default="0,20,100,500,2000", help="comma-separated spin lengths (microseconds)")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()
    cfg = load_config(backend=args.backend)
    cfg.scale = "gpu" if args.backend == "cuda" else "cpu"
    cfg.timing.iterations = args.iterations
    cfg.validate()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpc-outside-clock-") as root:
        root = Path(root)
        task_path = root / "level1" / "spin_relu.py"
        task_path.parent.mkdir()
        task_path.write_text(TASK)
        task = load_task(task_path)
        toolchain = default_toolchain(args.backend, cfg.compile.cuda_arch)
        print(f"{'spin us':>8} {'in-process ms':>14} {'outside ms':>11} {'diff us':>8} {'overhead ms':>12} "
              f"{'cv':>6} {'reward':>6}", flush=True)
        for us in (float(v) for v in args.spins_us.split(",")):
            ns = int(us * 1e3)
            work = make_candidate(root, ns)
            rec = evaluate(task, load_candidate(work), cfg)
            built = compile_workdir(work, toolchain, cfg.cache_path())
            truth = in_process_ms(built.library, args.backend, ns) if built.ok else float("nan")
            row = {"spin_us": us, "in_process_ms": truth, "outside_ms": rec.candidate_ms,
                   "diff_us": (rec.candidate_ms - truth) * 1e3, "overhead_ms": rec.overhead_ms,
                   "cv": rec.candidate_cv, "status": rec.status, "reason": rec.reason, "reward": rec.reward}
            rows.append(row)
            print(f"{us:8.0f} {truth:14.4f} {rec.candidate_ms:11.4f} {row['diff_us']:8.1f} {rec.overhead_ms:12.4f} "
                  f"{rec.candidate_cv:6.3f} {rec.reward:6.1f} {rec.reason[:60]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "date": time.strftime("%Y-%m-%d"),
                                              "iterations": args.iterations, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

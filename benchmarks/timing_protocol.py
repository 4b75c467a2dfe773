"""What the CUDA timing protocol reports for work of known device duration, next to the naive
protocol (events around the call on an idle GPU, as KernelBench times), in one run.

Each program is a spin kernel (torch.cuda._sleep) of known device time, called after some host
work (standing in for Python dispatch, the policy guard, ctypes). The ideal figure is the device
time alone as long as the host part is shorter; the naive protocol adds the host part.

    python benchmarks/timing_protocol.py [--out protocol.json]
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

import torch  # noqa: E402

from hpc.profile import timing  # noqa: E402
from hpc.profile.start_gate import start_gate_library  # noqa: E402


def busy_host(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def naive_ms(call) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call([])
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory() as cache:
        timing.install_start_gate(start_gate_library(Path(cache), "sm_90"), 500.0)
    rows = []
    print(f"{'device us':>9} {'host us':>7} {'naive us':>9} {'gated us':>9} {'naive/dev':>9} {'gated/dev':>9} "
          f"{'gated CV':>8}")
    for cycles in (20_000, 100_000, 400_000, 2_000_000):
        truth = timing.device_only_ms(lambda c=cycles: torch.cuda._sleep(c), 30) * 1e3
        for host_us in (0, 30, 100):
            call = lambda _, c=cycles, h=host_us: (busy_host(h), torch.cuda._sleep(c))  # noqa: E731
            naive = [naive_ms(call) * 1e3 for _ in range(args.calls)]
            gated = [timing.time_call(call, [], device)[0].ms * 1e3 for _ in range(args.calls)]
            row = {"device_us": truth, "host_us": host_us, "naive_us": statistics.median(naive),
                   "gated_us": statistics.median(gated), "gated_cv": statistics.stdev(gated) / statistics.mean(gated)}
            rows.append(row)
            print(f"{truth:9.1f} {host_us:7d} {row['naive_us']:9.1f} {row['gated_us']:9.1f} "
                  f"{row['naive_us'] / truth:9.3f} {row['gated_us'] / truth:9.3f} {row['gated_cv']:8.4f}", flush=True)
    latency = timing.sync_latency_ms(device) * 1e3
    print(f"synchronize latency subtracted: {latency:.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "hardware":
                                              torch.cuda.get_device_name(), "sync_latency_us": latency,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

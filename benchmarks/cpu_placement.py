"""Does a memory-bound call's time on the CPU depend on which memory its input was given? The
evaluator's cpu driver publishes each call's inputs into the program's slot (shared memory, as
hpc.sandbox.exchange makes it), flushes the last-level cache and times the call. Here one process,
on one core with one thread, does the same against `--regions` slots of its own, each a fresh
memfd as large as the input: per slot, the median of `--calls` timed calls of a streaming read
(torch's sum over the whole input). The slots differ only in where their pages landed, so their
spread is what a program's figure can move by between evaluations that differ in nothing else.

    python benchmarks/cpu_placement.py [--mib 64] [--regions 6] [--calls 40] [--core 1]
        [--flush memset|read|write] [--flush-mib 32] [--flush-first]

`--flush`: how the cache is flushed: memset (the driver's: glibc may write a buffer this large
around the cache), read (a sum over the buffer), write (the buffer read and written back);
`--flush-first`: before the publish rather than after it.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def slot(nbytes: int) -> mmap.mmap:
    """Shared memory as the exchange's slot is: a memfd, mapped."""
    fd = os.memfd_create("slot")
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="the input's size")
    p.add_argument("--regions", type=int, default=6, help="slots, each a fresh memfd")
    p.add_argument("--calls", type=int, default=40, help="timed calls a slot (after 5 untimed)")
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the core to run on")
    p.add_argument("--flush-mib", type=int, default=32, help="the cache flush's buffer (the cpu default)")
    p.add_argument("--flush", choices=("memset", "read", "write"), default="memset")
    p.add_argument("--flush-first", action="store_true", help="flush before the publish")
    args = p.parse_args()
    os.sched_setaffinity(0, {args.core})
    import torch
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    staging = slot(nbytes)
    torch.frombuffer(staging, dtype=torch.float32).normal_()
    flush = (ctypes.c_char * (args.flush_mib << 20))()
    words = torch.frombuffer(flush, dtype=torch.int64)

    def flush_cache(k: int) -> None:
        if args.flush == "memset":
            ctypes.memset(flush, k & 0xFF, len(flush))   # the driver's (hpc.profile.driver)
        elif args.flush == "read":
            words.sum()
        else:
            words.add_(1)

    medians = []
    for r in range(args.regions):
        region = slot(nbytes)
        x = torch.frombuffer(region, dtype=torch.float32)
        times = []
        for k in range(5 + args.calls):
            if args.flush_first:
                flush_cache(k)
            region[:] = staging   # the driver's publish
            if not args.flush_first:
                flush_cache(k)
            t0 = time.perf_counter_ns()
            x.sum()
            times.append(time.perf_counter_ns() - t0)
        medians.append(statistics.median(times[5:]) / 1e6)
        del x
        region.close()
    low, high = min(medians), max(medians)
    print(f"{args.mib} MiB input, one thread on core {args.core}, flush {args.flush} {args.flush_mib} MiB "
          f"{'before' if args.flush_first else 'after'} the publish: median ms per slot "
          + " / ".join(f"{m:.3f}" for m in medians)
          + f"; spread {100 * (high - low) / statistics.median(medians):.1f}% of the median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

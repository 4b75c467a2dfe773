"""Does a call's time on cpu depend on where its output lies against its input? A program's outputs
come from its own heap, whose layout each process draws anew (the sizes of what it allocated
before), while its inputs lie in the slot the harness lays out. Loads whose address matches a
recent store's in the low 12 bits wait on it (4K aliasing), and buffers whose addresses share more
low bits compete for the same cache sets; either would make a row's figure a property of the
process.

    python benchmarks/cpu_aliasing.py [--mib 16] [--rounds 15] [--step 256]

One process, one thread: an input of `--mib` on huge pages at a 2 MiB boundary, and an output at
each offset from 0 to 4 KiB (`--step`) past another 2 MiB boundary, both written once; each round
times one call of each op at every offset, in a fresh random order, after the cache flush the
harness does (128 MiB read through). Prints each op's median per offset in ms and the spread of
those medians ((max - min) / median).

On this project's 2-core Xeon guest (2026-12-06, `--step 256 --rounds 8`): cumsum 3.30-5.12 ms
(47%), the elementwise ops, sum and softmax 5-10%, about their noise. So on cpu each frame's inputs
move to the next of 32 places within 4 KiB (`timing.input_shifts_cpu`, hpc.profile.driver.input_shifts).
"""

from __future__ import annotations

import argparse
import logging
import mmap
import random
import statistics
import sys
import time

import numpy as np
import torch

log = logging.getLogger("cpu_aliasing")
HUGE = 2 << 20


def huge_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` of anonymous memory on transparent huge pages (madvise), every page written."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGE
    buf = raw[start:start + nbytes]
    m.madvise(mmap.MADV_HUGEPAGE)
    buf[:] = 1
    return buf


OPS = {
    "add": lambda x, out: torch.add(x, 1.0, out=out),
    "exp": lambda x, out: torch.exp(x, out=out),
    "sigmoid": lambda x, out: torch.sigmoid(x, out=out),
    "sum(dim=1)": lambda x, out: torch.sum(x.view(x.shape[0] // 4096, 4096), dim=1, out=out[: x.shape[0] // 4096]),
    "cumsum(dim=1)": lambda x, out: torch.cumsum(x.view(-1, 4096), 1, out=out.view(-1, 4096)),
    "softmax(dim=1)": lambda x, out: torch.ops.aten._softmax.out(x.view(-1, 4096), 1, False, out=out.view(-1, 4096)),
    "gelu": lambda x, out: torch._C._nn.gelu(x, out=out),
}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--step", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = (args.mib << 20) // 4
    src = huge_buffer(n * 4)
    x = torch.from_numpy(src.view(np.float32))
    x.normal_()
    dst = huge_buffer(n * 4 + 4096)
    offsets = list(range(0, 4096, args.step))
    outs = {d: torch.from_numpy(dst[d:d + n * 4].view(np.float32)) for d in offsets}
    flush = huge_buffer(128 << 20).view(np.uint64)
    times: dict[tuple[str, int], list[float]] = {(op, d): [] for op in OPS for d in offsets}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(times)
        rng.shuffle(order)
        for op, d in order:
            flush.sum()
            t0 = time.perf_counter_ns()
            OPS[op](x, outs[d])
            times[(op, d)].append((time.perf_counter_ns() - t0) / 1e6)
    log.info("%d MiB input, output at each offset (bytes) past a 2 MiB line, %d rounds; median ms", args.mib, args.rounds)
    log.info("%-12s %s  spread", "op", " ".join(f"{d:>6}" for d in offsets))
    for op in OPS:
        medians = [statistics.median(times[(op, d)][1:]) for d in offsets]
        spread = (max(medians) - min(medians)) / statistics.median(medians)
        log.info("%-12s %s  %.1f%%", op, " ".join(f"{m:6.3f}" for m in medians), 100 * spread)
    return 0


if __name__ == "__main__":
    sys.exit(main())

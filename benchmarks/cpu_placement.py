"""Does a call's time on the CPU depend on which memory its inputs were given? The evaluator's cpu
driver publishes each call's inputs into the program's slot (shared memory, as
hpc.sandbox.exchange makes it), flushes the last-level cache and times the call. Here one process,
on one core with one thread, does the same against `--placements` slots of its own, each a fresh
memfd: per slot, the median of `--calls` timed calls. The slots differ only in where their pages
landed, so their spread is what a program's figure can move by between evaluations that differ in
nothing else.

    python benchmarks/cpu_placement.py [--mib 64] [--placements 6] [--calls 40] [--core 1]
        [--flush memset|read|write|none] [--flush-mib 32] [--flush-first] [--memory memfd|thp] [--fragment]
    python benchmarks/cpu_placement.py TASK SOLUTION --flush read --flush-mib 128 [...]

Without a task the call is a streaming read (torch's sum over a `--mib` input). With TASK (a task
file, run at its cpu scale) and SOLUTION (the candidate's folder), the calls are the candidate's,
eager PyTorch's and torch.compile's, in turn on each slot (each program its own slot, as in an
evaluation), and the ratios are printed per placement.
`--flush`: how the cache is flushed: memset (glibc may write a buffer this large around the
cache), read (a sum over the buffer: the driver's), write (the buffer read and written back), none;
`--flush-first`: before the publish rather than after it. `--memory thp`: the slots are private
anonymous memory on transparent huge pages instead of memfds; `--fragment`: before each
placement, scatter the kernel's free memory (as a machine that has run for a while has it).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc.sandbox.exchange import huge_page_share  # noqa: E402


def slot(nbytes: int) -> mmap.mmap:
    """Shared memory as the exchange's slot is: a memfd, mapped."""
    fd = os.memfd_create("slot")
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def streaming_read(mib: int):
    """The programs and inputs without a task: torch's sum over `mib` of normal floats."""
    import torch

    return {"sum": lambda x: x.sum()}, [torch.randn((mib << 20) // 4)]


def task_programs(task_path: Path, solution: Path):
    """The candidate, eager PyTorch and torch.compile of a task at its cpu scale, and its inputs."""
    import torch

    from hpc.task import load_task_module

    task = load_task_module(task_path, "cpu")
    spec = importlib.util.spec_from_file_location("model_new", solution / "model_new.py")
    new = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(new)
    torch.manual_seed(0)
    eager = task.Model(*task.get_init_inputs()).eval()
    candidate = new.ModelNew(*task.get_init_inputs()).eval()
    candidate.load_state_dict(eager.state_dict(), strict=False)
    return {"candidate": candidate, "eager": eager, "compile": torch.compile(eager)}, task.get_inputs()


def fragment(held: list, pages: int = 40_000) -> None:
    """Scatter the kernel's free memory: take `pages` pages, give every other one back."""
    memory = mmap.mmap(-1, pages * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    for k in range(pages):
        memory[k * 4096] = 1
    for k in range(1, pages, 2):
        memory.madvise(mmap.MADV_DONTNEED, k * 4096, 4096)
    held.append(memory)


class Placement:
    """One slot holding a call's inputs (each tensor 256-byte aligned), and the tensors over it:
    `memory` "memfd" (the exchange's slot before `outside-6`) or "thp" (hpc.sandbox.exchange.HostSlot,
    the cpu program's slot since)."""

    def __init__(self, inputs: list, memory: str = "memfd"):
        import torch

        from hpc.sandbox.exchange import HostSlot, align

        self.tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        offsets, at = [], 0
        for x in self.tensors:
            offsets.append(at)
            at += align(x.nbytes)
        self.nbytes = max(at, 1)
        if memory == "thp":
            self.memory = HostSlot(self.nbytes)
            buffer, self.address = self.memory.view, self.memory.address
        else:
            self.memory = buffer = slot(self.nbytes)
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.views = [torch.frombuffer(buffer, dtype=x.dtype, count=x.numel(), offset=o).view(x.shape)
                      for x, o in zip(self.tensors, offsets)]
        views = iter(self.views)
        self.args = [next(views) if isinstance(x, torch.Tensor) else x for x in inputs]

    def publish(self) -> None:
        """The driver's publish: the inputs copied in anew before every call."""
        for view, x in zip(self.views, self.tensors):
            view.copy_(x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", type=Path, nargs="?", help="a task file (its cpu scale)")
    p.add_argument("solution", type=Path, nargs="?", help="the candidate's folder (model_new.py)")
    p.add_argument("--mib", type=int, default=64, help="the input's size, without a task")
    p.add_argument("--placements", "--regions", type=int, default=6, help="slots, each a fresh memfd")
    p.add_argument("--calls", type=int, default=40, help="timed calls of each program a slot (after 5 untimed)")
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the core to run on")
    p.add_argument("--flush-mib", type=int, default=32, help="the cache flush's buffer")
    p.add_argument("--flush", choices=("memset", "read", "write", "none"), default="memset")
    p.add_argument("--flush-first", action="store_true", help="flush before the publish")
    p.add_argument("--memory", choices=("memfd", "thp"), default="memfd",
                   help="the slots' memory: a memfd (the exchange's) or anonymous memory on huge pages")
    p.add_argument("--fragment", action="store_true", help="scatter the free memory before each placement")
    args = p.parse_args()
    if (args.task is None) != (args.solution is None):
        p.error("give a task and its solution, or neither")
    os.sched_setaffinity(0, {args.core})
    import torch
    torch.set_num_threads(1)
    programs, inputs = task_programs(args.task, args.solution) if args.task else streaming_read(args.mib)
    flush = (ctypes.c_char * (args.flush_mib << 20))()
    ctypes.memset(flush, 1, len(flush))
    words = torch.frombuffer(flush, dtype=torch.int64)

    def flush_cache(k: int) -> None:
        if args.flush == "memset":
            ctypes.memset(flush, k & 0xFF, len(flush))
        elif args.flush == "read":
            words.sum()
        elif args.flush == "write":
            words.add_(1)

    label = args.task.stem if args.task else f"{args.mib} MiB sum"
    print(f"{label}: {args.memory} slots{' after scattering the free memory' if args.fragment else ''}, "
          f"one thread on core {args.core}, flush {args.flush} {args.flush_mib} MiB "
          f"{'before' if args.flush_first else 'after'} the publish, {args.calls} calls a program a slot", flush=True)
    medians: dict[str, list[float]] = {name: [] for name in programs}
    held: list = []
    with torch.no_grad():
        for placement in range(args.placements):
            if args.fragment:
                fragment(held)
            slots = {name: Placement(inputs, args.memory) for name in programs}   # each its own, as in an evaluation
            times: dict[str, list[int]] = {name: [] for name in programs}
            for k in range(5 + args.calls):
                for name, program in programs.items():
                    if args.flush_first:
                        flush_cache(k)
                    slots[name].publish()
                    if not args.flush_first:
                        flush_cache(k)
                    t0 = time.perf_counter_ns()
                    program(*slots[name].args)
                    times[name].append(time.perf_counter_ns() - t0)
            line = []
            if args.memory == "thp":
                huge = statistics.mean(huge_page_share(os.getpid(), place.address, place.nbytes) or 0.0
                                       for place in slots.values())
                line.append(f"on huge pages {huge:.2f}")
            for name in programs:
                medians[name].append(statistics.median(times[name][5:]) / 1e6)
                line.append(f"{name} {medians[name][-1]:.3f} ms")
            if "candidate" in programs:
                line += [f"{name}/candidate {medians[name][-1] / medians['candidate'][-1]:.3f}"
                         for name in programs if name != "candidate"]
            print(f"placement {placement}: " + "  ".join(line), flush=True)
            del slots
    spreads = {name: 100 * (max(m) - min(m)) / statistics.median(m) for name, m in medians.items()}
    if "candidate" in programs:
        for name in programs:
            if name != "candidate":
                ratios = [a / b for a, b in zip(medians[name], medians["candidate"])]
                spreads[f"{name}/candidate"] = 100 * (max(ratios) - min(ratios)) / statistics.median(ratios)
    print("spread over the slots, % of the median: " + ", ".join(f"{k} {v:.1f}" for k, v in spreads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

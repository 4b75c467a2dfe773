"""What an idle core costs a timed frame on cpu: the go/done handshake between a driver on one core
and a program on another, with a cache flush's worth of idle time before each frame, waited for by
blocking or by spinning, with the program's core left to idle or kept awake by a spinner at
SCHED_IDLE (hpc.profile.cores.keep_awake), the program held stopped through the flush as a
candidate is, or not.

    python benchmarks/cpu_wake.py [--frames N] [--work-us U] [--gap-ms G]

Each mode's frames are interleaved with the others' (a round runs one frame of each, in a fresh
random order), so a slow minute of the host slows every mode alike. Prints each mode's median,
10th and 90th percentile frame time in microseconds, less the program's own work (`--work-us` of
busy looping per frame). Needs two cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import struct
import sys
import time

from hpc.profile.cores import keep_awake

log = logging.getLogger("cpu_wake")
FRAME = struct.Struct("<q")


def program(control: int, go: int, done: int, spin: bool, work_ns: int) -> None:
    """The program's loop, as a sandboxed program's serve loop: block until a chunk is asked for
    (the others' chunks run meanwhile), then for each frame wait for go, busy-loop `work_ns`,
    answer; a go of 0 ends the chunk, a "q" the program."""
    os.set_blocking(go, not spin)
    while os.read(control, 1) == b"c":
        while True:
            try:
                data = os.read(go, FRAME.size)
            except BlockingIOError:
                continue
            if FRAME.unpack(data)[0] == 0:
                break
            start = time.perf_counter_ns()
            while time.perf_counter_ns() - start < work_ns:
                pass
            os.write(done, data)
    os._exit(0)


class Mode:
    """One way of waiting: a program process of its own, on `program_core`."""

    def __init__(self, poll: bool, spin: bool, hold: bool, awake: bool, program_core: int, work_ns: int):
        self.name = ", ".join([f"driver {'polls' if poll else 'blocks'}", f"program {'spins' if spin else 'blocks'}",
                               *(["held"] if hold else []), *(["core kept awake"] if awake else [])])
        self.hold, self.awake = hold, awake
        control_r, self.control = os.pipe()
        go_r, self.go = os.pipe()
        self.done, done_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.sched_setaffinity(0, {program_core})
            for fd in (self.control, self.go, self.done):
                os.close(fd)
            program(control_r, go_r, done_w, spin, work_ns)
        for fd in (control_r, go_r, done_w):
            os.close(fd)
        os.set_blocking(self.done, not poll)
        self.times: list[int] = []

    def chunk(self, seqs: range, flush) -> None:
        os.write(self.control, b"c")
        for seq in seqs:
            self.frame(seq, flush)
        os.write(self.go, FRAME.pack(0))

    def frame(self, seq: int, flush) -> None:
        if self.hold:
            os.kill(self.pid, signal.SIGSTOP)
        flush()
        if self.hold:
            os.kill(self.pid, signal.SIGCONT)
        t0 = time.monotonic_ns()
        os.write(self.go, FRAME.pack(seq))
        while True:
            try:
                data = os.read(self.done, FRAME.size)
                break
            except BlockingIOError:
                continue
        self.times.append(time.monotonic_ns() - t0)
        assert FRAME.unpack(data)[0] == seq

    def close(self) -> None:
        os.write(self.control, b"q")
        os.waitpid(self.pid, 0)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=5, help="frames a mode runs in a row")
    ap.add_argument("--work-us", type=float, default=300.0)
    ap.add_argument("--gap-ms", type=float, default=7.0, help="idle time before each frame (the flush's)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        log.error("cpu_wake: needs two cores, this process has %d", len(cores))
        return 2
    driver_core, program_core = cores[0], cores[1]
    os.sched_setaffinity(0, {driver_core})
    work_ns = int(args.work_us * 1000)
    specs = [(False, False), (True, False), (True, True)]   # (driver polls, program spins)
    asleep = [Mode(p, s, h, False, program_core, work_ns) for p, s in specs for h in (False, True)]
    awake = [Mode(p, s, h, True, program_core, work_ns) for p, s in specs for h in (False, True)]
    gap_s = args.gap_ms / 1000

    def flush() -> None:
        time.sleep(gap_s)   # the driver's core busy elsewhere, the program's left idle

    rng = random.Random(0)
    for first in range(1, args.frames + 1, args.chunk):
        seqs = range(first, min(first + args.chunk, args.frames + 1))
        order = list(asleep)
        rng.shuffle(order)
        for mode in order:
            mode.chunk(seqs, flush)
        with keep_awake({program_core}):
            order = list(awake)
            rng.shuffle(order)
            for mode in order:
                mode.chunk(seqs, flush)
    log.info("%d frames a mode, %.0f us of work a frame, %.1f ms idle before each; frame less work, us:",
             args.frames, args.work_us, args.gap_ms)
    log.info("%-60s %8s %8s %8s", "mode", "median", "q10", "q90")
    for mode in asleep + awake:
        q = statistics.quantiles([t / 1000 - args.work_us for t in mode.times[10:]], n=10)
        log.info("%-60s %8.1f %8.1f %8.1f", mode.name, statistics.median(t / 1000 - args.work_us for t in mode.times[10:]),
                 q[0], q[-1])
        mode.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

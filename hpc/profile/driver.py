"""The harness's side of the timing protocol (hpc.profile.timing): set a worker pair up and run
calls through it.

On cpu the harness drives the calls itself: it writes each call's inputs from staging (where the
reference made them) into the program's slot, in the program's own memory, with process_vm_writev;
flushes the last-level cache, times the call on its own clock, and copies a checked call's outputs
out of the program's memory with process_vm_readv the moment it answers. On cuda the reference
worker drives (it owns the device memory involved) and the harness waits for its report.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import asdict

import numpy as np
import torch

from hpc.config import EvalConfig
from hpc.profile.window import round_spans
from hpc.profile.timing import CALIBRATION_WARMUP, Call, Failure, LoopResult, modified_input, run_calls, stop_program
from hpc.sandbox.cgroup import FreezeError
from hpc.sandbox.exchange import (HEADER_BYTES, MAX_DESCRIPTORS, InputLayout, TensorSpec, align,
                                  huge_page_share, map_fd, read_failure, read_outputs, read_process_memory, set_spinning,
                                  validated_outputs, write_process_memory)
from hpc.sandbox.prestart import WorkerPair, harness_file
from hpc.sandbox.messages import (SHIFT_SPAN, Attach, Capture, CaptureReply, Check, FailureKind, Load, LoadReply,
                                  Prepare, ProgramSetup, ReferenceSetup, Run, Serve, decode)
from hpc.sandbox.process import SandboxError
from hpc.task import Task


def spinning(cfg: EvalConfig) -> bool:
    """Whether the processes wait for each other's frames by polling (a core each, microsecond
    answers) or by blocking (woken by the kernel, tens of microseconds)."""
    mode = cfg.timing.handshake
    if mode != "auto":
        return mode == "spin"
    return cfg.backend == "cuda" and len(os.sched_getaffinity(0)) >= 8


def keeps_awake(cfg: EvalConfig) -> bool:
    """Whether a cpu window keeps its programs' cores from idling (hpc.profile.cores.keep_awake) and
    the harness polls for each frame's done on its own core: an idle core may halt, and waking it
    again is inside the frame (keep_awake; an evaluation's handshake 0.258 ms blocking, 0.138 ms
    so, on a 2-core KVM guest, docs/benchmarks.md). Only with `timing.handshake: spin`: a harness
    polling at normal priority through a window took a core from other evaluations on the same
    machine, whose processes then could not be stopped in time (CI, 2026-12-06)."""
    return cfg.backend == "cpu" and cfg.timing.handshake == "spin"


def graph_replays(cfg: EvalConfig) -> bool:
    """Whether the window's frames are to be graph replays, where every program can be recorded."""
    return cfg.backend == "cuda" and cfg.timing.graphs


def input_shifts(cfg: EvalConfig) -> list[int]:
    """How far past the start of a program's slot its frames' inputs lie, in the order the frames
    take them: on cpu `timing.input_shifts_cpu` places 4096/n bytes apart, in bit-reversed order
    so that any run of frames (a round of the window) meets them spread over the 4 KiB; [0] on cuda.
    cumsum ran 3.2 ms with its output at one offset from its input within 4 KiB and 4.9 at another
    (4K aliasing; benchmarks/cpu_aliasing.py), and each process's heap puts the outputs where its
    own history leads: eager and torch.compile rose 39% together in one of three runs. Over every
    shift a program's figure no longer hangs on where its process put them."""
    n = cfg.timing.input_shifts_cpu if cfg.backend == "cpu" else 1
    bits = n.bit_length() - 1
    return [int(format(k, f"0{bits}b")[::-1], 2) * (SHIFT_SPAN // n) if bits else 0 for k in range(n)]


def timing_processes(cfg: EvalConfig) -> int:
    """How many processes each program is timed in (hpc.profile.window): `timing.processes_cpu` on
    cpu; one on cuda, whose figures repeat within 1% from one process to the next (H100, three
    runs of the suite, docs/benchmarks.md)."""
    return cfg.timing.processes_cpu if cfg.backend == "cpu" else 1


def process_frames(cfg: EvalConfig) -> list[int]:
    """Each process's timed frames: `timing.iterations` shared out, the first ones one more where
    they do not divide."""
    return [end - start for start, end in round_spans(cfg.timing.iterations, timing_processes(cfg))]


def most_calls(cfg: EvalConfig, burst: int) -> int:
    """The longest run of calls an evaluation makes (a batch of inputs never needs to be larger):
    a process's warm-up and timed frames, its share of them where a program is timed in several."""
    t = cfg.timing
    return max((t.warmup + max(process_frames(cfg))) * burst, (t.calibration_calls + CALIBRATION_WARMUP) * burst,
               cfg.correctness.trials + len(cfg.correctness.distributions))


def flush_bytes(cfg: EvalConfig) -> int:
    """How much the cache flush before each timed frame reads (cpu) or writes (cuda); 0: none."""
    t = cfg.timing
    return (t.flush_bytes_cuda if cfg.backend == "cuda" else t.flush_bytes_cpu) if t.flush_cache else 0


def burst_for(cfg: EvalConfig, probe_ms: float, per_call_bytes: int, outputs: int) -> int:
    """How many calls a timed frame runs back to back: enough that the frame lasts
    `timing.frame_ms` at the reference's own speed (`probe_ms`), so that the handshake, paid once a
    frame, is small beside it; a power of two (a program a little faster or slower keeps the same
    frames); at most `timing.burst_max`, what the memory budget holds, and what the header
    describes."""
    t = cfg.timing
    frame_ms = t.frame_ms_cuda if cfg.backend == "cuda" else t.frame_ms_cpu
    budget = (t.batch_mb_cuda if cfg.backend == "cuda" else t.batch_mb_cpu) << 20
    most = min(t.burst_max, max(1, budget // max(per_call_bytes, 1)), MAX_DESCRIPTORS // max(outputs, 1))
    burst = 1
    while burst * 2 <= most and burst * probe_ms < frame_ms:
        burst *= 2
    return burst


class PairDriver:
    """One worker pair, set up for one task, running calls under the timing protocol. On cpu its
    program process is kept frozen, with everything in its cgroup, while each frame's inputs are
    published and the cache flushed: a candidate's, so that nothing it left running sees the inputs
    before its clock starts; the baselines' trusted one too, so that its frames and the empty
    program's (the handshake taken off every figure) wake the way the candidate's do."""

    def __init__(self, pair: WorkerPair, cfg: EvalConfig):
        if pair.program.proc.cgroup is None:   # started from inside a sandbox: nothing could hold it
            raise SandboxError("the program process has no cgroup of its own to hold it in: not evaluated",
                               FailureKind.HARNESS)
        self.pair, self.cfg = pair, cfg
        self.spin = spinning(cfg)
        self.agent: _HostAgent | None = None
        self.huge_pages: float | None = None   # cpu: the share of the program's input slot on huge pages

    def setup(self, task: Task, init_seed: int, probe_seed: int, burst: int = 0) -> dict:
        """Lay out the task's inputs and outputs (reference), share the slot, map it in the program;
        `burst` calls a timed frame (0: sized from the reference's probe, hpc.profile.driver.burst_for).
        {"layout", "outputs", "burst"}; SandboxError (kind TASK for the task's own failures) when a
        step fails."""
        cfg, ex = self.cfg, self.pair.exchange
        ref, prog = self.pair.reference, self.pair.program
        common = {"scale": cfg.scale, "init_seed": init_seed, "device": cfg.backend}
        laid = ref.request(ReferenceSetup(**common, probe_seed=probe_seed, graphs=graph_replays(cfg),
                                          task=str(harness_file(task.path, ref.workdir, "task.py", task.sha256))))
        layout = InputLayout.from_message(laid.layout)
        outputs = [TensorSpec.parse(o) for o in laid.outputs]
        t = cfg.timing
        flush = flush_bytes(cfg)
        budget = (t.batch_mb_cuda if cfg.backend == "cuda" else t.batch_mb_cpu) << 20
        per_call = align(layout.slot_bytes) + align(laid.output_bytes)
        burst = burst or burst_for(cfg, laid.probe_ms, per_call, len(outputs))
        batch = max(burst, min(most_calls(cfg, burst), budget // max(per_call, 1)))
        staging = batch * per_call if cfg.backend != "cuda" else 0
        os.ftruncate(ex.staging, staging)
        shared = {"layout": laid.layout, "outputs": laid.outputs, "spin": self.spin, "burst": burst}
        attached = ref.request(Attach(**shared, fds=ex.reference.to_message(), correctness=asdict(cfg.correctness),
                                      flush_bytes=flush, batch_bytes=budget, staging_bytes=staging, per_call=per_call))
        made = prog.request(ProgramSetup(**common, **shared, fds=ex.program.to_message(),
                                         task=str(harness_file(task.path, prog.workdir, "task.py", task.sha256)),
                                         slot_handle=attached.slot_handle, shifts=input_shifts(cfg)))
        if cfg.backend != "cuda":
            if layout.slot_bytes and made.slot_address <= 0:
                raise SandboxError("malformed reply from the program process: no input slot")
            self.agent = _HostAgent(self.pair, layout, outputs, per_call, batch, flush, made.slot_address)
            self.huge_pages = huge_page_share(prog.worker_pid, made.slot_address, burst * layout.stride + SHIFT_SPAN)
        return {"layout": layout, "outputs": outputs, "burst": burst}

    def placement(self) -> dict:
        """Where the program's inputs lie, for the record's conditions: on cpu how many places within
        4 KiB they take in turn (`input_shifts`) and the share of its input slot on huge pages
        (`inputs_on_huge_pages`, left out where it could not be read); {} on cuda."""
        if self.agent is None:
            return {}
        shifts = {"input_shifts": len(input_shifts(self.cfg))}
        return shifts if self.huge_pages is None else {**shifts, "inputs_on_huge_pages": round(self.huge_pages, 3)}

    def run(self, calls: list[Call], batch_limit: int = 0, program: str = "", graph: bool = False) -> LoopResult:
        """Run `calls` of `program` (one the program process holds; default: its candidate, or its
        empty program before one is loaded) through its serve loop (`batch_limit`: see run_calls;
        `graph`: its timed frames replay its captured graph); a crashed or hung program is killed
        and shows as the loop's failure (its exit described by the program's SandboxError)."""
        prog, timeout = self.pair.program, self.cfg.sandbox.timeout_s
        serve = Serve(program, graph)
        prog.send(serve)
        if self.agent is not None:
            set_spinning(self.pair.exchange.done_read, self.spin)   # polled: a hung program still times out
            result = run_calls(calls, self.agent, self.pair.exchange.go_write, self.pair.exchange.done_read,
                               self.spin, time.monotonic() + timeout, batch_limit)
            stop_program(self.pair.exchange.go_write)
        else:
            reply = self.pair.reference.request(Run([c.to_message() for c in calls], timeout, batch_limit))
            result = LoopResult([int(x) for x in reply.times_ns], _failure(reply.failure),
                                {"checked": reply.checked, "max_abs_error": reply.max_abs_error,
                                 "max_rel_error": reply.max_rel_error})
        if result.failure is not None and result.failure.kind in (FailureKind.TIMEOUT, FailureKind.CRASH):
            prog.kill()
        prog.receive(serve)
        return result

    def capture(self, program: str, calls: int) -> CaptureReply:
        """Record a frame of `calls` calls of `program` as one CUDA graph in the program process."""
        return self.pair.program.request(Capture(program, calls))

    def load(self, message: dict) -> LoadReply:
        """Load a program in the program process (`message`: the fields of a Load request)."""
        return self.pair.program.request(Load(**message))


def _failure(reported: dict | None) -> Failure | None:
    """The failure a reference's reply reports; SandboxError when it is malformed."""
    if reported is None:
        return None
    try:
        return decode(Failure, reported)
    except ValueError as e:
        raise SandboxError(f"malformed reply from the reference process: {e}") from None


def _reference_kind(e: SandboxError) -> FailureKind:
    """A failure of the reference is the task's when it says so, else the harness's: never the
    candidate's."""
    return FailureKind.TASK if e.kind == FailureKind.TASK else FailureKind.HARNESS


class _HostAgent:
    """The cpu driver's work, in the harness: staging -> the program's slot, the cache flush,
    outputs read out of the program's memory.

    A frame's inputs are published and the cache flushed (6.6 ms over 128 MiB here) before its
    clock starts. A thread the candidate left running could watch its slot meanwhile and compute
    the call before it is timed: `early_start` (tests/hacks) did, and was paid 11.4x torch.compile
    where its honest twin is 1.08x. So the program's cgroup is frozen before the first input of a
    frame is written, found still frozen after the flush, and thawed just before t0. The freezer
    and not SIGSTOP: a program that sends itself SIGCONT (a POSIX timer every millisecond,
    `sigcont_timer` in tests/hacks) resumed from every stop and computed its frames during the
    flush, paid 3.8-6.8x eager where its twin is 0.4-0.6x. Every program is held alike: a process
    let go on just before t0 answers the go byte sooner than one that blocked through the flush
    (benchmarks/cpu_wake.py), and the empty program's handshake is taken off the candidate's
    figures."""

    def __init__(self, pair: WorkerPair, layout: InputLayout, outputs: list[TensorSpec], per_call: int,
                 batch: int, flush_bytes: int, slot_address: int):
        ex = pair.exchange
        self.ref, self.pid = pair.reference, pair.program.worker_pid
        self.group = pair.program.proc.cgroup
        self.held = False
        self.layout, self.outputs, self.per_call, self.batch = layout, outputs, per_call, batch
        self.slot_address = slot_address
        self.header = map_fd(ex.header, HEADER_BYTES)
        self.staging_map = map_fd(ex.staging, batch * per_call)
        self.staging = memoryview(self.staging_map) if self.staging_map is not None else memoryview(b"")
        self.readback = memoryview(bytearray(layout.slot_bytes))   # a checked call's inputs, read back
        self.flush_buffer = (ctypes.c_char * flush_bytes)() if flush_bytes else None
        if self.flush_buffer is not None:
            ctypes.memset(self.flush_buffer, 1, flush_bytes)   # every page its own, not the shared zero page
            self.flush_words = np.frombuffer(self.flush_buffer, dtype=np.uint64)

    def batch_size(self, calls: list[Call]) -> int:
        return self.batch

    def prepare(self, calls: list[Call]) -> Failure | None:
        try:
            self.ref.request(Prepare([c.to_message() for c in calls]))
        except SandboxError as e:
            return Failure(_reference_kind(e), f"reference: {e.reason}")
        return None

    def publish(self, index: int, call: Call, position: int) -> Failure | None:
        """Write a call's inputs into the program's slot, `call.shift` past its position (a program
        that unmapped or protected it fails the call)."""
        if not self.held:
            try:
                self.group.freeze()
            except FreezeError as e:
                raise SandboxError(f"its processes could not be frozen: {e}", FailureKind.RUNTIME) from None
            self.held = True
        n, at = self.layout.slot_bytes, index * self.per_call
        if not n:
            return None
        try:
            write_process_memory(self.pid, self.slot_address + call.shift + position * self.layout.stride,
                                 self.staging[at:at + n])
        except OSError as e:
            self._release()
            return Failure(FailureKind.RUNTIME, f"its inputs could not be written into its input slot: {e}")
        return None

    def flush(self) -> None:
        """Read the flush buffer through, on this thread: loads fill the cache with it and push the
        inputs just published out to memory. A memset this large does not: glibc writes it with
        non-temporal stores, around the cache, and left a call over a 64 MiB input 7.5-12% apart
        between slots that differed only in where their pages landed; read, 128 MiB, 1.2-4.2%
        (benchmarks/cpu_placement.py, docs/benchmarks.md). numpy's sum is one thread (6.6 ms over
        128 MiB here): torch's would leave its OpenMP workers spinning beside the program timed next.
        Called last before t0: the held candidate goes on here, once its group is found still frozen."""
        if self.flush_buffer is not None:
            self.flush_words.sum()
        if self.held and not self.group.frozen():
            self._release()
            raise SandboxError("its cgroup was no longer frozen after its inputs were written", FailureKind.RUNTIME)
        self._release()

    def _release(self) -> None:
        if self.held:
            self.group.thaw()
            self.held = False

    def capture(self, index: int, call: Call, position: int, calls: int) -> Failure | None:
        start = index * self.per_call
        if call.check_inputs and self.layout.slot_bytes:
            try:
                read_process_memory(self.pid, self.slot_address + call.shift + position * self.layout.stride,
                                    self.readback)
            except OSError as e:
                return Failure(FailureKind.RULES, f"its input slot could not be read after the call: {e}")
            modified = modified_input(self.layout, lambda e: not torch.equal(
                torch.frombuffer(self.readback, dtype=torch.uint8, count=e.nbytes, offset=e.offset),
                torch.frombuffer(self.staging, dtype=torch.uint8, count=e.nbytes, offset=start + e.offset)))
            if modified is not None:
                return modified
        base = start + align(self.layout.slot_bytes)
        try:
            for claim, o in zip(validated_outputs(read_outputs(self.header), self.outputs, calls, position),
                                self.outputs):
                if o.nbytes:
                    read_process_memory(self.pid, claim.address, self.staging[base + o.offset:base + o.offset + o.nbytes])
        except (ValueError, OSError) as e:
            return Failure(FailureKind.CORRECTNESS, f"the program's outputs could not be read: {e}")
        return None

    def check(self, calls: list[Call]) -> tuple[Failure | None, dict]:
        try:
            reply = self.ref.request(Check([c.to_message() for c in calls]))
        except SandboxError as e:
            return Failure(_reference_kind(e), f"reference: {e.reason}"), {}
        return _failure(reply.failure), {"checked": reply.checked, "max_abs_error": reply.max_abs_error,
                                         "max_rel_error": reply.max_rel_error}

    def program_failure(self) -> Failure:
        return Failure(*read_failure(self.header))

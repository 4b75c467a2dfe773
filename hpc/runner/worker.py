"""The roles a sandboxed worker plays. Each answers the harness's messages (hpc.sandbox.protocol)
and shares memory and pipes with the other (hpc.sandbox.exchange).

reference: trusted; runs the task's code, never a candidate's. It makes every input of every call
           from seeds only it and the harness know, and checks every output against the task's
           Model on the same inputs. On cuda it also drives the program's calls (it owns the
           device memory involved) and times them on its own clock (hpc.profile.timing).
program:   runs calls on the inputs in its slot when told to: first an empty program (the
           handshake's cost, measured before anything else is loaded), then the candidate's
           ModelNew under the op rules, eager Model, or torch.compile(Model).
"""

from __future__ import annotations

import importlib.util
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc.config import CorrectnessConfig
from hpc.profile.cores import compiling
from hpc.profile.timing import POISON, Call, Failure, modified_input, run_calls, stop_program
from hpc.runner.guard import ALLOWED_OPS, ForwardGuard, RuleViolation
from hpc.runner.inputs import as_tuple, init_model, make_inputs
from hpc.runner.op_monitor import OpMonitor
from hpc.sandbox import cuda_ipc
from hpc.sandbox.exchange import (DONE_FAILED, DONE_OK, HEADER_BYTES, STOP, ExchangeFds, HostSlot, InputLayout,
                                  OutputDescriptor, TensorSpec, map_fd, packed, read_failure, read_frame,
                                  read_outputs, send_frame, set_spinning, validated_outputs, write_failure,
                                  write_outputs)
from hpc.sandbox.messages import (SHIFT_SPAN, WORKER_KINDS, Attach, AttachReply, Capture, CaptureReply, Check,
                                  CheckReply, Cost, CostReply, FailureKind, Load, LoadReply, Ok, Outputs, OutputsReply,
                                  Prepare, ProgramSetup, ProgramSetupReply, Ready, ReferenceSetup, Repeatable,
                                  RepeatableReply, Reply, Request, Run, RunReply, Serve, ServeReply, SetupReply)
from hpc.task import load_task_module
from hpc.verify.compare import compare_outputs


class WorkerError(Exception):
    """Reported to the harness as {"error": message, "kind": kind}: one of the kinds a worker may
    report (hpc.sandbox.messages.WORKER_KINDS; ValueError for any other)."""

    def __init__(self, message: str, kind: FailureKind):
        super().__init__(message)
        if kind not in WORKER_KINDS:
            raise ValueError(f"a worker cannot report kind {kind!r}")
        self.kind = FailureKind(kind)


def _device(name: str) -> torch.device:
    if name == "cuda":
        try:
            torch.cuda.init()
        except Exception as e:
            raise WorkerError(f"backend cuda requested but CUDA is unusable here: {str(e).strip()[-160:]}",
                              FailureKind.HARNESS) from None
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _task_error(what: str, e: BaseException) -> WorkerError:
    text = " ".join(line.strip() for line in str(e).strip().splitlines())[:500]
    return WorkerError(f"{what}: {type(e).__name__}: {text}", FailureKind.TASK)


def _views(buffer: torch.Tensor, layout: InputLayout) -> list:
    """The inputs of one call over `buffer` (uint8, laid out as `layout`)."""
    out = []
    for entry in layout.entries:
        if isinstance(entry, TensorSpec):
            raw = buffer[entry.offset:entry.offset + entry.nbytes]
            out.append(raw.view(getattr(torch, entry.dtype)).view(entry.shape))
        else:
            out.append(entry["value"])
    return out


class PeakMemory:
    """The peak memory of the task's eager run since it is made (before the Model is built, so its
    parameters, inputs, intermediates and outputs count), for the synthesis memory filter: on cuda
    the caching allocator's peak; on cpu the growth of the resident set's high-water mark. That
    mark cannot be reset in the sandbox (writing /proc/self/clear_refs is refused), but in a fresh
    worker it equals the resident set when the task is set up, so it rises with each page the
    task's run touches beyond it."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.start = self._resident_peak()

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, self._resident_peak() - self.start)

    @staticmethod
    def _resident_peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


class _Worker:
    def setup_task(self, req: ReferenceSetup | ProgramSetup) -> None:
        self.device = _device(req.device)
        try:
            self.task = load_task_module(req.task, req.scale)
        except Exception as e:
            raise _task_error("task failed to load", e) from None
        self.init_seed = req.init_seed

    def attach_exchange(self, req: Attach | ProgramSetup) -> None:
        self.fds = ExchangeFds.from_message(req.fds)
        self.header = map_fd(self.fds.header, HEADER_BYTES)
        self.layout = InputLayout.from_message(req.layout)
        self.outputs = [TensorSpec.parse(o) for o in req.outputs]
        self.spin = req.spin

    def ready(self, req: Ready) -> Ok:
        """Answered once the interpreter is up and the device initialized: a prestarted process
        is then ready for its evaluation."""
        if req.device:
            _device(req.device)
        return Ok()


class ReferenceWorker(_Worker):
    """The task's Model, every input, every check; on cuda the driver of the program's calls."""

    def setup(self, req: ReferenceSetup) -> SetupReply:
        """Load the task, build the Model, and lay out one call's inputs and outputs from a sample."""
        self.setup_task(req)
        self.peak = PeakMemory(self.device)
        try:
            self.model = init_model(self.task.Model, self.task, self.init_seed, self.device)
        except Exception as e:
            raise _task_error("task Model failed to build", e) from None
        if req.compile:   # synthesis checks that torch.compile agrees with eager (compiled at the probe)
            self.model = torch.compile(self.model, mode=None if req.compile == "default" else req.compile)
        inputs = self._make(self.init_seed + 1 if req.probe_seed is None else req.probe_seed, "default")
        entries: list = []
        for k, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                if _dtype_name(x.dtype) not in cuda_ipc.DTYPES:
                    raise WorkerError(f"task input {k} has dtype {x.dtype}, which is not supported", FailureKind.TASK)
                entries.append(TensorSpec(_dtype_name(x.dtype), tuple(x.shape)))
            elif x is None or isinstance(x, (bool, int, float, str)):
                entries.append({"value": x})
            else:
                raise WorkerError(f"task input {k} is a {type(x).__name__}: only tensors and plain numbers "
                                  "or strings are supported", FailureKind.TASK)
        tensors, slot_bytes = packed([e for e in entries if isinstance(e, TensorSpec)])
        it = iter(tensors)
        self.layout = InputLayout(tuple(next(it) if isinstance(e, TensorSpec) else e for e in entries), slot_bytes)
        outputs = self._reference(inputs)
        probe_ms = self._probe_ms(inputs, req.graphs)
        specs = []
        for k, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or _dtype_name(t.dtype) not in cuda_ipc.DTYPES:
                raise WorkerError(f"task Model output {k} is a {type(t).__name__}"
                                  f"{' of dtype ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}: "
                                  "only tensors of the supported dtypes can be compared", FailureKind.TASK)
            specs.append(TensorSpec(_dtype_name(t.dtype), tuple(t.shape)))
        self.output_specs, self.output_bytes = packed(specs)
        return SetupReply(self.layout.to_message(), [o.__dict__ for o in self.output_specs], self.output_bytes,
                          probe_ms)

    def _probe_ms(self, inputs: list, graphs: bool = False) -> float:
        """The Model's time for one call on `inputs`, synchronized, the best of three: how long the
        programs' calls will be, known before any is timed (the harness sizes their frames by it).
        With `graphs` (cuda), the call's device time, from a replay of it recorded as a graph, as
        the programs' frames will be timed; its host-inclusive time where it cannot be recorded."""
        if graphs and self.device.type == "cuda":
            device_ms = self._replay_ms(inputs)
            if device_ms is not None:
                return device_ms
        best = math.inf
        for _ in range(3):
            copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
            synchronize(self.device)
            t0 = time.perf_counter()
            self._reference(copies)
            synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    def _replay_ms(self, inputs: list) -> float | None:
        """The best of three replays of one call recorded as a CUDA graph, on CUDA events; None
        when the Model cannot be recorded."""
        copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._reference(copies)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = math.inf
            for _ in range(3):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
        except Exception:   # not recordable: the host-inclusive probe
            synchronize(self.device)
            return None
        finally:
            cuda_ipc.forget_exported()
        return best

    def _make(self, seed: int, distribution: str) -> list:
        """The task's inputs for `seed`; a task whose get_inputs fails is the task's fault."""
        try:
            return make_inputs(self.task, seed, distribution, self.device)
        except Exception as e:
            raise _task_error("task get_inputs failed", e) from None

    def _reference(self, inputs: list) -> list:
        try:
            return list(as_tuple(self.model(*inputs)))
        except Exception as e:
            raise _task_error("task Model failed", e) from None

    def _inputs_for(self, call: Call) -> list:
        """A call's inputs, which must have the layout every call has."""
        inputs = self._make(call.seed, call.distribution)
        if len(inputs) != len(self.layout.entries):
            raise WorkerError(f"task get_inputs returned {len(inputs)} inputs for one seed and "
                              f"{len(self.layout.entries)} for another", FailureKind.TASK)
        for k, (x, entry) in enumerate(zip(inputs, self.layout.entries)):
            if isinstance(entry, TensorSpec):
                if not isinstance(x, torch.Tensor) or _dtype_name(x.dtype) != entry.dtype or tuple(x.shape) != entry.shape:
                    raise WorkerError(f"task input {k} changes type, dtype or shape with the seed", FailureKind.TASK)
            elif x != entry["value"]:
                raise WorkerError(f"task input {k} ({entry['value']!r}) changes with the seed: non-tensor inputs "
                                  "must be constants", FailureKind.TASK)
        return inputs

    def _pack(self, inputs: list, into: torch.Tensor) -> None:
        for x, entry in zip(inputs, self.layout.entries):
            if isinstance(entry, TensorSpec) and entry.nbytes:
                into[entry.offset:entry.offset + entry.nbytes].copy_(x.contiguous().reshape(-1).view(torch.uint8))

    def attach(self, req: Attach) -> AttachReply:
        """Map the exchange (cpu: slot and staging memfds; cuda: a slot of its own, exported)."""
        self.attach_exchange(req)
        self.correctness = CorrectnessConfig(**req.correctness)
        self.flush_bytes = req.flush_bytes
        self.budget = req.batch_bytes
        self.burst = req.burst
        if self.device.type == "cuda":
            self.slot = cuda_ipc.DeviceBuffer(self.burst * self.layout.stride, self.device)
            self.slot_handle = self.slot.export()
            return AttachReply(self.slot_handle.hex())
        self.staging_map = map_fd(self.fds.staging, req.staging_bytes)
        self.staging = (torch.frombuffer(self.staging_map, dtype=torch.uint8) if self.staging_map is not None
                        else torch.empty(0, dtype=torch.uint8))
        self.per_call = req.per_call
        return AttachReply()

    def outputs(self, req: Outputs) -> OutputsReply:
        """The Model's outputs for each trial (seed, distribution), on the host: for the synthesis
        filters, which judge tasks, not candidates; with the peak memory since the setup."""
        outputs = [[t.detach().to("cpu") for t in self._reference(self._make(t["seed"], t["distribution"]))]
                   for t in req.trials]
        return OutputsReply(outputs, self.peak.bytes())

    def repeatable(self, req: Repeatable) -> RepeatableReply:
        """Whether two runs of the Model on the same inputs agree within the evaluator's tolerance."""
        cfg = CorrectnessConfig() if req.correctness is None else CorrectnessConfig(**req.correctness)
        inputs = self._make(req.seed, "default")
        copies = lambda: [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]   # noqa: E731
        cmp = compare_outputs(self._reference(copies()), self._reference(copies()), cfg, self.device)
        return RepeatableReply(cmp.ok, cmp.reason)

    # --- cpu: the harness drives; the reference makes each batch and checks it ---------------

    def prepare(self, req: Prepare) -> Ok:
        """Make the inputs of a batch of calls into staging, one call every `per_call` bytes."""
        for j, data in enumerate(req.calls):
            call = Call.from_message(data)
            if call.seed >= 0:
                self._pack(self._inputs_for(call), self.staging[j * self.per_call:])
        return Ok()

    def check(self, req: Check) -> CheckReply:
        """Compare the outputs the harness captured into staging with the Model's on the same inputs."""
        calls = [Call.from_message(c) for c in req.calls]
        failure, measured = _check_calls(self, calls, lambda j: _views(self.staging[j * self.per_call:], self.layout),
                                         lambda j: self._captured_host(j))
        return CheckReply(failure.__dict__ if failure else None, **measured)

    def _captured_host(self, j: int) -> list:
        base = j * self.per_call + self.layout.slot_bytes
        return [self.staging[base + o.offset:base + o.offset + o.nbytes].view(getattr(torch, o.dtype)).view(o.shape)
                for o in self.output_specs]

    # --- cuda: the reference drives the calls itself ----------------------------------------

    def run(self, req: Run) -> RunReply:
        """Drive the program through `calls` (hpc.profile.timing.run_calls) and end its serve loop."""
        calls = [Call.from_message(c) for c in req.calls]
        set_spinning(self.fds.done, self.spin)
        agent = _DeviceAgent(self)
        try:
            result = run_calls(calls, agent, self.fds.go, self.fds.done, self.spin,
                               time.monotonic() + req.timeout_s, req.batch_limit)
        finally:
            stop_program(self.fds.go)
            agent.close()
        return RunReply(result.times_ns, result.failure.__dict__ if result.failure else None, **result.checks)

    def cost(self, req: Cost) -> CostReply:
        """FLOPs (matmul/conv family, counted by torch) and the fewest bytes any implementation must
        move: inputs, parameters and outputs once each. With `meta`, counted on a copy of the task
        built on the meta device (shapes only: no device work, so the harness holds no device lock
        for it); a task whose forward needs real values there replies with `meta_failed`."""
        if req.meta:
            meta = torch.device("meta")
            try:
                with meta:
                    model = init_model(self.task.Model, self.task, self.init_seed, meta)
                return _counted(model, make_inputs(self.task, req.seed, "default", meta))
            except Exception as e:   # the task's own code on shapes alone: anything may fail
                return CostReply(meta_failed=f"{type(e).__name__}: {e}")
        return _counted(self.model, self._make(req.seed, "default"))


def _check_calls(ref: ReferenceWorker, calls: list[Call], inputs_of, captured_of) -> tuple[Failure | None, dict]:
    """Each checked call's captured outputs against the Model's on its inputs. A mismatch the Model
    cannot reproduce on the same inputs is the task's: it is not deterministic."""
    measured = {"checked": 0, "max_abs_error": 0.0, "max_rel_error": 0.0}
    for j, call in enumerate(calls):
        if not call.checked:
            continue
        inputs = inputs_of(j)
        # on copies: a task that writes into its inputs must not change what the next run sees
        expected = ref._reference([x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        cmp = compare_outputs(expected, captured_of(j), ref.correctness, ref.device)
        measured["checked"] += 1
        measured["max_abs_error"] = max(measured["max_abs_error"], cmp.max_abs_error)
        measured["max_rel_error"] = max(measured["max_rel_error"], cmp.max_rel_error)
        if not cmp.ok:
            again = compare_outputs(expected, ref._reference([x.clone() if isinstance(x, torch.Tensor) else x
                                                              for x in inputs]), ref.correctness, ref.device)
            if not again.ok:
                return Failure(FailureKind.TASK, f"the task's Model is not deterministic: two runs on the same inputs "
                                       f"differ ({again.reason})", j), measured
            return Failure(FailureKind.CORRECTNESS, cmp.reason, j), measured
    return None, measured


class _DeviceAgent:
    """The driver's device work on cuda, in the reference's process: batches of inputs made in
    memory the program cannot map, published into the slot and the L2 flushed through the copy
    engines (so the program's context stays on the SMs: no context switch lands inside a call),
    and a checked call's outputs copied out of the program's allocations as soon as it answers."""

    def __init__(self, ref: ReferenceWorker):
        self.ref = ref
        self.stream = torch.cuda.Stream(ref.device)
        self.event = torch.cuda.Event()
        half = max(ref.flush_bytes // 2, 1)
        self.flush_src = torch.empty(half, dtype=torch.uint8, device=ref.device) if ref.flush_bytes else None
        self.flush_dst = torch.empty(half, dtype=torch.uint8, device=ref.device) if ref.flush_bytes else None
        self.mappings = cuda_ipc.Mappings()
        self.mappings.own(ref.slot_handle, ref.slot)   # an output may be a view of the inputs
        self.private = torch.empty(0, dtype=torch.uint8, device=ref.device)
        self.captured: dict[int, list[torch.Tensor]] = {}
        self.pending: Failure | None = None

    def batch_size(self, calls: list[Call]) -> int:
        per = max(self.ref.layout.slot_bytes + self.ref.output_bytes, 1)
        return max(self.ref.burst, min(len(calls), self.ref.budget // per))

    def prepare(self, calls: list[Call]) -> Failure | None:
        size = self.ref.layout.slot_bytes
        if self.private.numel() < len(calls) * size:
            self.private = torch.empty(len(calls) * size, dtype=torch.uint8, device=self.ref.device)
        self.captured = {}
        try:
            for j, call in enumerate(calls):
                if call.seed >= 0:
                    self.ref._pack(self.ref._inputs_for(call), self.private[j * size:])
        except WorkerError as e:
            return Failure(e.kind, str(e))
        torch.cuda.synchronize(self.ref.device)
        return None

    def _wait(self) -> None:
        self.event.record(self.stream)
        while not self.event.query():
            pass

    def publish(self, index: int, call: Call, position: int) -> Failure | None:
        size, at = self.ref.layout.slot_bytes, position * self.ref.layout.stride
        with torch.cuda.stream(self.stream):
            self.ref.slot.tensor[at:at + size].copy_(self.private[index * size:(index + 1) * size])
        return None

    def flush(self) -> None:
        if self.flush_src is not None:
            with torch.cuda.stream(self.stream):
                self.flush_dst.copy_(self.flush_src)
        self._wait()

    def capture(self, index: int, call: Call, position: int, calls: int) -> Failure | None:
        size = self.ref.layout.slot_bytes
        if call.check_inputs:
            private, slot = self.private[index * size:], self.ref.slot.tensor[position * self.ref.layout.stride:]
            modified = modified_input(self.ref.layout, lambda e: not torch.equal(
                private[e.offset:e.offset + e.nbytes], slot[e.offset:e.offset + e.nbytes]))
            if modified is not None:
                return modified
        try:
            claims = validated_outputs(read_outputs(self.ref.header), self.ref.output_specs, calls, position)
            copies = []
            with torch.cuda.stream(self.stream):
                for o, claim in zip(self.ref.output_specs, claims):
                    view = self.mappings.view(claim.handle, claim.address, o.nbytes, self.ref.device)
                    copies.append(torch.empty(o.nbytes, dtype=torch.uint8, device=self.ref.device).copy_(view))
            self._wait()
        except (ValueError, cuda_ipc.IpcError) as e:
            return Failure(FailureKind.CORRECTNESS, f"the program's outputs could not be read: {e}")
        self.captured[index] = [c.view(getattr(torch, o.dtype)).view(o.shape) for c, o in zip(copies, self.ref.output_specs)]
        return None

    def check(self, calls: list[Call]) -> tuple[Failure | None, dict]:
        size = self.ref.layout.slot_bytes
        return _check_calls(self.ref, calls, lambda j: _views(self.private[j * size:], self.ref.layout),
                            lambda j: self.captured[j])

    def program_failure(self) -> Failure:
        return Failure(*read_failure(self.ref.header))

    def close(self) -> None:
        torch.cuda.synchronize(self.ref.device)
        self.mappings.close()


class _EmptyModel(torch.nn.Module):
    """The handshake alone: preallocated outputs, and on cuda one tiny kernel (every call launches at
    least one, and the switch of the SMs to this context is part of every call). It runs in the
    baselines' trusted process, unguarded: a candidate's figure keeps its guard's small cost, so
    taking this one off errs against the candidate, never for it."""

    def __init__(self, outputs: list[torch.Tensor], device: torch.device):
        super().__init__()
        self.outputs = outputs
        self.tick = torch.zeros(1, device=device) if device.type == "cuda" else None

    def forward(self, *inputs):
        if self.tick is not None:
            self.tick.fill_(1.0)
        return self.outputs


@dataclass
class Replay:
    """A program's frame of `calls` calls recorded as one CUDA graph, and the outputs it writes."""

    calls: int
    graph: torch.cuda.CUDAGraph
    outputs: list[torch.Tensor]


class ProgramWorker(_Worker):
    """Runs calls of one of its programs on the slot's inputs when the driver says go. A trusted
    process holds the empty program, eager Model and each torch.compile mode; a candidate's process
    holds the candidate alone once it is loaded."""

    def setup(self, req: ProgramSetup) -> ProgramSetupReply:
        """Make (cpu: hpc.sandbox.exchange.HostSlot) or map (cuda) the slot's positions, one call's
        inputs each, and prepare the empty program. No candidate code runs here."""
        self.setup_task(req)
        self.attach_exchange(req)
        burst, stride = req.burst, self.layout.stride
        self.slot_bytes = burst * stride
        self.host_slot: HostSlot | None = None
        shifts = req.shifts if self.device.type != "cuda" else [0]
        if self.device.type == "cuda":
            self.mappings = cuda_ipc.Mappings()
            try:
                self.slot_handle = bytes.fromhex(req.slot_handle)
                slot = self.mappings.view(self.slot_handle, 0, self.slot_bytes, self.device)
            except (ValueError, cuda_ipc.IpcError) as e:
                raise WorkerError(f"the input slot could not be mapped: {e}", FailureKind.HARNESS) from None
        else:
            try:
                self.host_slot = HostSlot(self.slot_bytes + SHIFT_SPAN) if self.slot_bytes else None
            except OSError as e:
                raise WorkerError(f"the input slot could not be made: {e}", FailureKind.HARNESS) from None
            slot = (torch.frombuffer(self.host_slot.view, dtype=torch.uint8) if self.host_slot is not None
                    else torch.empty(0, dtype=torch.uint8))
        self.placed = {shift: [_views(slot[shift + k * stride:], self.layout) for k in range(burst)]
                       for shift in shifts}   # each shift's positions (of an empty slot where no input has bytes)
        self.positions = self.placed[shifts[0]]
        self.inputs = self.positions[0]
        self.inputs_base = slot.data_ptr()
        empty = _EmptyModel([torch.zeros(o.shape, dtype=getattr(torch, o.dtype), device=self.device)
                             for o in self.outputs], self.device)
        self.programs = {"empty": lambda inputs, poison: empty(*inputs)}
        self.call = self.programs["empty"]
        self.graphs: dict[str, Replay] = {}
        self.replay: Replay | None = None
        return ProgramSetupReply(self.host_slot.address if self.host_slot is not None else 0)

    @staticmethod
    def _monitor(req: Load) -> OpMonitor:
        """The op monitor with the config's rules, loaded before any candidate code runs."""
        try:
            return OpMonitor(req.op_monitor, ALLOWED_OPS | frozenset(req.rules["allowed_torch_ops"]))
        except (OSError, RuntimeError) as e:
            raise WorkerError(f"op monitor unusable: {e}", FailureKind.HARNESS) from None

    def load(self, req: Load) -> LoadReply:
        """Add a program to time: the candidate's ModelNew under the rules (which retires the empty
        program: nothing timed in this process after candidate code is loaded is trusted), or eager
        or compiled Model (a trusted process holds the empty program, eager and each compile mode)."""
        t0 = time.monotonic()
        program = req.program
        if program == "candidate":
            with compiling():   # a load-time build (load_inline) stays off the cores kept for timing (on cpu,
                                # where the sandbox refuses the move, the process already starts there)
                call = self._load_candidate(req)
            self.programs, self.graphs = {}, {}
        else:
            model = init_model(self.task.Model, self.task, self.init_seed, self.device)
            mode = req.mode
            if program == "compile":
                model = torch.compile(model, mode=None if mode == "default" else mode)
                program = f"compile:{mode}"
            call = lambda inputs, poison: model(*inputs)   # noqa: E731
        self.programs[program] = call
        if program.startswith("compile"):   # compile now: the timed calls run under an exclusive device lock
            with compiling():
                call(self.inputs, None)
                synchronize(self.device)
        return LoadReply(True, time.monotonic() - t0, **getattr(self, "load_info", {}))

    def _load_candidate(self, req: Load):
        from hpc import runtime

        monitor = self._monitor(req)   # before any candidate code
        runtime.count_extension_calls()
        os.environ.update({str(k): str(v) for k, v in req.environment.items()})
        path = Path(req.model_file)
        sys.path.insert(0, str(path.parent))
        try:
            spec = importlib.util.spec_from_file_location("model_new", str(path))
            module = importlib.util.module_from_spec(spec)
            sys.modules["model_new"] = module
            spec.loader.exec_module(module)
            torch.manual_seed(self.init_seed)
            model = module.ModelNew(*self.task.get_init_inputs()).to(self.device).eval()
        except Exception as e:
            raise WorkerError(f"candidate failed to load: {type(e).__name__}: {e}", FailureKind.LOAD) from None
        reference = init_model(self.task.Model, self.task, self.init_seed, self.device)
        own = model.state_dict()
        matched = {k: v for k, v in reference.state_dict().items() if k in own and own[k].shape == v.shape}
        model.load_state_dict(matched, strict=False)
        self.load_info = {"weights_loaded": len(matched), "weights_total": len(reference.state_dict())}
        del reference
        guard = ForwardGuard(model, monitor, req.rules["require_custom_kernel"], runtime.launch_count)
        return lambda inputs, poison: guard(inputs, check_inputs=False, poison=poison)

    def serve(self, req: Serve) -> ServeReply:
        """Run the calls of `program` each go frame asks for, back to back, until the stop frame;
        answer each with a done frame."""
        name = req.program or ("candidate" if "candidate" in self.programs else "empty")
        if name not in self.programs:
            raise WorkerError(f"no program {name!r} here (loaded: {', '.join(self.programs) or 'none'})",
                              FailureKind.HARNESS)
        self.call = self.programs[name]
        self.replay = self.graphs.get(name) if req.graph else None
        if req.graph and self.replay is None:
            raise WorkerError(f"no graph of {name!r} was captured", FailureKind.HARNESS)
        set_spinning(self.fds.go, self.spin)
        calls = 0
        while True:
            seq, poison, count, shift = read_frame(self.fds.go, math.inf, self.spin)
            if seq == STOP:
                return ServeReply(calls)
            calls += count
            status = DONE_OK
            try:
                if not 1 <= count <= len(self.positions):
                    raise WorkerError(f"a frame of {count} calls (the slot holds {len(self.positions)})",
                                      FailureKind.HARNESS)
                positions = self.placed.get(shift)
                if positions is None:
                    raise WorkerError(f"a frame's inputs {shift} bytes past the slot's start, not one of its shifts",
                                      FailureKind.HARNESS)
                self._one_frame(POISON[poison] if 0 <= poison < len(POISON) else None, positions[:count])
            except RuleViolation as e:
                write_failure(self.header, FailureKind.RULES, str(e))
                status = DONE_FAILED
            except WorkerError as e:
                write_failure(self.header, e.kind, str(e))
                status = DONE_FAILED
            except torch.cuda.OutOfMemoryError as e:
                write_failure(self.header, FailureKind.RUNTIME, f"CUDA out of memory: {str(e).splitlines()[0]}")
                status = DONE_FAILED
            except MemoryError:
                write_failure(self.header, FailureKind.RUNTIME, "out of memory (address-space limit)")
                status = DONE_FAILED
            except Exception as e:
                text = str(e).strip()
                write_failure(self.header, FailureKind.RUNTIME,
                              f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
                status = DONE_FAILED
            send_frame(self.fds.done, seq, status)

    def _one_frame(self, poison: float | None, positions: list) -> None:
        """A call on each of `positions`' inputs, back to back (or their graph replayed); then one
        synchronization, and every call's outputs described in the header."""
        if self.replay is not None and poison is None:
            if self.replay.calls != len(positions):
                raise WorkerError(f"a frame of {len(positions)} calls (the graph holds {self.replay.calls})",
                                  FailureKind.HARNESS)
            self.replay.graph.replay()
            outs = self.replay.outputs
        else:
            outs = self._calls(self.call, poison, positions)
        synchronize(self.device)   # device-wide: work left on any stream is inside the frame
        self._describe(outs)

    def _calls(self, call, poison: float | None, positions: list) -> list[torch.Tensor]:
        """A call of `call` on each of `positions`' inputs: their outputs, each checked to be a
        tensor the driver can compare."""
        outs = []
        for inputs in positions:
            for k, t in enumerate(as_tuple(call(inputs, poison))):
                if type(t) is not torch.Tensor:
                    raise RuleViolation(f"output {k} is a {type(t).__module__}.{type(t).__name__}, "
                                        "not a plain torch.Tensor")
                if t.device.type != self.device.type:
                    raise WorkerError(f"output {k} is on {t.device.type}, expected {self.device.type}",
                                      FailureKind.RUNTIME)
                if _dtype_name(t.dtype) not in cuda_ipc.DTYPES:
                    raise WorkerError(f"output {k} has dtype {t.dtype}, which cannot be compared", FailureKind.RUNTIME)
                outs.append(t if t.is_contiguous() else t.contiguous())
        return outs

    def _describe(self, outs: list[torch.Tensor]) -> None:
        """Every output of the frame described in the header, kept alive until the next frame."""
        claims = []
        for t in outs:
            if self.device.type == "cuda" and t.numel():
                handle, offset = self._handle_of(t)
                claims.append(OutputDescriptor(_dtype_name(t.dtype), tuple(t.shape), offset, handle))
            else:
                claims.append(OutputDescriptor(_dtype_name(t.dtype), tuple(t.shape), t.data_ptr() if t.numel() else 0))
        try:
            write_outputs(self.header, claims)
        except ValueError as e:
            raise WorkerError(str(e), FailureKind.RUNTIME) from None
        self.kept = outs   # alive until the next frame: the driver copies them out after this answer

    def capture(self, req: Capture) -> CaptureReply:
        """Record `calls` calls of `program`, one on each position's inputs, as one CUDA graph
        that a serve loop with `graph` replays for each of its frames: the frame's figure is then
        the device's work alone, none of the host path (Python, guards, launches), which moves
        with the host from one evaluation to the next. A program that cannot be recorded (it
        synchronizes, reads values on the host, launches outside the current stream) says why
        and is timed by calls; so, then, is every program it is compared with (the harness's
        choice). The call runs under the rules as any other (a candidate's guard and op monitor
        see its Python once, here)."""
        name = req.program or ("candidate" if "candidate" in self.programs else "empty")
        if name not in self.programs:
            raise WorkerError(f"no program {name!r} here", FailureKind.HARNESS)
        if self.device.type != "cuda":
            return CaptureReply(False, "graphs are recorded on cuda only")
        if not 1 <= req.calls <= len(self.positions):
            raise WorkerError(f"a graph of {req.calls} calls (the slot holds {len(self.positions)})",
                              FailureKind.HARNESS)
        self.graphs.pop(name, None)
        call = self.programs[name]
        try:
            side = torch.cuda.Stream()   # warm up on a side stream, as torch asks before a capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._calls(call, None, self.positions[:req.calls])
            torch.cuda.current_stream().wait_stream(side)
            synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    outs = self._calls(call, None, self.positions[:req.calls])
            finally:
                cuda_ipc.forget_exported()   # the capture emptied torch's cache: memory went back to the driver
            graph.replay()
            synchronize(self.device)
        except (RuleViolation, WorkerError):
            raise
        except Exception as e:   # not recordable: timed by calls
            try:
                synchronize(self.device)
            except Exception:
                pass   # the same error again: the serve loop reports it if it lasts
            text = str(e).strip()
            return CaptureReply(False, f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}")
        self.graphs[name] = Replay(req.calls, graph, outs)
        return CaptureReply(True, "")

    def _handle_of(self, t: torch.Tensor) -> tuple[bytes, int]:
        """The allocation an output lies in: the slot's own handle for a view of the inputs (CUDA
        gives no handle for memory opened from another process), else its own allocation's."""
        offset = t.data_ptr() - self.inputs_base
        if 0 <= offset < self.slot_bytes:
            return self.slot_handle, offset
        return cuda_ipc.handle_of(t)


def _counted(model: torch.nn.Module, inputs: list) -> CostReply:
    """FLOPs of one forward under torch's counter, and the bytes of its inputs, parameters,
    buffers and outputs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)] + list(model.parameters()) + list(
        model.buffers()) + [t for t in as_tuple(out) if isinstance(t, torch.Tensor)]
    return CostReply(flops=float(counter.get_total_flops()),
                     bytes=float(sum(t.numel() * t.element_size() for t in tensors)))


ROLES = {"reference": ReferenceWorker, "program": ProgramWorker}


def dispatch(worker: _Worker, request: Request) -> Reply:
    """The worker's answer to `request`, one its role takes (hpc.sandbox.messages.decode_request
    refused any other): the handler named by the request's op."""
    try:
        return getattr(worker, request.op)(request)
    except (WorkerError, RuleViolation):
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise WorkerError(f"CUDA out of memory: {str(e).splitlines()[0]}", FailureKind.RUNTIME) from None
    except MemoryError:
        raise WorkerError("out of memory (address-space limit)", FailureKind.RUNTIME) from None
    except Exception as e:
        raise WorkerError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                          FailureKind.RUNTIME) from None

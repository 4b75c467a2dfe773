"""The roles a sandboxed worker plays. Each answers the harness's messages (see hpc.sandbox.protocol).

reference: the task's Model; computes outputs for given seeds (on the GPU it keeps them and
           compares the program's outputs, shared through CUDA IPC, with them).
program:   something timed under the protocol: the candidate's ModelNew (guarded by the
           policy), eager Model, or torch.compile(Model).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from hpc.config import CorrectnessConfig
from hpc.profile.timing import (CacheFlusher, install_start_gate, synchronize, time_call, time_calls,
                                timers_intact)
from hpc.runner.guard import ALLOWED_OPS, POISON, ForwardGuard, PolicyViolation
from hpc.runner.inputs import as_tuple, fingerprint, init_model, make_inputs, timed_inputs
from hpc.runner.op_monitor import OpMonitor
from hpc.sandbox import cuda_ipc
from hpc.task import load_task_module
from hpc.verify.compare import compare_outputs

_PROBE = 4096   # int32 elements of the CUDA IPC probe


class WorkerError(Exception):
    """Reported to the harness as {"error": message, "kind": kind}."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _device(name: str) -> torch.device:
    if name == "cuda":
        try:
            torch.cuda.init()
        except Exception as e:
            raise WorkerError(f"backend cuda requested but CUDA is unusable here: {str(e).strip()[-160:]}",
                              "harness") from None
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_host(output, device: torch.device) -> list:
    """Outputs on the host, through pinned memory from a GPU (twice the bandwidth of pageable)."""
    synchronize(device)
    return [(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) if t.is_cuda else t.detach())
            if isinstance(t, torch.Tensor) else t for t in as_tuple(output)]


class _Worker:
    def setup(self, msg: dict) -> dict:
        self.device = _device(msg["device"])
        try:
            self.task = load_task_module(msg["task"], msg["scale"])
        except Exception as e:
            raise WorkerError(f"task failed to load: {type(e).__name__}: {e}", "task") from None
        self.init_seed = int(msg["init_seed"])
        return {}

    def ready(self, msg: dict) -> dict:
        """Answered once the interpreter is up and the device initialized: a prestarted process
        is then ready for its evaluation."""
        if "device" in msg:
            _device(msg["device"])
        return {"ok": True}

    def base_inputs(self, seed: int) -> list:
        return make_inputs(self.task, seed, "default", self.device)


class ReferenceWorker(_Worker):
    def setup(self, msg: dict) -> dict:
        super().setup(msg)
        try:
            self.model = init_model(self.task.Model, self.task, self.init_seed, self.device)
        except Exception as e:
            raise WorkerError(f"task Model failed to build: {type(e).__name__}: {e}", "task") from None
        return {"ok": True}

    def outputs(self, msg: dict) -> dict:
        """Each trial's outputs; with `keep` (one trial) they stay on the device for `compare`."""
        results = []
        for trial in msg["trials"]:
            inputs = make_inputs(self.task, trial["seed"], trial["distribution"], self.device)
            out = self.model(*inputs)
            if msg.get("keep"):
                self.kept = [t.detach() if isinstance(t, torch.Tensor) else t for t in as_tuple(out)]
                return {"kept": len(self.kept)}
            results.append(_to_host(out, self.device))
        return {"outputs": results}

    def kept_outputs(self, msg: dict) -> dict:
        """The kept outputs on the host: the program's outputs were not all shared."""
        return {"outputs": [_to_host(self.kept, self.device)]}

    def compare(self, msg: dict) -> dict:
        """The kept outputs against the program's, mapped from its process: the comparison the
        harness would make, made here because the expected outputs are here (this process runs
        the task's code, never a candidate's)."""
        cfg = CorrectnessConfig(**msg["correctness"])
        try:
            with cuda_ipc.imported(msg["outputs"], self.device) as got:
                cmp = compare_outputs(self.kept, got, cfg, self.device)
                del got
        except cuda_ipc.IpcError as e:
            raise WorkerError(f"the program's outputs could not be mapped: {e}", "program") from None
        return {"comparison": {k: getattr(cmp, k) for k in ("ok", "reason", "max_abs_error", "max_rel_error",
                                                            "mismatched", "numel")},
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in self.kept if isinstance(t, torch.Tensor)]}

    def probe_ipc(self, msg: dict) -> dict:
        """Whether the program's probe maps here with the values it was written with: CUDA IPC
        works between the two sandboxed processes on this machine."""
        expected = torch.arange(_PROBE, dtype=torch.int32, device=self.device)
        try:
            with cuda_ipc.imported([msg["probe"]], self.device) as got:
                same = got[0].shape == expected.shape and bool(torch.equal(got[0], expected))
                del got
        except cuda_ipc.IpcError as e:
            return {"ok": False, "reason": str(e)}
        return {"ok": same, "reason": "" if same else "probe values differ"}

    def cost(self, msg: dict) -> dict:
        """FLOPs (matmul/conv family, counted by torch) and the fewest bytes any implementation must
        move: inputs, parameters and outputs once each. With `meta`, counted on a copy of the task
        built on the meta device (shapes only: no device work, so the harness holds no device lock
        for it); a task whose forward needs real values there replies {"meta_failed": reason}."""
        if msg.get("meta"):
            meta = torch.device("meta")
            try:
                with meta:
                    model = init_model(self.task.Model, self.task, self.init_seed, meta)
                return _counted(model, make_inputs(self.task, msg["seed"], "default", meta))
            except Exception as e:   # the task's own code on shapes alone: anything may fail
                return {"meta_failed": f"{type(e).__name__}: {e}"}
        return _counted(self.model, self.base_inputs(msg["seed"]))

    def fingerprints(self, msg: dict) -> dict:
        base = self.base_inputs(msg["seed"])
        prints = [fingerprint(self.model(*timed_inputs(base, i))) for i in msg["iterations"]]
        return {"fingerprints": prints}


class ProgramWorker(_Worker):
    """Candidate, eager or compiled model under the timing protocol."""

    def setup(self, msg: dict) -> dict:
        super().setup(msg)
        t0 = time.monotonic()
        if msg.get("start_gate"):     # before any candidate code runs
            try:
                install_start_gate(msg["start_gate"], float(msg["start_gate_timeout_us"]))
            except (OSError, RuntimeError) as e:
                raise WorkerError(f"timing start gate unusable: {e}", "harness") from None
        probe = self._export_probe() if msg.get("share_outputs") else {}
        program = msg["program"]
        if program == "candidate":
            self.call = self._load_candidate(msg)
        else:
            model = init_model(self.task.Model, self.task, self.init_seed, self.device)
            if program == "compile":
                model = torch.compile(model, mode=None if msg.get("mode", "default") == "default" else msg["mode"])
            self.call = lambda inputs: model(*inputs)
            if program == "compile":   # compile now: the timing request is run under an exclusive device lock
                self.call(self.base_inputs(self.init_seed + 1))
                synchronize(self.device)
        return {"ok": True, "setup_seconds": time.monotonic() - t0, **probe, **getattr(self, "load_info", {})}

    def _export_probe(self) -> dict:
        """Exported before any candidate code runs: code that spoils it only loses the sharing."""
        self.exported = [torch.arange(_PROBE, dtype=torch.int32, device=self.device)]
        try:
            return {"ipc_probe": cuda_ipc.export(self.exported[0])}
        except cuda_ipc.IpcError as e:
            return {"ipc_probe_error": str(e)}

    def _load_candidate(self, msg: dict):
        from hpc import runtime

        try:   # before any candidate code runs
            monitor = OpMonitor(msg["op_monitor"], ALLOWED_OPS | frozenset(msg["policy"]["allowed_torch_ops"]))
        except (OSError, RuntimeError) as e:
            raise WorkerError(f"op monitor unusable: {e}", "harness") from None
        runtime.count_extension_calls()
        os.environ.update({str(k): str(v) for k, v in msg.get("environment", {}).items()})
        path = Path(msg["model_file"])
        sys.path.insert(0, str(path.parent))
        try:
            spec = importlib.util.spec_from_file_location("model_new", str(path))
            module = importlib.util.module_from_spec(spec)
            sys.modules["model_new"] = module
            spec.loader.exec_module(module)
            torch.manual_seed(self.init_seed)
            model = module.ModelNew(*self.task.get_init_inputs()).to(self.device).eval()
        except Exception as e:
            raise WorkerError(f"candidate failed to load: {type(e).__name__}: {e}", "load") from None
        reference = init_model(self.task.Model, self.task, self.init_seed, self.device)
        own = model.state_dict()
        matched = {k: v for k, v in reference.state_dict().items() if k in own and own[k].shape == v.shape}
        model.load_state_dict(matched, strict=False)
        self.load_info = {"weights_loaded": len(matched), "weights_total": len(reference.state_dict())}
        del reference
        guard = ForwardGuard(model, monitor, msg["policy"]["require_custom_kernel"], runtime.launch_count)
        self.checked_call = lambda inputs, trial: guard(inputs, check_inputs=True, poison=POISON[trial % len(POISON)])
        return guard

    def outputs(self, msg: dict) -> dict:
        checked = getattr(self, "checked_call", None)
        results = []
        for trial in msg["trials"]:
            inputs = make_inputs(self.task, trial["seed"], trial["distribution"], self.device)
            out = checked(inputs, trial["index"]) if checked else self.call(inputs)
            results.append(self._share(out) if msg.get("export") else _to_host(out, self.device))
        return {"outputs": results}

    def _share(self, output) -> list:
        """The outputs copied to allocations of their own and exported (kept until the next
        request); unless all are CUDA tensors the driver exports, all go to the host as usual. After a
        device-wide synchronize, as on the way to the host: work the forward left on another stream
        is finished and counted the same whichever way the outputs travel."""
        synchronize(self.device)
        outs = as_tuple(output)
        if all(isinstance(t, torch.Tensor) and t.is_cuda for t in outs):
            own = [torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for t in outs]
            try:
                shared = [cuda_ipc.export(t) for t in own]
                self.exported = own
                return shared
            except cuda_ipc.IpcError:
                pass
        return _to_host(output, self.device)

    def time(self, msg: dict) -> dict:
        base = self.base_inputs(msg["seed"])
        prints: list[torch.Tensor] = []
        times = time_calls(self.call, lambda i: timed_inputs(base, i), self.device, msg["warmup"],
                           msg["iterations"], msg["flush_bytes"],
                           after_call=lambda i, out: prints.append(fingerprint(out)))
        return {"times_ms": [t.ms for t in times], "host_ms": [t.host_ms for t in times], "fingerprints": prints,
                "timers_intact": timers_intact()}

    def prepare_calls(self, msg: dict) -> dict:
        base = self.base_inputs(msg["seed"])
        self.prepared = [timed_inputs(base, 10_000 + j) for j in range(msg["size"])]
        CacheFlusher(self.device, msg["flush_bytes"])()
        synchronize(self.device)
        return {"ok": True}

    def run_call(self, msg: dict) -> dict:
        """One prepared call, timed here as in the timed loop (index -1: nothing, for the round trip)."""
        index = int(msg["index"])
        if index < 0:
            return {"ms": 0.0}
        took, _ = time_call(self.call, self.prepared[index], self.device)
        return {"ms": took.ms}


def _counted(model: torch.nn.Module, inputs: list) -> dict:
    """FLOPs of one forward under torch's counter, and the bytes of its inputs, parameters,
    buffers and outputs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)] + list(model.parameters()) + list(
        model.buffers()) + [t for t in as_tuple(out) if isinstance(t, torch.Tensor)]
    return {"flops": float(counter.get_total_flops()),
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors))}


ROLES = {"reference": ReferenceWorker, "program": ProgramWorker}


def dispatch(worker: _Worker, msg: dict) -> dict:
    op = msg.get("op")
    handler = getattr(worker, op, None) if op in ("ready", "setup", "outputs", "kept_outputs", "compare",
                                                   "probe_ipc", "fingerprints", "cost", "time", "prepare_calls",
                                                   "run_call") else None
    if handler is None:
        raise WorkerError(f"unknown op {op!r}", "harness")
    try:
        return handler(msg)
    except (WorkerError, PolicyViolation):
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise WorkerError(f"CUDA out of memory: {str(e).splitlines()[0]}", "runtime") from None
    except MemoryError:
        raise WorkerError("out of memory (address-space limit)", "runtime") from None
    except Exception as e:
        raise WorkerError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                          "runtime") from None

"""What the harness and a sandboxed worker say to each other, as types both sides share.

Shared by the harness (hpc.sandbox.process, hpc.profile.driver) and the code inside the sandbox
(hpc.runner), which may import hpc.sandbox but is never imported by the harness. Everything a
worker sends is hostile input: it is decoded here, and whatever does not fit these types is a
malformed message, never a crash of the harness.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from types import UnionType
from typing import ClassVar, TypeVar, get_args, get_type_hints


class FailureKind(StrEnum):
    """Why a sandboxed step failed, which says whose fault it is: hpc.pipeline charges the
    candidate for every kind but TASK and HARNESS. A str, so it compares and serializes as its
    value."""

    ERROR = "error"              # the harness could not start a worker, read its reply, or run a baseline
    CRASH = "crash"              # the worker process ended (a signal, an exit, a closed pipe)
    TIMEOUT = "timeout"          # no reply or done frame before the deadline
    HARNESS = "harness"          # the worker cannot do what it was asked (the harness's or machine's fault)
    TASK = "task"                # the task's own code failed (loading it, its Model, its get_inputs)
    LOAD = "load"                # the candidate failed to load
    RUNTIME = "runtime"          # a call raised (out of memory included)
    RULES = "rules"              # the candidate broke the op, output or input rules
    OUTPUT = "output"            # the program's done frame or failure report is malformed
    CORRECTNESS = "correctness"  # an output is wrong, or could not be read


SHIFT_SPAN = 4096   # cpu: a frame's inputs lie less than this past the start of the program's slot

# The kinds a worker may report (an error reply's "kind", a failure the program writes in the
# shared header); the rest are the harness's own findings, which a worker cannot claim.
WORKER_KINDS = frozenset({FailureKind.HARNESS, FailureKind.TASK, FailureKind.LOAD, FailureKind.RUNTIME,
                          FailureKind.RULES})


# The kinds a process that runs candidate code may report: its own failures, never the task's or
# the harness's. Those are recorded as errors, not charged (no -1), and evaluated again: a
# candidate that could claim them would dodge every failing verdict. So once a candidate's code
# has run in a process (from its load request on), and in every failure written into a program's
# shared header, any other kind is a malformed report, charged to the program.
CANDIDATE_KINDS = frozenset({FailureKind.LOAD, FailureKind.RUNTIME, FailureKind.RULES})


def reported_kind(value: object, allowed: frozenset[FailureKind] = WORKER_KINDS) -> FailureKind:
    """The kind a worker reported; ValueError for anything else (a hostile or broken worker), or
    for a kind outside `allowed` (one it may not claim)."""
    if not isinstance(value, str) or value not in WORKER_KINDS:
        raise ValueError(f"unknown failure kind {str(value)[:40]!r}")
    if value not in allowed:
        raise ValueError(f"a failure of kind {value!r}, which a process that ran candidate code cannot report")
    return FailureKind(value)


# --- requests (harness -> worker) and their replies (worker -> harness) ----------------------
#
# A message is a JSON object: a request names its class's `op`; a reply is its request's `reply`
# class's fields (or {"error", "kind"}). Nested structures stay in their wire form here and are
# parsed by their own types (hpc.sandbox.exchange.InputLayout, TensorSpec, ExchangeFds;
# hpc.profile.timing.Call), which check them.


@dataclass(frozen=True)
class Reply:
    def to_message(self) -> dict:
        """The fields as they are (no copy: a reply may carry large tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Ok(Reply):
    ok: bool = True


@dataclass(frozen=True)
class Request:
    op: ClassVar[str]
    reply: ClassVar[type[Reply]] = Ok

    def to_message(self) -> dict:
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class Ready(Request):
    """Answered once the interpreter is up and, with `device`, the device initialized."""
    op: ClassVar[str] = "ready"
    device: str = ""


@dataclass(frozen=True)
class Exit(Request):
    """End the worker; it does not answer."""
    op: ClassVar[str] = "exit"


@dataclass(frozen=True)
class SetupReply(Reply):
    layout: dict            # InputLayout.to_message()
    outputs: list           # TensorSpec fields of each output
    output_bytes: int
    probe_ms: float


@dataclass(frozen=True)
class ReferenceSetup(Request):
    """Load the task and build its Model; lay out one call's inputs and outputs from a sample
    (`probe_seed`; None: init_seed + 1). `compile`: a torch.compile mode for the Model, "" none."""
    op: ClassVar[str] = "setup"
    reply: ClassVar[type[Reply]] = SetupReply
    task: str
    scale: str
    init_seed: int
    device: str
    probe_seed: int | None = None
    compile: str = ""
    graphs: bool = False    # probe the call's device time from a graph replay (frames will be replays)


@dataclass(frozen=True)
class AttachReply(Reply):
    slot_handle: str = ""   # on cuda, the exported input slot (hex); "" on cpu


@dataclass(frozen=True)
class Attach(Request):
    """Map the exchange in the reference (cpu: staging; cuda: a slot of its own)."""
    op: ClassVar[str] = "attach"
    reply: ClassVar[type[Reply]] = AttachReply
    layout: dict
    outputs: list
    spin: bool
    burst: int
    fds: dict               # ExchangeFds.to_message()
    correctness: dict       # CorrectnessConfig fields
    flush_bytes: int
    batch_bytes: int
    staging_bytes: int
    per_call: int


@dataclass(frozen=True)
class Prepare(Request):
    """Make the inputs of a batch of calls into staging (cpu)."""
    op: ClassVar[str] = "prepare"
    calls: list             # Call.to_message() each


@dataclass(frozen=True)
class CheckReply(Reply):
    failure: dict | None    # Failure fields
    checked: int
    max_abs_error: float
    max_rel_error: float


@dataclass(frozen=True)
class Check(Request):
    """Compare the outputs captured into staging with the Model's (cpu)."""
    op: ClassVar[str] = "check"
    reply: ClassVar[type[Reply]] = CheckReply
    calls: list


@dataclass(frozen=True)
class RunReply(Reply):
    times_ns: list
    failure: dict | None
    checked: int
    max_abs_error: float
    max_rel_error: float


@dataclass(frozen=True)
class Run(Request):
    """Drive the program through `calls` and end its serve loop (cuda)."""
    op: ClassVar[str] = "run"
    reply: ClassVar[type[Reply]] = RunReply
    calls: list
    timeout_s: float
    batch_limit: int = 0


@dataclass(frozen=True)
class CostReply(Reply):
    flops: float | None = None
    bytes: float | None = None
    meta_failed: str | None = None   # why it could not be counted on the meta device


@dataclass(frozen=True)
class Cost(Request):
    op: ClassVar[str] = "cost"
    reply: ClassVar[type[Reply]] = CostReply
    seed: int
    meta: bool = False


@dataclass(frozen=True)
class OutputsReply(Reply):
    outputs: list           # per trial, the Model's output tensors
    peak_bytes: int         # the eager run's peak memory since the setup (hpc.runner.worker.PeakMemory)

    def __post_init__(self):
        if self.peak_bytes < 0:
            raise ValueError(f"OutputsReply.peak_bytes: must be >= 0, got {self.peak_bytes}")


@dataclass(frozen=True)
class Outputs(Request):
    op: ClassVar[str] = "outputs"
    reply: ClassVar[type[Reply]] = OutputsReply
    trials: list            # {"seed", "distribution"} each


@dataclass(frozen=True)
class RepeatableReply(Reply):
    same: bool
    reason: str


@dataclass(frozen=True)
class Repeatable(Request):
    op: ClassVar[str] = "repeatable"
    reply: ClassVar[type[Reply]] = RepeatableReply
    seed: int
    correctness: dict | None = None   # None: the default CorrectnessConfig


@dataclass(frozen=True)
class ProgramSetupReply(Reply):
    slot_address: int = 0   # on cpu, where the program's input slot (hpc.sandbox.exchange.HostSlot) lies; 0 on cuda


@dataclass(frozen=True)
class ProgramSetup(Request):
    """Make (cpu) or map (cuda) the slot's positions and prepare the empty program; no candidate
    code runs."""
    op: ClassVar[str] = "setup"
    reply: ClassVar[type[Reply]] = ProgramSetupReply
    task: str
    scale: str
    init_seed: int
    device: str
    layout: dict
    outputs: list
    spin: bool
    burst: int
    fds: dict
    slot_handle: str = ""
    shifts: list = field(default_factory=lambda: [0])   # how far past the slot's start a frame's inputs may lie

    def __post_init__(self):
        if not self.shifts or not all(type(x) is int and 0 <= x < SHIFT_SPAN and x % 64 == 0 for x in self.shifts):
            raise ValueError(f"ProgramSetup.shifts: expected multiples of 64 in [0, {SHIFT_SPAN})")


@dataclass(frozen=True)
class LoadReply(Reply):
    ok: bool
    setup_seconds: float
    weights_loaded: int = 0   # the candidate's: parameters copied from the Model, of weights_total
    weights_total: int = 0


@dataclass(frozen=True)
class Load(Request):
    """Add a program to time: "candidate" (`model_file` under the op monitor and `rules`),
    "eager", or "compile" (`mode`)."""
    op: ClassVar[str] = "load"
    reply: ClassVar[type[Reply]] = LoadReply
    program: str
    mode: str = "default"
    model_file: str = ""
    environment: dict = field(default_factory=dict)
    op_monitor: str = ""
    rules: dict | None = None    # {"allowed_torch_ops", "require_custom_kernel"}


@dataclass(frozen=True)
class ServeReply(Reply):
    calls: int


@dataclass(frozen=True)
class Serve(Request):
    """Run `program`'s calls as go frames ask, until the stop frame ("": the candidate, or the
    empty program before one is loaded); with `graph`, each timed frame replays the program's
    captured graph (Capture) instead of calling it."""
    op: ClassVar[str] = "serve"
    reply: ClassVar[type[Reply]] = ServeReply
    program: str = ""
    graph: bool = False


@dataclass(frozen=True)
class CaptureReply(Reply):
    captured: bool
    reason: str             # why not, when not


@dataclass(frozen=True)
class Capture(Request):
    """Record a frame of `calls` calls of `program` as one CUDA graph (cuda)."""
    op: ClassVar[str] = "capture"
    reply: ClassVar[type[Reply]] = CaptureReply
    program: str
    calls: int


# What each role answers: any other op is refused.
REQUESTS: dict[str, dict[str, type[Request]]] = {
    "reference": {r.op: r for r in (Ready, Exit, ReferenceSetup, Attach, Prepare, Check, Run, Cost, Outputs,
                                     Repeatable)},
    "program": {r.op: r for r in (Ready, Exit, ProgramSetup, Load, Serve, Capture)},
}


def decode_request(message: object, role: str) -> Request:
    """The request `message` holds for a worker of `role`; ValueError when it is malformed."""
    if not isinstance(message, dict):
        raise ValueError("a request is not an object")
    cls = REQUESTS[role].get(message.get("op"))   # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown op {str(message.get('op'))[:40]!r}")
    return decode(cls, {k: v for k, v in message.items() if k != "op"})


T = TypeVar("T")


def decode(cls: type[T], data: object) -> T:
    """`data` (decoded JSON) as a `cls`: every required field present, no other, each of its
    declared type (an int where a float is declared is taken as that float); ValueError otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: not an object")
    declared = {f.name: f for f in fields(cls)}   # type: ignore[arg-type]
    unknown = sorted(str(k)[:40] for k in data if k not in declared)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {', '.join(unknown[:5])}")
    hints = get_type_hints(cls)
    values = {}
    for name, f in declared.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{cls.__name__}: no {name}")
            continue
        values[name] = _typed(data[name], hints[name], f"{cls.__name__}.{name}")
    return cls(**values)


def _typed(value: object, tp: object, where: str) -> object:
    """`value` if it is of type `tp` (bool, int, float, str, a StrEnum, dict, list, or a union of
    them with None); ValueError otherwise."""
    options = get_args(tp) if isinstance(tp, UnionType) else (tp,)
    for option in options:
        if option is type(None) and value is None:
            return value
        if option is bool and type(value) is bool:
            return value
        if option is int and type(value) is int:
            return value
        if option is float and type(value) in (int, float):
            return float(value)
        if option in (str, dict, list) and type(value) is option:
            return value
        if isinstance(option, type) and issubclass(option, StrEnum) and type(value) is str:
            return option(value)   # ValueError for a value it does not define
    raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")

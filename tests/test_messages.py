"""The harness's and the workers' shared vocabulary (hpc.sandbox.messages): a failure kind is one
of those defined, and whatever a worker reports is checked where it arrives."""

from __future__ import annotations

import json
import mmap
import re

import pytest

from hpc.profile.timing import Failure
from hpc.sandbox.exchange import HEADER_BYTES, read_failure, write_failure
from hpc.sandbox.messages import (CANDIDATE_KINDS, WORKER_KINDS, Attach, Check, Cost, Exit, FailureKind, Load,
                                  LoadReply, Ok, Outputs, OutputsReply, Prepare, ProgramSetup, Ready, ReferenceSetup, Repeatable, Run, Serve, ServeReply,
                                  decode, decode_request)
from hpc.sandbox.process import SandboxError, checked_reply


def test_an_unknown_kind_is_refused_where_a_failure_is_made():
    with pytest.raises(ValueError):
        SandboxError("boom", "bogus")
    with pytest.raises(ValueError):
        Failure("bogus", "boom")
    assert SandboxError("boom", "crash").kind is FailureKind.CRASH
    assert Failure("rules", "boom").kind is FailureKind.RULES


def test_a_worker_error_carries_only_a_kind_a_worker_may_report():
    from hpc.runner.worker import WorkerError

    assert WorkerError("x", FailureKind.TASK).kind is FailureKind.TASK
    for kind in set(FailureKind) - WORKER_KINDS:
        with pytest.raises(ValueError):
            WorkerError("x", kind)


@pytest.mark.parametrize("kind", sorted(WORKER_KINDS))
def test_a_reported_error_keeps_its_kind(kind):
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "it failed", "kind": str(kind)}, LoadReply, "program")
    assert err.value.kind == kind and err.value.reason == "it failed"


@pytest.mark.parametrize("kind", ["crash", "timeout", "correctness", "bogus", None, 3, ["task"]])
def test_a_reply_claiming_a_kind_no_worker_may_report_is_malformed(kind):
    """Never a crash of the harness, and never the kind claimed: a malformed reply (ERROR)."""
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "it was not me", "kind": kind}, LoadReply, "program")
    assert err.value.kind == FailureKind.ERROR and "malformed reply from the program process" in err.value.reason


def test_a_reply_that_is_not_an_object_is_malformed():
    with pytest.raises(SandboxError, match="malformed reply"):
        checked_reply(["ok"], Ok, "reference")
    assert checked_reply({"ok": True}, Ok, "reference") == Ok()


EVERY_REQUEST = {
    "reference": [Ready(), Ready("cpu"), Exit(),
                  ReferenceSetup("t.py", "cpu", 1, "cpu", probe_seed=2, compile="default"),
                  Attach({"entries": []}, [], True, 4, {"header": 3}, {"trials": 5}, 0, 1 << 20, 0, 64),
                  Prepare([{"seed": 1}]), Check([]), Run([], 30.0, 1), Cost(7, meta=True), Outputs([]),
                  Repeatable(3, None)],
    "program": [Ready(), Exit(), ProgramSetup("t.py", "cpu", 1, "cpu", {}, [], False, 1, {}, "ab", [0, 2048, 1024, 3072]),
                Load("candidate", model_file="m.py", environment={"A": "1"}, op_monitor="m.so",
                     rules={"allowed_torch_ops": []}), Load("compile", mode="max-autotune"), Serve(), Serve("eager")],
}


@pytest.mark.parametrize("role", sorted(EVERY_REQUEST))
def test_every_request_reads_back_as_sent_by_the_role_that_takes_it(role):
    for request in EVERY_REQUEST[role]:
        assert decode_request(json.loads(json.dumps(request.to_message())), role) == request


@pytest.mark.parametrize("message, words", [
    ({"op": "load", "program": "candidate"}, "unknown op 'load'"),          # a program's op, sent to a reference
    ({"op": "shutdown"}, "unknown op 'shutdown'"),
    ({"task": "t.py"}, "unknown op 'None'"),
    ({"op": "setup", "task": "t.py", "scale": "cpu", "device": "cpu"}, "ReferenceSetup: no init_seed"),
    ({"op": "setup", "task": "t.py", "scale": "cpu", "init_seed": "1", "device": "cpu"},
     "ReferenceSetup.init_seed: expected int, got str"),
    ({"op": "cost", "seed": True}, "Cost.seed: expected int, got bool"),
    ({"op": "ready", "device": "cpu", "then": "rm -rf"}, "Ready: unknown fields then"),
    (["ready"], "not an object"),
])
def test_a_malformed_request_is_refused_with_a_reason(message, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        decode_request(message, "reference")


@pytest.mark.parametrize("shifts", [[], [100], [4096], [-64], [0, 64.0]])
def test_a_program_setup_takes_only_shifts_of_64_bytes_within_4_kib(shifts):
    message = {**ProgramSetup("t.py", "cpu", 1, "cpu", {}, [], False, 1, {}).to_message(), "shifts": shifts}
    with pytest.raises(ValueError, match="shifts"):
        decode_request(message, "program")


@pytest.mark.parametrize("reply, words", [
    ({"ok": True, "setup_seconds": 0.1, "weights_loaded": 1, "weights_total": 1, "reward": 9.0},
     "unknown fields reward"),
    ({"ok": True}, "LoadReply: no setup_seconds"),
    ({"ok": True, "setup_seconds": "fast"}, "LoadReply.setup_seconds: expected float, got str"),
    ({"error": "x", "kind": "load", "more": 1}, "an error reply holds a message and a kind"),
    ({"error": 3, "kind": "load"}, "an error reply holds a message and a kind"),
])
def test_a_reply_that_does_not_fit_its_type_is_malformed(reply, words):
    """The candidate's process answers `load` and `serve`: whatever it sends is checked against the
    reply's type, and anything else is a malformed reply (ERROR), never a KeyError in the harness."""
    with pytest.raises(SandboxError) as err:
        checked_reply(reply, LoadReply, "program")
    assert err.value.kind == FailureKind.ERROR and words in err.value.reason


def test_a_reply_keeps_its_values_and_a_float_may_arrive_as_an_int():
    assert checked_reply({"ok": True, "setup_seconds": 2}, LoadReply, "program") == LoadReply(True, 2.0)
    assert checked_reply({"calls": 12}, ServeReply, "program") == ServeReply(12)
    failure = decode(Failure, {"kind": "correctness", "reason": "outside atol", "call": 3})
    assert failure == Failure(FailureKind.CORRECTNESS, "outside atol", 3)
    with pytest.raises(ValueError):
        decode(Failure, {"kind": "bogus", "reason": "x"})


@pytest.mark.parametrize("reply, words", [
    ({"outputs": []}, "OutputsReply: no peak_bytes"),
    ({"outputs": [], "peak_bytes": 1.5}, "OutputsReply.peak_bytes: expected int, got float"),
    ({"outputs": [], "peak_bytes": True}, "OutputsReply.peak_bytes: expected int, got bool"),
    ({"outputs": [], "peak_bytes": -1}, "OutputsReply.peak_bytes: must be >= 0, got -1"),
])
def test_a_reference_reports_its_peak_memory_as_bytes(reply, words):
    """The synthesis memory filter bounds what the reference reports: a count of bytes, never
    missing, fractional or negative."""
    with pytest.raises(SandboxError) as err:
        checked_reply(reply, OutputsReply, "reference")
    assert err.value.kind == FailureKind.ERROR and words in err.value.reason
    assert checked_reply({"outputs": [], "peak_bytes": 0}, OutputsReply, "reference") == OutputsReply([], 0)


@pytest.mark.parametrize("kind", [FailureKind.HARNESS, FailureKind.TASK])
def test_a_process_that_ran_candidate_code_cannot_claim_a_fault_not_its_own(kind):
    """The task's and the harness's failures are errors, neither charged nor kept: a candidate
    that could claim one would dodge its -1. Its claim is a malformed reply, charged to it."""
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "not me", "kind": str(kind)}, LoadReply, "program", CANDIDATE_KINDS)
    assert err.value.kind == FailureKind.ERROR and "cannot report" in err.value.reason
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "it failed", "kind": "runtime"}, LoadReply, "program", CANDIDATE_KINDS)
    assert err.value.kind == FailureKind.RUNTIME


@pytest.mark.parametrize("kind, read", [(FailureKind.RUNTIME, FailureKind.RUNTIME),
                                        (FailureKind.RULES, FailureKind.RULES),
                                        (FailureKind.HARNESS, FailureKind.OUTPUT),
                                        (FailureKind.TASK, FailureKind.OUTPUT)])
def test_a_failure_in_a_programs_header_is_the_programs_own(kind, read):
    header = mmap.mmap(-1, HEADER_BYTES)
    write_failure(header, kind, "why")
    got, message = read_failure(header)
    assert got == read and "why" in message

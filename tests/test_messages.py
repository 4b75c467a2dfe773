"""The harness's and the workers' shared vocabulary (hpc.sandbox.messages): a failure kind is one
of those defined, and whatever a worker reports is checked where it arrives."""

from __future__ import annotations

import pytest

from hpc.profile.timing import Failure
from hpc.sandbox.messages import WORKER_KINDS, FailureKind
from hpc.sandbox.process import SandboxError, checked_reply


def test_an_unknown_kind_is_refused_where_a_failure_is_made():
    with pytest.raises(ValueError):
        SandboxError("boom", "bogus")
    with pytest.raises(ValueError):
        Failure("bogus", "boom")
    assert SandboxError("boom", "crash").kind is FailureKind.CRASH
    assert Failure("policy", "boom").kind is FailureKind.POLICY


def test_a_worker_error_carries_only_a_kind_a_worker_may_report():
    from hpc.runner.worker import WorkerError

    assert WorkerError("x", FailureKind.TASK).kind is FailureKind.TASK
    for kind in set(FailureKind) - WORKER_KINDS:
        with pytest.raises(ValueError):
            WorkerError("x", kind)


@pytest.mark.parametrize("kind", sorted(WORKER_KINDS))
def test_a_reported_error_keeps_its_kind(kind):
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "it failed", "kind": str(kind)}, "program")
    assert err.value.kind == kind and err.value.reason == "it failed"


@pytest.mark.parametrize("kind", ["crash", "timeout", "correctness", "bogus", None, 3, ["task"]])
def test_a_reply_claiming_a_kind_no_worker_may_report_is_malformed(kind):
    """Never a crash of the harness, and never the kind claimed: a malformed reply (ERROR)."""
    with pytest.raises(SandboxError) as err:
        checked_reply({"error": "it was not me", "kind": kind}, "program")
    assert err.value.kind == FailureKind.ERROR and "malformed reply from the program process" in err.value.reason


def test_a_reply_that_is_not_an_object_is_malformed():
    with pytest.raises(SandboxError, match="malformed reply"):
        checked_reply(["ok"], "reference")
    assert checked_reply({"ok": True}, "reference") == {"ok": True}

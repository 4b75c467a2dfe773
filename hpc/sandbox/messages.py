"""What the harness and a sandboxed worker say to each other, as types both sides share.

Shared by the harness (hpc.sandbox.process, hpc.profile.driver) and the code inside the sandbox
(hpc.runner), which may import hpc.sandbox but is never imported by the harness. Everything a
worker sends is hostile input: it is decoded here, and whatever does not fit these types is a
malformed message, never a crash of the harness.
"""

from __future__ import annotations

from enum import StrEnum


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
    POLICY = "policy"            # the candidate broke the op, output or input policy
    OUTPUT = "output"            # the program's done frame or failure report is malformed
    CORRECTNESS = "correctness"  # an output is wrong, or could not be read


# The kinds a worker may report (an error reply's "kind", a failure the program writes in the
# shared header); the rest are the harness's own findings, which a worker cannot claim.
WORKER_KINDS = frozenset({FailureKind.HARNESS, FailureKind.TASK, FailureKind.LOAD, FailureKind.RUNTIME,
                          FailureKind.POLICY})


def reported_kind(value: object) -> FailureKind:
    """The kind a worker reported; ValueError for anything else (a hostile or broken worker)."""
    if not isinstance(value, str) or value not in WORKER_KINDS:
        raise ValueError(f"unknown failure kind {str(value)[:40]!r}")
    return FailureKind(value)

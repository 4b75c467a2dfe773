"""The op monitor (hpc/runner/op_monitor.py): the C++ callback that enforces the op rules on every
forward call. Built with the real compiler against the installed torch (hpc/compile/op_monitor.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from hpc.compile.op_monitor import op_monitor_library
from hpc.runner.guard import ALLOWED_OPS
from hpc.runner.op_monitor import DISABLED, OpMonitor, decomposing_overloads


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return op_monitor_library(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def monitor(library):
    """The process's one monitor, with the default allowlist (a test may have replaced it)."""
    return OpMonitor(library, ALLOWED_OPS)


def _first_violation(monitor: OpMonitor, fn) -> str:
    monitor.arm()
    try:
        fn()
    finally:
        verdict = monitor.disarm()
    assert verdict != DISABLED
    return monitor.first() if verdict else ""


X = torch.randn(8, 8)


@pytest.mark.parametrize("fn", [
    lambda: torch.empty_like(X),
    lambda: X.reshape(64).view(8, 8).t().contiguous(),
    lambda: X.to(torch.float64),                   # aten::to decomposes into the allowed _to_copy
    lambda: X.split(2),
    lambda: torch.zeros(3).copy_(torch.ones(3)),
])
def test_allowed_and_decomposing_ops_pass(monitor, fn):
    assert _first_violation(monitor, fn) == ""
    assert monitor.seen() > 0


@pytest.mark.parametrize("fn, op", [
    (lambda: X + 1, "aten::add"),
    (lambda: torch.relu(X), "aten::relu"),
    (lambda: torch.nn.functional.linear(X, X), "aten::mm"),   # linear decomposes; its matmul is seen
    (lambda: X @ X, "aten::mm"),
])
def test_compute_ops_are_named(monitor, fn, op):
    assert _first_violation(monitor, fn) == op


def test_ops_on_another_thread_are_seen(monitor):
    def forward():
        worker = threading.Thread(target=lambda: X.sum())
        worker.start()
        worker.join()

    assert _first_violation(monitor, forward) == "aten::sum"


def test_nothing_is_recorded_while_disarmed(monitor):
    assert _first_violation(monitor, lambda: X.sum()) == "aten::sum"
    seen = monitor.seen()
    X.sum()
    assert monitor.seen() == seen and monitor.disarm() > 0 and monitor.first() == "aten::sum"   # the last armed call's


def test_extra_allowed_ops_extend_the_allowlist(library):
    monitor = OpMonitor(library, ALLOWED_OPS | {"relu"})
    assert _first_violation(monitor, lambda: torch.relu(X)) == ""
    assert _first_violation(monitor, lambda: X + 1) == "aten::add"


def test_the_allowlist_cannot_change_while_armed(library, monitor):
    monitor.arm()
    try:
        with pytest.raises(RuntimeError, match="while it is armed"):
            OpMonitor(library, ALLOWED_OPS | {"add"})
    finally:
        monitor.disarm()


def test_decomposing_overloads_exclude_ops_with_kernels():
    overloads = decomposing_overloads()
    assert {"aten::linear", "aten::reshape", "aten::to.dtype"} <= overloads
    assert not {"aten::mm", "aten::add.Tensor", "aten::relu", "aten::where.self"} & overloads


@pytest.fixture
def record_function_off():
    """RecordFunction switched off on this thread, as a forward could leave it: torch's own switch."""
    switch = torch._C._autograd._enable_record_function
    yield lambda: switch(False)
    switch(True)


def test_a_forward_that_switches_record_function_off_is_disabled(monitor, record_function_off):
    monitor.arm()
    record_function_off()
    torch.relu(X)                                  # unseen: no callback runs
    assert monitor.disarm() == DISABLED


def test_switching_off_another_thread_leaves_the_calling_thread_seen(monitor, record_function_off):
    def forward():
        worker = threading.Thread(target=record_function_off)
        worker.start()
        worker.join()

    assert _first_violation(monitor, forward) == ""


def test_the_canary_is_not_counted_as_an_operator(monitor):
    assert _first_violation(monitor, lambda: None) == "" and monitor.seen() == 0

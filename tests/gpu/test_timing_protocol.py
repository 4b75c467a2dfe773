"""The CUDA timing protocol against work of known device duration (torch.cuda._sleep spins).

In-process, on purpose: these check the clock itself, not the sandbox around it.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from hpc.profile import timing
from hpc.profile.start_gate import start_gate_library

pytestmark = pytest.mark.gpu
GATE_TIMEOUT_US = 500.0


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    timing.install_start_gate(start_gate_library(tmp_path_factory.mktemp("cache"), "sm_90"), GATE_TIMEOUT_US)
    return torch.device("cuda", torch.cuda.current_device())


def _busy_host(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _device_ms(cycles: int) -> float:
    return timing.device_only_ms(lambda: torch.cuda._sleep(cycles))


def _measure(call, device, n: int = 30) -> float:
    return statistics.median(timing.time_call(call, [], device)[0].ms for _ in range(n))


def test_host_launch_path_is_outside_the_interval(device):
    cycles = 400_000                                  # ~0.2 ms at H200 clocks
    truth = _device_ms(cycles)
    measured = _measure(lambda _: (_busy_host(80), torch.cuda._sleep(cycles)), device)
    assert truth * 0.97 - 0.003 <= measured <= truth * 1.03 + 0.003, (measured, truth)


def test_work_on_a_side_stream_is_inside_the_interval(device):
    cycles = 400_000
    truth = _device_ms(cycles)
    side = torch.cuda.Stream()

    def hidden(_):
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)

    assert _measure(hidden, device) >= truth * 0.97


def test_host_side_compute_is_paid(device):
    """Nothing on the device but a millisecond of host work: the call costs a millisecond."""
    assert _measure(lambda _: _busy_host(1000), device, n=10) >= 1.0


def test_a_call_that_synchronizes_pays_the_gate_timeout_and_no_more(device):
    cycles = 200_000
    truth = _device_ms(cycles)

    def syncing(_):
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    measured = _measure(syncing, device, n=10)
    assert truth < measured < truth + GATE_TIMEOUT_US / 1e3 + 0.3, (measured, truth)


def test_repeated_measurements_of_one_kernel_agree(device):
    """Spread of the median over 10 repeats of 50 calls: the evaluator's CV goal is 1%."""
    call = lambda _: torch.cuda._sleep(300_000)  # noqa: E731
    medians = [_measure(call, device, n=50) for _ in range(10)]
    cv = statistics.stdev(medians) / statistics.mean(medians)
    assert cv < 0.01, (cv, medians)

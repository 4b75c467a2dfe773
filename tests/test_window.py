"""hpc.profile.window: every program of an evaluation timed in rounds of one window, in orders drawn
per round; a failure names its entrant and its call. (The drivers here are scripted: the window's
scheduling is what is under test; real drivers run it in every evaluation test.)"""

from __future__ import annotations

import random
import statistics
import pytest

from hpc.profile.timing import Call, Failure, LoopResult, timing_calls
from hpc.profile.window import (Entrant, EntrantError, Window, chunks, fastest_process, flush_rate, handshake_ns,
                               paired_ratio, process_name, program_of, record_graphs, round_spans, run_window, timed_by)
from hpc.sandbox import launch
from hpc.sandbox.cgroup import Cgroup
from hpc.sandbox.messages import CaptureReply
from hpc.sandbox.process import SandboxError


class Scripted:
    """Answers each call with its seed as its time; fails at seed `fail_at` (or raises there).
    Recording: `refuses` the programs it cannot record, and each graph replay's check fails with
    `replay_fails` (a failure kind; "" passes)."""

    def __init__(self, log: list, fail_at: int | None = None, raises: bool = False, refuses: tuple = (),
                 replay_fails: str = ""):
        self.log, self.fail_at, self.raises = log, fail_at, raises
        self.refuses, self.replay_fails = refuses, replay_fails
        self.graph_runs: list = []

    def capture(self, program: str, calls: int) -> CaptureReply:
        self.log.append((program, f"capture {calls}"))
        if program in self.refuses:
            return CaptureReply(False, "StreamCaptureUnjoined")
        return CaptureReply(True, "")

    def run(self, calls: list[Call], batch_limit: int = 0, program: str = "", graph: bool = False) -> LoopResult:
        if graph:
            self.graph_runs.append((program, len(calls), all(c.checked for c in calls)))
        if graph and self.replay_fails and all(c.checked for c in calls) and not any(c.seed < 0 for c in calls):
            return LoopResult([], Failure(self.replay_fails, "outside atol", 0), {"checked": 1})
        times = []
        for k, call in enumerate(calls):
            if call.seed == self.fail_at:
                if self.raises:
                    raise SandboxError("the program process ended", "crash")
                return LoopResult(times, Failure("correctness", "wrong", k), {"checked": 1})
            self.log.append((program, call.seed))
            if call.timed:
                times.append(call.seed)
        return LoopResult(times, None, {"checked": sum(c.checked for c in calls), "max_abs_error": 0.5},
                          [2000 + call.seed for call in calls])   # a frame of one call: its flush


def entrant(name: str, driver, warmup: int, timed: int, base: int) -> Entrant:
    return Entrant(name, driver, name, [Call(base + k) for k in range(warmup)],
                   [Call(base + warmup + k, timed=True, checked=k % 4 == 0) for k in range(timed)])


def test_chunks_cut_calls_in_order_into_rounds_differing_by_at_most_one():
    calls = [Call(k) for k in range(23)]
    parts = chunks(calls, 5)
    assert [len(p) for p in parts] == [5, 5, 5, 4, 4]
    assert [c for p in parts for c in p] == calls


def test_chunks_never_split_a_frame():
    calls = timing_calls(list(range(7)), 0, set(), burst=3)    # 7 frames of 3 calls
    parts = chunks(calls, 3)
    assert [len(p) for p in parts] == [9, 6, 6]
    assert all(not p[0].follows for p in parts)
    assert [c for p in parts for c in p] == calls


def test_round_spans_are_the_frames_chunks_gives_each_round():
    calls = timing_calls(list(range(23)), 0, set(), burst=2)
    spans = round_spans(23, 5)
    assert spans == [(0, 5), (5, 10), (10, 15), (15, 19), (19, 23)]
    assert [len(p) // 2 for p in chunks(calls, 5)] == [b - a for a, b in spans]


def test_a_speedup_is_read_round_by_round_so_a_state_that_changes_between_programs_divides_out():
    """The device runs fast or 1.25x slow for a few rounds at a time; in round 5 it turns fast after
    the candidate's frames and before the baseline's. The candidate then has 60 slow frames of 100,
    the baseline 50: their whole-window medians fall in different states, and their ratio reads
    1.08 where the baseline is 1.2x the candidate's time in every state. Round by round it is 1.2."""
    state = [1.25] * 5 + [None] + [1.0] * 4
    candidate = [(1.25 if s is None else s) * 1.0 for s in state for _ in range(10)]
    baseline = [(1.0 if s is None else s) * 1.2 for s in state for _ in range(10)]
    assert statistics.median(baseline) / statistics.median(candidate) == pytest.approx(1.08)
    assert paired_ratio(baseline, candidate, 10) == pytest.approx(1.2)
    assert paired_ratio(candidate, baseline, 10) == pytest.approx(1 / 1.2)


def test_a_candidate_fast_in_most_rounds_but_not_in_most_frames_does_not_read_fast():
    """Fast (0.1) in 6 frames of each of 6 rounds: every one of those rounds' medians is fast, but
    64 of its 100 frames are slow. Its speedup is read over its frames, as a whole-window median's
    would be, so it is 1.0: a candidate must be fast in most of its frames, and of those the
    checked ones are drawn in secret."""
    candidate = [0.1 if r < 6 and k < 6 else 1.0 for r in range(10) for k in range(10)]
    baseline = [1.0] * 100
    assert paired_ratio(baseline, candidate, 10) == pytest.approx(1.0)
    assert statistics.median(statistics.median(candidate[10 * r:10 * r + 10]) for r in range(10)) == pytest.approx(0.1)


def test_a_speedup_takes_uneven_rounds_and_skips_rounds_one_program_lacks():
    assert paired_ratio([2.0] * 23, [1.0] * 23, 5) == pytest.approx(2.0)
    assert paired_ratio([3.0] * 3, [1.0] * 7, 5) == pytest.approx(3.0)   # rounds 3, 4: no numerator figure
    assert paired_ratio([], [1.0], 10) != paired_ratio([], [1.0], 10)    # NaN


def test_every_round_runs_a_share_of_every_entrant_in_an_order_drawn_for_it():
    log: list = []
    driver = Scripted(log)
    entrants = [entrant("candidate", driver, 2, 20, 0), entrant("eager", driver, 2, 20, 100),
                entrant("empty", driver, 3, 30, 200)]
    window = run_window(entrants, 10, random.Random(7))
    assert [p for p, _ in log[:7]] == ["candidate"] * 2 + ["eager"] * 2 + ["empty"] * 3   # warm-ups first
    assert window.times_ns["candidate"] == list(range(2, 22)) and window.times_ns["empty"] == list(range(203, 233))
    assert len(window.orders) == 10 and all(sorted(o) == ["candidate", "eager", "empty"] for o in window.orders)
    assert len({tuple(o) for o in window.orders}) > 1          # the order is drawn per round
    rounds = [log[7:][k:k + 7] for k in range(0, 70, 7)]           # 2 + 2 + 3 timed calls a round
    for order, calls in zip(window.orders, rounds):
        assert [p for p, _ in calls] == sorted((p for p, _ in calls), key=order.index)
    assert window.checks["candidate"]["checked"] == 5 and window.checks["eager"]["max_abs_error"] == 0.5
    assert window.failure is None


def test_every_frames_cache_flush_in_the_window_is_its_memory_rate():
    """Every entrant's flushes pooled: a read of so many bytes in so many ns is so many GB/s."""
    window = run_window([entrant("candidate", Scripted([]), 1, 10, 0), entrant("eager", Scripted([]), 1, 10, 100)],
                        5, random.Random(1))
    assert sorted(window.flush_ns) == [2000 + s for s in range(11)] + [2100 + s for s in range(11)]
    assert flush_rate(window, 4_000_000) == {"flush_gb_s": round(4e6 / statistics.median(window.flush_ns), 2)}
    assert flush_rate(window, 0) == {} and flush_rate(Window(), 4_000_000) == {}   # the flush off; cuda


def test_a_failure_names_its_entrant_and_its_call_among_its_own_and_ends_the_window():
    log: list = []
    entrants = [entrant("candidate", Scripted(log, fail_at=2 + 7), 2, 20, 0), entrant("eager", Scripted(log), 2, 20, 100)]
    window = run_window(entrants, 10, random.Random(1))
    assert window.failed == "candidate" and window.failure.call == 9          # warm-up 2 + timed call 7
    ran = len(log)
    assert ran < 2 + 2 + 40 and sum(1 for p, _ in log if p == "candidate") == 9


def test_a_driver_that_raises_is_named():
    entrants = [entrant("eager", Scripted([]), 1, 4, 0), entrant("compile:default", Scripted([], 3, True), 1, 4, 0)]
    with pytest.raises(EntrantError) as e:
        run_window(entrants, 2, random.Random(0))
    assert e.value.name == "compile:default" and e.value.error.kind == "crash"


def _graph_entrants(driver) -> list[Entrant]:
    out = [entrant("candidate", driver, 2, 8, 0), entrant("eager", driver, 2, 8, 100)]
    empty = Entrant("empty", driver, "empty", [Call(-1)], [Call(-1, timed=True) for _ in range(8)], checkable=False)
    return out + [empty]


def test_frames_are_graph_replays_only_when_every_entrant_is_recorded_and_its_replay_checks_out():
    """All recorded and each replay of the task's programs checked on a frame of fresh inputs:
    every entrant's frames are replays, in the window too. The empty program's outputs are not the
    task's: it is recorded, never checked."""
    log: list = []
    driver = Scripted(log)
    entrants = _graph_entrants(driver)
    recording = record_graphs(entrants, 4)
    assert recording.graphs and recording.failure is None and all(e.graph for e in entrants)
    assert [entry for entry in log if "capture" in str(entry[1])] == [("candidate", "capture 4"), ("eager", "capture 4"),
                                                                    ("empty", "capture 4")]
    assert driver.graph_runs == [("candidate", 4, True), ("eager", 4, True)]   # one frame of 4 calls, all checked
    driver.graph_runs.clear()
    run_window(entrants, 2, random.Random(0))
    assert {name for name, _, _ in driver.graph_runs} == {"candidate", "eager", "empty"}
    assert timed_by(recording) == {"timed_by": "graph replays"}


@pytest.mark.parametrize("refuses, replay_fails, why", [
    (("eager",), "", "eager could not be recorded as a graph: StreamCaptureUnjoined"),
    ((), "correctness", "candidate's graph replay: outside atol"),
])
def test_one_entrant_not_recordable_or_replaying_wrong_times_every_entrant_by_calls(refuses, replay_fails, why):
    """A program whose capture fails, or whose replay gives other outputs than its calls (work the
    capture missed), is no one's failure: nobody's frames are replays, so the programs compared
    are still timed alike, and the record says why."""
    driver = Scripted([], refuses=refuses, replay_fails=replay_fails)
    entrants = _graph_entrants(driver)
    recording = record_graphs(entrants, 4)
    assert not recording.graphs and recording.failure is None and recording.reason == why
    assert not any(e.graph for e in entrants)
    driver.graph_runs.clear()
    window = run_window(entrants, 2, random.Random(0))
    assert window.failure is None and driver.graph_runs == []
    assert timed_by(recording) == {"timed_by": "calls", "graphs_refused": why}


def test_a_program_that_dies_while_its_replay_is_checked_fails_as_in_the_window():
    recording = record_graphs(_graph_entrants(Scripted([], replay_fails="crash")), 4)
    assert not recording.graphs and recording.failed == "candidate" and recording.failure.kind == "crash"


def test_the_handshake_is_the_empty_programs_median_and_a_figure_must_stand_out_of_its_spread():
    assert handshake_ns([100, 100, 100, 100, 100]) == (100, 10)           # at least a tenth of the cost
    median, least = handshake_ns([80, 90, 100, 110, 300])
    assert median == 100 and least > 10                                 # the spread, when larger


class Observing:
    """Notes whether the candidate's group (or `watched`) is frozen each time its entrant runs."""

    def __init__(self, group: Cgroup, seen: list, watched: Cgroup | None = None):
        self.group, self.seen = watched or group, seen

    def run(self, calls: list[Call], batch_limit: int = 0, program: str = "", graph: bool = False) -> LoopResult:
        self.seen.append((program, self.group.frozen()))
        return LoopResult([c.seed for c in calls if c.timed], None, {})


def sleeper(tmp_path) -> launch.Confined:
    return launch.spawn(["sleep", "60"], launch.Policy(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})


def test_the_candidates_processes_are_frozen_while_every_other_entrant_runs(tmp_path):
    """A thread or child the candidate left running would slow the baselines beside it: its whole
    group is frozen while they run, and thawed when its own turn comes and after the window."""
    program = sleeper(tmp_path)
    try:
        seen: list = []
        driver = Observing(program.cgroup, seen)
        entrants = [Entrant("candidate", driver, "candidate", [Call(0)], [Call(k, timed=True) for k in range(1, 9)],
                            hold=program.cgroup),
                    entrant("eager", driver, 1, 8, 100), entrant("empty", driver, 1, 8, 200)]
        run_window(entrants, 4, random.Random(3))
        assert {frozen for name, frozen in seen if name == "candidate"} == {False}
        assert {frozen for name, frozen in seen if name != "candidate"} == {True}
        assert not program.cgroup.frozen()              # left going on after the window
    finally:
        program.reap()


def test_each_of_the_candidates_processes_is_frozen_while_another_runs(tmp_path):
    """A candidate timed in two processes: while either runs, the other is held frozen, so one
    cannot work beside the other's frames (or a baseline's)."""
    first, second = sleeper(tmp_path), sleeper(tmp_path)
    try:
        seen: list = []
        entrants = [Entrant(name, Observing(mine.cgroup, seen, other.cgroup), "candidate", [],
                            [Call(k, timed=True) for k in range(4)], hold=mine.cgroup)
                    for name, mine, other in (("candidate", first, second), ("candidate@1", second, first))]
        run_window(entrants, 4, random.Random(5))
        assert len(seen) == 8 and {frozen for _, frozen in seen} == {True}   # the other one, each time
    finally:
        for program in (first, second):
            program.reap()


def test_a_programs_figures_are_its_fastest_processes_by_median_whatever_its_name():
    """The rule is the same for every program: the process whose timed frames' median is least,
    among those of that program alone (compile:default's are not eager's)."""
    assert [process_name("eager", k) for k in range(3)] == ["eager", "eager@1", "eager@2"]
    assert program_of("compile:default@1") == "compile:default" and program_of("candidate") == "candidate"
    times = {"candidate": [5, 5, 9], "candidate@1": [4, 6, 6], "eager": [1, 1, 1], "eager@1": [3, 3, 3],
             "compile:default": [9, 9, 9], "compile:default@1": [2, 8, 8], "empty": [0]}
    assert fastest_process(times, "candidate") == "candidate"   # medians 5 and 6: not the lone fast frame
    assert fastest_process(times, "eager") == "eager"
    assert fastest_process(times, "compile:default") == "compile:default@1"
    assert fastest_process({"eager": [2]}, "eager") == "eager"   # one process: itself


def test_each_process_of_a_program_runs_its_share_of_the_frames_with_its_own_checks():
    """Every process of a program runs in every round, on frames no other process has, and the
    candidate's are each checked `correctness.timed_checks` times, however the frames divide."""
    from hpc.config import load_config
    from hpc.pipeline import Seeds
    from hpc.profile.driver import process_frames, timing_processes

    cfg = load_config(backend="cpu")
    cfg.timing.iterations, cfg.timing.processes_cpu = 21, 2
    assert timing_processes(cfg) == 2 and process_frames(cfg) == [11, 10]
    seeds = Seeds.draw(cfg)
    assert [len(p.timing) for p in seeds.processes] == [cfg.timing.warmup + 11, cfg.timing.warmup + 10]
    assert all(len(p.checked) == cfg.correctness.timed_checks for p in seeds.processes)
    assert len({s for p in seeds.processes for s in p.timing}) == 2 * cfg.timing.warmup + 21
    assert process_frames(load_config(backend="cuda")) == [100]   # one process on cuda


def test_a_frame_lasts_about_frame_ms_in_a_power_of_two_of_calls_within_its_limits():
    from hpc.config import load_config
    from hpc.profile.driver import burst_for
    from hpc.sandbox.exchange import MAX_DESCRIPTORS

    cfg = load_config(backend="cuda")
    cfg.timing.frame_ms_cuda, cfg.timing.burst_max = 2.0, 64
    assert burst_for(cfg, 0.13, 1 << 20, 1) == 16          # 16 x 0.13 ms: the first past 2 ms
    assert burst_for(cfg, 3.0, 1 << 20, 1) == 1            # a call longer than a frame: one a frame
    assert burst_for(cfg, 1e-4, 1 << 20, 1) == 64          # burst_max
    assert burst_for(cfg, 1e-4, 1 << 30, 1) == 4           # 4096 MiB of inputs and outputs at most
    assert burst_for(cfg, 1e-4, 1, MAX_DESCRIPTORS // 5) == 4   # the header describes every output
    cfg.timing.frame_ms_cuda = 0.0
    assert burst_for(cfg, 1e-4, 1, 1) == 1


def test_a_frames_call_seeds_are_its_own_then_ones_no_other_frame_shares():
    from hpc.profile.timing import call_seeds, frames

    a, b = call_seeds(11, 8), call_seeds(12, 8)
    assert a[0] == 11 and len(set(a)) == 8 and not set(a) & set(b)
    assert call_seeds(11, 8) == a and all(0 <= s < 1 << 62 for s in a)
    calls = timing_calls([11, 12, 13], 1, {1}, burst=8)
    assert frames(calls) == [(0, 8), (8, 16), (16, 24)]
    assert [c.seed for c in calls[8:16]] == call_seeds(12, 8)
    assert [c.timed for c in calls[::8]] == [False, True, True]
    assert [c.checked for c in calls] == [False] * 16 + [True] * 8    # every call of timed frame 1
    assert Call.from_message(calls[9].to_message()) == calls[9]


def test_input_shifts_are_every_place_64_bytes_or_more_apart_within_4_kib_on_cpu_and_none_on_cuda():
    from hpc.config import load_config
    from hpc.profile.driver import input_shifts

    cfg = load_config(backend="cpu")
    shifts = input_shifts(cfg)
    assert sorted(shifts) == list(range(0, 4096, 128)) and shifts[:4] == [0, 2048, 1024, 3072]
    assert sorted(shifts[:8]) == list(range(0, 4096, 512))     # any 8 in a row spread over the 4 KiB
    cfg.timing.input_shifts_cpu = 1
    assert input_shifts(cfg) == [0]
    assert input_shifts(load_config(backend="cuda")) == [0]


def test_every_program_meets_the_same_shifts_in_each_round_of_a_window():
    """A round's ratio sets a candidate's frames against a baseline's median in the same round: both
    must have met the same input shifts there, or where each process put its outputs comes back."""
    from hpc.profile.window import chunks

    shifts = [0, 2048, 1024, 3072]
    candidate = timing_calls(list(range(12)), 2, {3}, burst=2, shifts=shifts)
    eager = timing_calls(list(range(100, 112)), 2, set(), burst=2, shifts=shifts)
    assert [c.shift for c in candidate[4::2]] == shifts * 2 + shifts[:2]   # the timed frames, from the first
    assert all(c.shift == candidate[k - k % 2].shift for k, c in enumerate(candidate))   # a frame's calls alike
    for mine, theirs in zip(chunks(candidate[4:], 3), chunks(eager[4:], 3)):
        assert [c.shift for c in mine] == [c.shift for c in theirs]
    assert Call.from_message(candidate[5].to_message()) == candidate[5]


def test_the_baselines_process_is_held_frozen_through_each_frames_flush_as_a_candidates_is(fast_config,
                                                                                           monkeypatch):
    """Real drivers: the baselines' trusted process is frozen while a frame's inputs are published
    and the cache flushed, like a candidate's. A process let go on just before t0 answers the go
    byte sooner than one that blocked through the flush (benchmarks/cpu_wake.py), and the empty
    program's handshake, which lives in the baselines' process, is taken off the candidate's figures."""
    from tests.conftest import RELU_TASK
    from hpc.baseline import measure_program
    from hpc.profile import driver as driver_module
    from hpc.profile.device_lock import DeviceLock
    from hpc.task import load_task

    states: list[bool] = []
    flush = driver_module._HostAgent.flush

    def observed(agent) -> None:
        states.append(agent.group.frozen())
        flush(agent)

    monkeypatch.setattr(driver_module._HostAgent, "flush", observed)
    stats, measured = measure_program(load_task(RELU_TASK), "eager", fast_config, 1,
                                      DeviceLock("cpu", fast_config.cache_path()))
    assert stats.median_ms > 0 and len(states) >= fast_config.timing.iterations
    assert set(states) == {True}, states


def test_a_task_whose_calls_take_no_tensor_is_timed_at_every_input_shift(fast_config, tmp_path):
    """Its slot holds no bytes, yet its frames still carry the window's shifts: the program takes
    them all (each shift's positions over the empty slot), or its frames fail as the harness's."""
    from hpc.baseline import measure_program
    from hpc.profile.device_lock import DeviceLock
    from hpc.task import load_task

    task = tmp_path / "level1" / "ramp.py"
    task.parent.mkdir()
    task.write_text("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
                    "    def forward(self, n):\n        return torch.arange(n, dtype=torch.float32) * 2\n\n\n"
                    "def get_inputs():\n    return [4096]\n\n\ndef get_init_inputs():\n    return []\n")
    stats, measured = measure_program(load_task(task), "eager", fast_config, 1,
                                      DeviceLock("cpu", fast_config.cache_path()))
    assert stats.median_ms > 0 and measured["input_shifts"] == 32

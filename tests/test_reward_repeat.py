"""benchmarks/reward_repeat.py's reading of kept runs: the co-movement lines that say whether an
evaluation's figures rise and fall together, the estimators' table, and the rounds of a program
that ran far from its window."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from reward_repeat import bandwidth_movement, by_process, co_movement, far_rounds  # noqa: E402


def _row(candidate: float, eager: float, compile_ms: float, handshake: float, flush_gb_s: float = 10.0) -> tuple:
    # (reward, speedup vs compile, status, candidate, eager, compile, handshake, speedup vs eager, burst,
    #  compile / candidate, round noise, chunk starts, the window's flush rate)
    return (3, compile_ms / candidate, "ok", candidate, eager, compile_ms, handshake, eager / candidate, 8,
            compile_ms / candidate, 0.01, (1.0, 1.0, 1.0), flush_gb_s)


def test_a_slow_evaluation_moves_the_host_bound_figures_most():
    """Each run slows every figure by its host share (torch.compile twice the candidate's, eager
    not at all): the lines show torch.compile following the candidate at about twice its
    deviation, and eager flat."""
    runs = []
    for slow in (0.0, 0.05, 0.10, -0.03):
        runs.append({task: _row(base * (1 + slow), 0.3 * base, base * (1 + 2 * slow), 0.03 * (1 + 5 * slow))
                     for task, base in (("a", 0.1), ("b", 0.2))})
    lines = co_movement(runs)
    assert "torch.compile against candidate: correlation 1.00, slope 1.95" in lines   # deviations from medians
    assert "eager against candidate: one of them never moved" in lines
    assert lines[0].startswith("rows under 1 ms, 8 figures each") and "eager 0.0%" in lines[0], lines


def test_rows_of_a_millisecond_or_more_are_left_out():
    runs = [{"big": _row(2.0 * (1 + s), 4.0, 5.0 * (1 + s), 0.2)} for s in (0.0, 0.1, 0.2)]
    assert co_movement(runs) == []


def test_a_ratio_that_follows_the_memory_bandwidth_of_its_window_reads_so():
    """The candidate bandwidth-bound, torch.compile not: with less bandwidth the candidate slows and
    the ratio falls with the flush rate; a row whose ratio holds gives no correlation."""
    runs = [{"bound": _row(1.0 * 10 / gb, 3.0, 2.0, 0.1, gb), "held": _row(1.0, 3.0, 2.0 + k / 100, 0.1, gb)}
            for k, gb in enumerate((10.0, 8.0, 11.0, 9.0))]
    (line,) = bandwidth_movement(runs)
    assert line.startswith("vs compile against the window's flush rate, 8 figures: correlation 0.") and "slope" in line
    bound_only = [{"bound": run["bound"]} for run in runs]
    assert "correlation 1.00" in bandwidth_movement(bound_only)[0]
    assert bandwidth_movement([{"a": _row(1.0, 3.0, 2.0, 0.1, float("nan"))}] * 3) == []   # cuda: no flush rate


def test_a_figure_read_shift_by_shift_weighs_every_shift_alike():
    """Frames at shift 0 fast and at shift 1 slow: the window's median swings with how many of each
    it took, the shift-by-shift figure does not."""
    from reward_repeat import shift_by_shift

    fast_heavy = [1.0, 2.0] * 5 + [1.0]          # six fast frames, five slow
    slow_heavy = [2.0, 1.0] * 5 + [2.0]          # the same window with its shifts the other way round
    assert shift_by_shift(fast_heavy, 2) == shift_by_shift(slow_heavy, 2) == 1.5
    assert shift_by_shift([3.0, 1.0, 2.0], 1) == 2.0   # one shift: the median
    assert shift_by_shift([], 32) != shift_by_shift([], 32)   # NaN without frames


def test_the_estimators_table_counts_each_reading_within_3_percent_on_its_own():
    """Three runs of one row whose readings spread 1%, 5%, 2% and 4% from their medians: each
    reading's column and count say so on their own."""
    from reward_repeat import estimators

    def row(round_by_round: float, of_medians: float, by_shift: float, paired_by_shift: float) -> tuple:
        return (_row(1.0, 3.0, 2.0, 0.1)[:1] + (round_by_round,) + _row(1.0, 3.0, 2.0, 0.1)[2:9] + (of_medians,)
                + (0.01, (1.0, 1.0, 1.0), 10.0, by_shift, paired_by_shift))

    runs = [{"a": row(2.0 * f, 2.0 * g, 2.0 * h, 2.0 * k)}
            for f, g, h, k in ((1.0, 1.0, 1.0, 1.0), (1.01, 1.05, 0.98, 1.04), (0.995, 0.99, 1.005, 0.999))]
    lines = estimators(runs, ["a"])
    assert lines[-1] == ("within 3% of the median: round by round 1/1, ratio of medians 0/1, shift by shift 1/1, "
                         "paired then shift by shift 0/1")
    assert lines[2].startswith("| a | 2.000 / 2.020 / 1.990 (1.0%) | 2.000 / 2.100 / 1.980 (5.0%) |"), lines[2]
    assert lines[2].count("|") == 7   # six columns


def test_rounds_a_process_ran_twice_as_slow_are_named_and_a_steady_window_names_none():
    """A program's 100 frames in 10 rounds: three rounds of its window (7-9) run at twice the time,
    as swish_scale_add's baselines did from one round on; those three are named, with their ratio
    to the window's median, and a window with a few percent of noise names none."""
    steady = [1.0 + 0.02 * ((k * 7) % 5 - 2) for k in range(100)]
    slowed = [x * 2 if k >= 70 else x for k, x in enumerate(steady)]
    assert far_rounds(steady, 10) == []
    found = far_rounds(slowed, 10)
    assert [k for k, _ in found] == [7, 8, 9]
    assert all(1.9 < ratio < 2.1 for _, ratio in found)
    assert far_rounds([], 10) == []


def _process_run(path, medians: dict[str, list[float]]):
    """A kept run of one row whose programs were each timed in two processes (conditions only)."""
    import json

    from hpc.results.hdf5 import ResultWriter
    from hpc.results.record import EvalRecord

    conditions = {program: {"process_medians_ms": m, "timed_in_process": m.index(min(m))}
                  for program, m in medians.items()}
    with ResultWriter(path, {"git_commit": "abc"}) as writer:
        writer.append(EvalRecord(task_id="level1/x", task_level=1, status="ok", reward=3.0, correct=True,
                                 compiled=True, conditions=json.dumps(conditions)))
    return path


def test_one_process_alone_is_read_beside_the_fastest_and_a_process_gone_slow_shows_in_it_alone(tmp_path):
    """Three runs; in the second, torch.compile's first process ran 2x slow (as swish_scale_add's
    baselines did in 3 of 36 runs): process 0 read alone moves and pays 3 once, process 1 alone and
    the fastest process do not."""
    steady = {"candidate": [4.0, 4.04], "eager": [12.0, 12.1], "compile:default": [4.1, 4.12]}
    slow = {**steady, "compile:default": [8.2, 4.12]}
    paths = [_process_run(tmp_path / f"run-{k}.h5", m) for k, m in enumerate((steady, slow, steady))]
    lines = by_process(paths)
    assert lines[0].startswith("| task | process 0 alone") and "fastest process" in lines[0]
    row = lines[2].split(" | ")
    assert "(100.0%), 2/3/2" in row[1]                 # process 0 alone: 1.025x, 2.05x, 1.025x
    assert "(0.0%), 2/2/2" in row[2] and "(0.5%), 2/2/2" in row[3]   # the fastest: 1.025x, 1.03x, 1.025x
    assert lines[-1].endswith("process 0 alone: same reward 0, within 3% 0; process 1 alone: same reward 1, "
                              "within 3% 1; fastest process: same reward 1, within 3% 1")


def test_runs_timed_in_one_process_have_no_process_table(tmp_path):
    one = {"candidate": [4.0], "eager": [12.0], "compile:default": [4.4]}
    assert by_process([_process_run(tmp_path / "run-0.h5", one)]) == []

"""Progress output: a bar redrawn in place at a terminal, item lines plus periodic summaries in a log."""

from __future__ import annotations

import io

from hpc.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_at_a_terminal_item_lines_stay_and_one_bar_is_redrawn_below_them(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    out = Terminal()
    with Progress(4, "suite", out) as p:
        p.advance("[1/4] a: ok")
        p.advance("[2/4] b: ok")
    text = out.getvalue()
    assert text.index("[1/4] a: ok\n") < text.index("[2/4] b: ok\n")
    assert text.count("\r\033[K") == 1               # the first bar erased before the second item line
    last = text.rsplit("\r\033[K", 1)[1]
    assert last.startswith("[2/4] b: ok\n[") and "suite: 2/4 (50%)" in last and "left" in last
    assert last.endswith("\n")                        # close() ends the bar's line


def test_in_a_log_items_are_lines_and_a_summary_comes_every_period_and_at_the_end():
    out = io.StringIO()
    p = Progress(3, "pool", out, every_s=3600)
    p.advance("[1/3] a: reward 3")
    p.advance("[2/3] b: reward 1")
    assert out.getvalue() == "[1/3] a: reward 3\n[2/3] b: reward 1\n"      # no summary due yet
    p.advance("[3/3] c: reward -1")
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("pool: 3/3 (100%), ") and "/min" in lines[-1] and "\r" not in out.getvalue()

    out = io.StringIO()
    p = Progress(10, "shards", out, every_s=0)
    p.tick()
    p.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0] == "shards: 0/10 (0%), 0s elapsed"
    assert lines[1].startswith("shards: 1/10 (10%), 0s elapsed, ") and lines[1].endswith(" left")


def _clock(monkeypatch, start: float = 1000.0):
    """A settable monotonic clock for hpc.progress."""
    now = [start]
    monkeypatch.setattr("hpc.progress.time.monotonic", lambda: now[0])
    return now


def test_items_done_before_a_resume_count_as_done_but_not_in_the_rate(monkeypatch):
    now = _clock(monkeypatch)
    out = io.StringIO()
    p = Progress(100, "train", out, every_s=3600)
    now[0] += 0.001
    p.skip(98, "resumed after step 98")   # a resume with almost nothing left: was 1.26e9/min
    assert "/min" not in p.status()       # nothing measured in this run yet
    now[0] += 30.0
    p.advance("step 99")
    status = p.status()
    assert "99/100" in status and "2.00/min" in status and "~30s left" in status


def test_time_left_is_summed_from_each_remaining_items_kind(monkeypatch):
    now = _clock(monkeypatch)
    p = Progress(6, "train", io.StringIO(), every_s=3600, kinds=["sft"] * 4 + ["ppo"] * 2)
    for _ in range(2):
        now[0] += 1.0
        p.advance()
    assert p.status().endswith("~2s left + 2 ppo not yet timed")   # the ppo steps are not guessed from sft
    for _ in range(3):
        now[0] += 1.0 if p.done < 4 else 40.0
        p.advance()
    assert p.status().endswith("~40s left")                         # was ~3 s left with ~80 s to go

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

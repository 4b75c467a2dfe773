"""Progress of a batch of evaluations, for a person at a terminal and for a Slurm log.

At a terminal: each finished item's line, with one bar line kept below them and redrawn in
place. Elsewhere (a Slurm log, a pipe): the item lines, plus a summary line with the rate and
the estimated time left every `every_s` seconds, so a log shows where a long job stands.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Sequence, TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """`advance(line)` once per finished item; `close()` at the end (also as a context manager)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, every_s: float = 60.0,
                 kinds: Sequence[str] | None = None):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        self.every_s = every_s
        self.kinds = list(kinds) if kinds is not None else None   # each item's kind, in order (ETA per kind)
        self.done = 0
        self.skipped = 0                   # done before this run (a resume): not part of the rate
        self.started = self._last_summary = self._last_item = time.monotonic()
        self._spent: dict[str, list[float]] = {}   # kind -> [seconds, items] measured in this run
        self._bar_shown = False

    def status(self) -> str:
        """`label: done/total (pct), elapsed, rate, time left`: the rate over the items of this run,
        the time left from each remaining item's kind as measured so far."""
        elapsed = time.monotonic() - self.started
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"{self.label}: {self.done}/{self.total} ({pct:.0f}%), {_duration(elapsed)} elapsed"
        ran = self.done - self.skipped
        if ran and elapsed > 0:
            text += f", {ran / elapsed * 60:.2f}/min"
            if self.done < self.total:
                text += self._left()
        return text

    def _kind(self, index: int) -> str:
        return self.kinds[index] if self.kinds is not None and index < len(self.kinds) else ""

    def _left(self) -> str:
        seconds, untimed = 0.0, {}
        for i in range(self.done, self.total):
            kind = self._kind(i)
            if kind in self._spent:
                spent, items = self._spent[kind]
                seconds += spent / items
            else:
                untimed[kind] = untimed.get(kind, 0) + 1
        text = f", ~{_duration(seconds)} left"
        if untimed:
            text += " + " + ", ".join(f"{n} {kind or 'other'} not yet timed" for kind, n in untimed.items())
        return text

    def skip(self, n: int, line: str = "") -> None:
        """`n` items were done before this run (a resume): counted as done, not in the rate."""
        self.skipped += n
        self.advance(line, n, timed=False)

    def advance(self, line: str = "", n: int = 1, timed: bool = True) -> None:
        """`n` more items finished; `line` (if any) says how the last one ended. The time since the
        previous item is theirs, shared evenly (`timed` False: not measured here)."""
        now = time.monotonic()
        if timed:
            for i in range(self.done, self.done + n):
                spent = self._spent.setdefault(self._kind(i), [0.0, 0])
                spent[0] += (now - self._last_item) / n
                spent[1] += 1
        self._last_item = now
        self.done += n
        if self.tty:
            self._clear_bar()
            if line:
                self.stream.write(line + "\n")
        elif line:
            self.stream.write(line + "\n")
        self.tick(force=self.done == self.total)

    def tick(self, force: bool = False) -> None:
        """Refresh while waiting: the bar at a terminal, else a summary line when one is due."""
        if self.tty:
            self._clear_bar()
            self._draw_bar()
        elif force or time.monotonic() - self._last_summary >= self.every_s:
            self._last_summary = time.monotonic()
            self.stream.write(self.status() + "\n")
        self.stream.flush()

    def _draw_bar(self) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        text = self.status()
        cells = max(10, min(40, width - len(text) - 4))
        filled = cells * self.done // self.total if self.total else cells
        self.stream.write(f"[{'#' * filled}{'.' * (cells - filled)}] {text}"[:width - 1])
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.stream.write("\r\033[K")
            self._bar_shown = False

    def close(self) -> None:
        if self.tty and self._bar_shown:
            self.stream.write("\n")
            self._bar_shown = False
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

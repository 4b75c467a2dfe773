"""Stop a confined program and everything below it, and let it go on: while one program of an
evaluation is timed, the others must take no CPU (a candidate's left-over threads or children
would slow a baseline timed beside it, and so raise its own speedup).

Everything a confined program starts is below it: it is pid 1 of its PID namespace, so an orphan
(a double-forked daemon) is re-parented to it, not to a process outside. The tree is found through
/proc/<pid>/task/<tid>/children, and SIGSTOP'd until a walk finds no process that is not stopped
(a child forked while the walk ran is stopped on the next one; the program's own rlimit on
processes bounds the walks). Without PID namespaces an orphan escapes to the stub (a subreaper),
which is stopped too when passed as `root`.
"""

from __future__ import annotations

import os
import signal
import time


# How long a tree may take to stop. A thread in uninterruptible sleep (a page fault or a write on a
# loaded machine) stops only when it leaves it; the wait is never inside a timed interval (the
# driver's hold runs before t0, the window's between chunks), so a long one costs an honest
# candidate nothing, while a tree that forks faster than the walks still fails, this much later.
STOP_TIMEOUT_S = 10.0


class FreezeError(Exception):
    """The tree did not stop in time (a process in uninterruptible sleep, or forking faster than
    the walks)."""


def tree(root: int) -> list[int]:
    """`root` and every process below it, parents before children; [] when `root` is gone."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue   # ended
        found.append(pid)
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    queue.extend(int(child) for child in f.read().split())
            except OSError:
                pass
    return found


def _running(pid: int) -> bool:
    """Whether any thread of `pid` is not stopped (a leader that exited leaves its threads running,
    so each thread's own state counts)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
                    return True
        except (OSError, IndexError):
            pass
    return False


def stop(root: int, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGSTOP `root` and its whole tree and wait until every process in it is stopped; how many
    processes were stopped. FreezeError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pids = tree(root)
        running = [pid for pid in pids if _running(pid)]
        if not running:
            return len(pids)
        for pid in running:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise FreezeError(f"{len(running)} of {len(pids)} processes under {root} did not stop "
                              f"in {timeout:.1f} s")
        time.sleep(0.0002)


def resume(root: int) -> None:
    """SIGCONT `root` and its whole tree."""
    for pid in tree(root):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

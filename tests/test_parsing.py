"""Python files parsed from several threads at once (hpc.parsing): CPython 3.11's AST constructor
keeps its recursion depth in state the threads share, and a garbage collection that runs Python
finalizers in the middle of one parse lets another thread's parse in. Straight ast.parse under this
load raised `SystemError: AST constructor recursion depth mismatch` 1-4 times in each of 3 runs
here (and once in CI, in a synthesis shard's workers)."""

from __future__ import annotations

import gc
import sys
import threading

from hpc.parsing import parse
from tests.conftest import ROOT


class _Cyclic:
    """Garbage only the collector frees, whose finalizer runs Python (a thread switch point)."""

    def __del__(self):
        sum(range(200))


def test_threads_parsing_at_once_each_get_their_tree():
    source = (ROOT / "hpc" / "verify" / "static.py").read_text()
    errors: list[str] = []

    def work() -> None:
        for _ in range(150):
            try:
                parse(source)
            except SystemError as e:
                errors.append(str(e))
            for _ in range(50):
                junk = _Cyclic()
                junk.me = junk

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(50, 5, 5)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]

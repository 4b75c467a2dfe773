"""Python source parsed into an AST, one parse at a time in a process.

CPython 3.11 keeps the AST constructor's recursion depth in the interpreter's shared state, so two
threads parsing at once (an eval-suite's or a synthesis shard's workers, each checking a file)
can trip over each other's count: `SystemError: AST constructor recursion depth mismatch`, seen
in this project's CI (cpython gh-106905 is one such path). A parse takes milliseconds; serializing
them costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading

_lock = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """ast.parse, behind the process's one lock (SyntaxError as ast.parse raises it)."""
    with _lock:
        return ast.parse(source, filename=filename)

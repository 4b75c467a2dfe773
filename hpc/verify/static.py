"""Static checks of a candidate's Python source, before anything of it runs.

Stops the cheap escapes from the runtime policy: importing modules that reach outside the model
(ctypes, os, threading, numpy...), dynamic code (exec, eval, __import__), and introspection
that lets code rewrite the harness inside its process (__globals__, __code__, sys.modules...).
"""

from __future__ import annotations

import ast

ALLOWED_IMPORTS = frozenset({
    "torch", "torch.nn", "torch.nn.functional", "torch.utils.cpp_extension", "math", "typing",
    "__future__", "functools", "dataclasses", "hpc.runtime",
})
FORBIDDEN_NAMES = frozenset({"exec", "eval", "compile", "__import__", "open", "breakpoint", "globals", "locals",
                             "vars", "getattr", "setattr", "delattr", "__builtins__", "memoryview"})
FORBIDDEN_ATTRIBUTES = frozenset({"__globals__", "__code__", "__subclasses__", "__builtins__", "__dict__",
                                  "__closure__", "__bases__", "__mro__", "_C", "_dynamo",
                                  "__torch_dispatch__", "__torch_function__", "_python_dispatch", "settrace",
                                  "setprofile", "f_back", "f_globals", "gi_frame"})


def source_defect(source: str, filename: str) -> str:
    """The first policy problem in the candidate's Python source, or "" when there is none."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        return f"syntax error at line {e.lineno}: {e.msg}"
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        return "defines no class ModelNew"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in ALLOWED_IMPORTS:
                    return f"line {node.lineno}: import of {alias.name} is not allowed"
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or (module not in ALLOWED_IMPORTS and not all(
                    f"{module}.{a.name}" in ALLOWED_IMPORTS for a in node.names)):
                return f"line {node.lineno}: import from {'.' * node.level}{module} is not allowed"
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            return f"line {node.lineno}: use of {node.id} is not allowed"
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            return f"line {node.lineno}: access to .{node.attr} is not allowed"
    return ""

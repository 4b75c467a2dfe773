"""Static checks of a candidate's sources, before anything of it runs.

Python: stops the cheap escapes from the runtime policy: importing modules that reach outside the
model (ctypes, os, threading, numpy...), dynamic code (exec, eval, __import__), and introspection
that lets code rewrite the harness inside its process (__globals__, __code__, every dunder but
__init__, and the modules torch exposes as attributes: torch.sys, torch.os, torch.ctypes...).
Kernel sources: no torch headers (the workdir format's contract), and vendor libraries only where
the library policy allows them (CUDA Agent allows e.g. cuBLAS for GEMM); an allowed library is
also what gets linked.
"""

from __future__ import annotations

import ast
import re

ALLOWED_IMPORTS = frozenset({
    "torch", "torch.nn", "torch.nn.functional", "torch.utils.cpp_extension", "math", "typing",
    "__future__", "functools", "dataclasses", "hpc.runtime",
})
FORBIDDEN_NAMES = frozenset({"exec", "eval", "compile", "__import__", "open", "breakpoint", "globals", "locals",
                             "vars", "getattr", "setattr", "delattr", "__builtins__", "memoryview"})
FORBIDDEN_ATTRIBUTES = frozenset({"_C", "_dynamo", "_python_dispatch", "settrace", "setprofile", "f_back",
                                  "f_globals", "gi_frame", "load", "save", "hub", "cudart", "library",
                                  # modules torch imports are its attributes: torch.sys, torch.ctypes...
                                  "sys", "os", "ctypes", "importlib", "inspect", "builtins", "threading",
                                  "multiprocessing", "signal", "platform", "glob", "subprocess", "modules",
                                  "types", "gc", "pickle", "io", "shutil", "pathlib", "socket", "weakref"})
ALLOWED_DUNDERS = frozenset({"__init__"})   # super().__init__(); every other dunder reaches the interpreter


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
        elif isinstance(node, ast.Attribute) and (node.attr in FORBIDDEN_ATTRIBUTES or (
                node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in ALLOWED_DUNDERS)):
            return f"line {node.lineno}: access to .{node.attr} is not allowed"
    return ""


# library -> (headers that use it, linker flags when the policy allows it)
LIBRARIES = {
    "cublas": (("cublas_v2.h", "cublas_api.h", "cublas.h", "cublasLt.h"), ("-lcublas", "-lcublasLt")),
    "cudnn": (("cudnn.h",), ("-lcudnn",)),
    "curand": (("curand.h", "curand_kernel.h"), ("-lcurand",)),
    "cufft": (("cufft.h",), ("-lcufft",)),
    "cutlass": (("cutlass/", "cute/"), ()),
    "cblas": (("cblas.h", "mkl.h", "mkl_cblas.h"), ("-lcblas",)),
}
_TORCH_HEADERS = ("torch/", "ATen/", "c10/", "pybind11/", "Python.h")
_DYNAMIC_LOADING = re.compile(r"\b(dlopen|dlmopen|dlsym|dlvsym)\b")
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def kernel_defect(files: dict[str, bytes], allowed_libraries: list[str]) -> str:
    """The first problem in a workdir's kernel sources under the library policy, or ""."""
    for name, data in sorted(files.items()):
        if not name.startswith("kernels/"):
            continue
        text = data.decode("utf-8", "replace")
        loader = _DYNAMIC_LOADING.search(text)
        if loader:
            return f"{name} calls {loader.group(1)}: dynamic loading is not allowed (libraries come from the policy)"
        for header in _INCLUDE.findall(text):
            if header.startswith(_TORCH_HEADERS):
                return f"{name} includes {header}: workdir kernels must not include torch or Python headers"
            for lib, (headers, _) in LIBRARIES.items():
                if header.startswith(headers) and lib not in allowed_libraries:
                    return f"{name} includes {header}: library {lib} is not allowed by the policy"
    return ""


def link_flags(allowed_libraries: list[str]) -> tuple[str, ...]:
    return tuple(flag for lib in allowed_libraries for flag in LIBRARIES[lib][1])

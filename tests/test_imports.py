"""The package's import graph, read from the sources with `ast` (nothing is imported): no module
imports itself through others, and the harness never imports `hpc.runner`, the code that runs
inside sandboxed workers (hpc/runner/__init__.py says so).

Every import counts, at module level, inside functions and under `if TYPE_CHECKING:` alike: an
import moved into a function still ties the modules together."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "hpc"
RUNNER = "hpc.runner"


def _in_runner(module: str) -> bool:
    return module == RUNNER or module.startswith(RUNNER + ".")


def _module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, not `__init__`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement asks for: `from a import b` asks for `a.b` (a module,
    or a name defined in `a`); relative imports resolved against `module`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that defines `name` (itself, or the longest module prefix of it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@lru_cache
def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (read once per package)."""
    modules = _module_names(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.name == "__init__.py"):
                    edges.add(_owner(name, modules))
        graph[module] = edges - {None, module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan), each
    sorted, with no recursion (the graph's depth is the package's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_sees_imports_at_every_level(tmp_path):
    """The reader itself: function-level, TYPE_CHECKING and relative imports are edges, and a
    cycle through them is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name, source in {
        "__init__.py": "",
        "a.py": "import os\nfrom pkg.sub import b\n",
        "sub/__init__.py": "from . import b\n",
        "sub/b.py": "def f():\n    from ..c import value\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nvalue = 1\n",
        "d.py": "from .sub.b import f\n",
    }.items():
        (package / name).write_text(source)
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.sub.b", "pkg.sub"}, "pkg.sub": {"pkg.sub.b"},
                     "pkg.sub.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.sub.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub", "pkg.sub.b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles in hpc/: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_harness_never_imports_the_runner():
    importers = sorted(f"{module} imports {', '.join(sorted(filter(_in_runner, edges)))}"
                       for module, edges in import_graph().items()
                       if not _in_runner(module) and any(map(_in_runner, edges)))
    assert not importers, ("hpc.runner runs inside sandboxed workers and is never imported by the harness "
                           "(hpc/runner/__init__.py): " + "; ".join(importers))


def test_no_job_script_imports_another():
    """jobs/ holds the commands; what one needs of another's work lives in hpc/ (the trainer's
    report is hpc.analysis.runs, not jobs/analyze.py)."""
    found = []
    for path in sorted((ROOT / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name} imports {name}" for name in names if name == "jobs" or name.startswith("jobs.")]
    assert not found, "; ".join(found)


def redefined(source: str) -> list[str]:
    """Top-level functions and classes a module defines more than once: the later one silently
    replaces the earlier for every caller (two `os_reason`s once turned every link-loop message
    into the OS's own words)."""
    seen: dict[str, int] = {}
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                found.append(f"{node.name} (lines {seen[node.name]} and {node.lineno})")
            seen[node.name] = node.lineno
    return found


def test_redefined_sees_a_second_definition():
    assert redefined("def f(): pass\nclass C: pass\ndef f(): pass\n") == ["f (lines 1 and 3)"]
    assert redefined("def f(): pass\ndef g(): pass\n") == []


def test_no_module_defines_a_name_twice():
    found = [f"{path.relative_to(ROOT)}: {name}" for root in ("hpc", "jobs", "benchmarks")
             for path in sorted((ROOT / root).rglob("*.py")) for name in redefined(path.read_text())]
    assert not found, "; ".join(found)

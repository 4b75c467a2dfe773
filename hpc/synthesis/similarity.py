"""Normalized syntax trees and operator signatures: what deduplication and decontamination compare.

Normalization keeps what a task computes and drops how it is spelled: docstrings, imports (their
aliases resolved: `F.relu` and `torch.nn.functional.relu` are one token), annotations, the SCALES
dict, the values of module-level size globals (the same task at another size is the same task),
the arguments of `super(...)`, and every local name (variables, parameters, globals, `self.`
attributes are numbered in order of first use). Operator hyperparameters inside the model stay.

- `ast_hash`: sha256 of the normalized token sequence of the whole file (deduplication);
- `similarity`: difflib's ratio of two token sequences, here those of the `Model` method bodies
  (`model_tokens`, decontamination): 1.0 for the same normalized model;
- `op_signature`: the operators `Model.forward` applies, in evaluation order, under canonical
  names (`nn.ReLU()`, `torch.relu`, `F.relu` and `x.relu()` are all `relu`; views are left out).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
from collections import Counter
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path

from hpc.errors import DataFileError
from hpc.parsing import parse

KEPT_NAMES = frozenset({"Model", "get_inputs", "get_init_inputs", "forward", "__init__", "self"})
_BUILTINS = frozenset(dir(builtins))
_SKIPPED_FIELDS = frozenset({"ctx", "type_comment", "annotation", "returns", "type_params", "kind"})


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_size_value(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_size_value(node.operand)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_is_size_value(e) for e in node.elts)
    return False


def _assigned_names(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = []
    for t in targets:
        elements = [t] if isinstance(t, ast.Name) else getattr(t, "elts", [])
        names += [e.id for e in elements if isinstance(e, ast.Name)]
    return names


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted module or object path, from the file's imports."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


class _Normalizer(ast.NodeTransformer):
    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases
        self.names: dict[str, str] = {}
        self.attrs: dict[str, str] = {}

    def _name(self, name: str) -> str:
        if name in KEPT_NAMES or name in _BUILTINS:
            return name
        if name in self.aliases:
            return self.aliases[name]
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self._name(node.id)
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = self._name(node.arg)
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.name = self._name(node.name)
        node.body = [s for s in node.body if not _is_docstring(s)] or [ast.Pass()]
        node.decorator_list = []
        return self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.name = self._name(node.name)
        node.body = [s for s in node.body if not _is_docstring(s)] or [ast.Pass()]
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            node.attr = self.attrs.setdefault(node.attr, f"a{len(self.attrs)}")
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Name) and node.func.id == "super":
            node.args, node.keywords = [], []
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return None
        return self.visit(ast.Assign(targets=[node.target], value=node.value))


def _module_body(tree: ast.Module) -> list[ast.stmt]:
    body = []
    for node in tree.body:
        if _is_docstring(node) or isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names = _assigned_names(node)
        if "SCALES" in names:
            continue
        if names and _is_size_value(node.value):
            node.value = ast.Constant("<size>")
        body.append(node)
    return body


def _tokens(node: ast.AST) -> list[str]:
    out = [type(node).__name__]
    for name, value in ast.iter_fields(node):
        if name in _SKIPPED_FIELDS:
            continue
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, ast.AST):
                out.extend(_tokens(item))
            elif item is not None:
                out.append(repr(item))
    return out


def normalized_tokens(source: str) -> list[str]:
    """The normalized token sequence of a problem file (SyntaxError if it does not parse)."""
    tree = parse(source)
    aliases = import_aliases(tree)
    tree.body = _module_body(tree)
    tree = _Normalizer(aliases).visit(tree)
    return _tokens(tree)


def _is_super_init(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "__init__"
            and isinstance(call.func.value, ast.Call) and isinstance(call.func.value.func, ast.Name)
            and call.func.value.func.id == "super")


def model_tokens(source: str) -> list[str]:
    """The normalized tokens of what `Model` computes: each method's name and body, without
    `super().__init__()`. The rest of a problem file (imports, class and method headers, sizes,
    get_inputs) is much the same in every file and would make any two one-operator tasks look
    alike. Empty when there is no Model."""
    tree = parse(source)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return []
    normalizer = _Normalizer(import_aliases(tree))
    out: list[str] = []
    for node in model.body:
        if _is_docstring(node):
            continue
        if isinstance(node, ast.FunctionDef):
            out.append(node.name)
            for stmt in node.body:
                if not _is_docstring(stmt) and not _is_super_init(stmt):
                    out.extend(_tokens(normalizer.visit(stmt)))
        else:
            out.extend(_tokens(normalizer.visit(node)))
    return out


def ast_hash(tokens: list[str]) -> str:
    return hashlib.sha256("\x1f".join(tokens).encode()).hexdigest()


def similarity(a: list[str], b: list[str]) -> float:
    return SequenceMatcher(None, a, b, autojunk=False).ratio()


# ---- operator signatures ----

VIEWS = frozenset("""view reshape permute transpose t contiguous size dim numel unsqueeze squeeze expand expandas
flatten unflatten viewas narrow select chunk split detach clone to float double half cpu cuda type item
zeros zeroslike ones oneslike empty emptylike full fulllike arange tensor astensor newzeros newones newempty
parameter sequential modulelist moduledict identity""".split())
_ALIASES = {"batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm", "batchnorm3d": "batchnorm",
            "instancenorm1d": "instancenorm", "instancenorm2d": "instancenorm", "instancenorm3d": "instancenorm",
            "multiply": "mul", "subtract": "sub", "divide": "div", "truedivide": "div", "absolute": "abs",
            "clip": "clamp", "mm": "matmul", "linalgvectornorm": "vectornorm"}
_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.MatMult: "matmul", ast.Pow: "pow",
           ast.FloorDiv: "floordiv", ast.Mod: "remainder"}
_SKIPPED_CALLS = frozenset(_BUILTINS) | {"super"}


def canonical_op(name: str) -> str:
    """`torch.nn.functional.batch_norm`, `nn.BatchNorm2d`, `x.relu_` -> `batchnorm`, `batchnorm`, `relu`."""
    base = name.rsplit(".", 1)[-1].rstrip("_").replace("_", "").lower()
    return _ALIASES.get(base, base)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return None


class _Signature(ast.NodeVisitor):
    """Operators in evaluation order: a call's receiver and arguments before the call itself."""

    def __init__(self, modules: dict[str, list[str]]):
        self.modules = modules
        self.ops: list[str] = []

    def _add(self, name: str) -> None:
        if name and name not in VIEWS:
            self.ops.append(name)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            self.visit(func.value)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            self.visit(arg)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            for name in self.modules.get(func.attr, []):
                self._add(name)
        elif isinstance(func, ast.Name):
            if func.id not in _SKIPPED_CALLS:
                self._add(canonical_op(func.id))
        elif isinstance(func, ast.Attribute):
            self._add(canonical_op(func.attr))

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.visit(node.left)
        self.visit(node.right)
        self._add(_BINOPS.get(type(node.op), ""))


def _module_ops(value: ast.expr) -> list[str]:
    """The operators an `__init__` assignment's value stands for (containers expanded)."""
    if isinstance(value, ast.Call):
        name = _dotted(value.func) or ""
        short = canonical_op(name)
        if short in ("sequential", "modulelist"):
            first = value.args[0] if value.args else None
            items = first.elts if isinstance(first, (ast.List, ast.Tuple)) else value.args
            return [op for item in items for op in _module_ops(item)]
        if short in VIEWS:
            return []
        return [short]
    if isinstance(value, (ast.List, ast.Tuple)):
        return [op for item in value.elts for op in _module_ops(item)]
    return []


def op_signature(source: str) -> tuple[str, ...]:
    """The canonical operator sequence of `Model.forward` (empty when there is no Model)."""
    tree = parse(source)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return ()
    methods = {n.name: n for n in model.body if isinstance(n, ast.FunctionDef)}
    modules: dict[str, list[str]] = {}
    if "__init__" in methods:
        for node in ast.walk(methods["__init__"]):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        modules[target.attr] = _module_ops(node.value)
    visitor = _Signature(modules)
    if "forward" in methods:
        for stmt in methods["forward"].body:
            visitor.visit(stmt)
    return tuple(visitor.ops)


# ---- the benchmark a dataset is decontaminated against ----

@dataclass(frozen=True)
class _Reference:
    name: str
    tokens: list[str]
    counts: Counter
    signature: tuple[str, ...]


class BenchmarkIndex:
    """Every problem file under a folder (e.g. a KernelBench checkout's KernelBench/), normalized once."""

    def __init__(self, root: str | Path):
        root = Path(root)
        if not root.is_dir():
            raise DataFileError(f"benchmark {root}: no such folder")
        self.root = root
        self.entries: list[_Reference] = []
        self.signatures: dict[tuple[str, ...], str] = {}
        for path in sorted(root.rglob("*.py")):
            try:
                source = path.read_text(encoding="utf-8", errors="replace")
                tokens = model_tokens(source)
                signature = op_signature(source)
            except (SyntaxError, ValueError):
                continue   # not a problem file (a helper or a broken file): nothing to match against
            name = str(path.relative_to(root))
            self.entries.append(_Reference(name, tokens, Counter(tokens), signature))
            if signature:
                self.signatures.setdefault(signature, name)
        if not self.entries:
            raise DataFileError(f"benchmark {root}: no Python problem files found")

    def most_similar(self, tokens: list[str], threshold: float) -> tuple[str, float] | None:
        """The first benchmark file whose model (`model_tokens`) is at least `threshold` similar,
        with its score (cheap upper bounds of difflib's ratio skip most files before the exact
        ratio is computed)."""
        if not tokens:
            return None
        counts = Counter(tokens)
        for ref in self.entries:
            total = len(tokens) + len(ref.tokens)
            if not ref.tokens:
                continue
            if 2.0 * min(len(tokens), len(ref.tokens)) / total < threshold:
                continue
            if 2.0 * sum((counts & ref.counts).values()) / total < threshold:
                continue
            score = similarity(tokens, ref.tokens)
            if score >= threshold:
                return ref.name, score
        return None

    def same_signature(self, signature: tuple[str, ...]) -> str | None:
        return self.signatures.get(signature) if signature else None

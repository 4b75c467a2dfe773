"""Static checks of a candidate's sources, before anything of it runs.

Python: stops the cheap escapes from the run-time rules. Imports and every attribute chain that
starts at an imported name resolve against an allow-list of modules, so a module that an allowed
module re-exports (torch.os, hpc.runtime.ctypes, cpp_extension.subprocess, F.np) is refused however
it is reached; a module is never a value (no aliases to look through); dynamic code (exec, eval,
__import__), every dunder but __init__ and work outside the op monitor's view (torch.compile, CUDA
graphs, numpy, tolist...) are refused.
load_inline: its sources and flags must be literal (or names and sums of literals), so the
check sees what is compiled. The C++ may not touch what the op monitor relies on (RecordFunction,
its callbacks, dispatch keys and TLS), reach Python, load libraries, bind symbols by name or call
kernels past the dispatcher, and refuses the preprocessor routes around a name check.
Workdir kernel sources: no torch headers (the workdir format's contract), and vendor libraries only
where the config's `rules.libraries` allows them (CUDA Agent allows e.g. cuBLAS for GEMM); an allowed library
is also what gets linked.
"""

from __future__ import annotations

import ast
import codecs
import importlib
import io
import re
import sys
import tokenize
import types
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from hpc.parsing import parse

# ---------------------------------------------------------------------------------------- Python

PUBLIC = None   # every public attribute that is not a module; a module only where MODULES lists it
MODULES: dict[str, frozenset[str] | None] = {
    "torch": PUBLIC, "torch.nn": PUBLIC, "torch.nn.functional": PUBLIC, "torch.nn.init": PUBLIC,
    "torch.cuda": PUBLIC, "torch.autograd": PUBLIC, "torch.fft": PUBLIC, "torch.linalg": PUBLIC,
    "torch.special": PUBLIC, "math": PUBLIC,
    "torch.utils": frozenset(), "torch.utils.cpp_extension": frozenset({"load_inline"}),
    "hpc": frozenset(), "hpc.runtime": frozenset({"load_kernels"}),
    "typing": frozenset({"Any", "Callable", "ClassVar", "Dict", "Final", "Iterable", "Iterator", "List", "Literal",
                         "Mapping", "NamedTuple", "Optional", "Sequence", "Tuple", "Type", "TypeVar", "Union",
                         "TYPE_CHECKING", "cast", "overload"}),   # not get_type_hints: it evals annotations
    "functools": frozenset({"cache", "cached_property", "cmp_to_key", "lru_cache", "partial", "reduce",
                            "total_ordering"}),   # not wraps: it sets attributes of its target
    "dataclasses": frozenset({"dataclass", "field", "fields", "replace", "asdict", "astuple"}),
    "__future__": frozenset({"annotations"}),
}
ALLOWED_IMPORTS = frozenset(MODULES)
LOAD_INLINE = "torch.utils.cpp_extension.load_inline"
FORBIDDEN_NAMES = frozenset({"exec", "eval", "compile", "__import__", "open", "breakpoint", "globals", "locals",
                             "vars", "getattr", "setattr", "delattr", "__builtins__", "memoryview"})
ALLOWED_DUNDER_NAMES = frozenset({"__file__", "__name__"})   # load_kernels(__file__)
FORBIDDEN_ATTRIBUTES = frozenset({"_C", "_dynamo", "_python_dispatch", "settrace", "setprofile", "f_back",
                                  "f_globals", "gi_frame", "load", "save", "hub", "cudart", "library",
                                  # modules torch imports are its attributes: torch.sys, torch.ctypes...
                                  "sys", "os", "ctypes", "importlib", "inspect", "builtins", "threading",
                                  "multiprocessing", "signal", "platform", "glob", "subprocess", "modules",
                                  "types", "gc", "pickle", "io", "shutil", "pathlib", "socket", "weakref",
                                  # work the op monitor does not see: generated kernels, replayed graphs,
                                  # numpy or Python doing the math, allocations outside torch's
                                  "compile", "graph", "CUDAGraph", "make_graphed_callables", "numpy",
                                  "from_numpy", "frombuffer", "from_file", "tolist", "apply_", "map_", "map2_",
                                  "CUDAPluggableAllocator", "change_current_allocator", "caching_allocator_alloc"})
ALLOWED_DUNDERS = frozenset({"__init__"})   # super().__init__(); every other dunder reaches the interpreter


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def python_text(data: bytes) -> tuple[str, str]:
    """The text Python reads from a source file's bytes, and "" ; or ("", why it is refused). Only
    UTF-8 is read: a declared encoding (PEP 263) makes Python decode the bytes otherwise than a
    checker that reads them as UTF-8 (with shift_jis, a byte pair that ends a string literal for
    Python and not for the checker hid imports of os and ctypes), so the check would not read the
    code that runs."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:
        return "", f"the source's encoding declaration is refused: {e.msg}"
    if codecs.lookup(encoding).name not in ("utf-8", "utf-8-sig"):
        return "", f"the source declares the encoding {encoding}: only UTF-8 sources are read"
    try:
        return data.decode(encoding), ""
    except UnicodeDecodeError as e:
        return "", f"the source is not UTF-8 (byte {e.start} of it)"


def source_defect(source: str, filename: str, allowed_libraries: Sequence[str] = ()) -> str:
    """The first rule broken by the candidate's Python source (and the C++ it gives load_inline),
    or "" when there is none. `allowed_libraries`: the vendor libraries inline C++ may use."""
    try:
        tree = parse(source, filename=filename)
    except SyntaxError as e:
        where = f"{Path(filename).name}: syntax error"
        return f"{where} at line {e.lineno}: {e.msg}" if e.lineno else f"{where}: {e.msg}"
    except ValueError as e:   # NUL bytes (Python 3.11)
        return f"not Python source: {e}"
    except (RecursionError, MemoryError):
        return "the source is nested too deeply to check"
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        return "defines no class ModelNew"
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    imported: dict[str, tuple[str, ...]] = {}   # local name -> the dotted path it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            defect = import_defect(node)
            if defect:
                return f"line {node.lineno}: {defect}"
            for alias in node.names:
                if isinstance(node, ast.Import):
                    path = tuple(alias.name.split(".")) if alias.asname else (alias.name.split(".")[0],)
                else:
                    path = (*node.module.split("."), alias.name)
                imported[alias.asname or path[-1]] = path
    for node in ast.walk(tree):
        defect = _node_defect(node, imported, parents, tree, allowed_libraries)
        if defect:
            return f"line {getattr(node, 'lineno', '?')}: {defect}"
    return ""


def import_defect(node: ast.Import | ast.ImportFrom) -> str:
    """Why an import statement is refused, or "": each module must be allowed, and each name a
    from-import takes must be an allowed module or an attribute allowed for its module."""
    for alias in node.names:
        if alias.asname and (alias.asname in FORBIDDEN_NAMES or alias.asname in FORBIDDEN_ATTRIBUTES
                             or _dunder(alias.asname)):
            return f"import as {alias.asname} is not allowed"
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name not in ALLOWED_IMPORTS:
                return f"import of {alias.name} is not allowed"
        return ""
    module = node.module or ""
    if node.level or module not in MODULES:
        return f"import from {'.' * node.level}{module} is not allowed"
    for alias in node.names:
        if alias.name == "*":
            return f"import * from {module} is not allowed (import names one by one)"
        defect = _chain_defect((*module.split("."), alias.name))[0]
        if defect:
            return defect
    return ""


@lru_cache(maxsize=4096)
def _chain_defect(path: tuple[str, ...]) -> tuple[str, str | None]:
    """(why the dotted path is refused or "", the allowed module it names or None). Walks the real
    modules (the harness's, the same torch as the worker's) so re-exports are seen for what they are."""
    module: str | None = path[0]
    if module not in MODULES:
        return f"{module} is not an allowed module", None
    for i, name in enumerate(path[1:], 1):
        where = ".".join(path[:i + 1])
        if name.startswith("_"):
            if not (module is None and name in ALLOWED_DUNDERS):
                return f"access to {where} is not allowed (private)", None
            continue
        if name in FORBIDDEN_ATTRIBUTES:
            return f"access to {where} is not allowed", None
        if module is None:
            continue
        if f"{module}.{name}" in MODULES:
            module = f"{module}.{name}"
            continue
        allowed = MODULES[module]
        if allowed is not PUBLIC:
            if name not in allowed:
                return f"{where} is not allowed (from {module}: {', '.join(sorted(allowed)) or 'modules only'})", None
            module = None
            continue
        value = vars(sys.modules.get(module) or importlib.import_module(module)).get(name, _MISSING)
        if value is _MISSING:
            return f"{where} does not exist", None
        if isinstance(value, types.ModuleType):
            return f"{where} is the module {value.__name__}, which is not allowed", None
        module = None
    return "", module


_MISSING = object()


def _node_defect(node: ast.AST, imported: dict, parents: dict, tree: ast.Module, libraries: Sequence[str]) -> str:
    if isinstance(node, ast.Name):
        if node.id in FORBIDDEN_NAMES or (_dunder(node.id) and node.id not in ALLOWED_DUNDER_NAMES):
            return f"use of {node.id} is not allowed"
        if node.id in imported:
            if not isinstance(node.ctx, ast.Load):
                return f"{node.id} is imported: it may not be rebound"
            return _imported_use_defect(node, imported, parents, tree, libraries)
    elif isinstance(node, ast.Attribute):
        if node.attr in FORBIDDEN_ATTRIBUTES or (_dunder(node.attr) and node.attr not in ALLOWED_DUNDERS):
            return f"access to .{node.attr} is not allowed"
        if not isinstance(node.ctx, ast.Load) and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            # torch.equal = ..., Tensor.clone = ...: the harness runs torch in the same process
            return f"assigning {ast.unparse(node)} is not allowed (only attributes of self)"
    elif isinstance(node, ast.MatchClass):   # case C(attr=...) reads attributes by name
        for attr in node.kwd_attrs:
            if attr in FORBIDDEN_ATTRIBUTES or attr.startswith("_"):
                return f"access to .{attr} is not allowed"
    return ""


def _imported_use_defect(name: ast.Name, imported: dict, parents: dict, tree: ast.Module,
                         libraries: Sequence[str]) -> str:
    """An imported name with the attribute chain on it: the chain must resolve, a module is only
    ever the base of an attribute, and load_inline is only ever called."""
    top, path = name, imported[name.id]
    while isinstance(parents.get(top), ast.Attribute):
        top = parents[top]
        path = (*path, top.attr)
    defect, module = _chain_defect(path)
    if defect:
        return defect
    if module is not None:
        return f"the module {module} is used as a value (only module.attribute is allowed)"
    if ".".join(path) == LOAD_INLINE:
        call = parents.get(top)
        if not (isinstance(call, ast.Call) and call.func is top):
            return "load_inline is used other than by calling it"
        return load_inline_defect(call, tree, libraries)
    return ""


# --------------------------------------------------------------------------- load_inline arguments

_INLINE_POSITIONAL = ("name", "cpp_sources", "cuda_sources")   # the same in every torch version
_INLINE_SOURCES = frozenset({"cpp_sources", "cuda_sources", "sycl_sources"})
_INLINE_FLAGS = frozenset({"extra_cflags", "extra_cuda_cflags", "extra_sycl_cflags", "extra_ldflags",
                           "extra_include_paths"})


class _NotStatic(Exception):
    """An expression whose value the check cannot know without running the candidate."""


def load_inline_defect(call: ast.Call, tree: ast.Module, libraries: Sequence[str]) -> str:
    """The sources, flags and build directory of a load_inline call must be static (literals,
    module-level names bound once to them, `+`, f-strings of those, str.join): the sources checked
    are then the sources built. Anything else (a call, chr(), % or .format) is refused."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return "load_inline arguments must be written out (no *args / **kwargs)"
    if len(call.args) > len(_INLINE_POSITIONAL):
        return f"load_inline takes {', '.join(_INLINE_POSITIONAL)} by position, the rest by keyword"
    arguments = dict(zip(_INLINE_POSITIONAL, call.args)) | {k.arg: k.value for k in call.keywords}
    constants, values = _module_constants(tree), {}
    for parameter, expr in arguments.items():
        if parameter not in _INLINE_SOURCES | _INLINE_FLAGS | {"build_directory"}:
            continue   # name, functions, verbose...: they do not change what is compiled
        try:
            value = _static(expr, constants, values, ())
        except (_NotStatic, RecursionError) as e:
            return (f"load_inline's {parameter} is not a literal ({e}): sources and flags must be written as "
                    "string literals (or module-level names of them, joined by +) for the static check to see them")
        if parameter == "build_directory" and value is not None:
            return "load_inline's build_directory is not allowed: the evaluator chooses where extensions build"
        if value is None:
            continue
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return f"load_inline's {parameter} must be a string or a list of strings"
        defect = (next(filter(None, (native_source_defect(t, libraries) for t in texts)), "")
                  if parameter in _INLINE_SOURCES else flags_defect(texts, libraries))
        if defect:
            return f"load_inline's {parameter}: {defect}"
    return ""


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level names assigned once, and bound nowhere else in the file."""
    bindings: dict[str, int] = {}
    for node in ast.walk(tree):
        for name in _bound_names(node):
            bindings[name] = bindings.get(name, 0) + 1
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        if bindings.get(target) == 1:
            constants[target] = value
    return constants


def _bound_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
        return [node.id]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.arg):
        return [node.arg]
    return []


_STATIC_LIMIT = 4 << 20   # characters: a candidate is at most 4 MiB, and x = y + y doubles


def _static(expr: ast.expr, constants: dict[str, ast.expr], values: dict, seen: tuple[str, ...]):
    """The value of `expr` computed from literals alone; `values` memoizes the module constants."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str | int | float | bool | type(None)):
        return expr.value
    if isinstance(expr, ast.List | ast.Tuple):
        return _bounded([_static(e, constants, values, seen) for e in expr.elts])
    if isinstance(expr, ast.Name):
        if expr.id not in constants or expr.id in seen:
            raise _NotStatic(f"{expr.id} is not a module-level name assigned once")
        if expr.id not in values:
            values[expr.id] = _static(constants[expr.id], constants, values, (*seen, expr.id))
        return values[expr.id]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _static(expr.left, constants, values, seen), _static(expr.right, constants, values, seen)
        if type(left) is type(right) and isinstance(left, str | list):
            return _bounded(left + right)
    if isinstance(expr, ast.JoinedStr):
        return _bounded("".join(_static(v, constants, values, seen) for v in expr.values))
    if isinstance(expr, ast.FormattedValue) and expr.conversion == -1 and expr.format_spec is None:
        value = _static(expr.value, constants, values, seen)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "join"
            and isinstance(expr.func.value, ast.Constant) and isinstance(expr.func.value.value, str)
            and len(expr.args) == 1 and not expr.keywords):
        parts = _static(expr.args[0], constants, values, seen)
        if isinstance(parts, list) and all(isinstance(p, str) for p in parts):
            return _bounded(expr.func.value.value.join(parts))
    raise _NotStatic(f"{ast.unparse(expr)[:60]!r} at line {expr.lineno}")


def _bounded(value: str | list) -> str | list:
    size = len(value) if isinstance(value, str) else sum(len(v) if isinstance(v, str) else 1 for v in value)
    if size > _STATIC_LIMIT:
        raise _NotStatic("a value of more than 4 Mi characters")
    return value


# ------------------------------------------------------------------------------------------ C++

# Anywhere in the text (code, strings, comments): what the op monitor and the library rules rely on.
# Names are matched as substrings, so a mangled symbol in a string is caught too.
_NATIVE_FORBIDDEN = [
    (re.compile(r"RecordFunction|record_function|RECORD_FUNCTION|(?:clear|remove|disable|reenable|add)\w*Callback"),
     "switching the op monitor's RecordFunction callbacks off is not allowed"),
    (re.compile(r"DispatchKey|dispatch_key|AutoDispatch|AutoNonVariableTypeMode|redispatch|Dispatcher|ModeTLS"
                r"|FunctionTLS|ThreadLocalState|TORCH_LIBRARY"),
     "changing how torch dispatches operators is not allowed"),
    (re.compile(r"(?<![A-Za-z])_*Py[A-Za-z]*_[A-Za-z]|get_internals|ob_type|tp_dict|__builtins__"),
     "reaching the Python interpreter is not allowed"),
    (re.compile(r"dlopen|dlmopen|dlsym|dlvsym|dl_iterate_phdr|_dl_|DynamicLibrary"),
     "dynamic loading is not allowed (libraries come from rules.libraries)"),
]
# Identifiers in code: pybind11's ways into Python, and symbol binding by name.
_NATIVE_IDENTIFIERS = {
    **dict.fromkeys(("import", "exec", "eval", "eval_file", "globals", "getattr", "setattr", "hasattr", "delattr"),
                    "reaching the Python interpreter is not allowed"),
    **dict.fromkeys(("weakref", "__weakref__", "alias", "__alias__", "ifunc", "__ifunc__", "symver", "__symver__",
                     "weak", "redefine_extname"), "binding a symbol by name is not allowed"),
}
# Namespaces of kernels called directly, past the dispatcher (and so past the op monitor).
_KERNEL_NAMESPACES = re.compile(r"native|cpu|meta|composite\w*")
# Vendor libraries in load_inline sources: what names them (and torch's wrappers of them).
_LIBRARY_IDENTIFIERS = {
    "cublas": re.compile(r"(?i:cublas)|CUDABlas|^blas$"), "cudnn": re.compile(r"(?i:cudnn)"),
    "curand": re.compile(r"(?i:curand)"), "cufft": re.compile(r"(?i:cufft)"),
    "cutlass": re.compile(r"^(?:cutlass|cute)$"), "cblas": re.compile(r"(?i:cblas)"),
}
_SPLICE = re.compile(r"(?:\\|\?\?/)[ \t]*(?:\r\n|\r|\n)")
_TOKEN = re.compile(r"""
    (?P<comment>//[^\n]*|/\*.*?(?:\*/|\Z))
  | (?P<string>(?:u8|u|U|L)?R"(?P<delim>[^()\\\s"]{0,16})\(.*?(?:\)(?P=delim)"|\Z)
             |(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*"?|(?:u8|u|U|L)?'(?:\\.|[^'\\\n])*'?)
  | (?P<number>\.?\d(?:[eEpP][+-]|'?[\w.])*)
  | (?P<ident>[^\W\d][\w$]*|\$[\w$]*)
  | (?P<newline>\n)
  | (?P<space>[^\S\n]+)
  | (?P<punct>%:%:|\#\#|::|->|%:|.)
""", re.VERBOSE | re.DOTALL)


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) of every token of spliced C++ text but comments; a directive's header name is
    one "header" token."""
    out: list[tuple[str, str]] = []
    line: list[tuple[str, str]] = []   # the tokens of the current line so far
    header = re.compile(r"\s*(<[^>\n]*>?|\"[^\"\n]*\"?)?")
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        kind = m.lastgroup if m.lastgroup != "delim" else "string"
        pos = m.end()
        if kind in ("comment", "space"):
            continue
        if kind == "newline":
            line = []
            continue
        token = (kind, m.group())
        line.append(token)
        out.append(token)
        if (len(line) == 2 and line[0][1] in ("#", "%:") and kind == "ident"
                and token[1] in ("include", "include_next", "import", "embed")):
            h = header.match(text, pos)
            out.append(("header", h.group(1) or ""))
            pos = h.end()
    return out


def native_source_defect(text: str, allowed_libraries: Sequence[str] = ()) -> str:
    """The first problem in C++/CUDA source given to load_inline, or "". Names are checked in the
    text as written and as spliced (line continuations joined, so `clear\\<newline>Callbacks` is
    one name); `##` is refused, so the preprocessor cannot assemble a name the check never saw."""
    text = _SPLICE.sub("", text)
    defect = _forbidden_name(text)
    if defect:
        return defect
    if re.search(r"\\[uU][0-9a-fA-F]{4}", text):
        return "universal character names (\\u...) are not allowed"
    tokens = _tokens(text)
    return (_token_defect(tokens) or _asm_label_defect(tokens) or _kernel_namespace_defect(tokens)
            or _library_defect(tokens, allowed_libraries))


def _forbidden_name(text: str) -> str:
    for pattern, reason in _NATIVE_FORBIDDEN:
        m = pattern.search(text)
        if m:
            return f"{m.group()!r}: {reason}"
    return ""


def _token_defect(tokens: list[tuple[str, str]]) -> str:
    for i, (kind, tok) in enumerate(tokens):
        if tok in ("##", "%:%:"):
            return "token pasting (##) is not allowed: it builds names the check cannot see"
        if kind == "ident" and tok in _NATIVE_IDENTIFIERS:
            return f"{tok!r}: {_NATIVE_IDENTIFIERS[tok]}"
        if tok == "attr" and i and tokens[i - 1][1] in (".", "->"):   # pybind11's obj.attr("name")
            return "'.attr': reaching the Python interpreter is not allowed"
        if kind == "header" and not tok:
            return "#include of a macro is not allowed: name the header"
    return ""


def _asm_label_defect(tokens: list[tuple[str, str]]) -> str:
    """`void f() asm("symbol")` binds any symbol by its (mangled) name, built from pieces the name
    check sees apart. An asm statement has operands (a `:`) or instructions (a `;` in its string);
    a label has neither."""
    for i, (kind, tok) in enumerate(tokens):
        if kind != "ident" or tok not in ("asm", "__asm", "__asm__"):
            continue
        j = i + 1
        while j < len(tokens) and tokens[j][1] in ("volatile", "__volatile__", "goto", "inline"):
            j += 1
        if j >= len(tokens) or tokens[j][1] != "(":
            return "asm other than asm(...) is not allowed"
        depth, statement = 0, False
        for kind2, tok2 in tokens[j:]:
            depth += (tok2 == "(") - (tok2 == ")")
            statement |= (depth == 1 and tok2 in (":", "::")) or (kind2 == "string" and ";" in tok2)
            if depth == 0:
                break
        if not statement:
            return "asm labels are not allowed (an inline asm statement needs instructions or operands)"
    return ""


@lru_cache(maxsize=1)
def _aten_op_names() -> frozenset[str]:
    import torch

    return frozenset(n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                     if n.startswith("aten::"))


def _kernel_namespace_defect(tokens: list[tuple[str, str]]) -> str:
    """at::native::relu, at::cpu::add, at::cuda::mm... run a kernel without the dispatcher, unseen by
    the op monitor. at::cuda's streams and guards stay usable: `cuda` may only be followed by `::`
    and a name that is no operator, or be a method (`.cuda()`)."""
    def tok(k: int) -> str:
        return tokens[k][1] if 0 <= k < len(tokens) else ""

    for i, (kind, name) in enumerate(tokens):
        if kind != "ident":
            continue
        if _KERNEL_NAMESPACES.fullmatch(name) and "::" in (tok(i - 1), tok(i + 1)):
            return f"namespace {name}: kernels called past the dispatcher are not allowed"
        if name == "cuda" and tok(i - 1) not in (".", "->"):
            if tok(i + 1) != "::":
                return "at::cuda may only be used as at::cuda::name (no aliases or using-directives)"
            if tok(i + 2) in _aten_op_names():
                return f"cuda::{tok(i + 2)}: kernels called past the dispatcher are not allowed"
    return ""


def _library_defect(tokens: list[tuple[str, str]], allowed_libraries: Sequence[str]) -> str:
    for kind, tok in tokens:
        for lib, pattern in _LIBRARY_IDENTIFIERS.items():
            if lib in allowed_libraries:
                continue
            if kind == "header" and tok[1:].startswith(LIBRARIES[lib][0]):
                return f"includes {tok}: library {lib} is not allowed by rules.libraries"
            if kind == "ident" and pattern.search(tok):
                return f"{tok!r}: library {lib} is not allowed by rules.libraries"
    return ""


_FLAG_REFUSED = ("-include", "--include", "-imacros", "--imacros", "--pre-include", "-wrapper", "-fplugin",
                 "-specs", "--specs", "-B", "@", "--defsym", "-defsym", "--wrap", "-wrap", "-ccbin",
                 "--compiler-bindir", "-x", "--linker-options", "-o", "--output-file")
_MACRO_FLAGS = ("-D", "--define-macro")


def flags_defect(flags: Sequence[str], allowed_libraries: Sequence[str] = ()) -> str:
    """The first problem in compiler or linker flags given to load_inline, or "": no flag that
    includes, wraps or defines symbols, runs other programs, or links a library rules.libraries does not
    allow; a flag that defines a macro is checked as source."""
    previous = ""
    for flag in flags:
        for piece in re.split(r"[\s,]+", flag):
            if piece.startswith(_FLAG_REFUSED):
                return f"flag {flag!r} is not allowed"
            for lib, (_, link) in LIBRARIES.items():
                if piece in link and lib not in allowed_libraries:
                    return f"flag {flag!r}: library {lib} is not allowed by rules.libraries"
        macro = previous in _MACRO_FLAGS or any(m in flag for m in _MACRO_FLAGS)
        defect = native_source_defect(flag.replace("=", " "), allowed_libraries) if macro else _forbidden_name(flag)
        if defect:
            return f"flag {flag!r}: {defect}"
        previous = flag
    return ""


# ----------------------------------------------------------------------------- workdir kernels

# library -> (headers that use it, linker flags when rules.libraries allows it)
LIBRARIES = {
    "cublas": (("cublas_v2.h", "cublas_api.h", "cublas.h", "cublasLt.h"), ("-lcublas", "-lcublasLt")),
    "cudnn": (("cudnn.h",), ("-lcudnn",)),
    "curand": (("curand.h", "curand_kernel.h"), ("-lcurand",)),
    "cufft": (("cufft.h",), ("-lcufft",)),
    "cutlass": (("cutlass/", "cute/"), ()),
    "cblas": (("cblas.h", "mkl.h", "mkl_cblas.h"), ("-lcblas",)),
}
_TORCH_HEADERS = ("torch/", "ATen/", "c10/", "pybind11/", "Python.h")
_DYNAMIC_LOADING = re.compile(r"(dlopen|dlmopen|dlsym|dlvsym|dl_iterate_phdr)")


def kernel_defect(files: dict[str, bytes], allowed_libraries: list[str]) -> str:
    """The first problem in a workdir's kernel sources under the library rules, or ""."""
    for name, data in sorted(files.items()):
        if not name.startswith("kernels/"):
            continue
        text = _SPLICE.sub("", data.decode("utf-8", "replace"))
        loader = _DYNAMIC_LOADING.search(text)
        if loader:
            return (f"{name} calls {loader.group(1)}: dynamic loading is not allowed "
                    "(libraries come from rules.libraries)")
        tokens = _tokens(text)
        asm = _asm_label_defect(tokens)
        if asm:
            return f"{name}: {asm}"
        for kind, header in tokens:
            if kind != "header":
                continue
            if not header:
                return f"{name}: #include of a macro is not allowed: name the header"
            header = header[1:-1]
            if header.startswith(_TORCH_HEADERS):
                return f"{name} includes {header}: workdir kernels must not include torch or Python headers"
            for lib, (headers, _) in LIBRARIES.items():
                if header.startswith(headers) and lib not in allowed_libraries:
                    return f"{name} includes {header}: library {lib} is not allowed by rules.libraries"
    return ""


def link_flags(allowed_libraries: list[str]) -> tuple[str, ...]:
    return tuple(flag for lib in allowed_libraries for flag in LIBRARIES[lib][1])

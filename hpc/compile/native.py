"""Compile a workdir's torch-free kernel sources into one shared library, cached by content.

Sources include no torch headers, so a single-kernel candidate compiles in about a second
instead of the ~40-60 s that `load_inline` spends on torch/extension.h. Each source becomes
an object in parallel; objects are linked into `kernels.so`. The cache key covers the
sources, the flags, the target arch and the compiler's own version string, so a cache hit
can never hand back an object built differently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_SUFFIX = {"cpu": ".cpp", "cuda": ".cu"}
LIBRARY_NAME = "kernels.so"


@dataclass(frozen=True)
class Toolchain:
    """Compiler and flags for one backend; part of every cache key."""

    backend: str
    compiler: str
    flags: tuple[str, ...]
    link_flags: tuple[str, ...] = ()

    def version(self) -> str:
        return _compiler_version(self.compiler)


def arch_flags(cuda_arch: str) -> tuple[str, ...]:
    """nvcc's target flags for `cuda_arch`. An arch-specific target (sm_90a: wgmma, setmaxnreg, the
    tensor copy engine's multicast) is written as -gencode: nvcc 13.0's -arch=sm_90a shorthand also
    runs a plain sm_90 pass that rejects those instructions."""
    if cuda_arch.startswith("sm_") and cuda_arch.endswith("a"):
        return (f"-gencode=arch=compute_{cuda_arch[3:]},code={cuda_arch}",)
    return (f"-arch={cuda_arch}",)


def default_toolchain(backend: str, cuda_arch: str = "sm_90a", extra_link: tuple[str, ...] = ()) -> Toolchain:
    """The toolchain the evaluator uses unless the config overrides it.

    Libraries link with no undefined symbols: a kernel cannot reach a library the policy did not
    link (cuBLAS, BLAS, torch's own) by declaring its functions itself and resolving them at load.
    """
    if backend == "cpu":
        return Toolchain(
            "cpu", os.environ.get("CXX", "g++"),
            ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC"),
            ("-fopenmp", "-Wl,--no-undefined") + extra_link,
        )
    if backend == "cuda":
        return Toolchain(
            "cuda", os.environ.get("NVCC", "nvcc"),
            ("-O3", *arch_flags(cuda_arch), "-std=c++17", "--use_fast_math", "-Xcompiler", "-fPIC,-O3"),
            ("-Xlinker", "--no-undefined") + extra_link,
        )
    raise ValueError(f"unknown backend {backend!r}")


@dataclass
class CompileResult:
    ok: bool
    library: Path | None
    cached: bool
    seconds: float
    log: str = ""
    key: str = ""
    sources: list[str] = field(default_factory=list)


_VERSION_CACHE: dict[str, str] = {}


def _compiler_version(compiler: str) -> str:
    if compiler not in _VERSION_CACHE:
        try:
            out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
            _VERSION_CACHE[compiler] = out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            _VERSION_CACHE[compiler] = f"unavailable: {e}"
    return _VERSION_CACHE[compiler]


def _host_arch() -> str:
    """What -march=native means here: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    model = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return hashlib.sha256((model + flags).encode()).hexdigest()[:16]


def kernel_sources(workdir: Path, backend: str) -> list[Path]:
    """The sources a workdir contributes for a backend: kernels/*.cpp (cpu) or kernels/*.cu (cuda)."""
    kdir = Path(workdir) / "kernels"
    if not kdir.is_dir():
        return []
    return sorted(p for p in kdir.iterdir() if p.suffix == SOURCE_SUFFIX[backend] and p.is_file())


def cache_key(sources: list[Path], headers: list[Path], toolchain: Toolchain) -> str:
    h = hashlib.sha256()
    for part in (toolchain.compiler, toolchain.version(), " ".join(toolchain.flags),
                 " ".join(toolchain.link_flags), _host_arch() if toolchain.backend == "cpu" else ""):
        h.update(part.encode() + b"\0")
    for p in sorted(sources + headers, key=lambda p: p.name):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _headers(workdir: Path) -> list[Path]:
    kdir = Path(workdir) / "kernels"
    return sorted(p for p in kdir.iterdir() if p.suffix in (".h", ".hpp", ".cuh") and p.is_file())


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        return proc.returncode, (proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        return -1, f"compiler timed out after {timeout:.0f} s: {' '.join(cmd[:3])} ..."
    except OSError as e:
        return -1, f"cannot run {cmd[0]}: {e}"


_LINKER_WEAK = frozenset({"__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable",
                          "__cxa_finalize"})
_TORCH_MANGLED = ("_ZN2at", "_ZN3c10", "_ZN5torch", "_ZNK2at", "_ZNK3c10", "_ZNK5torch")


def symbol_defect(library: Path, timeout: float = 60.0) -> str:
    """What the linked library reaches outside its own code and the linked libraries, or "".

    Linking with --no-undefined leaves two ways to resolve a symbol from the host process at load
    time: the interpreter's own exports and weak references. Either would let kernels run Python
    (patch timers, call torch) or a library the policy did not link, so both are refused here.
    """
    rc, out = _run(["nm", "-D", "--undefined-only", str(library)], timeout)
    if rc != 0:
        return f"cannot list the library's symbols with nm: {out.strip()[:200]}"
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        kind, name = parts[-2], parts[-1].split("@")[0]
        if name.startswith(("Py", "_Py")):
            return f"kernels use the Python C API ({name}): not allowed"
        if name.startswith(_TORCH_MANGLED):
            return f"kernels call into torch ({name}): not allowed"
        if kind in ("w", "v") and name not in _LINKER_WEAK:
            return f"weak reference to {name}: kernels may only use symbols of the libraries they link"
    return ""


def compile_workdir(workdir: Path, toolchain: Toolchain, cache_dir: Path,
                    timeout: float = 120.0, jobs: int | None = None, trusted: bool = False) -> CompileResult:
    """Compile kernels/*.{cpp,cu} of `workdir` into a cached shared library.

    Compilation happens in a private temp dir copy of the sources, so a compiler run never
    writes into the candidate's workdir, and the finished library appears atomically. Only the
    harness's own sources are `trusted`: they may call into torch (the symbol check is skipped).
    """
    import time

    t0 = time.monotonic()
    workdir = Path(workdir)
    sources = kernel_sources(workdir, toolchain.backend)
    if not sources:
        return CompileResult(False, None, False, 0.0,
                             f"no kernels/*{SOURCE_SUFFIX[toolchain.backend]} sources in the workdir")
    headers = _headers(workdir)
    key = cache_key(sources, headers, toolchain)
    out_dir = Path(cache_dir) / "native" / key
    library = out_dir / LIBRARY_NAME
    if library.is_file():
        return CompileResult(True, library, True, time.monotonic() - t0, "", key, [s.name for s in sources])

    Path(cache_dir, "native").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=Path(cache_dir) / "native", prefix=".build-") as tmp:
        build = Path(tmp)
        for p in sources + headers:
            shutil.copyfile(p, build / p.name)
        objects = [build / (s.name + ".o") for s in sources]
        cmds = [[toolchain.compiler, *toolchain.flags, "-c", str(build / s.name), "-o", str(o)]
                for s, o in zip(sources, objects)]
        with ThreadPoolExecutor(max_workers=jobs or min(len(cmds), os.cpu_count() or 1)) as pool:
            results = list(pool.map(lambda c: _run(c, timeout), cmds))
        logs = "\n".join(log for _, log in results if log.strip())
        if any(rc != 0 for rc, _ in results):
            return CompileResult(False, None, False, time.monotonic() - t0, logs, key, [s.name for s in sources])
        linked = build / LIBRARY_NAME
        rc, log = _run([toolchain.compiler, "-shared", *[str(o) for o in objects], "-o", str(linked),
                        *toolchain.link_flags], timeout)
        logs = (logs + "\n" + log).strip()
        if rc != 0:
            return CompileResult(False, None, False, time.monotonic() - t0, logs, key, [s.name for s in sources])
        defect = "" if trusted else symbol_defect(linked, timeout)
        if defect:
            return CompileResult(False, None, False, time.monotonic() - t0, f"error: {defect}", key,
                                 [s.name for s in sources])
        # its own folder: another thread or process may be finishing the same key
        staged = Path(tempfile.mkdtemp(dir=Path(cache_dir) / "native", prefix=f".{key}."))
        staged.chmod(0o755)   # as a plain mkdir would have made it
        shutil.move(str(linked), staged / LIBRARY_NAME)
        (staged / "compile.log").write_text(logs)
        try:
            staged.rename(out_dir)
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)  # another process finished the same key first
    return CompileResult(True, library, False, time.monotonic() - t0, logs, key, [s.name for s in sources])

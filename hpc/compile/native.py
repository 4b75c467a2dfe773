"""Compile a workdir's torch-free kernel sources into one shared library, cached by content.

Sources include no torch headers, so a single-kernel candidate compiles in about a second
instead of the ~40-60 s that `load_inline` spends on torch/extension.h. Each source becomes
an object in parallel; objects are linked into `kernels.so`. The cache key covers the
sources, the flags, the target arch and the compiler's own version string, so a cache hit
can never hand back an object built differently.

The compiler runs confined like a worker (hpc/sandbox/launch.py), since a source steers it
(`#include "/abs/path"`, `.incbin`): it reads only the system's programs, libraries and headers
(launch.TOOLCHAIN_SYSTEM: no /dev, /proc, /sys or home folder), CUDA, the toolchain's own -I/-L
folders and its build folder, a private copy of the sources, and writes only that folder; it has no network, a minimal environment, and runs as `sandbox.run_as_uid`
where the harness is root. Each compiler run is pid 1 of its own PID namespace, so a timeout
ends its whole tree (cc1plus, cicc, as), and each runs in a cgroup of its own whose memory is
bounded (`compile.memory_gb`): a source that makes the compiler grow without end (`#include` of
a device that never ends) ends that compile, never another process. Objects and the library are capped (RLIMIT_FSIZE, then
the library's size) at `compile.max_library_mb`, and so are the sources read; what goes past it
fails with a reason that names the key and is not cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hpc.sandbox import launch
from hpc.sandbox.tempdirs import owned_temporary

SOURCE_SUFFIX = {"cpu": ".cpp", "cuda": ".cu"}
LIBRARY_NAME = "kernels.so"
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
DEFAULT_MAX_LIBRARY_MB = 256
DEFAULT_MEMORY_GB = 8.0
_SIGXFSZ_EXIT = {-25, 128 + 25}
# the compiler's environment: what toolchains read, nothing of the harness's (its keys)
_ENV_KEYS = ("PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH",
             "CUDA_HOME", "CUDA_PATH", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "LANG", "LC_ALL",
             "SOURCE_DATE_EPOCH")


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

    Libraries link with no undefined symbols: a kernel cannot reach a library outside rules.libraries
    (cuBLAS, BLAS, torch's own) by declaring its functions itself and resolving them at load.
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
    return _regular_files(workdir, (SOURCE_SUFFIX[backend],))


def _regular_files(workdir: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """kernels/ files with these suffixes; links are not followed (the harness reads these files:
    a link could make it read, and so compile and print, a file the compiler could not)."""
    kdir = Path(workdir) / "kernels"
    if kdir.is_symlink() or not kdir.is_dir():
        return []
    return sorted(p for p in kdir.iterdir() if p.suffix in suffixes and stat.S_ISREG(p.lstat().st_mode))


def cache_key(sources: list[Path], headers: list[Path], toolchain: Toolchain) -> str:
    h = hashlib.sha256()
    for part in (toolchain.compiler, toolchain.version(), " ".join(toolchain.flags),
                 " ".join(toolchain.link_flags), _host_arch() if toolchain.backend == "cpu" else ""):
        h.update(part.encode() + b"\0")
    for p in sorted(sources + headers, key=lambda p: p.name):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _headers(workdir: Path) -> list[Path]:
    return _regular_files(workdir, HEADER_SUFFIXES)


COMPILE_TASKS = 512   # processes and threads of one compiler run (nvcc, cicc, ptxas and their threads)


@dataclass(frozen=True)
class _Confinement:
    """How one compile's programs run: what they read, the one folder they write, the file-size
    cap, the memory its cgroup may hold, the uid."""

    readable: tuple[str, ...]
    build: Path | None
    max_bytes: int
    uid: int | None
    memory_gb: float = DEFAULT_MEMORY_GB

    def run(self, cmd: list[str], timeout: float) -> tuple[int, str]:
        writable = () if self.build is None else (str(self.build),)
        policy = launch.Policy(readable=(*self.readable, *writable), writable=writable, uid=self.uid,
                               limits=launch.Limits(file_bytes=self.max_bytes, processes=COMPILE_TASKS),
                               background=True, memory_bytes=int(self.memory_gb * (1 << 30)),
                               system=launch.TOOLCHAIN_SYSTEM, proc=False)
        env = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
        home = str(self.build or "/")
        env.update(TMPDIR=home, HOME=home)
        try:
            rc, out, exceeded = launch.run(cmd, policy, cwd=home, env=env, timeout=timeout)
        except (launch.LaunchError, OSError) as e:
            return -1, f"cannot run {cmd[0]}: {e}"
        if "memory" in exceeded:
            return -1, (f"error: the compiler went over its memory limit (compile.memory_gb = {self.memory_gb:g} GiB): "
                        f"{' '.join(cmd[:3])} ...\n{out[-2000:]}")
        if rc is None:
            return -1, f"compiler timed out after {timeout:.0f} s: {' '.join(cmd[:3])} ..."
        if rc in _SIGXFSZ_EXIT or "File size limit exceeded" in out or "File too large" in out:
            return -1, f"error: {_too_large(self.max_bytes)}\n{out[-2000:]}"
        return rc, out


def _too_large(max_bytes: int) -> str:
    return f"kernels exceed compile.max_library_mb ({max_bytes >> 20} MB): an object, the library or the sources"


def toolchain_readable(toolchain: Toolchain) -> list[str]:
    """What the compiler reads beyond the system: its own folder, CUDA, the -I/-L/-isystem folders
    of the toolchain's flags and the include and library paths of the environment."""
    paths = launch.tool_readable(toolchain.compiler)
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(key):
            paths.append(os.environ[key])
    for key in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "LD_LIBRARY_PATH"):
        paths += [p for p in os.environ.get(key, "").split(os.pathsep) if p]
    flags = [*toolchain.flags, *toolchain.link_flags]
    for i, flag in enumerate(flags):
        if flag in ("-I", "-L", "-isystem") and i + 1 < len(flags):
            paths.append(flags[i + 1])
        elif flag.startswith(("-I", "-L")) and len(flag) > 2:
            paths.append(flag[2:])
        elif flag.startswith("-isystem") and len(flag) > 8:
            paths.append(flag[8:])
    return [p for p in dict.fromkeys(paths) if os.path.isabs(p) and os.path.exists(p)]


_LINKER_WEAK = frozenset({"__gmon_start__", "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable",
                          "__cxa_finalize"})
_TORCH_MANGLED = ("_ZN2at", "_ZN3c10", "_ZN5torch", "_ZNK2at", "_ZNK3c10", "_ZNK5torch")


def symbol_defect(library: Path, timeout: float = 60.0, confinement: _Confinement | None = None) -> str:
    """What the linked library reaches outside its own code and the linked libraries, or "".

    Linking with --no-undefined leaves two ways to resolve a symbol from the host process at load
    time: the interpreter's own exports and weak references. Either would let kernels run Python
    (patch timers, call torch) or a library outside rules.libraries, so both are refused here.
    nm runs confined too (it parses a file the candidate made).
    """
    if confinement is None:
        readable = (str(library),)
        confinement = _Confinement(readable, None, DEFAULT_MAX_LIBRARY_MB << 20, launch.run_as(65534, readable))
    rc, out = confinement.run(["nm", "-D", "--undefined-only", str(library)], timeout)
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


def compile_workdir(workdir: Path, toolchain: Toolchain, cache_dir: Path, timeout: float = 120.0,
                    jobs: int | None = None, trusted: bool = False, max_library_mb: int = DEFAULT_MAX_LIBRARY_MB,
                    run_as_uid: int = 65534, memory_gb: float = DEFAULT_MEMORY_GB) -> CompileResult:
    """Compile kernels/*.{cpp,cu} of `workdir` into a cached shared library.

    Compilation happens in a private temp folder holding a copy of the sources (so a compiler run
    never writes into the candidate's workdir, and reads no file of it but that copy), and the
    finished library appears atomically. Only the harness's own sources are `trusted`: they may
    call into torch (the symbol check is skipped). `run_as_uid`: the uid a root harness compiles as;
    `memory_gb`: what each compiler run's cgroup may hold.
    """
    import time

    t0 = time.monotonic()
    workdir = Path(workdir)
    sources = kernel_sources(workdir, toolchain.backend)
    names = [s.name for s in sources]
    if not sources:
        return CompileResult(False, None, False, 0.0,
                             f"no kernels/*{SOURCE_SUFFIX[toolchain.backend]} sources in the workdir")
    headers = _headers(workdir)
    max_bytes = max_library_mb << 20
    if sum(p.lstat().st_size for p in sources + headers) > max_bytes:
        return CompileResult(False, None, False, time.monotonic() - t0, f"error: {_too_large(max_bytes)}", "", names)
    key = cache_key(sources, headers, toolchain)
    out_dir = Path(cache_dir) / "native" / key
    library = out_dir / LIBRARY_NAME
    if library.is_file():
        return CompileResult(True, library, True, time.monotonic() - t0, "", key, names)

    def failed(log: str) -> CompileResult:
        return CompileResult(False, None, False, time.monotonic() - t0, log, key, names)

    Path(cache_dir, "native").mkdir(parents=True, exist_ok=True)
    # in the system's temp folder, which every uid can reach (the cache may sit in root's home)
    with owned_temporary("hpc-build-") as tmp:
        build = Path(tmp)
        for p in sources + headers:
            _copy_regular(p, build / p.name)
        readable = tuple(toolchain_readable(toolchain))
        uid = launch.run_as(run_as_uid, readable, [str(build)])   # LaunchError: this machine's to fix
        launch.give(uid, [build])
        confined = _Confinement(readable, build, max_bytes, uid, memory_gb)
        objects = [build / (s.name + ".o") for s in sources]
        cmds = [[toolchain.compiler, *toolchain.flags, "-c", str(build / s.name), "-o", str(o)]
                for s, o in zip(sources, objects)]
        with ThreadPoolExecutor(max_workers=jobs or min(len(cmds), os.cpu_count() or 1)) as pool:
            results = list(pool.map(lambda c: confined.run(c, timeout), cmds))
        logs = "\n".join(log for _, log in results if log.strip())
        if any(rc != 0 for rc, _ in results):
            return failed(logs)
        linked = build / LIBRARY_NAME
        rc, log = confined.run([toolchain.compiler, "-shared", *[str(o) for o in objects], "-o", str(linked),
                                *toolchain.link_flags], timeout)
        logs = (logs + "\n" + log).strip()
        if rc != 0:
            return failed(logs)
        if linked.is_symlink() or not linked.is_file() or linked.stat().st_size > max_bytes:
            return failed(f"error: {_too_large(max_bytes)}")
        defect = "" if trusted else symbol_defect(linked, timeout, confined)
        if defect:
            return failed(f"error: {defect}")
        # its own folder: another thread or process may be finishing the same key
        staged = Path(tempfile.mkdtemp(dir=Path(cache_dir) / "native", prefix=f".{key}."))
        staged.chmod(0o755)   # as a plain mkdir would have made it
        _copy_regular(linked, staged / LIBRARY_NAME)
        (staged / "compile.log").write_text(logs)
        try:
            staged.rename(out_dir)
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)  # another process finished the same key first
    return CompileResult(True, library, False, time.monotonic() - t0, logs, key, names)


def _copy_regular(src: Path, dst: Path) -> None:
    """Copy a regular file without following a link (its contents are what the compiler sees)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{src.name}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f, open(dst, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
            os.fchmod(out.fileno(), 0o755 if dst.name == LIBRARY_NAME else 0o644)
    finally:
        os.close(fd)

"""Native compilation of workdir kernels with the real g++ and nvcc: builds, caches, reports errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc.compile.native import cache_key, compile_workdir, default_toolchain, kernel_sources
from tests.conftest import ROOT, TESTS

HONEST = TESTS / "fixtures" / "honest_relu"


def _exports(library: Path) -> str:
    return subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout


def test_cpp_workdir_compiles_then_hits_the_cache(tmp_path):
    first = compile_workdir(HONEST, default_toolchain("cpu"), tmp_path)
    assert first.ok and not first.cached and first.library.is_file()
    assert " T relu" in _exports(first.library)
    second = compile_workdir(HONEST, default_toolchain("cpu"), tmp_path)
    assert second.ok and second.cached and second.library == first.library
    assert second.seconds < 0.5


def test_cache_key_changes_with_source_and_flags(tmp_path):
    work = tmp_path / "w"
    shutil.copytree(HONEST, work)
    tc = default_toolchain("cpu")
    key = cache_key(kernel_sources(work, "cpu"), [], tc)
    other_flags = type(tc)(tc.backend, tc.compiler, tc.flags + ("-DX=1",), tc.link_flags)
    assert cache_key(kernel_sources(work, "cpu"), [], other_flags) != key
    (work / "kernels" / "relu.cpp").write_text((work / "kernels" / "relu.cpp").read_text() + "\n// edit\n")
    assert cache_key(kernel_sources(work, "cpu"), [], tc) != key


def test_compile_error_is_reported_with_the_compiler_message(tmp_path):
    work = tmp_path / "bad"
    (work / "kernels").mkdir(parents=True)
    (work / "kernels" / "k.cpp").write_text('extern "C" void f(float* x) { x[0] = undefined_name; }\n')
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache")
    assert not result.ok and result.library is None
    assert "undefined_name" in result.log


def test_missing_sources_are_a_compile_failure(tmp_path):
    result = compile_workdir(tmp_path, default_toolchain("cpu"), tmp_path / "cache")
    assert not result.ok and "no kernels/*.cpp" in result.log


def test_parallel_objects_link_into_one_library(tmp_path):
    work = tmp_path / "two"
    (work / "kernels").mkdir(parents=True)
    (work / "kernels" / "a.cpp").write_text('#include "common.h"\nextern "C" void a(float* x) { x[0] = K; }\n')
    (work / "kernels" / "b.cpp").write_text('#include "common.h"\nextern "C" void b(float* x) { x[0] = 2 * K; }\n')
    (work / "kernels" / "common.h").write_text("#pragma once\nconstexpr float K = 3.f;\n")
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache")
    assert result.ok, result.log
    exports = _exports(result.library)
    assert " T a" in exports and " T b" in exports


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_workdir_compile_checks_with_nvcc(tmp_path):
    """No GPU needed: the CUDA launcher builds into a shared library exporting the same symbol."""
    result = compile_workdir(HONEST, default_toolchain("cuda"), tmp_path)
    assert result.ok, result.log
    assert " T relu" in _exports(result.library)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_compile_error_is_reported(tmp_path):
    work = tmp_path / "bad"
    (work / "kernels").mkdir(parents=True)
    (work / "kernels" / "k.cu").write_text("__global__ void k(float* x) { x[0] = nope; }\n")
    result = compile_workdir(work, default_toolchain("cuda"), tmp_path / "cache")
    assert not result.ok and "nope" in result.log


def test_every_shipped_cuda_source_compiles(tmp_path):
    """Shipped solutions' .cu files (if any) must at least build for sm_90."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    workdirs = sorted({p.parent.parent for p in (ROOT / "kernels" / "solutions").rglob("kernels/*.cu")})
    for work in workdirs:
        result = compile_workdir(work, default_toolchain("cuda"), tmp_path)
        assert result.ok, f"{work}: {result.log[-2000:]}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("program, defines", [("gemm_variants.cu", []), ("conv_check.cu", ["-DCHECK=conv2d"]),
                                              ("conv_check.cu", ["-DCHECK=relu_bias"]),
                                              ("conv_check.cu", ["-DCHECK=bn_relu"]), ("stream_variants.cu", []),
                                              ("wgmma_check.cu", [])])
def test_kernel_check_programs_build_against_the_shipped_headers(tmp_path, program, defines):
    """The sweep and check programs of benchmarks/*.cu build; most include the solutions' kernels, so
    a change to a shared header that breaks them shows here, not at the next GPU session. Built for
    the virtual sm_90a (PTX, no ptxas: two thirds of the time) since the shipped solutions' own
    compile (test_every_shipped_cuda_source_compiles) runs ptxas on the same headers."""
    out = tmp_path / "prog"
    cmd = ["nvcc", "-O1", "-std=c++17", "-gencode=arch=compute_90a,code=compute_90a", *defines, "-o", str(out),
           str(ROOT / "benchmarks" / program)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]


# -- the compiler is confined (issue 20): what it reads, how long it lives, how much it writes ------

def _workdir(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    work = tmp_path / f"w-{uuid.uuid4().hex[:8]}"
    (work / "kernels").mkdir(parents=True)
    for name, text in files.items():
        (work / "kernels" / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return work


def test_an_include_of_an_outside_file_does_not_print_it(tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("int SECRET_TOKEN_42 = ;\n")   # quoted back in the error, were it read
    canary = f"sk-canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("HPC_TEST_API_KEY", canary)
    logs = []
    for target in (str(secret), str(ROOT / "kernels" / "solutions" / "level1"), "/proc/self/environ"):
        work = _workdir(tmp_path, {"k.cpp": f'#include "{target}"\nextern "C" void f() {{}}\n'})
        logs.append(compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache").log)
    assert "Permission denied" in logs[0] and "Permission denied" in logs[1], logs
    assert not any("SECRET_TOKEN_42" in log or canary in log for log in logs), logs   # the compiler's own
    #                                                          environment holds nothing of the harness


def test_a_link_to_an_outside_file_is_not_compiled(tmp_path):
    secret = tmp_path / "secret.h"
    secret.write_text("int SECRET_TOKEN_43 = ;\n")
    work = _workdir(tmp_path, {"k.cpp": '#include "s.h"\nextern "C" void f() {}\n'})
    (work / "kernels" / "s.h").symlink_to(secret)
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache")
    assert not result.ok and "SECRET_TOKEN_43" not in result.log


def _compiler_processes(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(cmdline.split(b"\0")[0].decode(errors="replace"))
    return found


SLOW = ("constexpr long slow() { long s = 0; for (long i = 0; i < 200000; ++i) for (long j = 0; j < 200000; ++j) "
        "s += i ^ j; return s; }\nstatic_assert(slow() != 1);\nextern \"C\" void f() {}\n")


def test_a_compile_timeout_kills_the_whole_compiler_tree(tmp_path):
    """g++ as pid 1 of the compile's PID namespace, cc1plus its child: both end at the timeout
    (nvcc's cudafe++/cicc/ptxas are children the same way)."""
    marker = f"slow_{uuid.uuid4().hex}"
    work = _workdir(tmp_path, {f"{marker}.cpp": SLOW})
    t0 = time.monotonic()
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache", timeout=3)
    assert not result.ok and "timed out" in result.log and time.monotonic() - t0 < 30
    assert _compiler_processes(marker) == []   # no cc1plus left behind


def test_an_incbin_of_a_huge_file_is_refused_and_not_cached(tmp_path):
    blob = b"\0"   # 300 MB, sparse: costs no disk
    work = _workdir(tmp_path, {"blob.h": blob, "k.cpp": 'asm(".section .rodata\\n.incbin \\"blob.h\\"\\n.text");\n'
                                                        'extern "C" void f() {}\n'})
    os.truncate(work / "kernels" / "blob.h", 300 << 20)
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache", max_library_mb=256)
    assert not result.ok and "compile.max_library_mb (256 MB)" in result.log
    assert not list((tmp_path / "cache" / "native").glob("*/kernels.so"))


def test_an_object_past_the_cap_is_killed_and_not_cached(tmp_path):
    """No input needed to make a big object: the assembler's own .skip, capped by RLIMIT_FSIZE."""
    work = _workdir(tmp_path, {"k.cpp": 'asm(".data\\n.skip 314572800\\n.text");\nextern "C" void f() {}\n'})
    result = compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache", max_library_mb=256)
    assert not result.ok and "compile.max_library_mb (256 MB)" in result.log, result.log[-500:]
    assert not list((tmp_path / "cache" / "native").glob("*/kernels.so"))


# the test's own cap on address space, inherited by the compiler, so that a regression of the
# compiler's confinement cannot take the machine down (cc1plus once read /dev/zero to 23 GB)
_CAPPED = """import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from hpc.compile.native import compile_workdir, default_toolchain
result = compile_workdir(Path(sys.argv[1]), default_toolchain("cpu"), Path(sys.argv[2]), timeout=60,
                         memory_gb=float(sys.argv[3]))
print(result.ok, repr(result.log[-600:]))
"""


def _capped_compile(work: Path, cache: Path, memory_gb: float) -> str:
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(work), str(cache), str(memory_gb)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/sys/kernel/mm/transparent_hugepage/enabled",
                                    "/proc/self/maps"])
def test_a_source_that_includes_a_device_fails_without_reading_it(tmp_path, device):
    """The compiler reads programs, libraries and headers: no /dev, /sys or /proc."""
    work = _workdir(tmp_path, {"k.cpp": f'#include "{device}"\nextern "C" void f() {{}}\n'})
    t0 = time.monotonic()
    out = _capped_compile(work, tmp_path / "cache", 2.0)
    assert out.startswith("False") and "Permission denied" in out and time.monotonic() - t0 < 60, out


def test_a_compile_past_its_memory_limit_fails_naming_the_key(tmp_path):
    """Whatever makes the compiler grow is bounded by its cgroup: here the standard library's
    every header under a 50 MB cap; the same source builds under the default."""
    work = _workdir(tmp_path, {"k.cpp": '#include <bits/stdc++.h>\nextern "C" int f() {\n'
                                        '  std::map<int, std::vector<std::string>> m; return (int)m.size(); }\n'})
    out = _capped_compile(work, tmp_path / "cache", 0.05)
    assert out.startswith("False") and "went over its memory limit (compile.memory_gb = 0.05 GiB)" in out, out
    assert not list((tmp_path / "cache" / "native").glob("*/kernels.so"))
    assert compile_workdir(work, default_toolchain("cpu"), tmp_path / "cache").ok


def test_the_max_library_mb_key_is_validated():
    from hpc.config import load_config
    from hpc.errors import UserError

    cfg = load_config()
    assert cfg.compile.max_library_mb == 256
    cfg.compile.max_library_mb = 0
    with pytest.raises(UserError, match="compile.max_library_mb"):
        cfg.validate()

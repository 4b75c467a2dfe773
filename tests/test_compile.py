"""Native compilation of workdir kernels with the real g++ and nvcc: builds, caches, reports errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hpc.compile.native import arch_flags, cache_key, compile_workdir, default_toolchain, kernel_sources
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
    a change to a shared header that breaks them shows here, not at the next GPU session."""
    out = tmp_path / "prog"
    cmd = ["nvcc", "-O1", "-std=c++17", *arch_flags("sm_90a"), *defines, "-o", str(out),
           str(ROOT / "benchmarks" / program)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]

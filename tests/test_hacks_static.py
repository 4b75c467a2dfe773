"""Ways around the static check (issue 20) and the run-time defense behind it.

Static: names that allowed modules re-export (torch.os, hpc.runtime.ctypes...), other ways to reach
a module or work the op monitor cannot see, and C++ given to load_inline that switches the monitor
off or reaches past it, each refused with a named reason; honest candidates, shipped and
KernelBench-style, pass. Run time: a forward that switches the op monitor off is caught by its
canary even where the static check is bypassed (it is monkeypatched away for those evaluations)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpc import pipeline
from hpc.candidate import load_candidate
from hpc.pipeline import evaluate
from hpc.task import load_task
from hpc.verify.static import kernel_defect, source_defect
from tests.conftest import RELU_TASK, ROOT, TESTS

HEADER = "import torch\nimport torch.nn as nn\n"
MODEL = "\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"


def _defect(body: str, libraries: tuple[str, ...] = ()) -> str:
    return source_defect(HEADER + body + MODEL, "model_new.py", libraries)


@pytest.mark.parametrize("body, words", [
    # re-exports of allowed modules, by from-import and by attribute chain
    ("from hpc.runtime import ctypes\n", "hpc.runtime.ctypes is not allowed"),
    ("from torch import os\n", "torch.os is not allowed"),
    ("from torch import _C\n", "torch._C is not allowed (private)"),
    ("from torch.utils.cpp_extension import subprocess\n", "cpp_extension.subprocess is not allowed"),
    ("from torch.utils.cpp_extension import load\n", "cpp_extension.load is not allowed"),
    ("from hpc.runtime import count_extension_calls\n", "count_extension_calls is not allowed"),
    ("from hpc.runtime import _LOADED\n", "hpc.runtime._LOADED is not allowed (private)"),
    ("from torch import *\n", "import * from torch is not allowed"),
    ("from typing import get_type_hints\n", "typing.get_type_hints is not allowed"),
    ("from torch import nn as os\n", "import as os is not allowed"),
    ("import torch.utils.cpp_extension as ext\nx = ext.shlex.split\n", "cpp_extension.shlex is not allowed"),
    ("import torch.nn.functional as F\nx = F.np.maximum\n", "torch.nn.functional.np is the module numpy"),
    ("x = torch.functools.reduce\n", "torch.functools is the module functools"),
    ("x = torch.ops.aten.relu\n", "torch.ops is the module torch.ops"),
    ("x = torch.cuda.jiterator\n", "torch.cuda.jiterator is the module"),
    # a module as a value would hide every chain through it
    ("t = torch\n", "the module torch is used as a value"),
    ("from torch import nn as n2\nmods = [n2]\n", "the module torch.nn is used as a value"),
    ("torch = None\n", "torch is imported: it may not be rebound"),
    # monkeypatching what the harness runs in the same process
    ("torch.equal = lambda a, b: True\n", "assigning torch.equal is not allowed"),
    ("def f(x):\n    type(x).clone = None\n", "assigning type(x).clone is not allowed"),
    # work the op monitor does not see
    ("f = torch.compile(torch.relu)\n", "access to .compile"),
    ("g = torch.cuda.CUDAGraph()\n", "access to .CUDAGraph"),
    ("def f(x):\n    return x.numpy()\n", "access to .numpy"),
    ("def f(x):\n    return torch.tensor(x.tolist())\n", "access to .tolist"),
    ("def f(x):\n    return x.apply_(abs)\n", "access to .apply_"),
    # attributes read by name
    ("def f(x):\n    match x:\n        case object(__globals__=g):\n            return g\n", "access to .__globals__"),
    ("x = __loader__\n", "use of __loader__"),
    # load_inline only with sources the check can see
    ("from torch.utils.cpp_extension import load_inline\nbuild = load_inline\n", "load_inline is used other than"),
    ("from torch.utils.cpp_extension import load_inline\nsrc = 'int f();' * 2\nm = load_inline('m', src)\n",
     "cpp_sources is not a literal"),
    ("from torch.utils.cpp_extension import load_inline\nm = load_inline('m', ''.join(map(chr, [105])))\n",
     "cpp_sources is not a literal"),
    ("from torch.utils.cpp_extension import load_inline\nimport math\nm = load_inline('m', f'{math.pi}')\n",
     "cpp_sources is not a literal"),
    ("from torch.utils.cpp_extension import load_inline\nsrc = 'int f();'\nsrc += ''\nm = load_inline('m', src)\n",
     "cpp_sources is not a literal"),
    ("from torch.utils.cpp_extension import load_inline\nkw = {}\nm = load_inline('m', 'int f();', **kw)\n",
     "no *args / **kwargs"),
    ("from torch.utils.cpp_extension import load_inline\nm = load_inline('m', 'int f();', build_directory='/tmp')\n",
     "build_directory is not allowed"),
])
def test_python_bypass_is_refused(body, words):
    assert words in _defect(body)


def _inline(cpp: str, **flags: list[str]) -> str:
    args = "".join(f", {name}={value!r}" for name, value in flags.items())
    return (f"from torch.utils.cpp_extension import load_inline\nsource = {cpp!r}\n"
            f"ext = load_inline('m', source{args})\n")


RECORD_FUNCTION = "switching the op monitor's RecordFunction callbacks off"
DISPATCH = "changing how torch dispatches operators"
PYTHON = "reaching the Python interpreter"
PAST_THE_DISPATCHER = "kernels called past the dispatcher"


@pytest.mark.parametrize("cpp, words", [
    ("torch::Tensor f(torch::Tensor x) { at::RecordFunctionGuard off(false); return x.relu(); }", RECORD_FUNCTION),
    ("void f() { at::DisableRecordFunctionGuard off; }", RECORD_FUNCTION),
    ("void f() { at::enableRecordFunction(false); }", RECORD_FUNCTION),
    ("void f() { auto t = at::get_record_function_tls_(); at::set_record_function_tls_(t); }", RECORD_FUNCTION),
    ("static const bool gone = (at::clearCallbacks(), true);", RECORD_FUNCTION),
    ("void f(uint64_t h) { at::removeCallback(h); at::disableCallback(h); }", RECORD_FUNCTION),
    ("void f() { at::clearThreadLocalCallbacks(); }", RECORD_FUNCTION),
    ("void f() { c10::impl::ExcludeDispatchKeyGuard g(c10::DispatchKeySet::FULL); }", DISPATCH),
    ("void f() { c10::impl::IncludeDispatchKeyGuard g(c10::DispatchKey::Python); }", DISPATCH),
    ("void f() { at::AutoDispatchBelowAutograd g; }", DISPATCH),
    ("void f() { c10::impl::tls_set_dispatch_key_excluded(c10::DispatchKey::Python, true); }", DISPATCH),
    ("void f() { at::ThreadLocalStateGuard g(at::ThreadLocalState()); }", DISPATCH),
    ("at::Tensor f(at::Tensor x) { return at::redispatch::relu(c10::DispatchKeySet(), x); }", DISPATCH),
    ("void f() { c10::impl::TorchDispatchModeTLS::pop_stack(); }", DISPATCH),
    # the preprocessor and the lexer around a name check
    ("#define CAT(a, b) a##b\nvoid f() { at::CAT(clear, Callbacks)(); }", "token pasting (##)"),
    ("%:define CAT(a, b) a %:%: b\nvoid f() { at::CAT(clear, Callbacks)(); }", "token pasting (##)"),
    ("void f() { at::clear\\\nCallbacks(); }", RECORD_FUNCTION),
    ("void f() { at::clear??/\nCallbacks(); }", RECORD_FUNCTION),
    ("void f() { at::\\u0063learCallbacks(); }", "universal character names"),
    ("// at::clearCallbacks() below, split by a comment\nvoid f() { at::clear/**/Callbacks(); }", RECORD_FUNCTION),
    ('const char* s = R"x( )" )x"; void f() { at::clearCallbacks(); }', RECORD_FUNCTION),
    # binding a symbol by a name assembled from pieces, or loading one
    ('void gone() asm("_ZN2at5clear" "CallbacksEv");', "asm labels are not allowed"),
    ('#define S(x) #x\nvoid gone() __asm__(S(_ZN2at5clear) "CallbacksEv");', "asm labels are not allowed"),
    ('#define LABEL __asm__\nvoid gone() LABEL("x");', "asm other than asm(...)"),
    ('static void gone() __attribute__((weakref("sym")));', "binding a symbol by name"),
    ('void f() { dlsym(RTLD_DEFAULT, "x"); }', "dynamic loading is not allowed"),
    ('#define H <dlfcn.h>\n#include H\n', "#include of a macro"),
    # Python from C++
    ('void f() { PyRun_SimpleString("import os"); }', PYTHON),
    ('void f() { pybind11::module_::import("torch"); }', PYTHON),
    ('void f() { py::exec("import os"); }', PYTHON),
    ('void f(py::object o) { o.attr("x"); }', PYTHON),
    # kernels called without the dispatcher (so without the monitor)
    ("at::Tensor f(at::Tensor x) { return at::native::relu(x); }", PAST_THE_DISPATCHER),
    ("at::Tensor f(at::Tensor x) { return at::cpu::relu(x); }", PAST_THE_DISPATCHER),
    ("at::Tensor f(at::Tensor x) { return at::cuda::mm(x, x); }", PAST_THE_DISPATCHER),
    ("at::Tensor f(at::Tensor x) { return at::compositeexplicitautograd::relu(x); }", PAST_THE_DISPATCHER),
    ("namespace k = at::cuda;", "at::cuda may only be used as at::cuda::name"),
    ("using namespace at;\nat::Tensor f(at::Tensor x) { return native::relu(x); }", PAST_THE_DISPATCHER),
    # vendor libraries outside rules.libraries
    ("#include <cublas_v2.h>\n", "library cublas is not allowed by rules.libraries"),
    ("void f() { auto h = at::cuda::getCurrentCUDABlasHandle(); }", "library cublas is not allowed"),
])
def test_inline_cpp_bypass_is_refused(cpp, words):
    assert words in _defect(_inline(cpp))


@pytest.mark.parametrize("flags, words", [
    ({"extra_cflags": ["-DOFF=at::RecordFunctionGuard"]}, RECORD_FUNCTION),
    ({"extra_cflags": ["-DNS=cuda"]}, "at::cuda may only be used as at::cuda::name"),
    ({"extra_cflags": ["-D", "CAT(a,b)=a##b"]}, "token pasting"),
    ({"extra_cflags": ["-include", "/tmp/x.h"]}, "flag '-include' is not allowed"),
    ({"extra_cuda_cflags": ["-Xcompiler", "-include,/tmp/x.h"]}, "is not allowed"),
    ({"extra_ldflags": ["-Wl,--defsym,f=_ZN2at14clearCallbacksEv"]}, "is not allowed"),
    ({"extra_ldflags": ["-lcublas"]}, "library cublas is not allowed by rules.libraries"),
])
def test_inline_flag_bypass_is_refused(flags, words):
    assert words in _defect(_inline("int f();", **flags))


SHIFT_JIS_HIDE = (b"# -*- coding: shift_jis -*-\n" + HEADER.encode()
                  + b'NOTE = """\x83\\"""\nimport os, ctypes\nEND = """"""  # """\n' + MODEL.encode())


@pytest.mark.parametrize("data, words", [
    # shift_jis reads 0x83 0x5c as one character, so Python's string ends at the next quotes and
    # `import os, ctypes` is code; read as UTF-8, the backslash escapes a quote and it is text
    (SHIFT_JIS_HIDE, "declares the encoding shift_jis"),
    (b"# vim: set fileencoding=latin-1 :\n" + (HEADER + MODEL).encode(), "declares the encoding iso-8859-1"),
    (b"# coding: no-such-codec\n" + (HEADER + MODEL).encode(), "encoding declaration is refused"),
    ((HEADER + "# caf\xe9\n" + MODEL).encode("latin-1"), "not UTF-8"),
])
def test_a_source_python_would_read_otherwise_than_the_check_is_refused(tmp_path, fast_config, data, words):
    assert "ctypes" not in source_defect(SHIFT_JIS_HIDE.decode("utf-8", "replace"), "m.py")   # what the check saw
    path = tmp_path / "model_new.py"
    path.write_bytes(data)
    rec = evaluate(load_task(RELU_TASK), load_candidate(path), fast_config)
    assert rec.status == "failed" and rec.failed_stage == "static" and words in rec.reason, rec.reason


@pytest.mark.parametrize("data", [b"# -*- coding: utf-8 -*-\n", b"\xef\xbb\xbf", b"# coding=utf8\n", b""])
def test_a_utf8_source_declared_or_not_is_read_as_python_reads_it(data):
    from hpc.verify.static import python_text

    text, defect = python_text(data + (HEADER + "# caf\u00e9\n" + MODEL).encode())
    assert defect == "" and "caf\u00e9" in text and source_defect(text, "model_new.py") == ""


def test_a_library_the_rules_allow_may_be_used_inline():
    cpp = "#include <cublas_v2.h>\nvoid f(cublasHandle_t h) { auto g = at::cuda::getCurrentCUDABlasHandle(); }"
    assert _defect(_inline(cpp, extra_ldflags=["-lcublas"]), ("cublas",)) == ""


KERNELBENCH_CUDA = r'''
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

BLOCK = 256
elementwise_add_source = """
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#define CHECK_CUDA(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)

template <typename scalar_t>
__device__ __forceinline__ scalar_t warp_sum(scalar_t v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    return v;
}

__global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;   // one element a thread
    if (idx < size) {
        float r;
        asm volatile("add.f32 %0, %1, %2;" : "=f"(r) : "f"(a[idx]), "f"(b[idx]));
        out[idx] = std::max(r, r);
    }
}

torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
    CHECK_INPUT(a); CHECK_INPUT(b);
    const at::cuda::OptionalCUDAGuard guard(device_of(a));
    auto size = a.numel();
    auto out = torch::zeros_like(a);
    const int block_size = BLOCK_SIZE;
    const int num_blocks = (size + block_size - 1) / block_size;
    AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "add", ([&] {
        elementwise_add_kernel<<<num_blocks, block_size, 0, at::cuda::getCurrentCUDAStream()>>>(
            a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), size);
    }));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}
"""
elementwise_add_cpp_source = (
    "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"
)
defines = f"#define BLOCK_SIZE {BLOCK}\n"

elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=elementwise_add_cpp_source,
    cuda_sources=defines + elementwise_add_source,
    functions=["elementwise_add_cuda"],
    verbose=True,
    extra_cflags=["-O3", ""],
    extra_cuda_cflags=["-O3", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a", "-DNDEBUG", "-lineinfo"],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add_cuda(a.contiguous(), b.contiguous())
'''

KERNELBENCH_CPU = '''
import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils import cpp_extension

cpp_source = "\\n".join([
    "#include <torch/extension.h>",
    "#include <vector>",
    """torch::Tensor scale(torch::Tensor x, double s) {
    TORCH_CHECK(x.device().is_cpu(), R"(x must be on the "cpu")");
    auto out = torch::empty_like(x);
    const float* in = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) o[i] = in[i] * static_cast<float>(s);
    return out;
}""",
])

module = cpp_extension.load_inline("scale_cpu", [cpp_source], functions={"scale": "x * s"},
                                   extra_include_paths=["/usr/local/cuda/include"])


class ModelNew(nn.Module):
    def __init__(self, s: Optional[float] = None):
        super().__init__()
        self.s = s if s is not None else math.sqrt(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return module.scale(x.contiguous(), self.s)
'''


@pytest.mark.parametrize("source", [KERNELBENCH_CUDA, KERNELBENCH_CPU], ids=["cuda", "cpu"])
def test_kernelbench_style_single_files_pass(source):
    assert source_defect(source, "candidate.py") == ""


def _honest_candidates() -> list[Path]:
    return sorted([p.parent for p in (ROOT / "kernels" / "solutions").rglob("model_new.py")]
                  + [TESTS / "fixtures" / "honest_relu", *(TESTS / "fixtures").glob("*.py")])


@pytest.mark.parametrize("path", _honest_candidates(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_candidates_pass(path):
    candidate = load_candidate(path)
    source = candidate.files[candidate.model_file].decode()
    assert source_defect(source, candidate.model_file) == "" and kernel_defect(candidate.files, []) == ""


def test_workdir_kernels_may_not_bind_symbols_by_name():
    files = {"kernels/k.cpp": b'extern "C" void* lookup(void*, const char*) asm("dl" "sym");\n'}
    assert "asm labels are not allowed" in kernel_defect(files, [])
    asm = b'__device__ void f() { asm volatile("bar.sync 0;"); asm volatile("mov.u32 %0, 1;" : "=r"(x)); }\n'
    assert kernel_defect({"kernels/k.cu": asm}, []) == ""


# ------------------------------------------------------------- the run-time defense behind it

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def config(request, fast_config, cache_dir):
    return fast_config if request.param == "cpu" else request.getfixturevalue("cuda_config")


@pytest.fixture
def past_the_static_check(monkeypatch):
    """The candidates below as if they had found a way past the static check: the op monitor's
    canary must still see that it was switched off."""
    monkeypatch.setattr(pipeline, "source_defect", lambda *args, **kwargs: "")


PYTHON_OFF = """import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def forward(self, x):
        torch._C._autograd._clear_callbacks()   # the op monitor's callback goes with the rest
        kernels.noop(x, x.numel())
        return torch.relu(x)
"""

CPP_OFF = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <ATen/record_function.h>
static const bool cleared = (at::clearCallbacks(), true);   // on import, before any forward
torch::Tensor noop(torch::Tensor x) { return x; }
"""
ext = load_inline(name="clear_callbacks", cpp_sources=[source], functions=["noop"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        ext.noop(x)
        return torch.relu(x)
'''


def _rejected_as_disabled(rec) -> None:
    assert rec.status == "failed" and rec.failed_stage == "verify", rec.reason
    assert "the op monitor was disabled" in rec.reason, rec.reason
    assert rec.reward == -1.0


def test_monitor_switched_off_from_python_is_rejected(tmp_path, config, past_the_static_check):
    assert "._C" in source_defect(PYTHON_OFF, "model_new.py")   # what the static check alone says
    hack = tmp_path / "python_off"
    shutil.copytree(TESTS / "hacks" / "torch_fallback" / "kernels", hack / "kernels")
    (hack / "model_new.py").write_text(PYTHON_OFF)
    _rejected_as_disabled(evaluate(load_task(RELU_TASK), load_candidate(hack), config))


@pytest.mark.slow
def test_monitor_cleared_by_inline_cpp_at_import_is_rejected(tmp_path, config, past_the_static_check):
    """load_inline builds with torch's headers (about a minute here, once per content)."""
    assert RECORD_FUNCTION in source_defect(CPP_OFF, "cpp_off.py")
    hack = tmp_path / "cpp_off.py"
    hack.write_text(CPP_OFF)
    _rejected_as_disabled(evaluate(load_task(RELU_TASK), load_candidate(hack), config))


def test_torch_compile_cannot_run_in_a_candidates_process(config, past_the_static_check):
    """tests/hacks/inductor_at_import compiles the task's expression at import and calls inductor's
    kernels once its trials are over: past the static check it was paid 3, 2, 2. A candidate's
    process cannot read inductor's compiler, so it fails at load, by the kernel's word, whatever its
    Python did to get there; an honest one still loads (dynamo, which torch enters for every
    dispatch mode, stays readable)."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "hacks" / "inductor_at_import"), config)
    assert rec.status == "failed" and rec.failed_stage == "load" and rec.reward == -1, rec.reason
    assert "Permission denied" in rec.reason and "torch/_inductor/" in rec.reason, rec.reason
    honest = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu"), config)
    assert honest.status == "ok" and honest.reward >= 1, honest.reason

"""What a workdir candidate's `model_new.py` imports to call its own compiled kernels.

    from hpc.runtime import load_kernels
    kernels = load_kernels(__file__)
    ...
    kernels.my_launcher(out, x, x.numel())

Every exported `extern "C"` function of kernels/*.cpp (cpu) or kernels/*.cu (cuda) becomes a
callable. Arguments convert by Python type: a torch.Tensor passes its data pointer (it must be
contiguous and on the evaluated device), an int or bool passes int64_t, a float passes double.
On the cuda backend the current CUDA stream is appended as the last argument (cudaStream_t), so
every launcher's C signature ends with `cudaStream_t stream`. Functions return void.
`kernels.device` says which backend was built, for the rare model that must differ between them.

Under the evaluator the library was already compiled outside the sandbox and its path arrives in
HPC_KERNEL_LIBRARY; run by hand, `load_kernels` compiles the workdir itself (same cache).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

LIBRARY_ENV = "HPC_KERNEL_LIBRARY"
BACKEND_ENV = "HPC_BACKEND"


_LOADED: list = []   # every KernelLibrary / extension proxy of this process: their calls prove custom code ran


def launch_count() -> int:
    """Calls into candidate-compiled code so far in this process."""
    return sum(lib.calls for lib in _LOADED)


class KernelLibrary:
    """ctypes view of a compiled candidate library that converts tensors and counts calls."""

    def __init__(self, path: Path, backend: str):
        self._path = Path(path)
        self._backend = backend
        self._device_type = "cuda" if backend == "cuda" else "cpu"
        self._cdll = ctypes.CDLL(str(path))
        self.calls = 0
        _LOADED.append(self)

    @property
    def device(self) -> str:
        """"cpu" or "cuda": where tensors passed to this library's launchers must live."""
        return self._device_type

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            fn = getattr(self._cdll, name)
        except AttributeError:
            raise AttributeError(f"kernel library {self._path.name} exports no function {name!r}") from None
        fn.restype = None
        launcher = _Launcher(self, name, fn)
        setattr(self, name, launcher)
        return launcher


class _Launcher:
    __slots__ = ("_lib", "_name", "_fn")

    def __init__(self, lib: KernelLibrary, name: str, fn):
        self._lib, self._name, self._fn = lib, name, fn

    def __call__(self, *args):
        lib = self._lib
        cargs = [_to_c(a, lib._device_type, self._name, i) for i, a in enumerate(args)]
        if lib._backend == "cuda":
            # the raw handle of the current stream: torch.cuda.current_stream() builds a Stream object (~5 us)
            cargs.append(ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())))
        lib.calls += 1
        self._fn(*cargs)


def _to_c(a, device_type: str, fname: str, i: int):
    if isinstance(a, torch.Tensor):
        if a.device.type != device_type:
            raise TypeError(f"{fname}: argument {i} is on {a.device}, expected {device_type}")
        if not a.is_contiguous():
            raise TypeError(f"{fname}: argument {i} is not contiguous")
        return ctypes.c_void_p(a.data_ptr())
    if isinstance(a, bool):
        return ctypes.c_int64(int(a))
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    raise TypeError(f"{fname}: argument {i} has unsupported type {type(a).__name__} (tensor, int, bool or float)")


def load_kernels(model_file: str | os.PathLike) -> KernelLibrary:
    """The candidate's compiled kernels: the evaluator's prebuilt library, or a fresh build."""
    backend = os.environ.get(BACKEND_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    prebuilt = os.environ.get(LIBRARY_ENV)
    if prebuilt:
        return KernelLibrary(Path(prebuilt), backend)
    from hpc.compile.native import compile_workdir, default_toolchain
    from hpc.config import default_cache_dir

    result = compile_workdir(Path(model_file).resolve().parent, default_toolchain(backend), default_cache_dir())
    if not result.ok:
        raise RuntimeError(f"kernel compilation failed:\n{result.log}")
    return KernelLibrary(result.library, backend)


class CountingExtension:
    """Proxy over a `load_inline` extension module that counts calls of its functions."""

    def __init__(self, module):
        self._module = module
        self.calls = 0
        _LOADED.append(self)

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def count_extension_calls() -> None:
    """Make torch's `load_inline`/`load` return counting proxies (called before candidate import)."""
    from torch.utils import cpp_extension

    for name in ("load_inline", "load"):
        original = getattr(cpp_extension, name)

        def wrapped(*args, _original=original, **kwargs):
            module = _original(*args, **kwargs)
            return CountingExtension(module) if kwargs.get("is_python_module", True) else module

        setattr(cpp_extension, name, wrapped)

"""What the results were measured on: hardware and software versions, recorded with every record."""

from __future__ import annotations

import functools
import os
import platform
import subprocess


@functools.lru_cache(maxsize=None)
def device_name(backend: str) -> str:
    """A stable description of the timing hardware (part of the baseline cache key)."""
    if backend == "cuda":
        index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader",
                                  "-i", index], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
        return "cuda (unknown device)"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} x{len(os.sched_getaffinity(0))} cpus"


@functools.lru_cache(maxsize=None)
def versions() -> dict[str, str]:
    import torch

    import hpc

    return {"hpc": hpc.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": str(torch.version.cuda)}

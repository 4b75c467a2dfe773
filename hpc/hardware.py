"""What the results were measured on: hardware and software versions, recorded with every record."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import time


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


def conditions(backend: str, beside: int) -> dict[str, object]:
    """The conditions a measurement was taken in (its provenance): when, the host's load, how many
    other evaluations ran on the device, and on cuda the GPU's clocks, temperature and power."""
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_1m": round(os.getloadavg()[0], 2),
            "beside": beside, **(gpu_state() if backend == "cuda" else {})}


def minor_faults(pids: list[int]) -> int:
    """Minor page faults so far of the processes `pids` (a program's cgroup's), all their threads
    (field 10 of /proc/PID/stat); a process that has ended counts 0. Read before and after a
    window, it says whether a program paid its buffers' pages in again on every call (a freed
    buffer handed back to the system, faulted in anew), a factor of that process alone."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            pass
    return total


def heap_on_huge_pages(pid: int) -> float | None:
    """The share of process `pid`'s heap (its [heap] mapping: glibc's main arena, where a program's
    tensors under the mmap threshold live, hpc.sandbox.process.STEADY_MALLOC) that lies on 2 MiB
    pages, read from /proc/PID/smaps; None where the process is gone or has no heap in memory. On
    a virtual machine a stream over 4 KiB pages pays a two-level page walk every 4 KiB: a program
    whose buffers missed the huge pages runs slower in that process alone, which no other figure
    of the window shows."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            text = f.read()
    except OSError:
        return None
    rss = huge = 0
    start = text.find("[heap]\n")
    while start >= 0:   # madvise may have split the heap into several mappings, each named [heap]
        for line in text[start + 7:].splitlines():
            name, _, rest = line.partition(":")
            if not rest.strip().endswith("kB"):
                break   # the flags that end this mapping
            if name == "Rss":
                rss += int(rest.split()[0])
            elif name == "AnonHugePages":
                huge += int(rest.split()[0])
        start = text.find("[heap]\n", start + 7)
    return round(huge / rss, 3) if rss else None


_NVML_CLOCK_SM, _NVML_CLOCK_MEM, _NVML_TEMPERATURE_GPU = 1, 2, 0


@functools.lru_cache(maxsize=None)
def _nvml() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return lib if lib.nvmlInit_v2() == 0 else None


def gpu_state() -> dict[str, float]:
    """SM and memory clocks (MHz), temperature (C) and power (W) of the timing GPU now, through
    NVML; {} where NVML is missing. The GPU is CUDA_VISIBLE_DEVICES' first entry (an index), else 0."""
    lib = _nvml()
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    if lib is None or not index.isdigit():
        return {}
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByIndex_v2(int(index), ctypes.byref(handle)) != 0:
        return {}
    state: dict[str, float] = {}
    value = ctypes.c_uint()
    for key, call, arg in (("sm_clock_mhz", lib.nvmlDeviceGetClockInfo, _NVML_CLOCK_SM),
                           ("mem_clock_mhz", lib.nvmlDeviceGetClockInfo, _NVML_CLOCK_MEM),
                           ("temperature_c", lib.nvmlDeviceGetTemperature, _NVML_TEMPERATURE_GPU)):
        if call(handle, arg, ctypes.byref(value)) == 0:
            state[key] = float(value.value)
    if lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(value)) == 0:
        state["power_w"] = value.value / 1000.0
    return state

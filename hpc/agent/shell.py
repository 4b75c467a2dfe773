"""The agent's `bash` tool: a command in the project's sandbox, confined to the episode.

Each call is a fresh `bash -c` started by the evaluator's launcher (hpc/sandbox/launch.py) under
the workers' rules: pid 1 of its own PID namespace with a fresh /proc (it sees no other process,
the harness's environment included), an empty network namespace, rlimits, the strict seccomp
profile (no socket of any family: the host's UNIX sockets and AF_VSOCK are out of reach), a cgroup
of its own (its memory, memfd and tmpfs pages included, and its tasks bounded: `bash.memory_gb`,
`bash.max_processes`), uid 65534 where the harness is root (hpc.sandbox.launch.run_as), and Landlock:
it writes only in the workdir and the episode's scratch folder, and reads only the system, the
Python installation, the toolkit package and the episode, so a command cannot read the
repository's shipped solutions, its tests, or another episode's workdir (`bash.confine_reads`,
`bash.readable`). When the command returns or reaches its time limit, bash is killed, and with
it, by the kernel, every process of its PID namespace: nothing it started lives on, setsid
daemons included. Where the machine cannot confine writes and network, the tool refuses to run
(unless `bash.require_isolation` is off).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc.agent.config import BashConfig
from hpc.agent.toolcall import truncate
from hpc.config import SandboxConfig
from hpc.sandbox import launch
from hpc.sandbox.process import isolation_support, seccomp_profile


class ShellUnavailable(Exception):
    """This machine cannot isolate a command as the config requires."""


@dataclass
class ShellResult:
    exit_code: int | None     # None: killed at the time limit
    output: str               # stdout and stderr interleaved, cut in the middle to the limit
    timed_out: bool


def run_bash(command: str, workdir: Path, scratch: Path, log: Path, cfg: BashConfig, backend: str,
             output_limit: int) -> ShellResult:
    """Run `command` with cwd `workdir`; writes are allowed only under `workdir` and `scratch`.

    Output goes through the file `log` (outside the command's write reach, opened before it
    starts), so a command printing without end costs disk up to `max_file_mb`, never memory.
    """
    support = isolation_support()
    abi, net = int(support["landlock_abi"]), bool(support["network_namespace"])
    if cfg.require_isolation and not (abi and net):
        raise ShellUnavailable(f"bash is disabled: this machine cannot confine commands "
                               f"(landlock ABI {abi}, network namespace {'yes' if net else 'no'})")
    scratch.mkdir(parents=True, exist_ok=True)
    readable = [*launch.python_readable(), str(workdir), str(scratch), *cfg.readable]
    writable = [str(workdir), str(scratch)]
    try:
        uid = launch.run_as(SandboxConfig().run_as_uid, readable, writable)
    except launch.LaunchError as e:
        raise ShellUnavailable(f"bash could not start in its sandbox: {e}") from None
    launch.give(uid, writable)   # files the harness wrote since the last call stay editable
    devices = glob.glob("/dev/nvidia*") if cfg.gpu and backend == "cuda" else []
    limits = launch.Limits(cpu_seconds=cfg.cpu_seconds, file_bytes=cfg.max_file_mb << 20,
                           processes=cfg.max_processes, open_files=SandboxConfig().max_open_files,
                           memory_bytes=None if devices else int(cfg.memory_gb * (1 << 30)))
    policy = launch.Policy(readable=tuple(readable) if cfg.confine_reads else None,
                           writable=(*writable, *devices), uid=uid, limits=limits,
                           seccomp=seccomp_profile(False, "cuda" if devices else "cpu"),
                           memory_bytes=int(cfg.memory_gb * (1 << 30)))
    with open(log, "w+b") as out:
        try:
            proc = launch.spawn(["bash", "--noprofile", "--norc", "-c", command], policy, cwd=workdir,
                                env=_environment(workdir, scratch, backend, cfg), stdout=out,
                                stderr=subprocess.STDOUT)
        except (launch.LaunchError, OSError) as e:   # the confinement itself failed
            raise ShellUnavailable(f"bash could not start in its sandbox: {e}") from None
        timed_out = False
        try:
            proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        code = proc.reap()
        out.seek(0)
        text = _read_cut(out, output_limit)
    return ShellResult(None if timed_out else code, text, timed_out)


def _read_cut(f, limit: int) -> str:
    """Head and tail of a possibly huge output file, read without loading all of it."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    if size <= 4 * limit:
        return truncate(f.read().decode("utf-8", "replace"), limit)
    head = f.read(limit)
    f.seek(size - limit)
    tail = f.read()
    return truncate(head.decode("utf-8", "replace") + tail.decode("utf-8", "replace"), limit,
                    hidden=size - len(head) - len(tail))


def _environment(workdir: Path, scratch: Path, backend: str, cfg: BashConfig) -> dict[str, str]:
    """A small, explicit environment: the venv's python first on PATH, the toolkit importable
    (so `python -c "import model_new"` works as under the evaluator) through a folder holding only
    a link to the package (the repository around it stays unreadable), caches in the scratch folder."""
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]),
           "HOME": str(workdir), "TMPDIR": str(scratch), "LANG": "C.UTF-8", "PYTHONPATH": launch.python_path_dir(),
           "PYTHONDONTWRITEBYTECODE": "1", "HPC_BACKEND": backend, "HPC_CACHE_DIR": str(scratch / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "CUDA_CACHE_PATH": str(scratch / "nv")}
    for key in ("OMP_NUM_THREADS", "LD_LIBRARY_PATH", "CXX", "NVCC", "CUDA_HOME", "LC_ALL"):
        if key in os.environ:
            env[key] = os.environ[key]
    if cfg.gpu and "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    elif not cfg.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env

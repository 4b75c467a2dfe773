"""The agent's `bash` tool: a command in the project's sandbox, confined to the episode.

Each call is a fresh `bash -c` with the evaluator sandbox's confinement (hpc.sandbox.process):
its own process group, rlimits, an empty network namespace, and Landlock so it writes only in
the workdir and the episode's scratch folder. A second Landlock layer confines reads too: to the
system (/usr, /etc, /proc, ...), the Python installation, the toolkit package and the episode, so a
command cannot read the repository's shipped solutions, its tests, or another episode's workdir
(`bash.confine_reads`, `bash.readable`). When the command returns or reaches its time limit, its
process group is killed, and so is every process still carrying the call's own environment tag
(one that left the group with setsid): nothing it started in the background lives on, short of a
process that also replaced its environment (that one keeps no network, no writes outside the
episode, and its CPU-time limit). Where the machine cannot confine writes and network, the tool
refuses to run (unless `bash.require_isolation` is off).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from hpc.agent.config import BashConfig
from hpc.agent.toolcall import truncate
from hpc.config import SandboxConfig
from hpc.sandbox import landlock
from hpc.sandbox.process import confine, isolation_support, writable_paths

_TAG = "HPC_AGENT_SHELL"   # marks every process of one bash call (inherited through fork and exec)
_SYSTEM = ("/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc", "/sys", "/dev")
_PACKAGE = Path(__file__).resolve().parents[1]   # the hpc package: model_new.py imports hpc.runtime


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
    device = backend if cfg.gpu else "cpu"   # "cpu": address-space limit on, no GPU device nodes
    limits = SandboxConfig(timeout_s=cfg.timeout_s, memory_gb=cfg.memory_gb, cpu_seconds=cfg.cpu_seconds,
                           max_processes=cfg.max_processes, max_file_mb=cfg.max_file_mb)
    scratch.mkdir(parents=True, exist_ok=True)
    writable = writable_paths(workdir, device, [scratch])
    readable = _readable_paths(workdir, scratch, cfg) if cfg.confine_reads and abi else []
    with open(log, "w+b") as out:
        env = _environment(workdir, scratch, backend, cfg)

        def confine_child() -> None:   # in the forked child, before exec
            confine(limits, device, writable, abi, net)
            if readable:
                landlock.restrict_reads(readable)

        try:
            proc = subprocess.Popen(
                ["bash", "--noprofile", "--norc", "-c", command], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=confine_child)
        except (OSError, subprocess.SubprocessError) as e:   # the confinement itself failed
            raise ShellUnavailable(f"bash could not start in its sandbox: {e}") from None
        timed_out = False
        try:
            proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        code = proc.wait()
        _sweep(env[_TAG])
        out.seek(0)
        text = _read_cut(out, output_limit)
    return ShellResult(None if timed_out else code, text, timed_out)


def _readable_paths(workdir: Path, scratch: Path, cfg: BashConfig) -> list[str]:
    """What commands may read: the system, the Python installation (interpreter, standard library,
    site-packages), the toolkit package, the episode's workdir and scratch, and `bash.readable`."""
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))}
    python |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    paths = [*_SYSTEM, *sorted(python), str(_PACKAGE), str(workdir), str(scratch), *cfg.readable]
    if os.environ.get("CUDA_HOME"):
        paths.append(os.environ["CUDA_HOME"])
    return [p for p in dict.fromkeys(paths) if os.path.exists(p)]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _sweep(tag: str) -> None:
    """Kill every process whose environment holds this call's tag (a few rounds: one may fork
    while the previous round kills)."""
    needle = f"{_TAG}={tag}".encode()
    for _ in range(3):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                os.kill(int(entry), signal.SIGKILL)
                found = True
            except OSError:
                continue
        if not found:
            return


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
    (so `python -c "import model_new"` works as under the evaluator), caches in the scratch folder.
    PYTHONPATH is a scratch folder holding only a link to the package: the repository around it
    (its solutions and tests) stays unreadable."""
    path_dir, link = scratch / "python", scratch / "python" / "hpc"
    if path_dir.is_symlink() or (path_dir.exists() and not path_dir.is_dir()):
        path_dir.unlink()
    path_dir.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and os.readlink(link) == str(_PACKAGE)):   # a command may have replaced it
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink(missing_ok=True)
        link.symlink_to(_PACKAGE, target_is_directory=True)
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]),
           "HOME": str(workdir), "TMPDIR": str(scratch), "LANG": "C.UTF-8", "PYTHONPATH": str(path_dir),
           "PYTHONDONTWRITEBYTECODE": "1", "HPC_BACKEND": backend, "HPC_CACHE_DIR": str(scratch / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "CUDA_CACHE_PATH": str(scratch / "nv"),
           _TAG: uuid.uuid4().hex}
    for key in ("OMP_NUM_THREADS", "LD_LIBRARY_PATH", "CXX", "NVCC", "CUDA_HOME", "LC_ALL"):
        if key in os.environ:
            env[key] = os.environ[key]
    if cfg.gpu and "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    elif not cfg.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env

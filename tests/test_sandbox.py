"""The sandbox for real: Landlock write confinement, no network, crash and timeout reasons, rlimits.
(Read confinement, namespaces, seccomp and lifetimes: tests/test_confinement.py.)"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from hpc.config import SandboxConfig
from hpc.sandbox import landlock, launch
from hpc.sandbox.messages import Cost, CostReply, Outputs, ReferenceSetup
from hpc.sandbox.process import SandboxedProcess, SandboxError, isolation_support
from tests.conftest import RELU_TASK, ROOT

needs_landlock = pytest.mark.skipif(landlock.abi_version() == 0, reason="kernel without Landlock")


def confined_python(tmp_path: Path, code: str) -> tuple[int, str]:
    """Run `code` in a child confined exactly like a sandboxed candidate worker (same policy)."""
    import sys

    from hpc.sandbox.process import worker_policy

    policy = worker_policy(SandboxConfig(), "cpu", tmp_path, [], [])
    rc, out, _ = launch.run([sys.executable, "-c", code], policy, cwd=tmp_path, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": launch.python_path_dir()})
    return rc, out


@needs_landlock
def test_writes_only_inside_the_workdir(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    work = tmp_path / "work"
    work.mkdir()
    rc, out = confined_python(work, f"""
open('inside.txt', 'w').write('ok')
try:
    open({str(outside)!r}, 'w').write('escaped')
    print('ESCAPED')
except PermissionError:
    print('BLOCKED')
""")
    assert rc == 0, out
    assert "BLOCKED" in out and not outside.exists()
    assert (work / "inside.txt").read_text() == "ok"


def test_no_network_from_inside(tmp_path):
    if not isolation_support()["network_namespace"] and landlock.abi_version() < 4:
        pytest.skip("neither network namespaces nor Landlock network rules available")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(_accept(server)))
    t.start()
    rc, out = confined_python(tmp_path, f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2)
    print('CONNECTED')
except OSError as e:
    print('REFUSED', e)
""")
    t.join()
    server.close()
    assert "REFUSED" in out and accepted == [False]


def _accept(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


def test_memory_limit_applies_on_cpu(tmp_path):
    rc, out = confined_python(tmp_path, "b = bytearray(64 << 30)")
    assert rc != 0 and "MemoryError" in out


def test_every_worker_gets_the_same_fixed_allocator_thresholds(tmp_path):
    """Without them a process's glibc moves its thresholds with what it freed, and one fresh process
    pays its tensors' page faults on every call where another does not (docs/benchmarks.md)."""
    from hpc.sandbox.process import STEADY_MALLOC
    with SandboxedProcess("reference", tmp_path, SandboxConfig(timeout_s=60), "cpu", readable=(RELU_TASK,)) as proc:
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{proc.worker_pid}/environ").read_text().split("\0") if "=" in item)
    assert {k: environ.get(k) for k in STEADY_MALLOC} == STEADY_MALLOC


def test_the_allocator_settings_put_a_tensor_from_the_heap_on_huge_pages():
    """Under STEADY_MALLOC a buffer below the mmap threshold comes from the heap, on 2 MiB pages:
    where each 4 KiB page of it would have landed is then out of the figures (docs/benchmarks.md)."""
    import subprocess
    import sys

    from hpc.sandbox.process import STEADY_MALLOC
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this host")
    code = ("import ctypes, os\n"
            "from hpc.sandbox.exchange import huge_page_share\n"
            "n = 24 << 20\n"
            "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
            "a = libc.malloc(n); ctypes.memset(a, 1, n)\n"
            "print(huge_page_share(os.getpid(), a, n))\n")
    share = {}
    for name, env in (("steady", STEADY_MALLOC), ("plain", {})):
        out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                                **env},
                             capture_output=True, text=True, timeout=60, check=True).stdout
        share[name] = float(out)
    assert share["steady"] >= 0.8, share
    if "[madvise]" in mode:   # under "always" every heap is on huge pages anyway
        assert share["plain"] < 0.1, share


def test_worker_crash_is_reported_with_its_signal(tmp_path):
    with SandboxedProcess("reference", tmp_path, SandboxConfig(timeout_s=60), "cpu", readable=(RELU_TASK,)) as proc:
        proc.request(ReferenceSetup(str(RELU_TASK), "cpu", 0, "cpu"))
        proc.kill()
        with pytest.raises(SandboxError) as err:
            proc.request(Outputs([{"seed": 1, "distribution": "default"}]))
    assert err.value.kind == "crash" and "SIGKILL" in err.value.reason


def test_worker_timeout_kills_the_process_group(tmp_path):
    with SandboxedProcess("reference", tmp_path, SandboxConfig(timeout_s=60), "cpu", readable=(RELU_TASK,)) as proc:
        with pytest.raises(SandboxError) as err:
            # the worker waits for a message that will never complete before the short deadline
            proc.request(ReferenceSetup(str(RELU_TASK), "cpu", 0, "cpu"), timeout=0.001)
        assert err.value.kind == "timeout"
        assert proc.proc.wait(timeout=10) is not None


def test_worker_reports_task_errors_by_kind(tmp_path):
    bad = tmp_path / "bad_task.py"
    bad.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n"
                   "def get_inputs():\n    raise ValueError('boom')\ndef get_init_inputs():\n    return []\n"
                   "SCALES = {'cpu': {'missing_global': 1}}\n")
    work = tmp_path / "w"
    work.mkdir()
    with SandboxedProcess("reference", work, SandboxConfig(timeout_s=60), "cpu", readable=(bad,)) as proc:
        with pytest.raises(SandboxError) as err:
            proc.request(ReferenceSetup(str(bad), "cpu", 0, "cpu"))
    assert err.value.kind == "task" and "missing_global" in err.value.reason


def _costs(task: Path, work: Path) -> tuple[CostReply, CostReply]:
    """(meta count, device count) of one task at cpu scale, from one real reference worker."""
    work.mkdir()
    with SandboxedProcess("reference", work, SandboxConfig(timeout_s=120), "cpu", readable=(task,)) as proc:
        proc.request(ReferenceSetup(str(task), "cpu", 0, "cpu"))
        return proc.request(Cost(1, meta=True)), proc.request(Cost(1))


def test_every_shipped_task_costs_the_same_counted_on_the_meta_device(tmp_path):
    """The floor check's FLOP and byte counts come from shapes alone: counting on the meta device
    (no device work, no lock) gives what counting on real tensors gives."""
    tasks = sorted((Path(__file__).parent.parent / "kernels" / "tasks").glob("level*/*.py"))
    assert tasks
    for i, task in enumerate(tasks):
        meta, real = _costs(task, tmp_path / str(i))
        assert meta == real and real.bytes > 0, task


def test_a_task_whose_forward_needs_values_is_counted_on_the_device(tmp_path):
    task = tmp_path / "branchy.py"
    task.write_text("import torch\nclass Model(torch.nn.Module):\n"
                    "    def forward(self, x):\n        return x @ x if x.sum() > 0 else x.t() @ x\n"
                    "def get_inputs():\n    return [torch.randn(32, 32)]\ndef get_init_inputs():\n    return []\n")
    meta, real = _costs(task, tmp_path / "w")
    assert meta.meta_failed is not None and real.flops == 2 * 32 ** 3


@pytest.mark.skipif(not launch.can_switch_uid(), reason="needs a root harness")
def test_giving_a_folder_moves_nothing_outside_it_while_its_folders_are_swapped_for_links(tmp_path):
    """A root harness hands a workdir to the sandbox's uid while a program of that uid swaps a
    folder in it for a link to a folder outside, again and again: the walk goes by descriptors,
    so the outside file keeps its owner (walking by paths, one was given away in 4 s)."""
    import threading

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("root's")
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    for k in range(50):
        (work / "sub" / f"f{k}").write_text("x")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            try:
                os.rename(work / "sub", work / "real")
                os.symlink(outside, work / "sub")
                os.unlink(work / "sub")
                os.rename(work / "real", work / "sub")
            except OSError:
                pass

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        deadline = time.monotonic() + 3
        walks = 0
        while time.monotonic() < deadline:
            launch.give(65534, [work])
            walks += 1
    finally:
        stop.set()
        swapper.join()
    assert walks > 10
    assert os.stat(outside / "secret").st_uid == 0 and os.stat(outside).st_uid == 0

"""Attacks from inside the sandbox, for real (issue 20, items 5-7): what a worker's code may read,
which processes and sockets it can reach, and what outlives it.

Worker-level tests run their attack as the module code of a task file loaded by a real reference
worker (`SandboxedProcess`, candidate seccomp profile); its exception carries the outcome back.
Pipeline-level tests run `hpc.pipeline.evaluate` on a workdir candidate whose kernels/*.cpp host
code attacks when called. Each asserts both that the attack ran and that it got nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from hpc.config import SandboxConfig
from hpc.sandbox import landlock, launch
from hpc.sandbox.messages import ReferenceSetup
from hpc.sandbox.process import SandboxedProcess, SandboxError, isolation_support
from tests.conftest import RELU_TASK, ROOT, TESTS, accepting, cuda_available, make_fast_config

SUPPORT = isolation_support()
needs_landlock = pytest.mark.skipif(not landlock.abi_version(), reason="kernel without Landlock")
needs_pidns = pytest.mark.skipif(SUPPORT["pid_namespace"] is not True, reason="no PID namespaces here")
needs_root = pytest.mark.skipif(not launch.can_switch_uid(), reason="needs a root harness")


def attack_in_worker(tmp_path: Path, code: str, trusted: bool = False, backend: str = "cpu", **kw) -> str:
    """Run `code` (which sets `result`) in a fresh worker; what it reported. `backend` picks the
    seccomp profile (cuda: the gpu profile); the worker itself runs on the CPU."""
    task = tmp_path / f"attack_{uuid.uuid4().hex[:8]}.py"
    task.write_text(f"{code}\nraise RuntimeError('RESULT<' + str(result) + '>')\n")
    work = tmp_path / "work"
    with SandboxedProcess("reference", work, SandboxConfig(timeout_s=120), backend, readable=(task,),
                          trusted=trusted, **kw) as proc:
        with pytest.raises(SandboxError) as err:
            proc.request(ReferenceSetup(str(task), "cpu", 0, "cpu"))
    reason = err.value.reason
    assert "RESULT<" in reason, reason   # the attack ran
    return reason[reason.index("RESULT<"):]


def host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


# -- reads -------------------------------------------------------------------------------------

@contextmanager
def process_with_secret_environment() -> Iterator[tuple[int, str]]:
    """A harness-side process whose environment (as /proc shows it: the one it started with)
    holds an API key; (its pid, the key)."""
    canary = f"sk-canary-{uuid.uuid4().hex}"
    helper = subprocess.Popen(["sleep", "120"], env={**os.environ, "HPC_TEST_API_KEY": canary})
    try:
        yield helper.pid, canary
    finally:
        helper.kill()
        helper.wait()


def test_worker_cannot_read_the_harness_environment(tmp_path):
    with process_with_secret_environment() as (helper, canary):
        out = attack_in_worker(tmp_path, f"""
import os
got = []
for pid in [{os.getpid()}, {helper}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:
    try:
        got.append(open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace'))
    except OSError as e:
        got.append(f'denied {{pid}} {{e.errno}}')
result = ' | '.join(got)
""")
    assert canary not in out and f"denied {os.getpid()}" in out and f"denied {helper}" in out


@needs_landlock
def test_worker_reads_only_the_system_python_and_its_workdir(tmp_path):
    secret = tmp_path / "solutions" / "level1" / "model_new.py"
    secret.parent.mkdir(parents=True)
    secret.write_text("SHIPPED-SOLUTION-TEXT")
    shipped = next((ROOT / "kernels" / "solutions").rglob("model_new.py"))
    out = attack_in_worker(tmp_path, f"""
import os, torch
open('mine.txt', 'w').write('own')
got = [open('mine.txt').read()]
for path in [{str(secret)!r}, {str(shipped)!r}, {str(Path.home() / '.cache')!r}, '/etc/shadow']:
    try:
        got.append(open(path).read() if os.path.isfile(path) else str(os.listdir(path)))
    except OSError as e:
        got.append(f'denied {{e.errno}}')
result = got
""")
    assert "own" in out and "SHIPPED-SOLUTION-TEXT" not in out and "class ModelNew" not in out
    # denied by Landlock (13), or not there at all (2: a folder the sandbox uid may not search is
    # covered for the program, and what it does not need of it is not in its view)
    assert out.count("denied 13") + out.count("denied 2") >= 4 and "denied 13" in out, out


# -- sockets, processes, syscalls ---------------------------------------------------------------

@contextmanager
def unix_server(tmp_path: Path) -> Iterator[tuple[str, list]]:
    """A pathname UNIX socket of the host that anyone may connect to; (its path, connections)."""
    folder = tmp_path / "sock"
    folder.mkdir()
    folder.chmod(0o777)
    path = str(folder / "host.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    with accepting(server) as accepted:
        yield path, accepted


def test_worker_cannot_connect_to_a_host_unix_socket(tmp_path):
    with unix_server(tmp_path) as (path, accepted):
        out = attack_in_worker(tmp_path, f"""
import socket
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect({path!r})
    result = 'connected'
except OSError as e:
    result = f'refused {{e.errno}}'
""")
    assert "refused 13" in out and not accepted


def test_a_gpu_worker_opens_unix_sockets_but_reaches_no_host_socket(tmp_path):
    """The gpu profile: the CUDA driver's socket() works, its connect() to the MPS daemon finds
    nothing (as on a machine without MPS), and no send can carry an address."""
    with unix_server(tmp_path) as (path, accepted):
        out = attack_in_worker(tmp_path, f"""
import socket
got = {{}}
def attempt(name, fn):
    try:
        fn()
        got[name] = 'allowed'
    except OSError as e:
        got[name] = e.errno
s = socket.socket(socket.AF_UNIX)
attempt('connect', lambda: s.connect({path!r}))
d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
attempt('sendto', lambda: d.sendto(b'x', {path!r}))
attempt('sendmsg', lambda: d.sendmsg([b'x'], [], 0, {path!r}))
a, b = socket.socketpair()
attempt('pair', lambda: a.send(b'x') and b.recv(1))
result = got
""", backend="cuda")
    assert "'connect': 2" in out and "'sendto': 13" in out and "'sendmsg': 13" in out, out
    assert "'pair': 'allowed'" in out and not accepted


# every family Linux numbers (1..45): AF_INET 2, AF_INET6 10, AF_NETLINK 16, AF_PACKET 17, AF_BLUETOOTH 31,
# AF_ALG 38, AF_VSOCK 40 (a virtual machine's host, past the network namespace), AF_XDP 44, ...
SOCKET_FAMILIES = range(1, 46)
OPEN_EVERY_FAMILY = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
got = {{}}
for family in {list(SOCKET_FAMILIES)}:
    errors = set()
    for kind in (1, 2, 3, 5):   # stream, datagram, raw, seqpacket: a family that refuses one may take another
        fd = libc.socket(family, kind, 0)
        if fd >= 0:
            os.close(fd)
            errors = {{'opened'}}
            break
        errors.add(ctypes.get_errno())
    got[family] = sorted(errors, key=str)
result = got
"""


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_candidate_creates_no_socket_of_any_family_but_what_its_driver_needs(tmp_path, backend):
    """Allow-listed, not deny-listed: off the GPU no socket at all; on it AF_UNIX alone (the CUDA
    driver's, which reaches no host socket: above). Every other family answers EACCES (13), which
    the kernel never gives for a family it lacks (EAFNOSUPPORT), so each was refused by the filter."""
    import ast
    out = attack_in_worker(tmp_path, OPEN_EVERY_FAMILY, backend=backend)
    got = ast.literal_eval(out[len("RESULT<"):out.rindex(">")])
    allowed = {1} if backend == "cuda" else set()
    assert {family for family, errors in got.items() if errors == ["opened"]} == allowed, got
    assert all(errors == [13] for family, errors in got.items() if family not in allowed), got


def test_a_trusted_worker_may_open_vsock_and_netlink_sockets(tmp_path):
    """The control: where the filter allows them, this kernel has the families the test refuses."""
    import ast
    out = attack_in_worker(tmp_path, OPEN_EVERY_FAMILY, trusted=True)
    got = ast.literal_eval(out[len("RESULT<"):out.rindex(">")])
    assert got[16] == ["opened"] and got[2] == ["opened"], got


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_candidate_cannot_send_sigcont(tmp_path, backend):
    """kill, tgkill and pidfd_send_signal of SIGCONT answer EPERM; other signals still go."""
    out = attack_in_worker(tmp_path, """
import os, signal, threading
signal.signal(signal.SIGCONT, lambda *_: None)
signal.signal(signal.SIGUSR1, lambda *_: None)
got = {}
def attempt(name, fn):
    try:
        fn()
        got[name] = 'sent'
    except OSError as e:
        got[name] = e.errno
attempt('kill', lambda: os.kill(os.getpid(), signal.SIGCONT))
attempt('tgkill', lambda: signal.pthread_kill(threading.get_ident(), signal.SIGCONT))
fd = os.pidfd_open(os.getpid())
attempt('pidfd', lambda: signal.pidfd_send_signal(fd, signal.SIGCONT))
attempt('usr1', lambda: os.kill(os.getpid(), signal.SIGUSR1))
result = got
""", backend=backend)
    assert "'kill': 1" in out and "'tgkill': 1" in out and "'pidfd': 1" in out and "'usr1': 'sent'" in out, out


def test_a_trusted_worker_may_open_unix_sockets(tmp_path):
    out = attack_in_worker(tmp_path, "import socket\nsocket.socket(socket.AF_UNIX).close()\nresult = 'opened'",
                           trusted=True)
    assert "opened" in out


def test_denied_syscalls_answer_an_error(tmp_path):
    """The seccomp list: io_uring, ptrace, namespaces, keyrings, bpf, perf, mounts; clone3 ENOSYS."""
    out = attack_in_worker(tmp_path, """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {'x86_64': dict(io_uring_setup=425, ptrace=101, unshare=272, keyctl=250, bpf=321, perf_event_open=298,
                     mount=165, clone3=435),
      'aarch64': dict(io_uring_setup=425, ptrace=117, unshare=97, keyctl=219, bpf=280, perf_event_open=241,
                      mount=40, clone3=435)}[os.uname().machine]
got = {}
for name, n in nr.items():
    rc = libc.syscall(n, 0x10000000 if name == 'unshare' else 0, 0, 0, 0, 0)
    got[name] = ctypes.get_errno() if rc < 0 else 'allowed'
result = got
""")
    assert "allowed" not in out
    for name in ("io_uring_setup", "ptrace", "unshare", "keyctl", "bpf", "perf_event_open", "mount"):
        assert f"'{name}': 1" in out, out
    assert "'clone3': 38" in out


def test_an_untrusted_program_cannot_move_itself_to_other_cores(tmp_path):
    """It is timed on the cores the harness pins it to, against baselines held alike: one that
    widened its own mask would run on more cores than they do (issue 21), off the GPU or on it.
    A trusted worker may still."""
    code = """
import os
try:
    os.sched_setaffinity(0, os.sched_getaffinity(0))
    result = 'moved'
except PermissionError:
    result = 'refused'
"""
    assert "refused" in attack_in_worker(tmp_path, code)
    assert "refused" in attack_in_worker(tmp_path, code, backend="cuda")
    assert "moved" in attack_in_worker(tmp_path, code, trusted=True)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_an_untrusted_program_starts_where_compiles_may_run(tmp_path, monkeypatch, backend):
    """Only the harness moves it onto the cores kept for timing, for a window."""
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(launch, "compile_cores", lambda: {allowed[0]})
    out = attack_in_worker(tmp_path, "import os\nresult = sorted(os.sched_getaffinity(0))", backend=backend)
    assert f"RESULT<{[allowed[0]]}>" in out, out


def test_kill_minus_one_reaches_nothing_outside(tmp_path):
    helper = subprocess.Popen(["sleep", "120"])
    sibling = SandboxedProcess("reference", tmp_path / "sibling", SandboxConfig(timeout_s=120), "cpu")
    try:
        work = tmp_path / "work"
        task = tmp_path / "killer.py"
        task.write_text("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
                        "raise RuntimeError('RESULT<still here>')\n")
        with SandboxedProcess("reference", work, SandboxConfig(timeout_s=120), "cpu", readable=(task,)) as proc:
            # without its PID namespace this would signal every process of the uid: refuse to try
            assert proc.isolation["pid_namespace"] is True
            with pytest.raises(SandboxError) as err:
                proc.request(ReferenceSetup(str(task), "cpu", 0, "cpu"))
        assert "RESULT<still here>" in err.value.reason
        time.sleep(0.5)
        assert helper.poll() is None and sibling.proc.poll() is None
    finally:
        helper.kill()
        helper.wait()
        sibling.close()


# -- lifetimes ---------------------------------------------------------------------------------

DAEMON = """
import os
marker = {marker!r}
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp('sleep', ['sleep', marker])
    os._exit(0)
os.wait()
result = 'forked'
"""


def test_a_setsid_daemon_does_not_outlive_its_worker(tmp_path):
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9}"
    out = attack_in_worker(tmp_path, DAEMON.format(marker=marker))
    assert "forked" in out
    deadline = time.monotonic() + 5
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_processes_with(marker) == []


@pytest.mark.parametrize("pid_namespace", [True, False], ids=["pid-namespace", "subreaper-sweep"])
def test_everything_a_program_starts_ends_with_it(tmp_path, pid_namespace):
    """The launcher itself, with and without a PID namespace (where a machine has none, the stub
    sweeps the orphans it reaps as a subreaper)."""
    marker = f"{2000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9}"
    code = DAEMON.format(marker=marker) + "print(result, flush=True)\nimport time\ntime.sleep(60)\n"
    policy = launch.Policy(readable=tuple(launch.python_readable()), pid_namespace=pid_namespace)
    proc = launch.spawn([sys.executable, "-c", code], policy, cwd=tmp_path,
                        env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE)
    assert proc.popen.stdout.readline().strip() == b"forked"
    assert host_processes_with(marker)
    proc.reap()
    assert host_processes_with(marker) == []


@needs_pidns
def test_a_joined_worker_shares_the_pid_namespace(tmp_path):
    """CUDA IPC between an evaluation's two workers needs one PID namespace (the driver checks pids)."""
    first = launch.spawn(["sleep", "60"], launch.Policy(), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    try:
        rc, out, _ = launch.run(["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; echo $$"],
                             launch.Policy(join=first.pidfd), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
                             timeout=30)
    finally:
        first.reap()
    assert rc == 0 and out.splitlines()[0].strip() == "sleep 60" and out.splitlines()[1] != "1"


# -- identity and what the harness keeps -----------------------------------------------------------

def test_the_isolation_in_force_is_recorded(tmp_path):
    with SandboxedProcess("program", tmp_path, SandboxConfig(timeout_s=60), "cpu") as proc:
        iso = proc.isolation
        assert proc.worker_pid != proc.proc.pid and os.path.exists(f"/proc/{proc.worker_pid}")
    for key in ("landlock_abi", "reads_confined", "pid_namespace", "network_namespace", "seccomp", "uid"):
        assert key in iso
    assert iso["seccomp"] == "strict" and iso["reads_confined"] is bool(SUPPORT["landlock_abi"])
    assert iso["capabilities"] is False


@needs_root
def test_a_root_harness_runs_programs_as_the_uid_and_can_still_read_their_memory(tmp_path):
    private = tmp_path / "root-only.txt"
    private.write_text("root only")
    private.chmod(0o600)
    tmp_path.chmod(0o755)
    policy = launch.Policy(readable=(str(tmp_path),), uid=65534)
    proc = launch.spawn(["sh", "-c", f"id -u; cat {private} || echo refused; exec sleep 60"], policy,
                        cwd="/", env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.popen.stdout.readline().strip() == b"65534"
        assert b"refused" in proc.popen.stdout.readline() + proc.popen.stdout.readline()
        assert proc.isolation["uid"] == 65534
        time.sleep(0.2)
        with open(f"/proc/{proc.worker_pid}/maps") as f:   # the harness reads the worker's memory
            start = int(next(ln for ln in f if "[stack]" in ln).split("-")[0], 16)
        with open(f"/proc/{proc.worker_pid}/mem", "rb") as mem:
            assert len(os.pread(mem.fileno(), 64, start)) == 64
    finally:
        proc.reap()


@needs_root
def test_a_folder_the_uid_may_not_search_is_covered_for_the_program_alone(tmp_path):
    """Python under a root's home of mode 700: the folder is covered, in the program's own mount
    namespace, by one that holds only the entries on the way to what it reads; the rest of it is
    not there, and the harness's own view is unchanged."""
    locked = tmp_path / "locked"
    (locked / "needed").mkdir(parents=True)
    (locked / "needed" / "file").write_text("readable")
    (locked / "other").write_text("root's")
    (locked / "needed").chmod(0o755)
    (locked / "needed" / "file").chmod(0o644)
    locked.chmod(0o700)
    code = f"ls -a {locked}; cat {locked}/needed/file; cat {locked}/other || echo no-other; id -u"
    rc, out, _ = launch.run(["sh", "-c", code], launch.Policy(readable=(str(locked / "needed"),), uid=65534),
                            cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert rc == 0 and "readable" in out and "no-other" in out and "65534" in out, out
    assert "other" not in out.split("readable")[0], out    # the listing of the covered folder
    assert sorted(os.listdir(locked)) == ["needed", "other"] and (locked / "other").read_text() == "root's"


@needs_root
def test_a_path_the_uid_cannot_read_itself_is_refused_in_one_line_never_run_as_root(tmp_path):
    private = tmp_path / "task.py"
    private.write_text("x = 1\n")
    private.chmod(0o600)
    with pytest.raises(SandboxError) as refused:
        SandboxedProcess("reference", tmp_path / "work", SandboxConfig(), "cpu", readable=(private,))
    assert "uid 65534 cannot read" in refused.value.reason and "chmod" in refused.value.reason
    assert "\n" not in refused.value.reason


@needs_root
def test_every_confined_worker_runs_as_the_sandbox_uid(tmp_path):
    """Wherever the interpreter lives (here: under a root home of mode 700), no worker is uid 0."""
    with SandboxedProcess("reference", tmp_path / "work", SandboxConfig(), "cpu") as proc:
        with open(f"/proc/{proc.worker_pid}/status") as f:
            ids = {ln.split(":")[0]: ln.split()[1:] for ln in f if ln.startswith(("Uid:", "Gid:"))}
        assert proc.isolation["uid"] == 65534
        assert set(ids["Uid"]) == {"65534"} and set(ids["Gid"]) == {"65534"}, ids


# -- the real evaluator ----------------------------------------------------------------------------

KERNEL_ATTACK = r"""
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static void attack() {
%s
}
"""
CPU_RELU = r"""
extern "C" void relu(float* out, const float* x, int64_t n) {
    attack();
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""
READ_AND_DIE = r"""
    char buf[4096] = {0};
    int fd = open("%s", O_RDONLY);
    if (fd < 0) { fprintf(stderr, "ATTACK-RAN open errno=%%d\n", errno); abort(); }
    ssize_t got = read(fd, buf, sizeof buf - 1);
    for (ssize_t i = 0; i < got; ++i) if (buf[i] == 0) buf[i] = ' ';
    fprintf(stderr, "ATTACK-RAN LEAK %%s\n", buf);
    abort();
"""


def _attacking_candidate(tmp_path: Path, body: str, backend: str) -> Path:
    """The honest relu workdir whose kernel host code runs `body` first on every call."""
    work = tmp_path / f"candidate-{uuid.uuid4().hex[:8]}"
    shutil.copytree(TESTS / "fixtures" / "honest_relu", work)
    kernels = work / "kernels"
    if backend == "cpu":
        (kernels / "relu.cu").unlink()
        (kernels / "relu.cpp").write_text(KERNEL_ATTACK % body + CPU_RELU)
    else:
        launch = "cudaStream_t stream) {"
        honest = (kernels / "relu.cu").read_text().replace(launch, launch + "\n    attack();")
        (kernels / "relu.cpp").unlink()
        (kernels / "relu.cu").write_text(KERNEL_ATTACK % body + honest)
    return work


def _evaluate(work: Path, config):
    from hpc.candidate import load_candidate
    from hpc.pipeline import evaluate
    from hpc.task import load_task

    return evaluate(load_task(RELU_TASK), load_candidate(work), config)


def _record_text(rec) -> str:
    """Everything the record says, but the candidate's own source (which holds the attack's text)."""
    return " ".join(str(v) for k, v in vars(rec).items() if k != "candidate_source")


BACKENDS = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def config(request, fast_config, cache_dir):
    """The evaluator's test config on the parametrized backend (cuda only where there is a GPU)."""
    if request.param == "cpu":
        return fast_config
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    return make_fast_config(cache_dir, "cuda")


@pytest.mark.parametrize("config", BACKENDS, indirect=True)
def test_kernel_host_code_cannot_read_a_shipped_solution(tmp_path, config):
    secret = tmp_path / "solutions" / "model_new.py"
    secret.parent.mkdir()
    secret.write_text("SHIPPED-SOLUTION-SECRET")
    rec = _evaluate(_attacking_candidate(tmp_path, READ_AND_DIE % secret, config.backend), config)
    assert "ATTACK-RAN open errno=13" in rec.reason, rec.reason
    assert "SHIPPED-SOLUTION-SECRET" not in _record_text(rec)


@pytest.mark.parametrize("config", BACKENDS, indirect=True)
def test_kernel_host_code_cannot_read_the_harness_environment(tmp_path, config):
    attack = READ_AND_DIE % f"/proc/{os.getpid()}/environ"
    rec = _evaluate(_attacking_candidate(tmp_path, attack, config.backend), config)
    assert "ATTACK-RAN open errno=" in rec.reason and "ATTACK-RAN LEAK" not in _record_text(rec), rec.reason


@pytest.mark.parametrize("config", BACKENDS, indirect=True)
def test_kernel_host_code_cannot_reach_a_host_unix_socket(tmp_path, config):
    body = r"""
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0) { fprintf(stderr, "ATTACK-RAN socket errno=%%d\n", errno); abort(); }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, "%s", sizeof addr.sun_path - 1);
    int rc = connect(s, (sockaddr*)&addr, sizeof addr);
    fprintf(stderr, "ATTACK-RAN connect rc=%%d errno=%%d\n", rc, errno);
    abort();
"""
    with unix_server(tmp_path) as (path, accepted):
        rec = _evaluate(_attacking_candidate(tmp_path, body % path, config.backend), config)
    # off the GPU there is no AF_UNIX socket at all; on it (the CUDA driver needs one) connect finds nothing
    expected = "socket errno=13" if config.backend == "cpu" else "connect rc=-1 errno=2"
    assert f"ATTACK-RAN {expected}" in rec.reason, rec.reason
    assert not accepted


@pytest.mark.parametrize("config", BACKENDS, indirect=True)
def test_a_daemon_started_by_kernel_code_does_not_outlive_the_evaluation(tmp_path, config):
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9}"
    body = r"""
    static bool done = false;
    if (done) return;
    done = true;
    if (fork() == 0) {
        setsid();
        if (fork() == 0) { execlp("sleep", "sleep", "%s", (char*)nullptr); _exit(1); }
        _exit(0);
    }
""" % marker
    rec = _evaluate(_attacking_candidate(tmp_path, body, config.backend), config)
    assert rec.compiled, rec.reason
    deadline = time.monotonic() + 5
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_processes_with(marker) == []


# -- priority ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("background", [True, False])
def test_a_background_program_and_all_it_starts_run_at_idle_priority(tmp_path, background):
    """Compiles run in the background: on a machine whose cores time another evaluation's calls,
    they take only what the timed work leaves idle (issue 21)."""
    rc, out, _ = launch.run(["sh", "-c", "cat /proc/self/stat | cut -d' ' -f19,41; sh -c \"cut -d' ' -f41 /proc/self/stat\""],
                         launch.Policy(background=background), cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"},
                         timeout=30)
    assert rc == 0, out
    nice, policy, child_policy = out.split()
    # field 19 is the nice value, field 41 the scheduling policy (5 = SCHED_IDLE)
    assert (nice, policy, child_policy) == (("19", "5", "5") if background else ("0", "0", "0")), out

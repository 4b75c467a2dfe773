"""Odd input on the command line (issue 20, item 8): NUL bytes, non-UTF-8 names, folders and files
swapped, link loops, FIFOs, unreadable, empty-ish and huge files, task files that do not parse.

The contract (README, "Evaluate"): a candidate that is there but no candidate is a failed record
(printed, written with --out, its reason on stderr, exit 1); a bad task, config, --out or argument
is one `error:` line and exit 2; a record with status error (the task's or harness's fault) is
printed and written, and exits 2; eval-suite records every task and never stops for one; records
already in a results file survive every failure.

Most calls run `hpc.cli.main` in this process (torch imported once) in a thread, so a read that
would block on a FIFO fails the test instead of hanging it. Everything here fails before a worker
starts, except two evaluations in the results-file test and the workers eval-suite starts ahead.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from hpc.cli import main
from hpc.results.hdf5 import read_records
from tests.conftest import RELU_TASK, ROOT, TESTS

HONEST = TESTS / "fixtures" / "honest_relu"
NOT_ALLOWED = b"import os\n"      # fails the static check: nothing of it ever runs
NON_UTF8 = os.fsdecode(b"r\xff")  # a file name that is not UTF-8, as Python spells it


def cli(*args, timeout: float = 600) -> tuple[int, str, str]:
    """Exit code, stdout, stderr of `hpc ARGS`. stdout encodes strictly, as a UTF-8 terminal does."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    result: dict = {}

    def run():
        try:
            with redirect_stdout(out), redirect_stderr(err):
                result["rc"] = main([str(a) for a in args])
        except BaseException as e:   # re-raised below: a traceback the user would have seen
            result["exc"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"hpc {' '.join(map(str, args))} blocked"
    if "exc" in result:
        raise result["exc"]
    return result["rc"], out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


def one_line(stderr: str, prefix: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


def workdir(root: Path, name: str = "wd") -> Path:
    """A workdir candidate that would fail the static check, should it get that far."""
    wd = root / name
    (wd / "kernels").mkdir(parents=True)
    (wd / "model_new.py").write_bytes(NOT_ALLOWED)
    return wd


def _nul(tmp: Path) -> Path:
    path = tmp / "nul.py"
    path.write_bytes(b"import torch\x00\nclass ModelNew: pass\n")
    return path


def _garbage_model(tmp: Path) -> Path:
    wd = workdir(tmp)
    (wd / "model_new.py").write_bytes(bytes(range(256)) * 16)
    return wd


def _non_utf8_name(tmp: Path) -> Path:
    path = tmp / f"{NON_UTF8}.py"
    path.write_bytes(NOT_ALLOWED)
    return path


def _non_utf8_kernel(tmp: Path) -> Path:
    wd = workdir(tmp)
    (wd / "kernels" / f"{NON_UTF8}.cpp").write_text("int f() { return 0; }\n")
    return wd


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "f.py")
    return tmp / "f.py"


def _fifo_model(tmp: Path) -> Path:
    wd = tmp / "wd"
    wd.mkdir()
    os.mkfifo(wd / "model_new.py")
    return wd


def _loop(tmp: Path) -> Path:
    (tmp / "loop.py").symlink_to("loop.py")
    return tmp / "loop.py"


def _kernel_loop(tmp: Path) -> Path:
    wd = workdir(tmp)
    (wd / "kernels" / "k.cpp").symlink_to("k.cpp")
    return wd


def _kernel_link_out(tmp: Path) -> Path:
    wd = workdir(tmp)
    (wd / "kernels" / "secret.h").symlink_to("/etc/passwd")
    return wd


def _link_to_a_secret(tmp: Path) -> Path:
    """A single file that is a link with another name than its target: read as root through it,
    /etc/shadow was the candidate's source (and a KeyError, the harness's error)."""
    (tmp / "x.py").symlink_to("/etc/shadow" if os.path.exists("/etc/shadow") else "/etc/passwd")
    return tmp / "x.py"


def _kernels_is_a_file(tmp: Path) -> Path:
    wd = tmp / "wd"
    wd.mkdir()
    (wd / "model_new.py").write_bytes(NOT_ALLOWED)
    (wd / "kernels").write_text("not a folder")
    return wd


def _folder_named_py(tmp: Path) -> Path:
    (tmp / "d.py").mkdir()
    return tmp / "d.py"


def _huge(tmp: Path) -> Path:
    path = tmp / "huge.py"
    with open(path, "wb") as f:
        f.truncate(200 << 20)   # sparse: 200 MiB that take no disk
    return path


@pytest.mark.parametrize("make, words", [
    (_nul, "null bytes"),
    (_garbage_model, "the source is not UTF-8"),
    (_non_utf8_name, "r\\xff.py: file name is not valid UTF-8"),
    (_non_utf8_kernel, "kernels/r\\xff.cpp: file name is not valid UTF-8"),
    (_fifo, "f.py: not a regular file"),
    (_fifo_model, "model_new.py: not a regular file"),
    (_loop, "loop.py: a symbolic link loop"),
    (_kernel_loop, "kernels/k.cpp: a symbolic link loop"),
    (_kernel_link_out, "kernels/secret.h: a link out of the workdir"),
    (_link_to_a_secret, "x.py: a symbolic link (name the file it points to)"),
    (_kernels_is_a_file, "kernels is not a folder"),
    (_folder_named_py, "workdir has no model_new.py"),
    (_huge, "too large"),
], ids=lambda x: x.__name__.strip("_") if callable(x) else "")
def test_odd_candidate_is_a_failed_record_printed_and_written(tmp_path, make, words):
    out = tmp_path / "r.h5"
    rc, stdout, stderr = cli("eval", RELU_TASK, make(tmp_path), "--json", "--out", out)
    assert rc == 1, stderr
    result = json.loads(stdout)
    assert words in result["reason"] and result["reward"] == -1 and result["status"] == "failed"
    assert one_line(stderr, "failed: static: ") == f"failed: static: {result['reason']}"
    [rec] = read_records(out)
    assert rec.reason == result["reason"] and rec.failed_stage == "static" and rec.reward == -1
    assert "root:" not in stdout and "root:" not in rec.candidate_source   # no line of a file it linked to


def _syntax_error(tmp: Path) -> Path:
    path = tmp / "level1" / "t.py"
    path.parent.mkdir()
    path.write_text("class Model:\n  pass\ndef get_inputs(:\n")
    return path


def _nul_task(tmp: Path) -> Path:
    path = tmp / "t.py"
    path.write_bytes(RELU_TASK.read_bytes() + b"\nx = 1\x00\n")
    return path


def _nested_task(tmp: Path) -> Path:
    path = tmp / "t.py"
    path.write_text(RELU_TASK.read_text() + "\nx = " + "+".join(["n"] * 200_000) + "\n")
    return path


def _non_utf8_task(tmp: Path) -> Path:
    path = tmp / f"{NON_UTF8}.py"
    shutil.copy(RELU_TASK, path)
    return path


@pytest.mark.parametrize("make, words", [
    (_syntax_error, "level1/t.py: syntax error at line 3"),
    (_nul_task, "t.py: syntax error: source code string cannot contain null bytes"),
    (_nested_task, "t.py: cannot be parsed (nested too deeply)"),
    (_non_utf8_task, "r\\xff.py: file name is not valid UTF-8"),
    (_fifo, "f.py: not a regular file"),
    (_loop, "loop.py: a symbolic link loop"),
    (_folder_named_py, "d.py: is a folder"),
    (_huge, "huge.py: too large"),
], ids=lambda x: x.__name__.strip("_") if callable(x) else "")
def test_odd_task_is_one_error_line_and_exit_2(tmp_path, make, words):
    out = tmp_path / "r.h5"
    rc, stdout, stderr = cli("eval", make(tmp_path), HONEST, "--out", out)
    assert rc == 2 and not stdout
    assert words in one_line(stderr, "error: task ")
    assert not out.exists()


def _fifo_named(tmp: Path, name: str) -> Path:
    os.mkfifo(tmp / name)
    return tmp / name


def _under_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("")
    return tmp / "file" / "r.h5"


def _not_utf8_config(tmp: Path) -> Path:
    (tmp / "c.yaml").write_bytes(b"seed: \xff\n")
    return tmp / "c.yaml"


@pytest.mark.parametrize("option, make, words", [
    ("--out", lambda tmp: _fifo_named(tmp, "r.h5"), "r.h5: not a regular file"),
    ("--out", lambda tmp: tmp, "is a folder"),
    ("--out", lambda tmp: _loop(tmp), "loop.py: a symbolic link loop"),
    ("--out", _under_a_file, "file/r.h5: a folder on its path is a file"),
    ("--out", lambda tmp: tmp / "r.txt", "r.txt: an HDF5 results file's name ends in .h5"),
    ("--config", lambda tmp: _fifo_named(tmp, "c.yaml"), "c.yaml: not a regular file"),
    ("--config", _not_utf8_config, "c.yaml: not UTF-8 text"),
], ids=["out-fifo", "out-folder", "out-loop", "out-under-a-file", "out-not-h5", "config-fifo", "config-not-utf8"])
def test_odd_out_or_config_is_one_error_line_and_exit_2(tmp_path, option, make, words):
    rc, stdout, stderr = cli("eval", RELU_TASK, _nul(tmp_path), option, make(tmp_path), timeout=120)
    assert rc == 2 and not stdout
    assert words in one_line(stderr, f"error: {option} " if option == "--out" else "error: config ")



@pytest.mark.parametrize("command", ["eval", "eval-suite"])
def test_a_config_with_the_old_name_of_the_rules_is_one_line_naming_the_new_key(tmp_path, command):
    """The evaluator's op and library rules were `policy:`, now `rules:` (`policy` is the LLM)."""
    (tmp_path / "c.yaml").write_text("policy:\n  libraries: [cublas]\n")
    task, candidate = (RELU_TASK, HONEST) if command == "eval" else (RELU_TASK.parent.parent, HONEST.parent)
    rc, stdout, stderr = cli(command, task, candidate, "--config", tmp_path / "c.yaml", "--out", tmp_path / "r.h5",
                             timeout=120)
    assert rc == 2 and not stdout
    assert one_line(stderr, "error: config ") == ("error: config policy: renamed to rules "
                                                  "(the candidate's op and library rules)")
    assert not (tmp_path / "r.h5").exists()

@pytest.mark.parametrize("args, words", [
    (["eval", "", "c.py"], "argument task: expected a path, got an empty string"),
    (["eval", RELU_TASK, "c.py", "--out", ""], "argument --out: expected a path"),
    (["eval", RELU_TASK, "c.py", "--config", ""], "argument --config: expected a path"),
    (["eval-suite", RELU_TASK, ""], "argument candidates: expected a path"),
    (["eval", RELU_TASK, "c.py", "--seed", str(1 << 64)], f"argument --seed: at most {(1 << 62) - 1}"),
    (["eval", RELU_TASK, "c.py", "--seed", "1e3"], "argument --seed: expected an integer, got '1e3'"),
], ids=["empty-task", "empty-out", "empty-config", "empty-candidates", "huge-seed", "float-seed"])
def test_odd_arguments_are_one_error_line_before_any_work(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    _nul(tmp_path).rename(tmp_path / "c.py")
    rc, stdout, stderr = cli(*args)
    assert rc == 2 and not stdout and words in one_line(stderr, "error: hpc ")
    assert os.listdir(tmp_path) == ["c.py"]


def test_eval_suite_refuses_a_fifo_for_tasks_and_a_file_for_candidates(tmp_path):
    rc, stdout, stderr = cli("eval-suite", _fifo(tmp_path), tmp_path, timeout=120)
    assert rc == 2 and "f.py: not a regular file or folder" in one_line(stderr, "error: tasks ")
    rc, stdout, stderr = cli("eval-suite", RELU_TASK, RELU_TASK)
    assert rc == 2 and f"{RELU_TASK}: not a folder" in one_line(stderr, "error: candidates ")


def test_results_file_keeps_every_record_through_failing_commands(tmp_path, cache_dir, monkeypatch):
    """An honest record first; then commands that fail in each way, against the same --out."""
    monkeypatch.setenv("HPC_CACHE_DIR", str(cache_dir))
    out = tmp_path / "r.h5"
    fast = ("--backend", "cpu", "--scale", "cpu", "--iterations", "10", "--out", out)
    rc, _, stderr = cli("eval", RELU_TASK, HONEST, *fast)
    assert rc == 0, stderr
    [honest] = read_records(out)

    rc, _, stderr = cli("eval", _syntax_error(tmp_path), HONEST, *fast)
    assert rc == 2 and "syntax error" in one_line(stderr, "error: task ")
    rc, _, stderr = cli("eval", RELU_TASK, tmp_path / "missing", *fast)
    assert rc == 2 and "no such file or folder" in one_line(stderr, "error: candidate ")
    rc, _, stderr = cli("eval", RELU_TASK, HONEST, *fast, "--config", _fifo_named(tmp_path, "c.yaml"), timeout=120)
    assert rc == 2 and "not a regular file" in one_line(stderr, "error: config ")
    rc, _, stderr = cli("eval", RELU_TASK, _nul(tmp_path), *fast)
    assert rc == 1 and "null bytes" in one_line(stderr, "failed: static: ")

    # the task's fault (its module raises on import): status error, exit 2, and still recorded
    boom = tmp_path / "level1" / "boom.py"
    boom.write_text(RELU_TASK.read_text() + "\nraise RuntimeError('no such dataset\\non this \\x1b[2Jmachine')\n")
    rc, stdout, stderr = cli("eval", boom, HONEST, *fast, "--json")
    line = one_line(stderr, "error: level1/boom: load: ")
    assert rc == 2 and "no such dataset on this \\x1b[2Jmachine" in line, stderr
    assert json.loads(stdout)["status"] == "error" and json.loads(stdout)["reward"] is None

    # the harness itself raising is an error record too, not a traceback
    def raises(*_):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("hpc.suite.evaluate", raises)
    rc, _, stderr = cli("eval", RELU_TASK, HONEST, *fast)
    assert rc == 2 and "harness error: RecursionError" in one_line(stderr, "error: level1/relu: load: ")

    records = read_records(out)
    assert repr(records[0]) == repr(honest)
    assert [(r.task_id, r.status, r.failed_stage) for r in records[1:]] == [
        ("level1/relu", "failed", "static"), ("level1/boom", "error", "load"), ("level1/relu", "error", "load")]


def test_eval_suite_records_every_odd_task_and_candidate_and_goes_on(tmp_path, cache_dir):
    """One real process (strict stdout, argv as bytes); as root, without the capabilities that
    let root read a chmod 000 file (else unreadable would mean nothing here)."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root needs setpriv to meet an unreadable file")
        drop = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}"]
    tasks, cands = tmp_path / "tasks" / "level1", tmp_path / "cands" / "level1"
    tasks.mkdir(parents=True)
    cands.mkdir(parents=True)
    for name in ("nul", "fifo", "loop", "unreadable", "none"):
        shutil.copy(RELU_TASK, tasks / f"{name}.py")
    shutil.copy(_nul(tmp_path), cands / "nul.py")
    os.mkfifo(cands / "fifo.py")
    (cands / "loop").symlink_to("loop")
    (cands / "unreadable.py").write_bytes(NOT_ALLOWED)
    (cands / "unreadable.py").chmod(0)
    (tasks / "bad_syntax.py").write_text("class Model:\n  pass\ndef get_inputs(:\n")
    shutil.copy(RELU_TASK, tasks / f"{NON_UTF8}.py")
    os.mkfifo(tasks / "task_fifo.py")
    (tasks / "task_folder.py").mkdir()
    shutil.copy(RELU_TASK, tasks / "task_unreadable.py")
    (tasks / "task_unreadable.py").chmod(0)
    (tmp_path / "tasks" / "more" / "level1").mkdir(parents=True)
    shutil.copy(RELU_TASK, tmp_path / "tasks" / "more" / "level1" / "nul.py")   # a second level1/nul
    out = tmp_path / "r.h5"

    proc = subprocess.run([*prefix, sys.executable, "-m", "hpc.cli", "eval-suite", tasks.parent, cands.parent,
                           "--out", out], capture_output=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HPC_CACHE_DIR": str(cache_dir)})
    stderr = proc.stderr.decode()
    assert "Traceback" not in stderr and proc.returncode == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: 6 of 11 tasks not evaluated (status error)")
    records = read_records(out)
    got = {(r.task_id, r.status): r.reason for r in records}
    t, c = f"task {tasks}", f"candidate {cands}"
    expected = {
        ("level1/bad_syntax", "error"): f"{t}/bad_syntax.py: syntax error at line 3: invalid syntax",
        ("level1/fifo", "failed"): f"{c}/fifo.py: not a regular file",
        ("level1/loop", "failed"): f"{c}/loop: a symbolic link loop",
        ("level1/none", "failed"): f"no candidate for level1/none under {cands.parent}",
        ("level1/nul", "failed"): "source code string cannot contain null bytes",
        ("level1/nul", "error"): f"task {tmp_path}/tasks/more/level1/nul.py: task id level1/nul is also "
                                 f"{tasks}/nul.py",
        ("level1/r\\xff", "error"): f"{t}/r\\xff.py: file name is not valid UTF-8 (the task id is stored as text)",
        ("level1/task_fifo", "error"): f"{t}/task_fifo.py: not a regular file",
        ("level1/task_folder", "error"): f"{t}/task_folder.py: is a folder",
        ("level1/task_unreadable", "error"): f"{t}/task_unreadable.py: cannot read (Permission denied)",
        ("level1/unreadable", "failed"): f"{c}/unreadable.py: cannot read (Permission denied)",
    }
    assert len(records) == 11 and got.keys() == expected.keys()
    assert all(expected[key] in got[key] for key in got), got
    rows = [ln.split()[0] for ln in proc.stdout.decode().splitlines() if ln.startswith("level1/")]
    assert len(rows) == 11 and "level1/r\\xff" in rows

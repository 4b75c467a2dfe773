"""Crash consistency of results files: the journal beside each file, the rebuild from it after a
kill at any write or a full disk, `hpc repair`, and the one-line errors of an unwritable --out."""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpc.errors import UserError
from hpc.results.hdf5 import JOURNAL_ID, RecordStore, ResultWriter, read_records, repair
from hpc.results.journal import journal_path, read_entries, write_new
from hpc.results.record import COLUMNS, EvalRecord
from hpc.results.training import TRAIN_SCHEMA_VERSION, TrainingWriter, read_steps, read_trajectories
from tests.conftest import ROOT


def rec(task_id: str, size: int = 10) -> EvalRecord:
    return EvalRecord(task_id=task_id, reward=1.0, reason="r" * size, candidate_source="s" * size,
                      candidate_times_ms=[1.0] * 5)


def ids(path: Path) -> list[str]:
    return [r.task_id for r in read_records(path)]


def write(path: Path, *task_ids: str, size: int = 10) -> None:
    with ResultWriter(path) as w:
        for task_id in task_ids:
            w.append(rec(task_id, size))


def test_a_file_cut_in_half_is_rebuilt_from_its_journal(tmp_path):
    path = tmp_path / "r.h5"
    write(path, "a", "b", "c", size=3000)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="hpc repair"):
        read_records(path)
    with ResultWriter(path) as w:          # the next writer rebuilds it, and continues it
        assert [r.task_id for r in w.records()] == ["a", "b", "c"]
        w.append(rec("d"))
    assert ids(path) == ["a", "b", "c", "d"]
    assert read_records(path)[0].reason == "r" * 3000
    with h5py.File(path, "r") as f:   # the columns' units and meanings are journaled with the layout
        assert {(c.name, c.units, c.description) for c in COLUMNS} == \
            {(name, ds.attrs["units"], ds.attrs["description"]) for name, ds in f["records"].items()}


def test_a_journal_from_before_column_attributes_rebuilds_the_file_and_the_next_writer_adds_them(tmp_path):
    path = tmp_path / "r.h5"
    write(path, "a", "b")
    entries, _ = read_entries(journal_path(path))
    for entry in entries:
        entry.pop("column_attrs", None)
    write_new(journal_path(path), entries[:-1])   # not closed: the file is rebuilt from it
    assert repair(path).startswith(f"{path}: rebuilt from its journal")
    with h5py.File(path, "r") as f:
        assert not any(ds.attrs for ds in f["records"].values())
    write(path, "c")
    assert ids(path) == ["a", "b", "c"]
    with h5py.File(path, "r") as f:
        assert all(ds.attrs["description"] for ds in f["records"].values())


def test_a_torn_journal_tail_is_cut_and_the_rows_before_it_kept(tmp_path):
    path = tmp_path / "r.h5"
    write(path, "a", "b")
    entries, length = read_entries(journal_path(path))
    with open(journal_path(path), "ab") as f:    # a writer killed in the middle of its next entry
        f.write(b"HJ1\n\xff\x00\x00\x00garbage")
    path.write_bytes(b"")                        # and the HDF5 file lost with it
    assert read_entries(journal_path(path)) == (entries, length)
    write(path, "c")
    assert ids(path) == ["a", "b", "c"]
    assert [e["op"] for e in read_entries(journal_path(path))[0]][-1] == "close"


def test_a_file_without_a_journal_gets_one_and_is_then_protected(tmp_path):
    """Files written before journals (or copied without theirs) keep working: the first writer
    journals their complete rows, so a later crash loses none of them."""
    path = tmp_path / "r.h5"
    write(path, "a", "b")
    journal_path(path).unlink()
    with h5py.File(path, "a") as f:
        del f.attrs[JOURNAL_ID]
    write(path, "c")
    path.write_bytes(path.read_bytes()[:1000])
    write(path, "d")
    assert ids(path) == ["a", "b", "c", "d"]


def test_a_journal_of_another_file_is_not_applied(tmp_path):
    """A results file replaced by another (copied over it) keeps its own rows, not the old journal's."""
    path, other = tmp_path / "r.h5", tmp_path / "other.h5"
    write(path, "a", "b")
    write(other, "x")
    shutil.copyfile(other, path)
    write(path, "y")
    assert ids(path) == ["x", "y"]


def test_a_removed_file_starts_anew_despite_its_journal(tmp_path):
    path = tmp_path / "r.h5"
    write(path, "a")
    path.unlink()
    write(path, "b")
    assert ids(path) == ["b"]


def test_training_tables_and_their_truncation_are_rebuilt(tmp_path):
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        for step in (1, 2, 3):
            w.append_trajectories(step, "sft", [{"task_id": "t", "reward": float(step), "end_reason": "done"}])
            w.append_step({"step": step, "stage": "sft", "stage_step": step, "samples": 1, "sft_loss": 0.5})
        w.truncate_after(2)
        w.append_step({"step": 3, "stage": "ppo_single", "stage_step": 1, "samples": 1})
    path.write_bytes(b"\0" * 100)
    assert repair(path).endswith(f"{'rebuilt from its journal'} (train/steps 3, train/trajectories 2)")
    steps = read_steps(path)
    assert [(s["step"], s["stage"]) for s in steps] == [(1, "sft"), (2, "sft"), (3, "ppo_single")]
    assert steps[0]["sft_loss"] == 0.5 and math.isnan(steps[2]["sft_loss"])
    assert [t["reward"] for t in read_trajectories(path)] == [1.0, 2.0]
    with h5py.File(path, "r") as f:
        assert f["train"].attrs["schema_version"] == TRAIN_SCHEMA_VERSION and f["train/steps"]["step"].shape == (3,)
        assert f["train/steps/sft_loss"].attrs["units"] == "nat/token"
        assert f["train/trajectories/reward"].attrs["description"] == "its reward (NaN when none)"


def test_text_hdf5_refuses_is_a_value_error_before_anything_is_journaled(tmp_path):
    path = tmp_path / "train.h5"
    with TrainingWriter(path) as w:
        length = read_entries(journal_path(path))[1]
        with pytest.raises(ValueError, match="not text without NUL"):
            w.append_trajectories(1, "s\0ft", [{"task_id": "t", "reward": 0.0, "end_reason": "done"}])
        assert read_entries(journal_path(path))[1] == length
        w.append_trajectories(1, "sft", [{"task_id": "t", "reward": 0.0, "end_reason": "done"}])
    assert len(read_trajectories(path)) == 1


def test_hpc_repair_says_what_it_did_in_one_line(tmp_path, capsys):
    from hpc.cli import main

    path = tmp_path / "r.h5"
    write(path, "a", "b")
    assert main(["repair", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: intact (records 2)\n"
    path.write_bytes(path.read_bytes()[:500])
    assert main(["repair", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: rebuilt from its journal (records 2)\n"
    assert ids(path) == ["a", "b"]

    journal_path(path).unlink()
    path.write_bytes(path.read_bytes()[:500])
    assert main(["repair", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: results {path}: damaged, and no journal"), err
    assert main(["repair", str(tmp_path / "none.h5")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "none.h5").exists()


# -- real processes ---------------------------------------------------------------------------

SWEEP = """
import os, sys
from pathlib import Path
from hpc.results.hdf5 import ResultWriter
from hpc.results.record import EvalRecord

def writer(folder):
    marks = os.open(folder / "marks", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    def mark(text):   # writev: not among the system calls killed at
        os.writev(marks, [text.encode() + b"\\n"])
    k = 0
    for phase, names in enumerate((["a0"], ["b0"])):
        with ResultWriter(folder / "r.h5") as w:
            for name in names:
                w.append(EvalRecord(task_id=name, reward=float(k), reason="r" * (300 * k),
                                    candidate_times_ms=[float(k)] * k))
                mark(name)
                k += 1
        mark(f"closed {phase}")

root, at = Path(sys.argv[1]), int(sys.argv[2])
null = os.open(os.devnull, os.O_WRONLY)
for n in map(int, sys.argv[3:]):
    folder = root / f"k{n}"
    folder.mkdir()
    pid = os.fork()
    if pid == 0:
        for _ in range(at - n):   # strace counts each process's calls from 1: these shift its n-th write to `at`
            os.pwrite(null, b"x", 0)
        writer(folder)
        os._exit(0)
    os.waitpid(pid, 0)
"""
ORDER = ["a0", "b0"]


def _sweep(tmp_path: Path, at: int, points: list[int]) -> list[str]:
    """Run the writer once per kill point n in a process of its own (forked from one that imported
    everything once), under strace that SIGKILLs each process at its `at`-th pwrite64 or write; the
    process for n first makes at - n writes to /dev/null, so it dies at its own n-th write to the
    results file or its journal. at=0: no kill; returns the writer's calls (writev: its marks)."""
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    how = ["-o", os.devnull, "-e", "trace=pwrite64,write", "-e", f"inject=pwrite64,write:signal=KILL:when={at}"] \
        if at else ["-ff", "-o", str(tmp_path / "trace"), "-e", "trace=pwrite64,write,writev"]
    proc = subprocess.run(["strace", "-f", "-qq", *how, sys.executable, str(script),
                           str(tmp_path), str(at), *map(str, points)], capture_output=True, text=True, cwd=ROOT,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    if at:
        return []
    (trace,) = [t.read_text() for t in tmp_path.glob("trace.*") if "pwrite64(" in t.read_text()]   # the writer's
    return [line.split("(")[0] for line in trace.splitlines() if "(" in line]


def _recovered(folder: Path, n: int, first_mark: int) -> None:
    """The checks of one kill point (n: the write the writer was killed at; first_mark: the writes
    before its first record was finished)."""
    marks = (folder / "marks").read_text().split("\n")[:-1] if (folder / "marks").exists() else []
    assert "closed 1" not in marks, f"kill point {n}: the writer was not killed"
    path = folder / "r.h5"
    finished = [m for m in marks if m in ORDER]
    if not path.exists():
        assert not finished
        return
    if n % 3:   # two thirds of the points (2 cores' time): `hpc repair`; the others: a writer, appending
        repair(path)
    else:
        RecordStore(path).close()
    with h5py.File(path, "r") as f:
        laid_out = "records" in f
    if not laid_out:   # killed while the file was being created: nothing to keep
        assert not finished and n < first_mark, (n, marks)
        return
    got = ids(path)
    assert got == ORDER[:len(got)] and len(got) >= len(finished), (n, marks, got)
    with h5py.File(path, "r") as f:
        count = int(f["records"].attrs["count"])
        assert count == len(got) and [t.decode() for t in f["records/task_id"][:count]] == got
    if n % 3 == 0:
        with ResultWriter(path) as w:
            w.append(rec("after"))
        assert ids(path) == got + ["after"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/system-deps.sh installs it)")
def test_a_kill_at_any_write_keeps_every_finished_record_once(tmp_path):
    """A writer adds a record, closes, reopens and adds another: killed at each of its writes in turn
    (every pwrite64/write to the HDF5 file and the journal: strace's fault injection), the file
    then opens (a writer, or `hpc repair`) with every record finished before the kill, each once
    and in order, reads with read_records and with h5py directly, and takes appends again. The
    count of writes is strace's own: its injection fires at the last of them and not after."""
    calls = _sweep(tmp_path, 0, [0])
    assert (tmp_path / "k0" / "marks").read_text().split("\n")[:-1] == ["a0", "closed 0", "b0", "closed 1"]
    writes = [c for c in calls if c != "writev"]
    assert len(writes) > 100 and set(writes) == {"pwrite64"}, calls   # no write() left out of the sweep's count
    total = len(writes)
    first_mark = calls.index("writev")
    _sweep(tmp_path, total + 1, list(range(1, total + 2)))
    marks = (tmp_path / f"k{total + 1}" / "marks").read_text().split("\n")[:-1]
    assert marks[-1] == "closed 1", "strace counted more writes than the trace showed"
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_recovered, [tmp_path / f"k{n}" for n in range(1, total + 1)], range(1, total + 1),
                      [first_mark] * total))


@pytest.mark.slow
def test_a_full_disk_is_one_clear_error_and_the_file_resumes_once_space_is_freed(small_disk):
    path = small_disk / "r.h5"
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * 1536 * 1024)
    written = []
    with pytest.raises(UserError) as failed:
        with ResultWriter(path) as w:
            for k in range(1000):
                w.append(rec(f"t{k}", 2000))
                written.append(f"t{k}")
    message = str(failed.value)
    assert message.startswith(f"results {path}: cannot write (no space left on device)") and "\n" not in message
    assert len(written) >= 2
    assert not list(small_disk.glob(".r.h5.rebuilt.*")) and not list(small_disk.glob(".r.h5.journal.new.*"))
    ballast.unlink()
    with RecordStore(path) as store:     # the next writer finds every finished record, once
        got = [r.task_id for r in store.writer.records()]
        assert got[:len(written)] == written and len(got) <= len(written) + 1
        store.writer.append(rec("after", 10))
    assert ids(path)[-1] == "after"


FULL_DISK = """
import sys
from pathlib import Path
from hpc.errors import UserError
from hpc.results.hdf5 import RecordStore, ResultWriter, read_records, repair
from tests.test_results_journal import rec

disk, elsewhere = Path(sys.argv[1]), Path(sys.argv[2])
path, ballast = disk / "r.h5", disk / "ballast"
for kb in range(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])):
    for old in disk.iterdir():
        old.unlink()
    ballast.write_bytes(b"\\0" * kb * 1024)
    written = []
    try:
        with ResultWriter(path) as w:
            for k in range(1000):
                w.append(rec(f"t{k}", 2000 * (k % 3)))
                written.append(f"t{k}")
        raise SystemExit(f"ballast {kb} KB: the disk never filled")
    except UserError as e:
        assert "no space left on device" in str(e) and "\\n" not in str(e), e
    try:                                   # the disk still full: refused in one line, or rebuilt
        RecordStore(path).close()
    except UserError as e:
        assert "\\n" not in str(e), e
    other = elsewhere / f"o{kb}.h5"        # this process writes and reads another file as before
    with ResultWriter(other) as w:
        w.append(rec("x"))
    assert [r.task_id for r in read_records(other)] == ["x"]
    ballast.unlink()
    if path.exists():
        repair(path)
        got = [r.task_id for r in read_records(path)]
        assert got[:len(written)] == written and len(got) <= len(written) + 1, (kb, written, got)
        with ResultWriter(path) as w:
            w.append(rec("after"))
        assert [r.task_id for r in read_records(path)] == got + ["after"]
    else:
        assert not written, kb
    print(kb, len(written), flush=True)
"""


@pytest.mark.slow
def test_a_writer_process_stays_sound_after_a_full_disk(small_disk, tmp_path):
    """HDF5 cannot survive a failed write (a later close of the file crashes the process), so a
    writer reserves the room of each change before HDF5 writes it: in one process, writers that
    fill the disk at any point (laying out a file, appending, closing, rebuilding) each fail in one
    line, and the process goes on writing and reading results files, the full one included once
    there is room, and exits 0 (a negative exit code: a crash)."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script), str(small_disk), str(elsewhere),
                           "1024", "2048", "32"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [int(line.split()[1]) for line in proc.stdout.splitlines()]
    assert len(counts) == 32 and counts[0] > counts[-1] == 0, proc.stdout   # full at every stage, down to none


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval-suite", "jobs/evaluate.py", "jobs/train.py", "synthesize",
                                     "jobs/synthesize.py"])
def test_a_read_only_out_is_one_error_line_and_exit_2(read_only, command):
    tasks, solutions = ROOT / "kernels" / "tasks", ROOT / "kernels" / "solutions"
    cmd = {"eval-suite": ["-m", "hpc.cli", "eval-suite", str(tasks), str(solutions), "--only", "level1/01",
                          "--out", str(read_only / "r.h5")],
           "jobs/evaluate.py": ["jobs/evaluate.py", str(tasks), str(solutions), "--only", "level1/01", "--out",
                                str(read_only / "run"), "--executor", "local"],
           "jobs/train.py": ["jobs/train.py", "--config", "configs/train/default.yaml", "--out", str(read_only / "run")],
           "synthesize": ["-m", "hpc.cli", "synthesize", "--count", "1", "--out", str(read_only / "run")],
           "jobs/synthesize.py": ["jobs/synthesize.py", "--count", "1", "--out", str(read_only / "run"),
                                  "--executor", "local"]}[command]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "read-only file system" in lines[0].lower(), lines

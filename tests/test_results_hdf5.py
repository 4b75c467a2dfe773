"""The HDF5 schema: round trip, crash safety (a killed writer), live SWMR reads, bad files, and the
units and meaning every column carries."""

from __future__ import annotations

import dataclasses
import math
import signal
import subprocess
import sys
import time

import h5py
import pytest

from hpc.config import BACKENDS
from hpc.errors import ResultsFileError
from hpc.results.columns import Column, columns_of
from hpc.results.hdf5 import ResultWriter, file_attrs, read_records
from hpc.results.record import COLUMNS, STAGES, EvalRecord
from hpc.results.training import STEP_COLUMNS, TRAJECTORY_COLUMNS, EvaluationWriter


def test_round_trip_keeps_every_field(tmp_path):
    path = tmp_path / "r.h5"
    rec = EvalRecord(task_id="level1/x", task_level=1, reward=3.0, correct=True, candidate_times_ms=[1.5, 2.5],
                     reason="ünïcode ok", compile_cached=True, trials=7)
    with ResultWriter(path, {"git_commit": "abc"}) as w:
        w.append(rec)
        w.append(EvalRecord(task_id="level1/y", status="failed", failed_stage="compile"))
    back = read_records(path)
    assert _same(back[0], rec)
    assert back[1].failed_stage == "compile" and math.isnan(back[1].reward)
    assert file_attrs(path)["git_commit"] == "abc"


def _same(a: EvalRecord, b: EvalRecord) -> bool:
    """Field-wise equality where NaN equals NaN (unmeasured values are NaN)."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return da.keys() == db.keys() and all(
        da[k] == db[k] or (isinstance(da[k], float) and math.isnan(da[k]) and math.isnan(db[k])) for k in da)


def test_appending_to_an_existing_file_continues_it(tmp_path):
    path = tmp_path / "r.h5"
    for i in range(3):
        with ResultWriter(path) as w:
            w.append(EvalRecord(task_id=f"t{i}"))
    assert [r.task_id for r in read_records(path)] == ["t0", "t1", "t2"]


WRITER = """
import sys, time
from hpc.results.hdf5 import ResultWriter
from hpc.results.record import EvalRecord
with ResultWriter(sys.argv[1]) as w:
    i = 0
    while True:
        w.append(EvalRecord(task_id=f"t{i}", reward=float(i), candidate_times_ms=[float(i)] * 100))
        print(i, flush=True)
        i += 1
"""


def test_a_writer_killed_mid_run_leaves_every_finished_record(tmp_path):
    path = tmp_path / "crash.h5"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    finished = -1
    while finished < 40:
        finished = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    records = read_records(path)
    assert len(records) >= finished + 1
    assert [r.task_id for r in records] == [f"t{i}" for i in range(len(records))]
    assert all(r.candidate_times_ms == [float(i)] * 100 for i, r in enumerate(records))

    with ResultWriter(path) as w:     # the next writer rebuilds the file from its journal and continues it
        w.append(EvalRecord(task_id="after"))
    again = [r.task_id for r in read_records(path)]
    kept = again[:-1]   # the record in flight at the kill too, where its journal entry was whole: each once
    assert again[-1] == "after" and kept == [f"t{i}" for i in range(len(kept))] and 0 <= len(kept) - len(records) <= 1
    again = read_records(path)
    assert again[3].candidate_times_ms == [3.0] * 100


def test_a_second_writer_is_refused_while_the_first_lives(tmp_path):
    path = tmp_path / "live.h5"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        while int(proc.stdout.readline()) < 3:
            pass
        with pytest.raises(ResultsFileError, match="another process is writing it"):
            ResultWriter(path)
    finally:
        proc.kill()
        proc.wait()
    assert len(read_records(path)) >= 4


def _follow_once(path) -> list[str]:
    """One read of a live file as results/SCHEMA.md ("Following a live file") tells a reader outside
    the project: open in SWMR mode, read `count`, then the first `count` rows, close; a read that
    the writer's string data outran is tried again on a fresh open."""
    for _ in range(20):
        try:
            with h5py.File(path, "r", libver="latest", swmr=True) as f:
                count = int(f["records"].attrs["count"])
                return [t.decode() for t in f["records/task_id"][:count]]
        except OSError:
            time.sleep(0.05)
    raise AssertionError("20 reads outran")


def test_a_live_reader_follows_the_writer(tmp_path):
    path = tmp_path / "live.h5"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        while int(proc.stdout.readline()) < 5:
            pass
        first = len(read_records(path))
        seen = _follow_once(path)
        while int(proc.stdout.readline()) < first + 20:
            pass
        assert len(read_records(path)) > first >= 5
        later = _follow_once(path)
        assert len(later) > len(seen) >= 5 and later == [f"t{i}" for i in range(len(later))]
    finally:
        proc.kill()
        proc.wait()


def test_malformed_files_are_user_errors(tmp_path):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all")
    with pytest.raises(ResultsFileError, match="cannot read as HDF5"):
        read_records(junk)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=[1, 2, 3])
    with pytest.raises(ResultsFileError, match="not an hpc results file"):
        read_records(other)
    with pytest.raises(ResultsFileError, match="not an hpc results file"):
        ResultWriter(other)


def test_merging_shards_keeps_each_pair_once_preferring_a_real_result_over_a_pool_give_up(tmp_path):
    from hpc.results.merge import merge_files

    a, b = EvalRecord(task_id="level1/a", candidate_sha256="s1", reward=1.0, timestamp=1.0), \
        EvalRecord(task_id="level1/b", candidate_sha256="s2", reward=2.0, timestamp=1.0)
    gave_up = EvalRecord(task_id="level1/b", candidate_sha256="s2", timestamp=5.0).fail("pool", "rank lost", "error")
    rerun = EvalRecord(task_id="level1/a", candidate_sha256="s1", reward=3.0, timestamp=9.0)
    with ResultWriter(tmp_path / "s0.h5", {"git_commit": "abc"}) as w:
        w.append(a)
        w.append(gave_up)
    with ResultWriter(tmp_path / "s1.h5") as w:
        w.append(b)
        w.append(rerun)
    merged = merge_files([tmp_path / "s0.h5", tmp_path / "s1.h5"], tmp_path / "all.h5")
    back = read_records(tmp_path / "all.h5")
    assert [(r.task_id, r.reward) for r in back] == [("level1/a", 3.0), ("level1/b", 2.0)] == \
        [(r.task_id, r.reward) for r in merged]
    assert file_attrs(tmp_path / "all.h5")["git_commit"] == "abc"


def test_a_version_1_file_reads_with_newer_columns_as_defaults_and_takes_no_appends(tmp_path):
    """Files from before a column was added stay readable; appending would mix schemas, so it is refused."""
    from hpc.results.hdf5 import ADDED_IN, GROUP, RENAMED_IN

    path = tmp_path / "v1.h5"
    with ResultWriter(path) as w:
        w.append(EvalRecord(task_id="level1/x", candidate_ms=2.0, overhead_ms=0.5, stage_seconds="{}"))
    with h5py.File(path, "a") as f:
        f.attrs["schema_version"] = 1
        for name in ADDED_IN:
            del f[GROUP][name]
        for name, (before, _) in RENAMED_IN.items():
            f[GROUP].move(name, before)
    (rec,) = read_records(path)
    assert rec.task_id == "level1/x" and rec.candidate_ms == 2.0 and math.isnan(rec.overhead_ms)
    assert rec.stage_seconds == ""
    with pytest.raises(ResultsFileError, match="schema version 1; new results go to a new file"):
        ResultWriter(path)



def test_a_file_from_before_the_rules_were_named_so_reads_its_policy_column_as_rules(tmp_path):
    """Version 5 renamed the column of the evaluator's rules `policy` -> `rules`: a version 4 file
    keeps its column, read under the new name, and a new file has only the new one."""
    from hpc.results.hdf5 import GROUP

    path = tmp_path / "v4.h5"
    with ResultWriter(path) as w:
        w.append(EvalRecord(task_id="level1/x", rules='{"libraries": ["cublas"]}'))
    with h5py.File(path, "a") as f:
        assert "rules" in f[GROUP] and "policy" not in f[GROUP]
        f.attrs["schema_version"] = 4
        f[GROUP].move("rules", "policy")
    (rec,) = read_records(path)
    assert rec.task_id == "level1/x" and rec.rules == '{"libraries": ["cublas"]}'
    with h5py.File(path, "a") as f:
        del f[GROUP]["policy"]
    with pytest.raises(ResultsFileError, match="missing columns policy"):
        read_records(path)


def test_a_file_from_before_the_stages_had_one_vocabulary_reads_them_under_the_new_names(tmp_path):
    """Version 6 renamed the stages `correctness` -> `verify` and `timing` -> `profile` (the agent's
    tools' names): a version 5 file's failed_stage values and stage_seconds keys read under the new
    names; in a file of version 6 an old name is a malformed row."""
    import json

    from hpc.results.hdf5 import GROUP

    path = tmp_path / "v5.h5"
    with ResultWriter(path) as w:
        for task in ("level1/a", "level1/b", "level1/c"):
            w.append(EvalRecord(task_id=task))
    with h5py.File(path, "a") as f:   # the rows as the version 5 writer wrote them
        f.attrs["schema_version"] = 5
        f[GROUP]["failed_stage"][:] = [b"correctness", b"timing", b"compile"]
        f[GROUP]["stage_seconds"][:] = [b'{"static": 0.1, "correctness": 2.0}', b'{"correctness": 2.0, "timing": 3.5}',
                                        b""]
    back = read_records(path)
    assert [r.failed_stage for r in back] == ["verify", "profile", "compile"]
    assert [json.loads(r.stage_seconds or "{}") for r in back] == [{"static": 0.1, "verify": 2.0},
                                                                   {"verify": 2.0, "profile": 3.5}, {}]
    with h5py.File(path, "a") as f:
        f.attrs["schema_version"] = 6
    with pytest.raises(ResultsFileError, match="malformed, row 0: record failed_stage: expected one of"):
        read_records(path)


def _cut_file(tmp_path):
    """A results file of 50 records cut to its first half."""
    path = tmp_path / "r.h5"
    with ResultWriter(path) as w:
        for k in range(50):
            w.append(EvalRecord(task_id=f"level1/t{k}", reason="x" * 200))
    cut = tmp_path / "cut.h5"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return cut


def _three_records(path):
    with ResultWriter(path) as w:
        for k in range(3):
            w.append(EvalRecord(task_id=f"level1/t{k}"))


def _three_steps(path):
    from hpc.results.training import TrainingWriter

    with TrainingWriter(path) as w:
        for k in range(3):
            w.append_step({"step": k + 1, "stage": "sft", "stage_step": k + 1, "samples": 4, "step_s": 1.0})


def _read_tasks(path):
    return [r.task_id for r in read_records(path)]


def _read_steps(path):
    from hpc.results.training import read_steps

    return [s["step"] for s in read_steps(path)]


@pytest.mark.parametrize("write, read, rows, absent", [
    (_three_records, _read_tasks, ["level1/t0", "level1/t1", "level1/t2"], "not an hpc results file"),
    (_three_steps, _read_steps, [1, 2, 3], "no training data"),
], ids=["records", "train"])
def test_a_new_file_still_bare_while_its_writer_lives_is_read_again(tmp_path, write, read, rows, absent):
    """A writer switches a new file in bare and lays its tables out a moment later (CI saw a live
    reader fail so, in between): while the writer's lock is held that is a view to retry; once the
    table is there, its rows are read."""
    import fcntl
    import os
    import threading

    import h5py

    path, whole = tmp_path / "r.h5", tmp_path / "whole.h5"
    write(whole)
    h5py.File(path, "w").close()   # as _reconcile switches it in
    fd = os.open(tmp_path / ".r.h5.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)   # as the writer holds it
    later = threading.Timer(0.3, lambda: os.replace(whole, path))
    later.start()
    try:
        assert read(path) == rows
    finally:
        later.join()
        os.close(fd)
    h5py.File(path, "w").close()   # no writer now: a file without the table, said at once
    with pytest.raises(ResultsFileError, match=absent):
        read(path)


def test_a_truncated_file_is_a_clear_error_not_a_hang(tmp_path):
    cut = _cut_file(tmp_path)
    with pytest.raises(ResultsFileError, match="cannot read as HDF5"):
        read_records(cut)


def test_a_file_shorter_than_its_stored_end_while_its_writer_lives_is_read_again(tmp_path):
    """A live writer's file can be a moment shorter than the end its superblock stores (CI saw a
    live reader fail so): while the writer's lock is held, that is a view to retry, not damage."""
    import fcntl
    import os

    cut = _cut_file(tmp_path)
    fd = os.open(tmp_path / ".cut.h5.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)   # as the writer holds it
    try:
        with pytest.raises(ResultsFileError, match="unreadable while being written"):
            read_records(cut)
    finally:
        os.close(fd)
    with pytest.raises(ResultsFileError, match="cannot read as HDF5"):   # its writer gone: damage, at once
        read_records(cut)


def test_every_status_stage_and_backend_reads_back_as_written(tmp_path):
    path = tmp_path / "r.h5"
    written = [EvalRecord(task_id=f"t{k}", backend=backend).fail(stage, "why", status)
               for k, (stage, status, backend) in enumerate(
                   (stage, status, backend) for stage in STAGES for status in ("failed", "error")
                   for backend in ("", *BACKENDS))]
    with ResultWriter(path) as w:
        w.append(EvalRecord(task_id="ok", backend="cpu"))
        for rec in written:
            w.append(rec)
    back = read_records(path)
    assert (back[0].status, back[0].failed_stage) == ("ok", "")
    assert [(r.status, r.failed_stage, r.backend) for r in back[1:]] == \
        [(r.status, r.failed_stage, r.backend) for r in written]


@pytest.mark.parametrize("field, value", [("status", "passed"), ("failed_stage", "correctness"), ("backend", "rocm")])
def test_a_value_outside_its_vocabulary_is_refused_when_made_written_or_read(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"record {field}: expected one of"):
        EvalRecord(task_id="x", **{field: value})
    with pytest.raises(ValueError, match="record failed_stage"):
        EvalRecord(task_id="x").fail("correctness", "why")
    with pytest.raises(ValueError, match="record status"):
        EvalRecord(task_id="x").fail("load", "why", "ok")
    rec = EvalRecord(task_id="x")
    setattr(rec, field, value)   # past the constructor: the writer still refuses it
    path = tmp_path / "r.h5"
    with ResultWriter(path) as w:
        with pytest.raises(ValueError, match=f"record {field}"):
            w.append(rec)
        w.append(EvalRecord(task_id="y"))
    with h5py.File(path, "a") as f:   # a file written by something else: the reader refuses the row
        f[f"records/{field}"][0] = value.encode()
    with pytest.raises(ResultsFileError, match=f"malformed, row 0: record {field}: expected one of"):
        read_records(path)


def _described(path, tables: dict[str, tuple[Column, ...]]) -> list[str]:
    """The columns of `tables` in the file whose `units` and `description` are not the code's."""
    with h5py.File(path, "r") as f:
        return [f"{table}/{c.name}" for table, columns in tables.items() for c in columns
                if (f[table][c.name].attrs.get("units"), f[table][c.name].attrs.get("description"))
                != (c.units, c.description)]


def test_every_column_carries_its_units_and_meaning_and_a_file_without_them_gets_them_from_its_next_writer(
        tmp_path):
    """A writer describes every column of its tables (hpc.results.columns) and names the schema's
    document; a file written before that (no attributes) reads as before, and its next writer
    adds them and appends."""
    path = tmp_path / "r.h5"
    tables = {"records": COLUMNS, "train/steps": STEP_COLUMNS, "train/trajectories": TRAJECTORY_COLUMNS}
    with EvaluationWriter(path) as w:
        w.append(EvalRecord(task_id="a"))
        w.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 1})
    assert _described(path, tables) == [] and file_attrs(path)["schema_doc"] == "results/SCHEMA.md"
    with h5py.File(path, "a") as f:   # as written before 2026-12-03
        del f.attrs["schema_doc"]
        for table in tables:
            for ds in f[table].values():
                for key in list(ds.attrs):
                    del ds.attrs[key]
    assert len(_described(path, tables)) == sum(map(len, tables.values()))
    assert [r.task_id for r in read_records(path)] == ["a"]
    with EvaluationWriter(path) as w:
        w.append(EvalRecord(task_id="b"))
    assert _described(path, tables) == [] and file_attrs(path)["schema_doc"] == "results/SCHEMA.md"
    assert [r.task_id for r in read_records(path)] == ["a", "b"]


def test_every_column_is_described_in_ascii_with_known_units():
    """Descriptions in ASCII (HDF5 1.10's h5dump prints other bytes as octal escapes), none empty,
    and every column declared with `column` (a field without it fails at import)."""
    units = {"", "1", "s", "ms", "bytes", "FLOP", "tokens", "tokens/s", "nat/token"}
    for c in (*COLUMNS, *STEP_COLUMNS, *TRAJECTORY_COLUMNS):
        assert c.description and c.description.isascii(), c
        assert c.units in units, c

    @dataclasses.dataclass
    class Undescribed:
        x: int = 0

    with pytest.raises(TypeError, match=r"Undescribed.x: declare it with hpc.results.columns.column"):
        columns_of(Undescribed)

"""The one engine every run of evaluations goes through (hpc.engine): resume, write as results
arrive, stop on preemption, progress; and the one meaning of --only (hpc.task.select_tasks)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from hpc.engine import Gate, Item, again_alone, in_threads, run_items
from hpc.errors import TaskError
from hpc.results.hdf5 import RecordStore, read_records
from hpc.results.record import EvalRecord
from hpc.task import BadTask, select_tasks


class ListStore:
    def __init__(self, finished=()):
        self.kept = {key: f"old {key}" for key in finished}
        self.appended: list = []

    def finished(self):
        return set(self.kept)

    def append(self, item, result):
        self.appended.append((item.key, result))


def _items(n: int) -> list[Item]:
    return [Item(f"k{i}", i) for i in range(n)]


def test_items_the_store_holds_are_skipped_and_the_rest_written_as_they_finish():
    store, out = ListStore(finished={"k1", "k3"}), io.StringIO()
    run = run_items(_items(5), in_threads(lambda item: item.payload * 10, jobs=2, prestart=False), store,
                    describe=lambda item, r: f"item {item.payload}: {r}", label="test", stream=out)
    assert sorted(store.appended) == [("k0", 0), ("k2", 20), ("k4", 40)]
    assert (run.items, run.skipped, run.evaluated, run.written, run.stopped) == (5, 2, 3, [0, 20, 40], False)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("test: [")]
    assert len(lines) == 3 and lines[-1].startswith("test: [3/3] item ")


def test_once_stop_is_set_nothing_more_starts_or_is_written():
    """A result that finishes after the stop is not written (its workers may have died with the job),
    and no later item starts: the requeued run does them."""
    stop, started = threading.Event(), []

    def evaluate(item):
        started.append(item.payload)
        if item.payload == 1:
            stop.set()   # SIGTERM arrives while item 1 runs
        return item.payload

    store = ListStore()
    run = run_items(_items(4), in_threads(evaluate, jobs=1, prestart=False), store, describe=lambda i, r: "",
                    label="test", stop=stop, stream=io.StringIO())
    assert store.appended == [("k0", 0)] and started == [0, 1]
    assert run.stopped and run.evaluated == 1


def test_an_item_left_unrun_is_neither_written_nor_counted():
    store = ListStore()
    run = run_items(_items(3), in_threads(lambda item: None if item.payload == 2 else item.payload, prestart=False),
                    store, describe=lambda i, r: "", label="test", stream=io.StringIO())
    assert store.appended == [("k0", 0), ("k1", 1)] and (run.unrun, run.evaluated) == (1, 2)


def test_a_results_file_resumes_by_record_key_and_a_harness_error_runs_again(tmp_path):
    path = tmp_path / "r.h5"
    with RecordStore(path) as store:
        store.append(None, EvalRecord(task_id="level1/a", candidate_sha256="aa", reward=3.0))
        store.append(None, EvalRecord(task_id="level1/b", candidate_sha256="bb", status="error"))
    items = [Item(("level1/a", "aa"), "a"), Item(("level1/b", "bb"), "b"), Item(("level1/a", "a2"), "a changed")]
    with RecordStore(path) as store:
        assert store.finished() == {("level1/a", "aa")}
        run = run_items(items, in_threads(lambda item: EvalRecord(task_id=f"level1/{item.payload[0]}",
                                                                  candidate_sha256=item.key[1], reward=1.0),
                                          prestart=False),
                        store, describe=lambda i, r: "", label="test", stream=io.StringIO())
    assert (run.skipped, run.evaluated) == (1, 2)
    assert sorted((r.task_id, r.candidate_sha256, r.status) for r in read_records(path)) == [
        ("level1/a", "a2", "ok"), ("level1/a", "aa", "ok"), ("level1/b", "bb", "error"), ("level1/b", "bb", "ok")]



def test_a_task_without_a_candidate_is_recorded_once_however_often_the_run_resumes(tmp_path):
    """Its failed record carries the key its entry had before evaluating (the pool's resumes added
    one more such record on every run, issue 24)."""
    from hpc.config import load_config
    from hpc.suite import evaluate_entry, suite_entries
    from hpc.task import load_task
    from tests.conftest import RELU_TASK

    cfg = load_config(cache_dir=str(tmp_path / "cache"), backend="cpu", scale="cpu")
    task, path = load_task(RELU_TASK), tmp_path / "r.h5"
    for run in range(3):
        entries = suite_entries([(task, None)], str(tmp_path / "candidates"))
        with RecordStore(path) as store:
            summary = run_items([Item(e.record_key(), e) for e in entries],
                                in_threads(lambda item: evaluate_entry(item.payload, cfg), prestart=False), store,
                                describe=lambda i, r: "", label="test", stream=io.StringIO())
        assert (summary.skipped, summary.evaluated) == ((0, 1) if run == 0 else (1, 0))
    [record] = read_records(path)
    assert (record.task_id, record.status, record.reason) == (
        task.task_id, "failed", f"no candidate for {task.task_id} under {tmp_path / 'candidates'}")

def test_only_means_the_task_ids_containing_one_of_the_strings():
    tasks = [BadTask(Path(f"{t}.py"), t, 1, "") for t in ("level1/01_gelu", "level1/02_relu", "level2/01_gemm_gelu")]
    assert [t.task_id for t in select_tasks(tasks, ["gelu"], "tasks")] == ["level1/01_gelu", "level2/01_gemm_gelu"]
    assert [t.task_id for t in select_tasks(tasks, ["level1/", "gemm"], "tasks")] == [t.task_id for t in tasks]
    assert select_tasks(tasks, [], "tasks") == tasks
    with pytest.raises(TaskError, match="no task id contains conv or pool"):
        select_tasks(tasks, ["conv", "pool"], "tasks")


# ---- items evaluated side by side, one that needs it evaluated again alone ----

def test_an_item_run_alone_waits_for_those_in_flight_and_none_starts_beside_it():
    """Real threads on a run's gate: an item asked to run alone while another runs starts when it
    ends, and one asked for after it waits for it; items that overlap see each other."""
    gate, order = Gate(), []

    def recheck():
        with gate.alone():
            order.append("recheck")
            time.sleep(0.3)
            order.append("recheck done")

    def check():
        with gate.shared():
            order.append("check")

    with gate.shared() as first:
        threads = [threading.Thread(target=recheck)]
        threads[0].start()
        while not (gate._queued or order):   # the re-check waits for this check (or, wrongly, runs)
            time.sleep(0.01)
        threads.append(threading.Thread(target=check))
        threads[1].start()
        time.sleep(0.3)
        assert order == [] and not first.beside
    for t in threads:
        t.join(10)
    assert order == ["recheck", "recheck done", "check"]
    with gate.shared() as one, gate.shared() as two:
        pass
    assert one.beside and two.beside


def test_only_a_result_that_needs_it_after_running_beside_another_is_evaluated_again_alone():
    """Four items on four threads: "squeezed" fails while others run beside it and is evaluated
    again, with nothing beside it, and that second result is the one written; "hopeless" is
    evaluated again and stays failed; the ok ones once each. With one job none is evaluated again."""
    running, seen = set(), []
    lock = threading.Lock()

    def first(item: Item[str]) -> str:
        with lock:
            running.add(item.key)
        time.sleep(0.2)          # long enough for the other thread's item to start beside it
        with lock:
            running.discard(item.key)
        return "failed" if item.key in ("squeezed", "hopeless") else "ok"

    def again(item: Item[str], result: str) -> str:
        with lock:
            seen.append((item.key, result, set(running)))
        return "ok again" if item.key == "squeezed" else "failed again"

    items = [Item(k, k) for k in ("squeezed", "a", "hopeless", "b")]
    results = dict(in_threads(again_alone(first, again, lambda r: r == "failed"), 4, prestart=False)(
        items, threading.Event()))
    assert {i.key: r for i, r in results.items()} == {"squeezed": "ok again", "a": "ok", "hopeless": "failed again",
                                                        "b": "ok"}
    assert sorted(seen) == [("hopeless", "failed", set()), ("squeezed", "failed", set())]   # alone, each once
    seen.clear()
    results = dict(in_threads(again_alone(first, again, lambda r: r == "failed"), 1, prestart=False)(
        items, threading.Event()))
    assert seen == [] and {i.key: r for i, r in results.items()}["squeezed"] == "failed"

"""hpc/executor.py: waiting for an array reports a failed task in one line and still waits for the rest."""

from __future__ import annotations

from hpc.executor import make_executor, wait_for_array


def test_a_failed_array_task_is_one_line_naming_its_error_and_the_others_are_waited_for(tmp_path, capsys):
    executor = make_executor(tmp_path / "logs", "local", "test", minutes=5)
    jobs = executor.map_array(int, ["0", "one", "2"])     # a builtin: the job unpickles it anywhere
    failed = wait_for_array(jobs, "test", lambda shard: f"shard {shard} done", every=60.0)
    assert failed == [jobs[1].job_id]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "failed" in ln]
    assert len(lines) == 1, err
    assert "ValueError: invalid literal for int() with base 10: 'one'" in lines[0] and "_log.err" in lines[0]
    assert "shard 0 done" in err and "shard 2 done" in err


def test_quiet_waiting_shows_no_progress_and_logs_the_failed_array_task(tmp_path, capsys, caplog):
    executor = make_executor(tmp_path / "logs", "local", "test", minutes=5)
    jobs = executor.map_array(int, ["0", "one"])
    failed = wait_for_array(jobs, "test", lambda shard: f"shard {shard} done", every=60.0, quiet=True)
    assert failed == [jobs[1].job_id]
    err = capsys.readouterr().err
    assert "shard 0 done" not in err and "shards done" not in err, err
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "failed: ValueError" in errors[0], errors

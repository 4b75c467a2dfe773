"""hpc/logs.py: plain lines on stderr, the levels of --quiet and --verbose, rank 0 speaking for a
multi-rank job, libraries' records shown as before; and every entry point takes -v and -q."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import logs
from tests.conftest import ROOT

log = logging.getLogger("hpc.test_logs")


@pytest.fixture(autouse=True)
def restore_logging():
    """setup_logging changes the process's logging: put it back after each test."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    levels = {name: logging.getLogger(name).level for name in logs.PROJECT_LOGGERS}
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_lines_are_plain_and_info_shows_by_default(capsys):
    logs.setup_logging(rank=None)
    log.info("pool: %d to evaluate", 5)
    log.debug("not shown")
    log.error("error: %s", "bad input")
    assert capsys.readouterr().err == "pool: 5 to evaluate\nerror: bad input\n"


def test_the_rank_filter_drops_info_of_rank_1_and_keeps_rank_0s(capsys):
    logs.setup_logging(rank=1)
    log.info("status")
    assert capsys.readouterr().err == ""
    logs.setup_logging(rank=0)
    log.info("status")
    assert capsys.readouterr().err == "status\n"


def test_a_warning_of_rank_1_shows_prefixed(capsys):
    logs.setup_logging(rank=1)
    log.warning("lost worker rank 3")
    log.error("error: %s", "disk full")
    assert capsys.readouterr().err == "[rank 1] lost worker rank 3\n[rank 1] error: disk full\n"


def test_a_record_logged_on_every_rank_shows_once(capsys):
    logs.setup_logging(rank=2)
    log.error("error: bad config", extra=logs.ON_EVERY_RANK)
    assert capsys.readouterr().err == ""
    logs.setup_logging(rank=0)
    log.error("error: bad config", extra=logs.ON_EVERY_RANK)
    assert capsys.readouterr().err == "error: bad config\n"


def test_quiet_hides_info_and_keeps_warnings(capsys):
    logs.setup_logging(quiet=True, rank=None)
    log.info("status")
    log.warning("careful")
    assert capsys.readouterr().err == "careful\n"


def test_verbose_shows_debug_and_every_ranks_lines(capsys):
    logs.setup_logging(verbose=True, rank=None)
    log.debug("detail")
    assert capsys.readouterr().err == "detail\n"
    logs.setup_logging(verbose=True, rank=3)
    log.info("status")
    assert capsys.readouterr().err == "[rank 3] status\n"


def test_a_second_setup_reuses_the_handler():
    logs.setup_logging()
    logs.setup_logging(quiet=True)
    assert sum(isinstance(h, logs._StderrHandler) for h in logging.getLogger().handlers) == 1
    assert logging.getLogger("hpc").level == logging.WARNING


def test_libraries_show_warnings_once_and_no_info(capsys):
    logs.setup_logging(verbose=True, rank=None)
    library = logging.getLogger("some_library.module")
    library.setLevel(logging.INFO)
    library.info("chatter")
    library.warning("deprecated")
    own = logging.getLogger("own_handler_library")
    handler = logging.StreamHandler()   # its own handler shows its records (as submitit's does)
    own.addHandler(handler)
    try:
        own.warning("said once")
    finally:
        own.removeHandler(handler)
    assert capsys.readouterr().err == "deprecated\nsaid once\n"


@pytest.mark.parametrize("env, rank", [
    ({}, None),
    ({"SLURM_PROCID": "1"}, 1),
    ({"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "3"}, 3),     # mpirun inside a batch script
    ({"SLURM_PROCID": "1", "RANK": "5"}, 5),                     # torchrun under srun
    ({"PMIX_RANK": "2", "RANK": "0"}, 2),                        # a trainer rank sets RANK itself
    ({"PMI_RANK": "4"}, 4),
])
def test_the_rank_comes_from_the_launchers_variables(monkeypatch, env, rank):
    for name in logs.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert logs.detect_rank() == rank


def test_verbose_and_quiet_exclude_each_other():
    import argparse

    parser = argparse.ArgumentParser()
    logs.add_logging_args(parser)
    assert vars(parser.parse_args(["-v"])) == {"verbose": True, "quiet": False}
    assert vars(parser.parse_args(["--quiet"])) == {"verbose": False, "quiet": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["-v", "-q"])


# Each entry point's module and arguments it needs besides the flags.
ENTRY_POINTS = {
    "hpc eval": ("hpc.cli", ["eval", "task.py", "candidate.py"]),
    "hpc eval-suite": ("hpc.cli", ["eval-suite", "tasks", "candidates"]),
    "hpc import-kernelbench": ("hpc.cli", ["import-kernelbench", "eval_results.json", "--level", "1", "--out", "r.h5"]),
    "hpc synthesize": ("hpc.cli", ["synthesize", "--out", "run"]),
    "hpc serve": ("hpc.cli", ["serve", "--hf", "model"]),
    "hpc repair": ("hpc.cli", ["repair", "r.h5"]),
    "jobs/train.py": ("jobs.train", ["--config", "c.yaml", "--out", "run"]),
    "jobs/evaluate.py": ("jobs.evaluate", ["tasks", "candidates", "--out", "run"]),
    "jobs/analyze.py": ("jobs.analyze", ["r.h5", "--out", "report"]),
    "jobs/synthesize.py": ("jobs.synthesize", ["--out", "run"]),
    "python -m hpc.pool": ("hpc.pool.__main__", ["tasks", "candidates", "--out", "r.h5"]),
    "python -m hpc.agent": ("hpc.agent.__main__", ["task.py", "replies.json"]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("flag, verbose, quiet", [([], False, False), (["-v"], True, False),
                                                  (["--verbose"], True, False), (["-q"], False, True),
                                                  (["--quiet"], False, True)])
def test_every_entry_point_takes_verbose_and_quiet(entry, flag, verbose, quiet):
    import importlib

    name, argv = ENTRY_POINTS[entry]
    module = importlib.import_module(name)
    parse = module.build_parser().parse_args if name == "hpc.cli" else module.parse_args
    args = parse([*argv, *flag])
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_hf_convert_takes_verbose_and_quiet(capsys):
    from hpc.policy.hf_convert import main

    for command in ("to-megatron", "to-hf"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])     # argparse answers --help before anything runs
        assert exit.value.code == 0
        help_text = capsys.readouterr().out
        assert "--verbose" in help_text and "--quiet" in help_text


def _run_of_two_shards(root: Path) -> Path:
    """A run folder of two shard files: jobs/analyze.py merges them, and says so in an INFO line."""
    from tests.test_analysis import ok, write_results

    write_results(root / "shard-0000.h5", [ok("level1/a", 2.0, 1.5)])
    write_results(root / "shard-0001.h5", [ok("level1/b", 0.5, 0.25)])
    return root


def _analyze(run: Path, out: Path, *flags: str, rank: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in logs.RANK_VARIABLES}
    if rank is not None:
        env["RANK"] = rank   # as torchrun sets it
    return subprocess.run([sys.executable, "jobs/analyze.py", str(run), "--out", str(out), *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, rank, shown", [
    ((), None, "analyze: merged 2 shards"), (("--quiet",), None, None), (("-v",), None, "analyze: merged 2 shards"),
    ((), "1", None), (("--verbose",), "1", "[rank 1] analyze: merged 2 shards")])
def test_quiet_verbose_and_the_rank_filter_of_a_real_command(tmp_path, flags, rank, shown):
    """jobs/analyze.py as a user runs it: its status line by default and with -v, none with --quiet;
    on rank 1 of a job none, unless --verbose (prefixed). Its output (the report's path) and exit
    code are the same in every case."""
    run, out = _run_of_two_shards(tmp_path / "run"), tmp_path / "report"
    proc = _analyze(run, out, *flags, rank=rank)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out / "report.md"), proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == ([shown.replace("2 shards", f"2 shards of {run} into {run / 'results.h5'} (2 records)")]
                     if shown else []), proc.stderr


@pytest.mark.parametrize("flags, shown", [((), True), (("--quiet",), False)])
def test_a_submitted_job_logs_as_its_command_was_asked_to(tmp_path, flags, shown):
    """The job's own log (a submitit job, here a local one) keeps the submitter's --quiet."""
    run, out = _run_of_two_shards(tmp_path / "run"), tmp_path / "report"
    proc = _analyze(run, out, "--executor", "local", *flags)
    assert proc.returncode == 0, proc.stderr
    job_log = "".join(p.read_text() for p in (out / "submitit").glob("*_log.err"))
    assert ("analyze: merged 2 shards" in job_log) == shown, job_log

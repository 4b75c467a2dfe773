"""Temporary folders a killed harness left behind are swept by the next one, and only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hpc.sandbox.tempdirs import OWNER_LOCK, owned_temporary, owned_tempdir, sweep
from tests.conftest import ROOT

MAKE = """
import sys, time
from hpc.sandbox.tempdirs import owned_tempdir
folder, _ = owned_tempdir(sys.argv[1])
(folder / "copy-of-the-task.py").write_text("x")
print(folder, flush=True)
time.sleep(600)
"""

MAKE_IN_BLOCK = """
import sys, time
from hpc.sandbox.tempdirs import owned_temporary
with owned_temporary(sys.argv[1]) as folder:
    print(folder, flush=True)
    time.sleep(600)
"""


def _owner(tmp_path, prefix: str, block: bool = False) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKE_IN_BLOCK if block else MAKE, prefix], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, proc.stdout.readline().strip()


def test_a_folder_whose_owner_was_killed_is_swept_and_a_live_one_is_not(tmp_path):
    killed, killed_dir = _owner(tmp_path, "hpc-test-")
    alive, alive_dir = _owner(tmp_path, "hpc-test-")
    unlocked = tmp_path / "hpc-test-old"   # made without a lock file: nobody's to judge
    unlocked.mkdir()
    other = tmp_path / "other-kind"
    other.mkdir()
    (other / OWNER_LOCK).write_text("")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert os.path.isdir(killed_dir) and os.path.isdir(alive_dir)
        assert sweep("hpc-test-", tmp_path) == 1
        assert not os.path.exists(killed_dir), "the killed owner's folder was left"
        assert os.path.isdir(alive_dir) and (tmp_path / "hpc-test-old").is_dir() and other.is_dir()
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert sweep("hpc-test-", tmp_path) == 1 and not os.path.exists(alive_dir)


def test_the_first_folder_of_a_kind_sweeps_that_kind(tmp_path, monkeypatch):
    killed, killed_dir = _owner(tmp_path, "hpc-kind-")
    killed.kill()
    killed.wait(timeout=30)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    mine, fd = owned_tempdir("hpc-kind-")
    try:
        assert not os.path.exists(killed_dir) and mine.is_dir()
        assert sweep("hpc-kind-", tmp_path) == 0, "a folder whose owner lives was swept"
    finally:
        os.close(fd)


def test_a_with_block_folder_is_removed_at_its_end_and_swept_when_its_process_was_killed(tmp_path, monkeypatch):
    """The compile, build and synthesis folders (owned_temporary): gone when the block ends; left
    by a process killed inside it, swept by the next process that makes one of its kind."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with owned_temporary("hpc-block-") as folder:
        assert (folder / OWNER_LOCK).is_file() and sweep("hpc-block-", tmp_path) == 0
    assert not folder.exists()
    killed, killed_dir = _owner(tmp_path, "hpc-block-", block=True)
    killed.kill()
    killed.wait(timeout=30)
    assert os.path.isdir(killed_dir) and sweep("hpc-block-", tmp_path) == 1 and not os.path.exists(killed_dir)

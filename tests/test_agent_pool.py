"""The agent's compile / verify / profile served by the MPI reward pool (real Open MPI): rank 0 runs
a replayed episode through `python -m hpc.agent --pool`, rank 1 evaluates."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from hpc.agent.__main__ import main
from tests.conftest import ROOT
from tests.test_agent_episode import KERNEL, MODEL_NEW, TASK, call


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (scripts/test.sh installs it)")
def test_an_episode_on_the_reward_pool_is_paid_by_a_worker_rank(tmp_path, cache_dir):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps([
        call("write_file", path="kernels/reduce.cpp", content=KERNEL) + call("write_file", path="model_new.py",
                                                                               content=MODEL_NEW),
        call("compile") + call("verify"),
        call("profile"),
        call("finish")]))
    config = tmp_path / "eval.yaml"
    config.write_text("correctness:\n  trials: 2\n  distributions: []\n  timed_checks: 2\n"
                      "timing:\n  warmup: 1\n  calibration_calls: 10\n")
    out = tmp_path / "trajectory.json"
    env = {**os.environ, "HPC_CACHE_DIR": str(cache_dir), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1", "TMPDIR": str(tmp_path)}
    cmd = ["mpirun", "-n", "2", "--enable-recovery", sys.executable, "-m", "mpi4py", "-m", "hpc.agent", str(TASK),
           str(replies), "--pool", "--eval-config", str(config), "--iterations", "10", "--backend", "cpu",
           "--root", str(tmp_path / "episode"), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, log
    summary = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    assert summary["served_by_ranks"] == [1] and summary["end_reason"] == "finished"
    assert summary["reward"] >= 1, log
    traj = json.loads(out.read_text())
    events = {e["name"]: e for t in traj["turns"] for e in t["events"]}
    assert all(events[name]["ok"] for name in ("compile", "verify", "profile")), events
    assert events["profile"]["reward"] == traj["reward"] and traj["record"]["correct"]
    assert (tmp_path / "episode" / "work").is_dir()            # a --root given is never removed


def test_the_command_reports_bad_input_in_one_line(tmp_path, capsys):
    replies = tmp_path / "replies.json"
    replies.write_text('{"not": "replies"}')
    assert main([str(TASK), str(replies), "--root", str(tmp_path / "episode")]) == 2
    assert "error: replies" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.py"), str(replies)]) == 2
    assert "error: task" in capsys.readouterr().err

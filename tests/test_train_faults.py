"""The trainer under faults: SIGKILL at every rename of a checkpoint save, a full disk during a
save, the trainer killed after a save, a reward rank killed during training."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.train_support import LIBRARY_WARNINGS, run_command, small_config

pytestmark = LIBRARY_WARNINGS


KILL_SWEEP = """
import os, sys
from pathlib import Path


def main():
    root, config, at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    import megatron.core, torch   # imported once, before the forks
    from jobs.train import train
    for n in map(int, sys.argv[4:]):
        pid = os.fork()
        if pid == 0:
            for _ in range(at - n):   # strace counts each process's renames from 1: these shift its n-th to `at`
                try:
                    os.rename("/nonexistent/a", "/nonexistent/b")
                except OSError:
                    pass
            try:
                train(config, str(root / f"k{n}"), quiet=True)
            except BaseException as e:
                print(f"k{n}: {type(e).__name__}: {e}", file=sys.stderr)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"k{n} {status}", flush=True)


if __name__ == "__main__":   # megatron's checkpoint writer spawns a process that imports this file
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (scripts/system-deps.sh installs it)")
def test_a_kill_at_any_step_of_a_save_resumes_from_a_complete_checkpoint(tmp_path):
    """Two SFT steps, a checkpoint after each. The trainer is SIGKILLed at each rename of the second
    save in turn (strace's fault injection, before the call: every state the checkpoint folders
    pass through, from the policy's staging folder to the trainer state that publishes the step),
    then run again on the same folder: it resumes from a complete checkpoint, never a partial one,
    and ends with the rows of an uninterrupted run, each step once."""
    from hpc.results.training import read_steps

    config = small_config(tmp_path, checkpoint_every=1)
    data = yaml.safe_load(config.read_text())
    data["stages"] = data["stages"][:1]
    data["stages"][0]["steps"] = 2
    config.write_text(yaml.safe_dump(data))
    script = tmp_path / "sweep.py"
    script.write_text(KILL_SWEEP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def sweep(at: int, points: list[int], *strace: str) -> str:
        proc = subprocess.run(["strace", "-f", "-qq", *strace, sys.executable, "-W", "ignore", str(script),
                               str(tmp_path), str(config), str(at), *map(str, points)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    big = 10_000   # beyond every rename of a run: the reference run is never killed
    sweep(big, [big], "-o", str(tmp_path / "trace"), "-e", "trace=rename")
    whole = read_steps(tmp_path / f"k{big}" / "train.h5")
    assert [r["step"] for r in whole] == [1, 2]
    trace = (tmp_path / "trace").read_text().splitlines()
    main = next(line.split()[0] for line in trace if "trainer.json.2" in line)   # the trainer's pid
    renames = [line for line in trace if line.startswith(main + " ") and "rename(" in line]
    names = [line.split('"')[1] for line in renames]
    first = next(k for k, name in enumerate(names) if "trainer.json.1" in name) + 1
    last = next(k for k, name in enumerate(names) if "trainer.json.2" in name) + 1
    points = list(range(first + 1, last + 1))   # every rename of the second save (1-based, as strace counts)
    assert any("policy/iter_0000002.partial" in names[k - 1] for k in points), names
    killed = sweep(big, points, "-o", os.devnull, "-e", "trace=rename", "-e", f"inject=rename:signal=KILL:when={big}")
    for n in points:
        assert f"k{n} 9" in killed, (n, killed)   # SIGKILLed at its n-th rename
        done = tmp_path / f"k{n}" / "checkpoints"
        assert not (done / "trainer.json.2").exists(), n
    resumed = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path), str(config), "0",
                              *map(str, points)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    for n in points:   # each killed run, run again on its folder (no strace: at 0 shifts nothing)
        assert f"k{n} 0" in resumed.stdout, (n, resumed.stdout, resumed.stderr[-3000:])
        rows = read_steps(tmp_path / f"k{n}" / "train.h5")
        assert [r["step"] for r in rows] == [1, 2], n
        for a, b in zip(whole, rows):
            assert a["sft_loss"] == pytest.approx(b["sft_loss"], rel=1e-5), (n, a, b)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_error_line_and_the_run_resumes_with_room(tmp_path):
    """megatron's writer reports a full disk from its worker processes, wrapped (or as torch's
    "unexpected pos"): the trainer says it in one line, exit 2, leaves no staging folder behind,
    and the same command resumes once there is room."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        config = small_config(tmp_path, checkpoint_every=1)
        data = yaml.safe_load(config.read_text())
        data["stages"] = [{"name": "warmup_sft", "kind": "sft", "steps": 2, "lr": 3e-3, "batch_size": 2}]
        config.write_text(yaml.safe_dump(data))
        command = [sys.executable, "jobs/train.py", "--config", str(config), "--out", str(disk / "run"), "-q"]
        full = run_command(command)
        lines = full.stderr.strip().splitlines()
        assert full.returncode == 2 and len(lines) == 1, full.stderr[-3000:]
        assert lines[0].startswith("error: checkpoint ") and "no space left on device" in lines[0], lines
        assert not list((disk / "run" / "checkpoints").rglob("*.partial")), "a staging folder was left behind"
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = run_command(command)
        assert again.returncode == 0, again.stderr[-3000:]
        from hpc.results.training import read_steps

        assert [r["step"] for r in read_steps(disk / "run" / "train.h5")] == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_trainer_killed_after_a_save_leaves_no_process_behind(tmp_path):
    """megatron's checkpoint writer serves its results queue from a process spawned at the first
    save; SIGKILL of the trainer must end it (and whatever else it started) too."""
    import signal
    import time

    from hpc.pool.processes import process_with

    mark = f"HPC_TEST_MARK={tmp_path}"
    config = small_config(tmp_path, checkpoint_every=1)
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--config", str(config), "--out", str(tmp_path / "run")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HPC_TEST_MARK": str(tmp_path)})
    saved = tmp_path / "run" / "checkpoints" / "trainer.json.1"
    deadline = time.monotonic() + 600
    while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert saved.exists() and proc.poll() is None, "the trainer ended or never saved"
    children = list(map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()))
    assert children, "no child process: the checkpoint writer's manager was expected"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while process_with(b"", mark) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    left = process_with(b"", mark)
    assert left is None, Path(f"/proc/{left}/cmdline").read_bytes()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI")
def test_a_reward_rank_killed_during_training_loses_no_sample_and_the_job_ends(tmp_path):
    """benchmarks/full_scale.py's fault drill at CPU scale: a TP=2 group of trainers and two
    workers; the last worker is SIGKILLed in the PPO stage. The step completes with every sample
    scored, the loss is reported, and the job ends (no rank left waiting in MPI_Finalize, no
    child process holding mpirun's output open)."""
    import json

    config = small_config(tmp_path, stages=[{"name": "warmup_sft", "kind": "sft", "steps": 2, "batch_size": 2},
                                            {"name": "ppo", "kind": "ppo", "steps": 1}])
    out = run_command([sys.executable, "benchmarks/full_scale.py", "--config", str(config), "--tensor", "2", "--out",
                str(tmp_path / "fs"), "--ranks", "4", "--trainers", "2", "--scaling", "1", "--kill-after", "0.5"],
               timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    figures = json.loads((tmp_path / "fs" / "full_scale.json").read_text())
    main, scaling = figures["runs"]["main"], figures["runs"]["scaling-1"]
    assert main["killed"]["rank"] == 3 and main["lost"] and "worker rank 3" in main["lost"][0], main
    assert [s["scored"] for s in main["steps"]] == [s["samples"] for s in main["steps"]] == [2]
    assert main["pools"][0]["workers"] == 2 and scaling["pools"][0]["workers"] == 1
    assert figures["params"] > 0 and main["steps"][0]["update_tokens_per_s"] > 0

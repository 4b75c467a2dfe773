"""Issue 7's run: trainer ranks (policy.parallel.tensor x data parallel) and the reward pool's
worker ranks in one MPI job on one machine, launched as a user would (`jobs/train.py --pool`
under mpirun; under Slurm the same entry point runs under `srun --mpi=pmix`), with a fault drill,
then the figures the issue asks for.

    python benchmarks/full_scale.py --config configs/train/h200-x8.yaml --out $OUT/full \
        --ranks 8 --trainers 4 --scaling 1,2,4 --peak-tflops 989
    python benchmarks/full_scale.py --config configs/train/default.yaml --tensor 2 --out /tmp/fs \
        --ranks 3 --trainers 2 --scaling 1          # the code paths, on the CPU

Runs, each its own MPI job and run folder under --out:
  main       --ranks ranks, --trainers trainer ranks; each tensor-parallel group of trainers gets
             an equal share of the remaining ranks as reward workers (jobs/train.py). Once the
             first PPO step is under way (`--kill-after` seconds after its stage starts), the last
             worker rank is SIGKILLed: the step and the run must still complete, every sample
             scored (its in-flight requests go to the group's other workers; a group needs two).
  scaling-W  for each W in --scaling: one tensor-parallel group of trainers and W workers.
Figures, from each run's train.h5 and its pools' usage lines: per PPO step the generation /
reward / update seconds; the pools' answered requests per minute and busy share; the update's
tokens/s and MFU = 6 x params x update_tokens x data-parallel groups / update_s / (trainer GPUs
x --peak-tflops) (the policy's update only: the critic's and the reference's passes are not
counted); and reward seconds per PPO step against the worker count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
USAGE = re.compile(r"reward pool of trainer rank (\d+): (\d+) answered by (\d+) worker rank\(s\) in (\d+) s "
                   r"\(([\d.]+)/min\), workers busy (\d+)%")


def launch(config: Path, out: Path, ranks: int, trainers: int, kill_after: float | None, ppo_stage: str) -> dict:
    """One MPI job; with `kill_after`, the last rank (a worker) is killed that long into the PPO stage."""
    cmd = ["mpirun", "-n", str(ranks), "--bind-to", "none", "--enable-recovery", sys.executable, "-m", "mpi4py",
           str(ROOT / "jobs" / "train.py"), "--config", str(config), "--out", str(out), "--pool",
           "--trainers", str(trainers), "--verbose"]     # every trainer rank's pool usage line, not only rank 0's
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(ROOT), "HPC_FULL_SCALE_RUN": str(out)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed: dict = {}

    def drill() -> None:
        from hpc.pool.processes import process_with

        time.sleep(kill_after)
        victim = process_with(b"jobs/train.py", f"OMPI_COMM_WORLD_RANK={ranks - 1}", f"HPC_FULL_SCALE_RUN={out}")
        if victim is not None and proc.poll() is None:
            os.kill(victim, signal.SIGKILL)
            killed.update(rank=ranks - 1, pid=victim, at_s=round(time.monotonic() - started, 1))

    for line in proc.stdout:
        lines.append(line)
        print(f"  | {line}", end="", flush=True)
        if kill_after is not None and not killed and f"stage {ppo_stage}: ppo" in line:
            killed["pending"] = True
            threading.Thread(target=drill, daemon=True).start()
    proc.wait()
    killed.pop("pending", None)
    text = "".join(lines)
    pools = [{"trainer_rank": int(m[0]), "answered": int(m[1]), "workers": int(m[2]), "wall_s": int(m[3]),
              "per_min": float(m[4]), "busy_percent": int(m[5])} for m in USAGE.findall(text)]
    return {"ranks": ranks, "trainers": trainers, "returncode": proc.returncode,
            "wall_s": round(time.monotonic() - started, 1), "pools": pools, "killed": killed,
            "lost": re.findall(r"lost worker rank \d+[^\n]*", text)}


def parameters(run: Path) -> int:
    """The parameter count of the policy `run` trained (as its last checkpoint records its
    config), built at TP = 1 on this machine's CPU."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""       # before torch initializes CUDA: the build stays on the CPU
    from hpc.policy import model
    from hpc.policy.checkpoint import latest_step
    from hpc.policy.config import policy_config
    from hpc.policy.parallel import free_port, init_parallel, teardown

    root = run / "checkpoints" / "policy"
    meta = json.loads((root / f"iter_{latest_step(root):07d}" / "hpc_policy.json").read_text())
    cfg = policy_config({**meta["config"], "parallel": {"tensor": 1, "pipeline": 1}, "dtype": "fp32"})
    init_parallel(environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())})
    try:
        return model.count_parameters(model.build_policy(cfg))
    finally:
        teardown()


def step_figures(out: Path, ppo_stages: list[str], params: int, tensor: int, trainers: int,
                 peak_tflops: float) -> list[dict]:
    """One row per step of a PPO stage of the run in `out`."""
    from hpc.results.training import read_steps, read_trajectories

    rows = []
    for r in read_steps(out / "train.h5"):
        if r["stage"] not in ppo_stages:
            continue
        dp = trainers // tensor
        tokens_s = r["update_tokens"] * dp / r["update_s"] if r["update_s"] else float("nan")
        rows.append({"step": r["step"], "stage": r["stage"], "samples": r["samples"],
                     "scored": len(read_trajectories(out / "train.h5", step=r["step"])),
                     "generation_s": r["generation_s"], "reward_s": r["reward_s"], "update_s": r["update_s"],
                     "step_s": r["step_s"], "reward_mean": r["reward_mean"], "update_tokens_per_s": tokens_s,
                     "mfu": 6 * params * tokens_s / (trainers * peak_tflops * 1e12) if peak_tflops else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="training config (YAML); its last stage should be ppo")
    ap.add_argument("--out", required=True, help="folder for the runs and full_scale.json")
    ap.add_argument("--ranks", type=int, default=8, help="MPI ranks of the main run (trainers + workers)")
    ap.add_argument("--trainers", type=int, default=4, help="trainer ranks (policy.parallel.tensor x data parallel)")
    ap.add_argument("--tensor", type=int, default=None, help="override policy.parallel.tensor")
    ap.add_argument("--scaling", default="1,2,4", help="worker counts of the scaling runs (empty: none)")
    ap.add_argument("--kill-after", type=float, default=20.0, help="seconds into the PPO stage the drill kills")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per trainer GPU (H200 bf16 dense: 989)")
    args = ap.parse_args(argv)
    import yaml

    from hpc.rl.train_config import load_train_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(Path(args.config).read_text())
    if args.tensor:
        data.setdefault("policy", {}).setdefault("parallel", {})["tensor"] = args.tensor
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    cfg = load_train_config(config)
    tensor, ppo = cfg.policy.parallel.tensor, [s.name for s in cfg.stages if s.kind == "ppo"]
    if not ppo:
        raise SystemExit(f"{args.config}: no ppo stage to measure")
    figures: dict = {"date": time.strftime("%Y-%m-%d"), "config": data, "tensor": tensor, "runs": {}}
    plan = [("main", args.ranks, args.trainers, args.kill_after)]
    plan += [(f"scaling-{w}", tensor + int(w), tensor, None) for w in args.scaling.split(",") if w]
    for name, ranks, trainers, kill_after in plan:
        print(f"=== {name}: {ranks} ranks, {trainers} trainer(s), tensor {tensor}", flush=True)
        figures["runs"][name] = launch(config, out / name, ranks, trainers, kill_after, ppo[0])
    params = parameters(out / "main")
    figures["params"] = params
    for name, ranks, trainers, _ in plan:
        run = figures["runs"][name]
        run["steps"] = step_figures(out / name, ppo, params, tensor, trainers, args.peak_tflops)
        print(f"{name}: exit {run['returncode']}, {run['wall_s']} s; pools {run['pools']}; killed {run['killed']}")
        for s in run["steps"]:
            mfu = "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
            print(f"  step {s['step']} {s['stage']}: {s['scored']}/{s['samples']} scored, generation "
                  f"{s['generation_s']:.1f} s, reward {s['reward_s']:.1f} s, update {s['update_s']:.1f} s "
                  f"({s['update_tokens_per_s']:.0f} tokens/s, MFU {mfu})")
    (out / "full_scale.json").write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the embedded default (README command 1) learn, every time? It is run once per seed, one
run after another, and each run's `measure_before` and `measure_after` stages (the same tasks, as
many samples, no update) are compared: the mean reward and the pass rate before and after RL.
`--control` runs the same with the PPO stages' learning rate at 1e-30, RL switched off in effect:
a gain that shows there comes from something other than learning.

    python benchmarks/default_learning.py --seeds 0,1,2,3,4 [--control] [--keep DIR]

Bar (issue 22): every seed's mean reward after RL is above its mean reward before; the mean gain
is at least +0.5 reward and +20 points of pass rate; each run takes 10 minutes or less. Each
seed's PPO trend z (hpc.analysis.metrics.pass_rate_trend: the pass rate of the PPO stage's last
quarter of steps against its first) is what the test asserts (>= 3).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.analysis.metrics import pass_rate_trend  # noqa: E402
from hpc.results.training import read_steps  # noqa: E402

OFF = 1e-30   # rl.actor_lr must be > 0; at this one no weight moves


def one_run(config: dict, seed: int, control: bool, folder: Path) -> dict:
    """The default with `seed` (and RL off for `control`): its measurements and wall time."""
    data = {**config, "seed": seed}
    if control:
        data["rl"] = {**data.get("rl", {}), "actor_lr": OFF}
        data["stages"] = [{**s, "lr": 0.0, "lr_end": 0.0} if s.get("kind") in ("ppo", "rft") else s
                          for s in data["stages"]]
    path = folder / f"seed-{seed}.yaml"
    path.write_text(yaml.safe_dump(data))
    out = folder / f"seed-{seed}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "jobs/train.py", "--config", str(path), "--out", str(out), "-q"],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: the run failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    rows = read_steps(out / "train.h5")
    measured = {r["stage"]: r for r in rows if r["stage"].startswith("measure")}
    before, after = measured["measure_before"], measured["measure_after"]
    return {"seed": seed, "wall_s": wall, "samples": int(before["samples"]),
            "trend_z": pass_rate_trend([r for r in rows if r["stage"] == "ppo"])[2],
            "reward": (before["reward_mean"], after["reward_mean"]), "pass": (before["pass_rate"], after["pass_rate"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "train" / "default.yaml")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--control", action="store_true", help="RL switched off (PPO learning rate 1e-30)")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's folder here")
    args = p.parse_args()
    config = yaml.safe_load(args.config.read_text())
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    print(f"{args.config.name}, seeds {seeds}, {'RL off (control)' if args.control else 'RL on'}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory(prefix="default-learning-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        runs = []
        print("\n| seed | reward before | after | gain | pass before | after | gain (points) | PPO trend z | wall s |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for seed in seeds:
            r = one_run(config, seed, args.control, folder)
            runs.append(r)
            (rb, ra), (pb, pa) = r["reward"], r["pass"]
            print(f"| {seed} | {rb:.3f} | {ra:.3f} | {ra - rb:+.3f} | {100 * pb:.0f}% | {100 * pa:.0f}% | "
                  f"{100 * (pa - pb):+.0f} | {r['trend_z']:+.2f} | {r['wall_s']:.0f} |", flush=True)
    gains = [r["reward"][1] - r["reward"][0] for r in runs]
    points = [100 * (r["pass"][1] - r["pass"][0]) for r in runs]
    spread = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
    print(f"\nreward gain: mean {statistics.fmean(gains):+.3f} (std {spread(gains):.3f}, min {min(gains):+.3f}); "
          f"pass rate gain: mean {statistics.fmean(points):+.1f} points (std {spread(points):.1f}, min {min(points):+.1f}); "
          f"seeds whose reward rose: {sum(g > 0 for g in gains)}/{len(gains)}; "
          f"longest run {max(r['wall_s'] for r in runs):.0f} s; {runs[0]['samples']} samples per measurement")
    met = (all(g > 0 for g in gains) and statistics.fmean(gains) >= 0.5 and statistics.fmean(points) >= 20
           and max(r["wall_s"] for r in runs) <= 600)
    return 0 if met != args.control else 1


if __name__ == "__main__":
    sys.exit(main())

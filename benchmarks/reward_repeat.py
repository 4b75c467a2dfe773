"""Do rewards repeat? The shipped suite evaluated `--runs` times, each a separate `hpc eval-suite`
process with a fresh cache (nothing measured is carried from one run to the next: torch.compile
compiles anew into an empty inductor cache; only the candidates' own builds, keyed by their
sources, are shared), one run after another with nothing else started by this script beside them.
Per row: the reward of each run, and how far each run's speedup over torch.compile lies from the
row's median across runs. Per generated kernel: the launch config torch.compile's autotuner picked
in each run (picks-K.json beside run-K.h5), and which kernels got different picks.

    python benchmarks/reward_repeat.py --backend cpu --runs 3 [--only level2] [--jobs 1] [--keep DIR]
    python benchmarks/reward_repeat.py --tables DIR [--beside DIR1]   the tables again, from the runs kept in
                                                        DIR (and one run kept in DIR1 against their medians)
    python benchmarks/reward_repeat.py ... --first 2 --runs 1 --keep DIR   one more run (run-2) into DIR

Bar (issue 21): at least 95% of rows get the same reward in every run, and every row's
vs-compile ratio stays within 3% of its median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.config import RewardConfig  # noqa: E402
from hpc.profile.window import frame_ratios, paired_ratio, round_spans  # noqa: E402
from hpc.results.hdf5 import read_records  # noqa: E402
from hpc.reward import compute_reward  # noqa: E402


def one_run(args: argparse.Namespace, folder: Path, keep: Path, k: int) -> Path:
    """Run `k`: one eval-suite process with a cache of its own in `folder` (the candidates' builds
    shared), its records in `keep`."""
    keep.mkdir(parents=True, exist_ok=True)
    out = keep / f"run-{k}.h5"
    cache = folder / f"cache-{k}"
    cache.mkdir(parents=True, exist_ok=True)
    (folder / "native").mkdir(exist_ok=True)
    if not (cache / "native").exists():
        (cache / "native").symlink_to(folder / "native")
    env = {**os.environ, "HPC_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "hpc.cli", "eval-suite", str(args.tasks), str(args.solutions), "--out", str(out),
           "--backend", args.backend, "--jobs", str(args.jobs), "--iterations", str(args.iterations)]
    if args.scale:
        cmd += ["--scale", args.scale]
    if args.config:
        cmd += ["--config", str(args.config)]
    for only in args.only:
        cmd += ["--only", only]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr)   # its progress in this one's log
    if not out.exists():
        raise SystemExit(f"run {k} wrote no records (exit {proc.returncode})")
    print(f"run {k}: {time.monotonic() - t0:.0f} s, exit {proc.returncode}, "
          f"{time.strftime('%H:%M:%S', time.gmtime())} UTC", file=sys.stderr, flush=True)
    (keep / f"picks-{k}.json").write_text(json.dumps(autotune_picks(cache / "inductor"), indent=1, sort_keys=True))
    return out


def autotune_picks(inductor: Path) -> dict[str, dict]:
    """{kernel file: the launch config inductor's autotuner kept for it} from an inductor cache
    (its .best_config files; the time the pick took and the cache hashes left out)."""
    picks = {}
    for path in sorted(inductor.rglob("*.best_config")):
        try:
            pick = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        picks[path.stem] = {k: v for k, v in pick.items() if "time" not in k and "hash" not in k}
    return picks


def numbered(folder: Path, pattern: str = "run-*.h5") -> list[Path]:
    """The files of `folder` matching `pattern`, in the order of their run's number (run-2 before run-10)."""
    return sorted(folder.glob(pattern), key=lambda path: int(path.stem.rpartition("-")[2]))


def differing_picks(keeps: list[Path]) -> list[str]:
    """The kernels (of those every run generated) whose picks differ between the runs kept in `keeps`."""
    runs = [json.loads(path.read_text()) for keep in keeps for path in numbered(keep, "picks-*.json")]
    if len(runs) < 2:
        return []
    common = set(runs[0]).intersection(*runs[1:])
    return [f"{name}: " + " / ".join(json.dumps(run[name], sort_keys=True) for run in runs)
            for name in sorted(common) if len({json.dumps(run[name], sort_keys=True) for run in runs}) > 1]


def figures(path: Path) -> dict[str, tuple]:
    """{task: (reward, speedup vs compile, status, candidate ms, eager ms, compile ms, handshake ms,
    speedup vs eager, calls a frame, compile ms / candidate ms, round_noise, chunk_start of the
    candidate, eager and torch.compile, the window's flush read rate in GB/s, the vs-compile speedup
    read shift by shift, read round by round then shift by shift, the page faults over the window
    of the candidate's process and of the baselines', the share of each one's heap on huge pages, and
    each program's rounds far from its window's median (far_rounds))}. Where the record
    keeps the baselines' frames (schema version 7), the speedups and the reward are read from the
    frames by this checkout's hpc.profile.window.paired_ratio and hpc.reward, so runs recorded
    before a change of the estimator are read as it reads them now; else as the record has them.
    The ratio of the whole window's medians is beside."""
    out = {}
    for r in read_records(path):
        config = json.loads(r.config or "{}")
        rounds = config.get("timing", {}).get("rounds", 10)
        if r.status == "ok" and r.compile_times_ms and r.eager_times_ms:
            r.speedup_eager = paired_ratio(r.eager_times_ms, r.candidate_times_ms, rounds)
            r.speedup_compile = paired_ratio(r.compile_times_ms, r.candidate_times_ms, rounds)
            r.reward = compute_reward(True, r.speedup_eager, r.speedup_compile, RewardConfig(**config.get("reward", {})))
        conditions = json.loads(r.conditions or "{}")
        shifts = conditions.get("candidate", {}).get("input_shifts", 1)
        candidate_by_shift = shift_by_shift(r.candidate_times_ms or [], shifts)
        by_shift = (shift_by_shift(r.compile_times_ms or [], shifts) / candidate_by_shift if candidate_by_shift
                    else math.nan)
        ratios = frame_ratios(r.compile_times_ms or [], r.candidate_times_ms or [], rounds)
        paired_by_shift = (shift_by_shift(ratios, shifts) if ratios and len(ratios) == len(r.candidate_times_ms)
                           else math.nan)
        out[r.task_id] = (r.reward, r.speedup_compile, r.status, r.candidate_ms, r.eager_ms, r.compile_ms,
                          r.overhead_ms, r.speedup_eager, json.loads(r.seeds or "{}").get("burst", ""),
                          r.compile_ms / r.candidate_ms, round_noise(r),
                          tuple(chunk_start(t or [], rounds) for t in (r.candidate_times_ms, r.eager_times_ms,
                                                                       r.compile_times_ms)),
                          conditions.get("candidate", {}).get("flush_gb_s", math.nan),
                          by_shift, paired_by_shift,
                          tuple(conditions.get(program, {}).get("window_minor_faults", math.nan)
                                for program in ("candidate", "eager")),
                          tuple(conditions.get(program, {}).get("heap_on_huge_pages") for program in ("candidate", "eager")),
                          {name: far_rounds(t or [], rounds) for name, t in (("candidate", r.candidate_times_ms),
                                                                           ("eager", r.eager_times_ms),
                                                                           ("torch.compile", r.compile_times_ms))})
    return out


def shift_by_shift(times_ms: list[float], shifts: int) -> float:
    """A program's figure read shift by shift: the median of its timed frames at each input shift
    (frame j's inputs lie at the (j mod `shifts`)-th, hpc.profile.timing.timing_calls), then the mean
    of those. Where a program's time hangs on the shift, the window's median moves with the shares
    of fast and slow frames; this reading weighs every shift alike. NaN without frames."""
    classes = [times_ms[c::shifts] for c in range(min(shifts, len(times_ms)))]
    return statistics.fmean(statistics.median(c) for c in classes) if classes else math.nan


def far_rounds(times_ms: list[float], rounds: int, far: float = 0.25) -> list[tuple[int, float]]:
    """(round, its median against the window's) for each round of a program whose median lies more
    than `far` from its whole window's: a process that ran slow for a while, seconds at a time, while
    the other programs' rounds between its own did not (on this project's 2-core VM, the baselines'
    process of swish_scale_add ran twice as slow from one round to the window's end in 3 runs of 36)."""
    if not times_ms:
        return []
    whole = statistics.median(times_ms)
    ratios = [(k, statistics.median(times_ms[a:b]) / whole)
              for k, (a, b) in enumerate(round_spans(len(times_ms), rounds)) if b > a]
    return [(k, x) for k, x in ratios if abs(x - 1) > far]


def chunk_start(times_ms: list[float], rounds: int) -> float:
    """A program's first frame of each round against that round's median, averaged over the rounds:
    1.0 when a chunk starts as it goes on. Above it, the program's first frames after another
    program's chunk ran slow (on 2 cores, the OpenMP workers the other left spinning)."""
    spans = [(a, b) for a, b in round_spans(len(times_ms), rounds) if b - a >= 2]
    return statistics.fmean(times_ms[a] / statistics.median(times_ms[a:b]) for a, b in spans) if spans else math.nan


def round_noise(rec) -> float:
    """The relative standard error of one window's vs-compile speedup, with its rounds as the
    samples: each round's median of the candidate's frames against torch.compile's median in it
    (hpc.profile.window.frame_ratios), their spread from their median absolute deviation (a stray
    round does not inflate it). Rounds, not frames: a round's frames share its state, so frames
    would understate it. NaN for a record without the baselines' frames (before schema version 7)."""
    rounds = json.loads(rec.config or "{}").get("timing", {}).get("rounds", 10)
    ratios = frame_ratios(rec.compile_times_ms, rec.candidate_times_ms, rounds)
    if not rec.compile_times_ms or len(ratios) != len(rec.candidate_times_ms):
        return float("nan")
    per_round = [statistics.median(ratios[a:b]) for a, b in round_spans(len(ratios), rounds) if b > a]
    median = statistics.median(per_round)
    spread = 1.4826 * statistics.median(abs(x - median) for x in per_round)   # a standard deviation
    return 1.2533 * spread / math.sqrt(len(per_round)) / median


def estimators(runs: list[dict[str, tuple]], tasks: list[str]) -> list[str]:
    """The vs-compile speedup's spread over the runs read four ways from the same windows: round by
    round (the record's, hpc.profile.window.paired_ratio), as the ratio of the whole window's
    medians (the reward's before schema version 7), shift by shift (each program's shift_by_shift)
    and paired then shift by shift (each candidate frame against torch.compile's median in its
    round, hpc.profile.window.frame_ratios, those ratios then read shift by shift); and one window's
    standard error (round_noise)."""
    lines = ["| task | round by round: per run (spread from median) | ratio of medians: per run (spread) "
             "| shift by shift: per run (spread) | paired, shift by shift: per run (spread) "
             "| one window's standard error (mean over runs) |",
             "|---|---|---|---|---|---|"]
    within = [0, 0, 0, 0]
    for task in tasks:
        rows = [run[task] for run in runs if task in run and run[task][2] == "ok"]
        if len(rows) < len(runs):
            continue
        cells = []
        for k, i in enumerate((1, 9, 13, 14)):
            xs = [r[i] for r in rows]
            spread = max(abs(x / statistics.median(xs) - 1) for x in xs)
            within[k] += spread <= 0.03
            cells.append(" / ".join(f"{x:.3f}" for x in xs) + f" ({100 * spread:.1f}%)")
        lines.append(f"| {task} | {' | '.join(cells)} | {100 * statistics.fmean(r[10] for r in rows):.1f}% |")
    lines.append(f"within 3% of the median: round by round {within[0]}/{len(tasks)}, "
                 f"ratio of medians {within[1]}/{len(tasks)}, shift by shift {within[2]}/{len(tasks)}, "
                 f"paired then shift by shift {within[3]}/{len(tasks)}")
    return lines


def co_movement(runs: list[dict[str, tuple]], under_ms: float = 1.0) -> list[str]:
    """How the figures of the rows whose torch.compile figure is under `under_ms` move together
    between runs: each figure's deviation from its row's median, in percent, pooled over rows and
    runs. Figures that rise and fall together, the most host-bound most, point at something that
    slows a whole evaluation's host side rather than at one program or the handshake alone."""
    names = ("candidate", "eager", "torch.compile", "handshake")
    devs: dict[str, list[float]] = {name: [] for name in names}
    for task in sorted(set().union(*runs)):
        rows = [run[task] for run in runs if task in run and run[task][2] == "ok"]
        if len(rows) < 2 or statistics.median(r[5] for r in rows) >= under_ms:
            continue
        for name, i in zip(names, (3, 4, 5, 6)):
            median = statistics.median(r[i] for r in rows)
            devs[name] += [100 * (r[i] / median - 1) for r in rows]
    n = len(devs["candidate"])
    if n < 3:
        return []
    lines = [f"rows under {under_ms:g} ms, {n} figures each: standard deviation from the row's median " +
             ", ".join(f"{name} {statistics.pstdev(devs[name]):.1f}%" for name in names) +
             f"; candidate / torch.compile {statistics.pstdev([a - b for a, b in zip(devs['candidate'], devs['torch.compile'])]):.1f}%"]
    for a, b in (("candidate", "torch.compile"), ("candidate", "eager"), ("handshake", "torch.compile")):
        if len(set(devs[a])) < 2 or len(set(devs[b])) < 2:
            lines.append(f"{b} against {a}: one of them never moved")
            continue
        r = statistics.correlation(devs[a], devs[b])
        slope = statistics.linear_regression(devs[a], devs[b]).slope
        lines.append(f"{b} against {a}: correlation {r:.2f}, slope {slope:.2f}")
    return lines


def bandwidth_movement(runs: list[dict[str, tuple]]) -> list[str]:
    """Does a row's vs-compile ratio move with the memory bandwidth its window got (the flush's read
    rate, cpu)? Each row's ratio and flush rate as deviations from the row's medians, in percent,
    pooled over rows and runs: a correlation far from 0 says the host's memory (another tenant of
    the VM) moves the ratio, which a window cannot take out where the candidate and torch.compile
    need bandwidth unequally."""
    ratio: list[float] = []
    flush: list[float] = []
    for task in sorted(set().union(*runs)):
        rows = [run[task] for run in runs if task in run and run[task][2] == "ok" and not math.isnan(run[task][12])]
        if len(rows) < 2:
            continue
        ratio_median, flush_median = statistics.median(r[1] for r in rows), statistics.median(r[12] for r in rows)
        ratio += [100 * (r[1] / ratio_median - 1) for r in rows]
        flush += [100 * (r[12] / flush_median - 1) for r in rows]
    if len(ratio) < 3 or len(set(ratio)) < 2 or len(set(flush)) < 2:
        return []
    return [f"vs compile against the window's flush rate, {len(ratio)} figures: correlation "
            f"{statistics.correlation(flush, ratio):.2f}, slope {statistics.linear_regression(flush, ratio).slope:.2f}; "
            f"flush rate's standard deviation from its row's median {statistics.pstdev(flush):.1f}%"]


def by_process(paths: list[Path]) -> list[str]:
    """Where each program was timed in several processes (timing.processes_cpu; the record's
    conditions keep every process's median): the vs-compile ratio and the reward read from one
    process alone (process k's candidate against process k's baselines, all in the same window, as
    an evaluation timed in one process each would read them, ratio of medians), and from each
    program's fastest process (the record's rule, here also as a ratio of medians), run by run,
    with each reading's spread from its median over the runs. Side by side in the same windows:
    what timing each program in several processes changes."""
    runs = []
    for path in paths:
        rows = {}
        for r in read_records(path):
            conditions = json.loads(r.conditions or "{}")
            medians = {program: c.get("process_medians_ms") for program, c in conditions.items()}
            compiled = [m for program, m in medians.items() if program.startswith("compile")]
            if r.status != "ok" or not medians.get("candidate") or not compiled or not medians.get("eager"):
                continue
            reward = RewardConfig(**json.loads(r.config or "{}").get("reward", {}))
            cand, eager, comp = medians["candidate"], medians["eager"], compiled[0]
            readings = [(e / c, k / c) for c, e, k in zip(cand, eager, comp)] + [(min(eager) / min(cand),
                                                                                  min(comp) / min(cand))]
            rows[r.task_id] = [(compute_reward(True, e, k, reward), k) for e, k in readings]
        runs.append(rows)
    tasks = sorted(set().union(*runs)) if runs else []
    widths = {len(row) for run in runs for row in run.values()}
    if not tasks or len(widths) != 1 or widths == {2}:   # none timed in several processes
        return []
    names = [f"process {k} alone" for k in range(widths.pop() - 1)] + ["fastest process"]
    lines = ["| task | " + " | ".join(f"{name}: vs compile per run (spread), rewards" for name in names) + " |",
             "|---|" + "---|" * len(names)]
    same, within = [0] * len(names), [0] * len(names)
    complete = [task for task in tasks if all(task in run for run in runs)]
    for task in complete:
        cells = []
        for j in range(len(names)):
            rewards = [run[task][j][0] for run in runs]
            ratios = [run[task][j][1] for run in runs]
            spread = max(abs(x / statistics.median(ratios) - 1) for x in ratios)
            same[j] += len(set(rewards)) == 1
            within[j] += spread <= 0.03
            cells.append(" / ".join(f"{x:.3f}" for x in ratios) + f" ({100 * spread:.1f}%), "
                         + "/".join(f"{x:g}" for x in rewards))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append(f"ratios of medians over {len(complete)} rows in all {len(runs)} runs: " + "; ".join(
        f"{name}: same reward {a}, within 3% {b}" for name, a, b in zip(names, same, within)))
    return lines


def spread_pct(xs: list[float]) -> str:
    """(max - min) / median of one figure over the runs, in percent."""
    median = statistics.median(xs)
    return f"{100 * (max(xs) - min(xs)) / median:.1f}%" if median > 0 else "-"


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first", type=int, default=0, help="number the runs from this one (more runs into --keep)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--scale", choices=("cpu", "gpu"), default=None, help="default: the backend's own")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's records (run-K.h5) in this folder")
    p.add_argument("--tables", type=Path, action="append", default=[],
                   help="no runs: the tables of the run-K.h5 files here (repeat to pool folders)")
    p.add_argument("--beside", type=Path, default=None,
                   help="a folder with one more run (run-0.h5, e.g. --jobs 1) to set against the medians")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--config", type=Path, default=None, help="evaluation config for every run (docs/config.md)")
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--tasks", type=Path, default=ROOT / "kernels" / "tasks")
    p.add_argument("--solutions", type=Path, default=ROOT / "kernels" / "solutions")
    args = p.parse_args()
    if args.tables:
        paths = [path for folder in args.tables for path in numbered(folder)]
        runs = [figures(path) for path in paths]
        processes = by_process(paths)
        picks = differing_picks(args.tables)
    else:
        with tempfile.TemporaryDirectory(prefix="reward-repeat-") as tmp:
            os.chmod(tmp, 0o755)   # the workers' uid reaches the runs' caches, as it would a user's
            for k in range(args.first, args.first + args.runs):
                one_run(args, Path(tmp), args.keep or Path(tmp), k)
            runs = [figures(path) for path in numbered(args.keep or Path(tmp))]
            processes = by_process(numbered(args.keep or Path(tmp)))
            picks = differing_picks([args.keep or Path(tmp)])
    if not runs:
        raise SystemExit(f"no run-K.h5 files in {', '.join(map(str, args.tables))}")
    tasks = sorted(set().union(*runs))
    same = within = 0
    print("| task | rewards | vs compile per run | spread from median |\n|---|---|---|---|")
    for task in tasks:
        rows = [run.get(task, (float("nan"), float("nan"), "missing", *[float("nan")] * 8, (), *[float("nan")] * 3))
                for run in runs]
        rewards = [r[0] for r in rows]
        ratios = [r[1] for r in rows]
        ok = all(r[2] == "ok" for r in rows)
        median = statistics.median(ratios) if ok else float("nan")
        spread = max(abs(x / median - 1) for x in ratios) if ok else float("nan")
        same += ok and len(set(rewards)) == 1
        within += ok and spread <= 0.03
        print(f"| {task} | {' / '.join(f'{x:g}' for x in rewards)} | {' / '.join(f'{x:.3f}' for x in ratios)} "
              f"| {100 * spread:.1f}% |")
    print("\n| task | candidate ms per run (spread) | eager ms | compile ms | handshake ms | flush GB/s "
          "| page faults over the window: candidate / baselines | heap on 2 MiB pages: candidate / baselines |"
          "\n|---|---|---|---|---|---|---|---|")
    for task in tasks:   # which figure moves: the candidate's, a baseline's, the handshake taken off, the memory
        rows = [run[task] for run in runs if task in run]
        print(f"| {task} | " + " | ".join(" / ".join(f"{r[i]:.4f}" for r in rows) + f" ({spread_pct([r[i] for r in rows])})"
                                         for i in (3, 4, 5, 6)) + " | " + " / ".join(f"{r[12]:.1f}" for r in rows)
              + " | " + " ; ".join(" / ".join(f"{x:g}" for x in r[15]) or "-" for r in rows)
              + " | " + " ; ".join(" / ".join("-" if x is None else f"{x:.2f}" for x in r[16]) for r in rows) + " |")
    beside = {}
    if args.beside:   # one more run, under other settings (--jobs 1), against the medians
        (beside,) = [figures(path) for path in numbered(args.beside)[:1]] or [{}]
    print("\n| task | calls a frame | rewards | candidate ms (spread) | eager ms (spread) | torch.compile ms (spread) "
          "| vs compile (spread) |" + (" beside: vs compile, reward |" if args.beside else "")
          + "\n|---|---|---|---|---|---|---|" + ("---|" if args.beside else ""))
    medians: dict[str, list[float]] = {}
    for task in tasks:   # the suite table: each figure's median over the runs, and its spread
        rows = [run[task] for run in runs if task in run and run[task][2] == "ok"]
        if not rows:
            continue
        medians[task] = [statistics.median(r[i] for r in rows) for i in (3, 4, 5, 7, 1)]
        cells = [f"{statistics.median(r[i] for r in rows):.4f} ({spread_pct([r[i] for r in rows])})" for i in (3, 4, 5)]
        cells.append(f"{medians[task][4]:.2f}x ({spread_pct([r[1] for r in rows])})")
        line = f"| {task} | {rows[0][8]} | {'/'.join(f'{r[0]:g}' for r in rows)} | " + " | ".join(cells) + " |"
        if args.beside:
            other = beside.get(task)
            line += (f" {other[1]:.2f}x ({100 * (other[1] / medians[task][4] - 1):+.1f}%), {other[0]:g} |"
                     if other and other[2] == "ok" else " not run |")
        print(line)
    beat = sum(all(run.get(task, (0, 0.0))[1] > 1.05 for run in runs) for task in tasks)
    n = len(tasks)
    print(f"\nfaster than torch.compile by more than 5% in every run: {beat}/{n}; geomean of the medians: "
          f"{geomean([m[4] for m in medians.values()]):.2f}x vs torch.compile, "
          f"{geomean([m[3] for m in medians.values()]):.2f}x vs eager")
    for line in co_movement(runs):
        print(line)
    for line in bandwidth_movement(runs):
        print(line)
    starts = [[r[11][k] for run in runs for r in run.values() if r[2] == "ok" and not math.isnan(r[11][k])]
              for k in range(3)]
    if all(starts):
        print("a chunk's first frame against its round's median, mean over rows and runs: " + ", ".join(
            f"{name} {statistics.fmean(xs):.2f}" for name, xs in zip(("candidate", "eager", "torch.compile"), starts)))
    far = [f"  {task}, run {k}: " + "; ".join(f"{name} rounds " + ", ".join(f"{i} ({x:.2f}x)" for i, x in found)
                                              for name, found in run[task][17].items() if found)
           for k, run in enumerate(runs) for task in tasks if task in run and any(run[task][17].values())]
    print(f"rounds whose median lies more than 25% from its program's window median: {len(far)} windows" +
          "".join("\n" + line for line in far))
    print()
    for line in estimators(runs, tasks):
        print(line)
    if processes:
        print()
        for line in processes:
            print(line)
    print(f"torch.compile kernels whose autotuned launch config differs between runs: {len(picks)}")
    for line in picks:
        print(f"  {line}")
    print(f"same reward in all {len(runs)} runs: {same}/{n} ({100 * same / max(n, 1):.0f}%); "
          f"vs compile within 3% of the median: {within}/{n} ({100 * within / max(n, 1):.0f}%)")
    return 0 if n and same >= 0.95 * n and within == n else 1


if __name__ == "__main__":
    sys.exit(main())

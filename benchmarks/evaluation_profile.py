"""Where one evaluation's time goes: every harness request to its worker processes, timed.

The shipped solutions of the selected tasks are evaluated one at a time in this process,
`--repeat` times for each `--prestart` setting, side by side in one run (`--fill` first
evaluates each once, to fill a cold compile and baseline cache). Each request's time is from
the harness sending it to the whole reply being read; a process's first request includes its
interpreter start unless it was prestarted.

    python benchmarks/evaluation_profile.py --backend cuda --only level1 --repeat 2 --prestart 0,1
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpc.analysis.metrics import stage_seconds  # noqa: E402
from hpc.candidate import load_candidate  # noqa: E402
from hpc.config import load_config  # noqa: E402
from hpc.pipeline import evaluate  # noqa: E402
from hpc.sandbox.prestart import prestarted_workers  # noqa: E402
from hpc.sandbox.process import SandboxedProcess  # noqa: E402
from hpc.suite import find_candidate  # noqa: E402
from solution_args import solution_parser, solved_tasks  # noqa: E402


class RequestClock:
    """Wraps SandboxedProcess.send/receive: seconds per (role, op), from send to reply."""

    def __init__(self):
        self.seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._sent: dict[int, float] = {}
        clock = self
        send, receive = SandboxedProcess.send, SandboxedProcess.receive

        def timed_send(proc, message):
            clock._sent[id(proc)] = time.perf_counter()
            return send(proc, message)

        def timed_receive(proc, op, timeout=None):
            try:
                return receive(proc, op, timeout)
            finally:
                started = clock._sent.pop(id(proc), None)
                if started is not None:
                    clock.seconds[(proc.role, op)].append(time.perf_counter() - started)

        SandboxedProcess.send, SandboxedProcess.receive = timed_send, timed_receive

    def take(self) -> dict[str, dict[str, float]]:
        out = {f"{role}:{op}": {"n": len(v), "median_s": round(statistics.median(v), 4), "total_s": round(sum(v), 3)}
               for (role, op), v in sorted(self.seconds.items())}
        self.seconds.clear()
        return out


def main() -> None:
    ap = solution_parser(__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="evaluations of each solution per setting")
    ap.add_argument("--prestart", default="0,1", help="comma-separated prestart depths to compare")
    ap.add_argument("--fill", action="store_true",
                    help="evaluate each solution once first, untimed (a cold cache: compiles and baselines)")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    tasks = solved_tasks(args)
    pairs = [(t, load_candidate(find_candidate(t, Path(args.solutions)))) for t in tasks]
    figures: dict = {"backend": args.backend, "date": time.strftime("%Y-%m-%d"), "tasks": [t.task_id for t in tasks],
                     "repeat": args.repeat, "settings": {}}
    cfg = load_config(backend=args.backend, scale="gpu" if args.backend == "cuda" else "cpu")
    if args.fill:
        started = time.perf_counter()
        for task, cand in pairs:
            evaluate(task, cand, cfg)
        print(f"caches filled in {time.perf_counter() - started:.1f} s", flush=True)
    clock = RequestClock()
    for depth in (int(d) for d in args.prestart.split(",")):
        records = []
        started = time.perf_counter()
        with prestarted_workers(depth):
            for _ in range(args.repeat):
                records += [evaluate(task, cand, cfg) for task, cand in pairs]
        wall = time.perf_counter() - started
        setting = {"evaluations": len(records), "ok": sum(r.status == "ok" for r in records),
                   "wall_s": round(wall, 1), "per_min": round(60 * len(records) / wall, 2),
                   "stage_seconds": stage_seconds(records), "requests": clock.take()}
        figures["settings"][str(depth)] = setting
        print(f"prestart {depth}: {len(records)} evaluations ({setting['ok']} ok) in {wall:.1f} s = "
              f"{setting['per_min']:.2f}/min; stage totals {setting['stage_seconds']}", flush=True)
        for name, v in setting["requests"].items():
            print(f"  {name:<24} n={v['n']:<4} median {v['median_s']:8.4f} s  total {v['total_s']:8.2f} s",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

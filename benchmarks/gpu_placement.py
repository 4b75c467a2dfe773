"""Does a task's speedup on the GPU depend on where its buffers landed? One process, on the CUDA
device: per placement, a frame's worth of fresh inputs (kept alive, so that every placement gets
memory of its own), and the candidate, eager and torch.compile each recorded as one CUDA graph of
`--burst` calls over them (their outputs in the graph's pool), as the evaluator's graph replays
are; then `--replays` rounds, each replaying the three in turn after an L2 flush (a 256 MiB
memset), timed by CUDA events. Per placement, each program's median a call and the ratios. Were
the ratios to move between placements as much as they move between evaluations, the placement of
an evaluation's buffers would be the factor; where they hold, it is not.

    python benchmarks/gpu_placement.py kernels/tasks/level1/05_softmax.py kernels/solutions/level1/05_softmax
        [--placements 6] [--burst 8] [--replays 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", type=Path, help="a task file, run at its own (gpu) size")
    p.add_argument("solution", type=Path, help="the candidate's folder (model_new.py)")
    p.add_argument("--placements", type=int, default=6)
    p.add_argument("--burst", type=int, default=8, help="calls a graph (the evaluator's frame)")
    p.add_argument("--replays", type=int, default=40, help="timed replays of each program a placement")
    args = p.parse_args()
    import torch

    task = module(args.task, "task")
    candidate = module(args.solution / "model_new.py", "model_new").ModelNew(*task.get_init_inputs()).cuda()
    eager = task.Model(*task.get_init_inputs()).cuda()
    programs = {"candidate": candidate, "eager": eager, "compile": torch.compile(eager)}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kept = []
    print(f"{args.task.stem}, {args.placements} placements of {args.burst} inputs", flush=True)
    for placement in range(args.placements):
        inputs = [[x.cuda() if isinstance(x, torch.Tensor) else x for x in task.get_inputs()] for _ in range(args.burst)]
        kept.append(inputs)
        graphs = {}
        with torch.no_grad():
            for name, model in programs.items():
                for _ in range(3):
                    model(*inputs[0])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outputs = [model(*x) for x in inputs]
                graphs[name] = (graph, outputs)
        times: dict[str, list[float]] = {name: [] for name in graphs}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.replays):
            for name, (graph, _) in graphs.items():
                flush.zero_()
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.burst)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"placement {placement}: first input at {inputs[0][0].data_ptr():#x}  "
              + "  ".join(f"{name} {ms:.4f} ms" for name, ms in med.items())
              + f"  eager/candidate {med['eager'] / med['candidate']:.3f}"
              f"  compile/candidate {med['compile'] / med['candidate']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

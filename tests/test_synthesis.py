"""Training-task synthesis: shape inference over the whole catalog, the seeded composer, the filter
chain on planted bad tasks (each rejected by the right filter), deduplication and decontamination,
the merged dataset and manifest, the Ops-6K import, and every emitted task evaluated."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from hpc.errors import UserError
from hpc.synthesis.catalog import CATALOG
from hpc.synthesis.compose import compose
from hpc.synthesis.config import FILTERS, ComposeConfig, FilterConfig, SynthesisConfig, load_synthesis_config
from hpc.synthesis.filters import FilterChain, output_stats, repeated_axis
from hpc.synthesis.manifest import read_manifest
from hpc.synthesis.shards import checked_stats, merge, read_shard, run_local, run_shard, shard_path
from hpc.synthesis.similarity import BenchmarkIndex, ast_hash, normalized_tokens, op_signature, similarity
from hpc.task import load_task
from tests.conftest import LOCKED_TASK_HEAD, ROOT, TESTS

RUN_FILTERS = ["eager", "finite", "constant", "runtime", "compile"]   # skipped where a test needs only static ones


def _exec(code: str, scale: str) -> tuple[torch.Tensor, list]:
    """Run a composed task in this process (test code only): at the cpu scale for real, at the gpu
    scale on the meta device (shapes without memory)."""
    module = types.ModuleType("composed")
    exec(compile(code, "composed", "exec"), module.__dict__)
    if scale == "cpu":
        for name, value in module.SCALES["cpu"].items():
            setattr(module, name, value)
    with torch.device("cpu" if scale == "cpu" else "meta"), torch.no_grad():
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = module.get_inputs()
        return model(*inputs), inputs


def _steps(code: str) -> list[str]:
    return code.split('"""')[1].split(" (hpc.synthesis")[0].split(" -> ")


def test_every_catalog_operator_is_composed_with_the_shapes_inference_predicts():
    cfg = ComposeConfig()
    first: dict[str, int] = {}
    for i in range(1500):
        for step in _steps(compose(0, i, cfg).code):
            first.setdefault(step, i)
    assert {spec.name for spec in CATALOG} <= set(first), sorted({spec.name for spec in CATALOG} - set(first))
    for i in sorted(set(first.values())):
        c = compose(0, i, cfg)
        assert 1 <= len(c.ops) <= 5 and c.level == (1 if len(c.ops) == 1 else 2)
        for scale in ("cpu", "gpu"):
            out, inputs = _exec(c.code, scale)
            assert tuple(out.shape) == c.output_shapes[scale], (c.stem, scale, c.code)
            assert out.dtype == torch.float32
            assert all(x.dtype in (torch.float32, torch.int64) for x in inputs)
        assert all(line.split("(")[0].split("= ")[-1] in ("torch.randn", "torch.rand", "torch.randint")
                   for line in c.code.split("def get_inputs():")[1].split("return")[0].strip().splitlines())


def test_the_same_seed_composes_the_same_task_whatever_the_order():
    cfg = ComposeConfig(min_ops=2, max_ops=4)
    forward = [compose(11, i, cfg).code for i in range(30)]
    backward = [compose(11, i, cfg).code for i in reversed(range(30))][::-1]
    assert forward == backward
    assert forward != [compose(12, i, cfg).code for i in range(30)]
    counts = [len(compose(11, i, cfg).ops) for i in range(30)]
    assert min(counts) >= 2 and max(counts) <= 4


def test_a_bias_broadcasts_along_the_channels_the_operator_before_it_made():
    """A BiasAdd right after an operator that makes channels last (Embedding, Linear, Matmul) is
    per feature, after one that makes them first (a convolution) per channel: never a (seq_len, 1)
    bias per position after an Embedding."""
    cfg = ComposeConfig(max_ops=2)
    last, first = set(), set()   # the operators before a BiasAdd, by the bias's axis
    for i in range(1200):
        c = compose(1, i, cfg)
        steps = _steps(c.code)
        if len(steps) < 2 or steps[-1] != "BiasAdd":
            continue
        module = types.ModuleType("composed")
        exec(compile(c.code, "composed", "exec"), module.__dict__)
        shape = c.output_shapes["gpu"]
        bias = tuple(module.Model(*module.get_init_inputs()).bias.shape)   # gpu-scale sizes: the file's globals
        axis = len(shape) - len(bias)
        assert bias[0] == shape[axis] and set(bias[1:]) <= {1}, (c.stem, bias, shape)
        if steps[-2] in ("Embedding", "Linear", "Matmul", "Bmm"):
            assert axis == len(shape) - 1, (c.stem, bias, shape)
            last.add(steps[-2])
        if steps[-2].startswith(("Conv", "DepthwiseConv", "MaxPool", "AvgPool", "Adaptive")) and len(shape) > 2:
            assert axis == 1, (c.stem, bias, shape)
            first.add(steps[-2])
    assert "Embedding" in last and first, (last, first)


def test_no_operator_upsamples_a_length_1_axis():
    """An upsample of a length-1 axis (after a global pool) only repeats a value: never composed;
    every composed output ending in an upsample changes along every axis."""
    cfg = ComposeConfig(max_ops=3)
    ending = 0
    for i in range(1500):
        c = compose(2, i, cfg)
        steps = _steps(c.code)
        assert not any(a.startswith("Adaptive") and b == "Upsample" for a, b in zip(steps, steps[1:])), c.stem
        if steps[-1] == "Upsample":
            out, _ = _exec(c.code, "cpu")
            assert repeated_axis(out, 1e-9) is None, c.stem   # no axis a broadcast of one slice
            ending += 1
    assert ending >= 5


def test_each_family_has_its_share_of_candidates():
    """Every run of len(families) consecutive candidates has each family once: Embedding (the one
    first operator of `tokens`) starts a sixth of the candidates, never 3 of 7."""
    cfg = ComposeConfig()
    for seed in (0, 1):
        families = [compose(seed, i, cfg).family for i in range(60)]
        for block in range(10):
            assert sorted(families[6 * block:6 * block + 6]) == sorted(cfg.families), (seed, families)
        first = [compose(seed, i, cfg).ops[0] for i in range(60)]
        assert first.count("nn.Embedding") == 10
    assert [compose(0, i, cfg).family for i in range(12)] != [compose(1, i, cfg).family for i in range(12)]


def test_gpu_sizes_follow_the_roofline_target():
    """The batch is set so the estimate of eager is near the target: a larger target, larger tasks."""
    small = compose(3, 5, ComposeConfig(target_ms_gpu=1.0))
    large = compose(3, 5, ComposeConfig(target_ms_gpu=64.0))
    out_small, out_large = small.output_shapes["gpu"], large.output_shapes["gpu"]
    assert out_large[0] > out_small[0] and out_large[1:] == out_small[1:]
    assert small.output_shapes["cpu"] == large.output_shapes["cpu"]


# ---- normalization, hashes, signatures ----

KB_CONV = '''import torch
import torch.nn as nn

class Model(nn.Module):
    """Conv2d, ReLU, bias add (KernelBench level-2 style)."""
    def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.conv(x)
        x = torch.relu(x)
        x = x + self.bias
        return x

batch_size = 128
in_channels = 3
out_channels = 16
height, width = 32, 32
kernel_size = 3
bias_shape = (out_channels, 1, 1)

def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size, bias_shape]
'''


def test_normalized_hash_ignores_names_docstrings_and_sizes_but_not_operators():
    renamed = re.sub(r"\bx\b", "inp", KB_CONV.replace("self.conv", "self.c1")).replace(
        "batch_size = 128", "batch_size = 7").replace("height, width = 32, 32", "height, width = 64, 48").replace(
        "(KernelBench level-2 style)", "renamed")
    assert renamed != KB_CONV
    assert ast_hash(normalized_tokens(renamed)) == ast_hash(normalized_tokens(KB_CONV))
    other = KB_CONV.replace("torch.relu(x)", "torch.sigmoid(x)")
    assert ast_hash(normalized_tokens(other)) != ast_hash(normalized_tokens(KB_CONV))
    assert similarity(normalized_tokens(other), normalized_tokens(KB_CONV)) > 0.9


def test_operator_signatures_are_canonical():
    assert op_signature(KB_CONV) == ("conv2d", "relu", "add")
    assert op_signature((TESTS / "fixtures" / "kernelbench" / "19_ReLU.py").read_text()) == ("relu",)
    functional = KB_CONV.replace("x = torch.relu(x)", "x = F.relu(x)").replace(
        "import torch.nn as nn", "import torch.nn as nn\nimport torch.nn.functional as F")
    method = KB_CONV.replace("x = torch.relu(x)", "x = x.relu()")
    module = KB_CONV.replace("x = torch.relu(x)", "x = self.act(x)").replace(
        "self.bias = nn.Parameter", "self.act = nn.ReLU()\n        self.bias = nn.Parameter")
    assert op_signature(functional) == op_signature(method) == op_signature(module) == ("conv2d", "relu", "add")


# ---- planted bad tasks, each rejected by the right filter ----

def _task(forward: str, init: str = "", inputs: str = "torch.randn(batch_size, dim)",
          sizes: str = "batch_size = 64\ndim = 256", init_args: str = "", init_values: str = "") -> str:
    return f'''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self{init_args}):
        super().__init__()
{init or "        pass"}

    def forward(self, x):
{forward}


{sizes}


def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return [{init_values}]
'''


GOOD = _task("        return torch.relu(self.linear(x))", "        self.linear = nn.Linear(dim, dim)",
             sizes="batch_size = 256\ndim = 512", init_args=", dim", init_values="dim")
PLANTED = {
    "good": (GOOD, "", ""),
    "duplicate": (GOOD.replace("self.linear", "self.fc").replace("batch_size = 256", "batch_size = 32"), "duplicate",
                  "duplicate of candidate 0"),
    "not_a_task": ("import torch\n\nclass Model:\n    pass\n", "load", "missing get_inputs"),
    "stochastic_static": (_task("        return x + torch.rand_like(x)"), "stochastic", "rand_like"),
    "stochastic_dynamic": (_task("        return x + self.noise.sample(x.shape)",
                                 "        self.noise = torch.distributions.Laplace(0.0, 1.0)"),
                           "stochastic", "two calls on the same inputs differ"),
    "contaminated_ast": (KB_CONV.replace("self.conv", "self.convolution").replace('"""Conv2d, ReLU, bias add '
                                                                                  '(KernelBench level-2 style)."""',
                                                                                  '"""Mine."""'),
                         "contaminated", "AST similarity"),
    "contaminated_signature": (_task("        y = self.conv(x)\n        return torch.relu(y) + 1.5",
                                     "        self.conv = nn.Conv2d(4, 8, 3, padding=1)",
                                     "torch.randn(batch_size, 4, 16, 16)", "batch_size = 8"),
                               "contaminated", "operator signature (conv2d, relu, add)"),
    "eager_error": (_task("        return x @ torch.ones(3, 3)"), "eager", "RuntimeError"),
    "nonfinite": (_task("        return torch.log(x)"), "finite", "NaN or Inf"),
    "constant": (_task("        return torch.softmax(x.sum(dim=1, keepdim=True), dim=1)"), "constant",
                 "a constant would pass"),
    "nearly_constant": (_task("        return torch.selu(torch.log_softmax(x, dim=1))"), "variation",
                        "std / (|mean| + std) ="),      # std ~0.004 around -1.75: the SELU of a log-softmax
    "upsampled_length_1": (_task("        return nn.functional.interpolate(x.unsqueeze(-1), scale_factor=2)"),
                           "structure", "repeats along axis 2: 0% of adjacent slices differ"),
    "too_fast": (_task("        return torch.tanh(x)", sizes="batch_size = 2\ndim = 4"), "runtime", "too fast"),
    "too_slow": (_task("        return x @ x.t() @ x", sizes="batch_size = 1536\ndim = 1536"), "runtime", "too slow"),
}


def _filter_config(cache_dir: Path, tmp_path: Path, **filters):
    cfg = tmp_path / "synth.yaml"
    cfg.write_text(json.dumps({
        "filters": {"runtime_ms_cpu": [0.3, 40.0], **filters},
        "eval": {"cache_dir": str(cache_dir), "timing": {"warmup": 2, "iterations": 10}},
    }))
    return load_synthesis_config(cfg, count=len(PLANTED))


def test_planted_bad_tasks_are_rejected_by_the_right_filter_and_a_good_one_passes(tmp_path, cache_dir):
    bench = tmp_path / "KernelBench" / "level2"
    bench.mkdir(parents=True)
    (bench / "1_Conv2D_ReLU_BiasAdd.py").write_text(KB_CONV)
    shutil.copy(TESTS / "fixtures" / "kernelbench" / "19_ReLU.py", bench.parent / "19_ReLU.py")
    cfg = _filter_config(cache_dir, tmp_path)
    chain = FilterChain(cfg, BenchmarkIndex(bench.parent))
    results = {name: chain.check(index, code, name) for index, (name, (code, _, _)) in enumerate(PLANTED.items())}
    for name, (_, expected_filter, words) in PLANTED.items():
        v = results[name]
        assert (v.filter, v.accepted) == (expected_filter, expected_filter == ""), (name, v)
        assert words in v.reason, (name, v.reason)
        assert v.ran[0] == "load" and (expected_filter or "compile") in v.ran, (name, v.ran)
    good = results["good"]
    assert good.ran == ["load", "stochastic", "contaminated", "duplicate", "eager", "finite", "constant", "variation",
                        "structure", "memory", "runtime", "compile"]
    assert good.outputs[0]["shape"] == [256, 512] and good.outputs[0]["variation"] > 0.3
    assert (results["nearly_constant"].kind, results["upsampled_length_1"].kind) == ("nearly constant",
                                                                                    "broadcast along an axis")
    assert results["too_slow"].kind == "too slow" and results["eager_error"].kind == "RuntimeError"
    assert 0.3 <= good.eager_ms <= 40.0 and good.signature == ["linear", "relu"]
    assert results["too_fast"].eager_ms < 0.3 < 40.0 < results["too_slow"].eager_ms


# a 64 x 512 x 1024 float32 intermediate: 128 MiB in the eager run, for an output of 128 KiB
HEAVY = _task("        return (x.unsqueeze(-1) * self.ones).sum(dim=-1)", "        self.ones = torch.ones(1024)",
              sizes="batch_size = 64\ndim = 512")


def test_a_task_whose_eager_run_needs_too_much_memory_is_rejected(tmp_path, cache_dir):
    """The reference worker reports the eager run's peak (here the growth of its resident set):
    a task whose intermediate alone is 128 MiB is over a 32 MiB bound, an ordinary one (~10 MiB)
    is not; skipped, the filter lets the first through, its peak still recorded."""
    cfg = _filter_config(cache_dir, tmp_path, skip=["runtime", "compile"], max_memory_mib_cpu=32)
    chain = FilterChain(cfg)
    heavy, good = chain.check(0, HEAVY, "heavy"), chain.check(1, GOOD, "good")
    assert (heavy.filter, heavy.kind) == ("memory", "too much memory"), heavy
    assert re.fullmatch(r"peak memory \d+\.\d MiB > 32 MiB \(cpu scale\)", heavy.reason), heavy.reason
    assert heavy.peak_mib >= 128, heavy
    assert good.accepted and 0 < good.peak_mib < 32 and good.ran[-2:] == ["structure", "memory"], good
    cfg.filters.skip.append("memory")
    again = FilterChain(cfg).check(0, HEAVY, "heavy")
    assert again.accepted and "memory" not in again.ran and again.peak_mib >= 128, again


def test_a_repeat_is_told_from_values_that_repeat_within_rows():
    """Whole adjacent slices are compared (at the default threshold): each slice 4 times and a
    broadcast are repeats; a running max (values repeat along a row, rows mostly differ), a nearest
    upsample by 2 and random values are not."""
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    minimum = FilterConfig().min_slice_change
    assert repeated_axis(x, minimum) is None
    assert repeated_axis(torch.cummax(x, dim=1).values, minimum) is None
    assert repeated_axis(torch.relu(torch.randn(512)), minimum) is None      # half zeros, yet adjacent values differ
    assert repeated_axis(x.repeat_interleave(2, dim=1), minimum) is None
    assert repeated_axis(x.repeat_interleave(4, dim=1), minimum) == (1, pytest.approx(255 / 1023))
    assert repeated_axis(x[:, :1].expand(64, 8), minimum) == (1, 0.0)
    stats = output_stats(torch.full((4, 4), -1.744) + 0.005 * torch.randn(4, 4))
    assert stats["variation"] < 0.01 and output_stats(torch.zeros(3))["variation"] == 0.0
    assert output_stats(torch.tensor(0.7))["variation"] is None     # a scalar (a loss) has no spread to judge


def test_a_filter_can_be_skipped(tmp_path, cache_dir):
    """Without `constant`, a constant output is still nearly constant (`variation`), and without
    that a broadcast of one value (`structure`); without all three it passes."""
    cfg = _filter_config(cache_dir, tmp_path, skip=["runtime", "compile", "constant"])
    for skipped, kind in (("variation", "nearly constant"), ("structure", "broadcast along an axis")):
        v = FilterChain(cfg).check(0, PLANTED["constant"][0], "constant")
        assert (v.filter, v.kind) == (skipped, kind) and "constant" not in v.ran, v
        cfg.filters.skip.append(skipped)
    v = FilterChain(cfg).check(0, PLANTED["constant"][0], "constant")
    assert v.accepted and not {"constant", "variation", "structure", "runtime"} & set(v.ran), v


# ---- runs: shards, resume, merge, manifest, determinism ----

def _static_only(seed: int, count: int, cache_dir: Path):
    cfg = load_synthesis_config(None, seed=seed, count=count)
    cfg.filters.skip = list(RUN_FILTERS)
    cfg.compose.max_ops = 2
    cfg.eval.cache_dir = str(cache_dir)
    return cfg


def _tree(folder: Path) -> dict[str, bytes]:
    """Task files and manifest.jsonl (stats.json and manifest.h5 also hold timings and the shard count)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.suffix in (".py", ".jsonl")}


def test_the_same_seed_gives_the_same_dataset_whatever_the_sharding(tmp_path, cache_dir):
    one = tmp_path / "one"
    stats = run_local(_static_only(5, 60, cache_dir), one)
    three = tmp_path / "three"
    for shard in (2, 0, 1):
        run_shard(_static_only(5, 60, cache_dir), shard, 3, three)
    merge(three, _static_only(5, 60, cache_dir))
    assert _tree(one / "dataset") == _tree(three / "dataset")
    assert stats["candidates"] == 60 and 0 < stats["accepted"] <= 60
    rejected = {f["name"]: f["rejected"] for f in stats["filters"]}
    assert 0 < rejected["duplicate"] == 60 - stats["accepted"], stats   # 1-2 op chains repeat: deduplicated
    other = tmp_path / "other"
    run_local(_static_only(6, 60, cache_dir), other)
    assert _tree(other / "dataset") != _tree(one / "dataset")


def test_a_shard_resumes_after_a_torn_write_and_checks_only_what_is_missing(tmp_path, cache_dir):
    cfg = _static_only(2, 8, cache_dir)
    run_shard(cfg, 0, 2, tmp_path)
    path = shard_path(tmp_path, 0)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]) + lines[-2][:40])     # the last record lost, the one before torn
    summary = run_shard(cfg, 0, 2, tmp_path)
    assert (summary["checked"], summary["skipped"]) == (2, 2)
    _, records, _ = read_shard(path)
    assert sorted(r["index"] for r in records) == [0, 2, 4, 6]
    with pytest.raises(UserError, match=r"shard\(s\) 1 of 2 have no file yet"):
        merge(tmp_path, cfg)
    with pytest.raises(UserError, match="written by a different run"):
        run_shard(_static_only(3, 8, cache_dir), 0, 2, tmp_path)
    run_shard(cfg, 1, 2, tmp_path)
    stats = merge(tmp_path, cfg)
    assert stats["candidates"] == 8


def test_the_manifest_records_every_candidate_and_the_ops6k_fields(tmp_path, cache_dir):
    stats = run_local(_static_only(9, 20, cache_dir), tmp_path)
    dataset = tmp_path / "dataset"
    lines = [json.loads(line) for line in (dataset / "manifest.jsonl").read_text().splitlines()]
    assert len(lines) == stats["accepted"] == len(list(dataset.rglob("*.py")))
    for line in lines:
        assert isinstance(line["code"], str) and isinstance(line["ops"], list)
        assert line["data_source"] == "hpc-synthesis"
        assert (dataset / line["path"]).read_text() == line["code"]
        assert load_task(dataset / line["path"]).task_id == line["task_id"]
    records, filters, attrs = read_manifest(dataset / "manifest.h5")
    assert [r["index"] for r in records] == list(range(20))
    assert attrs["seed"] == 9 and attrs["count"] == 20 and attrs["format"] == "hpc-synthesis-manifest"
    assert [f.name for f in filters] == list(FILTERS)
    assert sum(f.rejected for f in filters) == 20 - stats["accepted"]
    assert json.loads((dataset / "stats.json").read_text())["accepted"] == stats["accepted"]


def test_the_quality_report_counts_rejections_by_reason_and_the_op_mix(tmp_path, cache_dir):
    """stats.json, manifest.h5's rejections group and report.md agree with the candidates' own
    records: rejections by filter and kind, the accepted tasks' families, categories and lengths."""
    import h5py

    stats = run_local(_static_only(4, 36, cache_dir), tmp_path)
    dataset = tmp_path / "dataset"
    records, _, _ = read_manifest(dataset / "manifest.h5")
    rejected = [r for r in records if not r["accepted"]]
    assert rejected and all(r["kind"] == "same AST" for r in rejected)
    assert stats["rejections"] == [{"filter": "duplicate", "kind": "same AST", "count": len(rejected),
                                    "example": rejected[0]["reason"]}]
    with h5py.File(dataset / "manifest.h5", "r") as f:
        group = f["rejections"]
        assert [(x.decode(), y.decode(), int(n)) for x, y, n in zip(group["filter"], group["kind"], group["count"])] \
            == [("duplicate", "same AST", len(rejected))]
        assert group["count"].attrs["units"] == "1"
    kept = [r for r in records if r["accepted"]]
    q = stats["quality"]
    assert sum(q["families"].values()) == len(kept) and set(q["families"]) == set(ComposeConfig().families)
    assert q["categories"]["embedding"] == sum(r["categories"][0] == "embedding" for r in kept) > 0
    assert sum(q["categories"].values()) == sum(len(r["ops"]) for r in kept)
    assert {int(k): n for k, n in q["lengths"].items()} == {n: sum(len(r["ops"]) == n for r in kept) for n in (1, 2)}
    report = (dataset / "report.md").read_text()
    assert f"| duplicate | same AST | {len(rejected)} | duplicate of candidate" in report
    assert f"| tokens | {q['families']['tokens']} |" in report and "| operators | count | share |" in report
    assert json.loads((dataset / "stats.json").read_text())["quality"] == q


def test_a_run_cut_short_has_the_merges_statistics_over_the_candidates_checked(tmp_path, cache_dir):
    cfg = _static_only(5, 60, cache_dir)
    summary = run_shard(cfg, 0, 3, tmp_path, deadline=time.monotonic())   # already past: none starts
    assert summary["cut_by_deadline"] and summary["checked"] == 0 and not summary["preempted"]
    assert not run_shard(cfg, 0, 3, tmp_path)["cut_by_deadline"]
    run_shard(cfg, 2, 3, tmp_path)
    stats, records = checked_stats(tmp_path, cfg)
    assert [r["index"] for r in records] == [i for i in range(60) if i % 3 != 1]
    assert (stats["count"], stats["candidates"]) == (60, 40)
    accepted = [r["ast_hash"] for r in records if r["accepted"]]
    assert stats["accepted"] == len(accepted) == len(set(accepted))
    assert any(r["reason"].startswith("duplicate of level") for r in records)   # across shards, as the merge does
    run_shard(cfg, 1, 3, tmp_path)
    assert checked_stats(tmp_path, cfg)[0] == merge(tmp_path, cfg)


# ---- out of memory beside another candidate: checked again alone ----

# Candidates that meet through a flock on LOCK (tests.conftest.LOCKED_TASK_HEAD): the hog holds it for
# as long as its sandboxed worker lives; the others wait up to 5 s for a neighbour to hold it (so they
# run beside one) and run out of memory while it does.
_LOCKED = LOCKED_TASK_HEAD + """

class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
{init}

    def forward(self, x):
{forward}
        return torch.relu(self.linear(x))


batch_size = 64
dim = 256


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]
"""
_HOG = ("        self.held = os.open(LOCK, os.O_RDONLY)\n        fcntl.flock(self.held, fcntl.LOCK_EX)\n"
        "        time.sleep(3)", "        pass")
_SQUEEZED = ("        if neighbour_holds_lock(5):\n"
             "            raise torch.OutOfMemoryError('out of memory: a neighbour holds the memory')", "        pass")
_HOPELESS = ("        neighbour_holds_lock(5)", "        raise MemoryError('needs more than the machine has')")


def _oom_run(tmp_path: Path, cache_dir: Path, workers: int) -> tuple[Path, SynthesisConfig]:
    """Rows hog, hog, squeezed, hopeless, hog in two shards: shard 0 checks hog, squeezed, hog;
    shard 1 hog, hopeless."""
    lock = tmp_path / "memory.lock"
    lock.touch()
    rows = [_LOCKED.format(lock=str(lock), init=init, forward=forward)
            for init, forward in (_HOG, _HOG, _SQUEEZED, _HOPELESS, _HOG)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"code": code, "ops": ["nn.Linear", "torch.relu"]}) + "\n" for code in rows))
    config = tmp_path / "synth.yaml"     # the workers may read the lock file in the test's folder
    config.write_text(json.dumps({"filters": {"skip": ["contaminated", "duplicate", "runtime", "compile"]},
                                  "eval": {"cache_dir": str(cache_dir),
                                           "sandbox": {"restrict_reads": False, "run_as_uid": -1}}}))
    return tmp_path / "run", load_synthesis_config(config, source=str(source), count=0, workers=workers)


def test_a_candidate_out_of_memory_beside_another_is_checked_again_alone(tmp_path, cache_dir, caplog):
    """The squeezed candidate runs out of memory while the first hog runs beside it; checked again
    once that hog is done, and before the next hog starts, it passes, and that is its record."""
    run, cfg = _oom_run(tmp_path, cache_dir, workers=2)
    with caplog.at_level("INFO", logger="hpc.synthesis.shards"):
        summary = run_shard(cfg, 0, 2, run)
    _, records, _ = read_shard(shard_path(run, 0))
    by_index = {r["index"]: r for r in records}
    assert sorted(by_index) == [0, 2, 4] and len(records) == 3 and summary["checked"] == 3   # each recorded once
    squeezed = by_index[2]
    assert squeezed["accepted"] and squeezed["rechecked_alone"], squeezed["reason"]
    assert squeezed["first_reason"].startswith("eager: task Model failed to build: OutOfMemoryError: out of memory")
    assert all(by_index[i]["accepted"] and not by_index[i]["rechecked_alone"] for i in (0, 4))
    assert caplog.text.count("checking it again alone") == 1


def test_a_candidate_out_of_memory_even_alone_stays_rejected_after_one_recheck(tmp_path, cache_dir, caplog):
    """With 2 workers the hopeless candidate, out of memory beside the hog, is checked once more
    alone and stays rejected; with 1 worker nothing ran beside it, and it is not checked again."""
    run, cfg = _oom_run(tmp_path, cache_dir, workers=2)
    with caplog.at_level("INFO", logger="hpc.synthesis.shards"):
        run_shard(cfg, 1, 2, run)
        cfg.workers = 1
        run_shard(cfg, 1, 2, tmp_path / "one-worker")
    hog, hopeless = sorted(read_shard(shard_path(run, 1))[1], key=lambda r: r["index"])
    assert (hopeless["index"], hopeless["accepted"], hopeless["filter"], hopeless["kind"]) == (3, False, "eager",
                                                                                              "MemoryError")
    assert hopeless["rechecked_alone"] and "MemoryError: needs more than the machine has" in hopeless["first_reason"]
    assert hog["accepted"] and caplog.text.count("checking it again alone") == 1
    alone = {r["index"]: r for r in read_shard(shard_path(tmp_path / "one-worker", 1))[1]}[3]
    assert (alone["kind"], alone["rechecked_alone"], alone["first_reason"]) == ("MemoryError", False, "")


def _throughput(tmp_path: Path, cache_dir: Path, capsys, *args: str) -> tuple[dict, str]:
    """benchmarks/synthesis_throughput.py in this process (no second torch import): figures, stdout."""
    spec = importlib.util.spec_from_file_location("synthesis_throughput",
                                                  ROOT / "benchmarks" / "synthesis_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "figures.json"
    assert bench.main(["--scale", "cpu", "--cache-dir", str(cache_dir), "--run-dir", str(tmp_path / "run"),
                       "--out", str(out), *args]) == 0
    text = capsys.readouterr().out
    summary = json.loads(text.splitlines()[-1].removeprefix("summary: "))
    figures = json.loads(out.read_text())
    assert summary == {k: figures[k] for k in summary}
    return figures, text


def test_a_throughput_run_within_its_budget_reports_the_merged_datasets_figures(tmp_path, cache_dir, capsys):
    config = tmp_path / "synth.yaml"
    config.write_text(json.dumps({"filters": {"skip": RUN_FILTERS}, "compose": {"max_ops": 2}}))
    figures, text = _throughput(tmp_path, cache_dir, capsys, "--count", "30", "--config", str(config),
                                "--seconds", "3600")
    stats = json.loads((tmp_path / "run" / "dataset" / "stats.json").read_text())
    assert (figures["cut_by_budget"], figures["checked"], figures["count"]) == (False, 30, 30)
    assert (figures["filters"], figures["yield"]) == (stats["filters"], stats["yield"])
    duplicates = 30 - stats["accepted"]       # the only filter that runs and can reject
    assert figures["rejected_by"] == ({"duplicate": duplicates} if duplicates else {}) and "cut by" not in text


def test_a_time_budget_cuts_a_throughput_run_to_the_candidates_it_checked(tmp_path, cache_dir, capsys):
    """A candidate runs for seconds (its sandboxed processes start): one starts within the budget,
    finishes past it and counts; the others never start."""
    config = tmp_path / "synth.yaml"
    config.write_text(json.dumps({"filters": {"skip": ["compile"]},
                                  "eval": {"timing": {"warmup": 1, "iterations": 5}}}))
    figures, text = _throughput(tmp_path, cache_dir, capsys, "--count", "3", "--workers", "1", "--config",
                                str(config), "--seconds", "1")
    _, records, _ = read_shard(shard_path(tmp_path / "run", 0))
    checked = len(records)
    assert figures["cut_by_budget"] and figures["checked"] == checked and 1 <= checked < 3
    assert [r["index"] for r in records] == list(range(checked))
    assert f"cut by the --seconds 1 budget: {checked} of 3 candidates checked" in text
    assert not (tmp_path / "run" / "dataset").exists()
    accepted = [r for r in records if r["accepted"]]
    assert figures["yield"] == len(accepted) / checked
    assert figures["candidates_per_hour"] == pytest.approx(checked * 3600 / figures["wall_s"], rel=0.05)
    assert figures["eager_ms"] == sorted(r["eager_ms"] for r in accepted)
    assert sum(figures["rejected_by"].values()) == checked - len(accepted)
    for f in figures["filters"]:
        assert f["entered"] == sum(f["name"] in r["ran"] for r in records), f
        assert f["rejected"] == sum(not r["accepted"] and r["filter"] == f["name"] for r in records), f


# ---- command line, config, Ops-6K import ----

def hpc(*args, cache=None):
    env = {**os.environ, "HPC_CACHE_DIR": str(cache)} if cache else None
    return subprocess.run([sys.executable, "-m", "hpc.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=env)


def test_an_ops6k_file_imports_into_the_task_format(tmp_path):
    rows = [{"code": KB_CONV, "ops": "['nn.Conv2d', 'torch.relu', 'torch.add']", "data_source": "ops6k-test"},
            {"code": (TESTS / "fixtures" / "kernelbench" / "19_ReLU.py").read_text()}]   # named by its signature
    src = tmp_path / "ops.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = hpc("synthesize", "--from", src, "--import-only", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    dataset = tmp_path / "run" / "dataset"
    assert sorted(str(p.relative_to(dataset)) for p in dataset.rglob("*.py")) == [
        "level1/000001_relu.py", "level2/000000_Conv2d_relu_add.py"]
    lines = [json.loads(line) for line in (dataset / "manifest.jsonl").read_text().splitlines()]
    assert [(x["ops"], x["data_source"]) for x in lines] == [(["nn.Conv2d", "torch.relu", "torch.add"], "ops6k-test"),
                                                             ([], "")]
    assert lines[0]["code"] == KB_CONV


def test_an_ops6k_parquet_file_imports_like_its_jsonl(tmp_path):
    """The released Ops-6K is parquet: the same rows as parquet (ops a list column) give the
    same dataset as JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"code": [KB_CONV, (TESTS / "fixtures" / "kernelbench" / "19_ReLU.py").read_text()],
            "ops": [["nn.Conv2d", "torch.relu", "torch.add"], None], "data_source": ["ops6k-test", None]}
    pq.write_table(pa.table(rows), tmp_path / "ops.parquet")
    jsonl = tmp_path / "ops.jsonl"
    jsonl.write_text("\n".join(json.dumps({k: v[i] for k, v in rows.items() if v[i] is not None})
                               for i in range(2)) + "\n")
    for src in ("ops.parquet", "ops.jsonl"):
        proc = hpc("synthesize", "--from", tmp_path / src, "--import-only", "--out", tmp_path / f"run-{src}")
        assert proc.returncode == 0, proc.stderr
    dataset = {src: tmp_path / f"run-{src}" / "dataset" for src in ("ops.parquet", "ops.jsonl")}
    files = {src: sorted((str(p.relative_to(d)), p.read_text()) for p in d.rglob("*.py")) for src, d in dataset.items()}
    assert files["ops.parquet"] == files["ops.jsonl"] and len(files["ops.parquet"]) == 2
    manifests = [[{k: x[k] for k in ("code", "ops", "data_source")} for x in map(
        json.loads, (d / "manifest.jsonl").read_text().splitlines())] for d in dataset.values()]
    assert manifests[0] == manifests[1] and manifests[0][0]["ops"] == ["nn.Conv2d", "torch.relu", "torch.add"]


def test_an_out_folder_under_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "f").write_text("")
    proc = hpc("synthesize", "--count", 1, "--out", tmp_path / "f" / "run")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'f' / 'run'}: {tmp_path / 'f'} is not a folder"], proc.stderr


def test_a_file_named_parquet_that_is_not_is_a_one_line_error(tmp_path):
    src = tmp_path / "ops.parquet"
    src.write_text('{"code": "x"}\n')
    proc = hpc("synthesize", "--from", src, "--import-only", "--out", tmp_path / "run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: ops6k {src}: cannot read as parquet"), proc.stderr


@pytest.mark.parametrize("content, message", [
    ('{"code": "x"}\n{"code": \n', "line 2: not valid JSON"),
    ('{"ops": ["relu"]}\n', "line 1: expected an object with a non-empty string 'code'"),
    ('{"code": "x", "ops": 3}\n', "line 1: 'ops' must be a list of strings"),
])
def test_a_malformed_ops6k_file_is_a_one_line_error(tmp_path, content, message):
    src = tmp_path / "bad.jsonl"
    src.write_text(content)
    proc = hpc("synthesize", "--from", src, "--out", tmp_path / "run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: ops6k {src} {message}"), proc.stderr
    assert not (tmp_path / "run").exists()


def test_parquet_without_pyarrow_is_a_one_line_error(tmp_path):
    blocked = tmp_path / "site" / "pyarrow"   # a pyarrow that fails to import, ahead of any installed one
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('no pyarrow here')\n")
    src = tmp_path / "ops.parquet"
    src.write_bytes(b"PAR1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "synthesize", "--from", str(src), "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: ops6k {src}: reading parquet needs pyarrow (pip install pyarrow), or convert the file to JSONL"]


@pytest.mark.parametrize("text, message", [
    ("filters:\n  runtime_ms_cpus: [0, 1]\n", "config filters.runtime_ms_cpus: unknown key"),
    ("filters:\n  runtime_ms_cpu: [5, 1]\n", "config filters.runtime_ms_cpu: expected [low, high]"),
    ("compose:\n  max_ops: 0\n", "config compose.min_ops/max_ops"),
    ("compose:\n  families: [matrix, graphs]\n", "config compose.families[]: expected one of"),
    ("eval:\n  timing:\n    iterations: 0\n", "config eval.timing.iterations: must be > 0"),
    ("filters:\n  skip: [load]\n", "config filters.skip[]: expected one of"),
    ("filters:\n  min_variation: 1.5\n", "config filters.min_variation: must be in [0, 1), got 1.5"),
    ("filters:\n  min_slice_change: -0.1\n", "config filters.min_slice_change: must be in [0, 1], got -0.1"),
    ("filters:\n  max_memory_mib_gpu: 0\n", "config filters.max_memory_mib_gpu: must be > 0, got 0"),
    ("filters:\n  max_memory_mib_cpu: -5\n", "config filters.max_memory_mib_cpu: must be > 0, got -5"),
    ("filters:\n  max_memory_mib_cpu: 1.5\n", "config filters.max_memory_mib_cpu: expected int"),
    ("workers: two\n", "config workers: expected int"),
])
def test_a_bad_config_is_a_one_line_error_naming_the_key(tmp_path, text, message):
    config = tmp_path / "synth.yaml"
    config.write_text(text)
    proc = hpc("synthesize", "--config", config, "--count", "2", "--out", tmp_path / "run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr


def test_bad_arguments_are_one_line(tmp_path):
    for args, message in ((["--out", tmp_path], "error: config count: the composer needs"),
                          (["--out", tmp_path, "--count", "x"], "error: hpc synthesize: argument --count"),
                          (["--out", tmp_path, "--count", "2", "--import-only"], "error: --import-only: needs --from"),
                          (["--out", tmp_path, "--count", "2", "--benchmark", tmp_path / "none"],
                           "error: config benchmark")):
        proc = hpc("synthesize", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), (args, proc.stderr)


# ---- every emitted task loads and evaluates ----

def _aten_ops(path: Path) -> list[str]:
    """The aten ops a task's forward dispatches at the cpu scale (test code runs the task here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpc.task import load_task_module

    seen: set[str] = set()

    class Collect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    module = load_task_module(path, "cpu", f"task_{path.stem}")
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).eval()
    with torch.no_grad(), Collect():
        model(*module.get_inputs())
    return sorted(seen)


@pytest.mark.slow
def test_a_seeded_run_emits_tasks_that_load_and_evaluate(tmp_path, cache_dir):
    """The whole pipeline on a few composed candidates (all filters, the compile included); every
    emitted task then evaluated by the evaluator with its own Model as the candidate."""
    from hpc.candidate import load_candidate
    from hpc.pipeline import evaluate
    from tests.conftest import make_fast_config

    config = tmp_path / "synth.yaml"
    config.write_text(json.dumps({"compose": {"families": ["matrix", "sequence"], "max_ops": 2},
                                  "filters": {"runtime_ms_cpu": [0.001, 1000.0]},
                                  "eval": {"timing": {"warmup": 1, "iterations": 5}}}))
    proc = hpc("synthesize", "--out", tmp_path / "run", "--count", "2", "--seed", "4", "--config", config,
               cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    dataset = tmp_path / "run" / "dataset"
    records, _, _ = read_manifest(dataset / "manifest.h5")
    assert len(records) == 2 and all(set(r["ran"]) == set(FILTERS) - {"contaminated"} or not r["accepted"]
                                     for r in records)
    emitted = sorted(dataset.rglob("*.py"))
    assert emitted and len(emitted) == sum(r["accepted"] for r in records), proc.stderr
    for path in emitted:
        task = load_task(path)
        assert task.declared_scales == ("cpu",)
        candidate = tmp_path / "candidates" / path.name
        candidate.parent.mkdir(exist_ok=True)
        candidate.write_text(path.read_text().replace("class Model(nn.Module)", "class ModelNew(nn.Module)"))
        cfg = make_fast_config(cache_dir)
        cfg.rules.require_custom_kernel = False
        cfg.rules.allowed_torch_ops = _aten_ops(path)
        cfg.correctness.trials, cfg.timing.iterations, cfg.timing.calibration_calls = 2, 5, 10
        rec = evaluate(task, load_candidate(candidate), cfg)
        assert rec.status == "ok" and rec.correct and not rec.failed_stage, (path.name, rec.reason)
        assert rec.eager_ms > 0 and rec.compile_ms > 0

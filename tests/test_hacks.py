"""Every known reward hack (docs/evaluator.md, "Reward hacks and where each is stopped"): each is
rejected with a named reason and paid the incorrect reward; honest candidates are paid. Each hack
workdir carries a CPU (kernels/*.cpp) and a CUDA (kernels/*.cu) variant; the CUDA cases run where
a GPU is visible (`scripts/test-gpu.sh`), and skip elsewhere."""

from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

from hpc import pipeline
from hpc.candidate import load_candidate
from hpc.pipeline import evaluate
from hpc.profile.window import handshake_ns, paired_ratio
from hpc.task import load_task
from tests.conftest import RELU_TASK, TESTS

HACKS = TESTS / "hacks"
RELU_LARGE = TESTS / "fixtures" / "tasks" / "level1" / "relu_large.py"
MEAN_ROWS = TESTS / "fixtures" / "tasks" / "level1" / "mean_rows.py"

# hack -> (stage that rejects it, words the reason must contain)
EXPECTED = {
    "inductor_at_import": ("static", "access to .compile is not allowed"),   # past it: tests/test_hacks_static.py
    "torch_fallback": ("verify", "aten.relu"),
    "try_except_fallback": ("verify", "aten.clamp_min"),
    "late_fallback": ("profile", "aten.relu"),
    "no_kernel": ("verify", "called none of the candidate's own kernels"),
    "result_reuse": ("verify", "outside atol"),
    "uninitialized_read": ("verify", "outside atol"),
    "native_thread": ("verify", "outside atol"),
    "python_thread": ("static", "import of threading"),
    "lazy_subclass": ("verify", "not a plain torch.Tensor"),
    "cached_result": ("verify", "outside atol"),
    "inplace_input": ("verify", "modified its input 0 in place"),
    "precision_downgrade": ("verify", "outside atol"),
    "timer_patch_python": ("static", "import of time"),
    "timer_patch_capi": ("compile", "Python C API"),
    "numpy_compute": ("static", "import of numpy"),
    "segfault": ("verify", "SIGSEGV"),
    "out_of_memory": ("verify", "allocate"),
    "library_bypass": ("compile", "undefined reference"),
    "dynamic_loading": ("static", "dynamic loading is not allowed"),
    "deferred_when_timed": ("profile", "output of timed call"),
    "frame_reuse": ("profile", "output of timed call"),
    "claimed_harness_fault": ("load", "cannot report"),
}


# Where the CUDA variant of a hack fails differently from its CPU variant.
CUDA_EXPECTED = {**EXPECTED, "segfault": ("verify", "illegal memory access")}
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def config(request, fast_config, cache_dir):
    return fast_config if request.param == "cpu" else request.getfixturevalue("cuda_config")


PAID_BY_REAL_TIME = ["clock_rewrite", "predicted_inputs", "early_start", "baseline_spinner"]   # correct, forging
                                                                                             # in vain: paid as honest


def test_every_hack_folder_has_an_expectation():
    assert sorted(p.name for p in HACKS.iterdir() if p.is_dir()) == sorted([*EXPECTED, *PAID_BY_REAL_TIME, "hang"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hack_is_rejected(name, config):
    if name == "frame_reuse":   # frames of 4 calls, however long the probe took on a loaded machine
        config = copy.deepcopy(config)
        config.timing.frame_ms_cpu = config.timing.frame_ms_cuda = 1e6
        config.timing.burst_max = 4
    rec = evaluate(load_task(RELU_TASK), load_candidate(HACKS / name), config)
    stage, words = (CUDA_EXPECTED if config.backend == "cuda" else EXPECTED)[name]
    assert rec.status == "failed", rec.reason
    assert rec.failed_stage == stage, rec.reason
    assert words in rec.reason
    assert rec.reward == -1.0


@pytest.fixture
def past_the_symbol_check(monkeypatch):
    """The timer hacks as if they had found a way into the interpreter that the link-time symbol
    check does not see: the timing behind it must still hold."""
    from hpc.compile import native

    monkeypatch.setattr(native, "symbol_defect", lambda *args, **kwargs: "")


def _timer_hack(tmp_path, both: int) -> Path:
    hack = tmp_path / f"timer_patch_{both}"
    shutil.copytree(HACKS / "timer_patch_capi", hack)
    model = hack / "model_new.py"
    model.write_text(model.read_text().replace("kernels.relu_and_patch(out, x, x.numel(), 0)",
                                               f"kernels.relu_and_patch(out, x, x.numel(), {both})"))
    for source in (hack / "kernels").iterdir():   # its own compile-cache entry, built without the check
        source.write_text(source.read_text() + "// unchecked build\n")
    return hack


@pytest.fixture
def honest_vs_eager(config):
    """An honest ReLU's time over eager's, both timed in its own window on this machine now: what a
    clock forger is held to. A ratio, since the two evaluations run apart and a loaded machine slows
    each as a whole (one honest figure was seen 10x slow under the parallel suite)."""
    rec = evaluate(load_task(RELU_LARGE), load_candidate(TESTS / "fixtures" / "honest_relu"), config)
    assert rec.status == "ok", rec.reason
    return rec.candidate_ms / rec.eager_ms


def _paid_by_real_time(rec, honest_vs_eager: float) -> None:
    """A correct ReLU whose process lies about time is paid like an honest one: the figure comes from
    a clock outside its process (its own clock, 1000x slow, would read ~0.001x; 0.1x leaves room
    for a loaded machine's noise)."""
    assert rec.status == "ok", rec.reason
    assert rec.candidate_ms / rec.eager_ms > 0.1 * honest_vs_eager, (rec.candidate_ms, rec.eager_ms, honest_vs_eager)


def test_clocks_rewritten_through_the_python_c_api_change_nothing(tmp_path, config, past_the_symbol_check,
                                                                   honest_vs_eager):
    """time.perf_counter_ns and the timing module's names replaced with a clock 1000x slow."""
    rec = evaluate(load_task(RELU_LARGE), load_candidate(_timer_hack(tmp_path, 1)), config)
    _paid_by_real_time(rec, honest_vs_eager)


def test_libc_clock_rewritten_in_memory_changes_nothing(config, honest_vs_eager):
    """Native code patches libc's clock_gettime (every clock of its process) to run 1000x slow."""
    rec = evaluate(load_task(RELU_LARGE), load_candidate(HACKS / "clock_rewrite"), config)
    _paid_by_real_time(rec, honest_vs_eager)


def test_inputs_predicted_from_the_init_seed_never_come(tmp_path, config, monkeypatch):
    """predicted_inputs was paid 31x (reward 3; `hpc eval` of this folder on the previous protocol)
    when every input derived from the init seed it can read: it answers from a table of predicted
    inputs. Drawn on their own, no input is in its table: it is paid as its twin without the table.
    Each is compared by its ratio to eager timed in its own window, as the reward compares it: the
    two evaluations run apart, and a loaded machine slows one of them as a whole. One OpenMP thread
    a program (the sandbox passes OMP_NUM_THREADS on): with torch's two, eager spun against the other
    test worker's processes and read 11.96 ms in one evaluation and 0.43 in the other (a clean-clone
    run of the suite on 2 cores), which says nothing of the attack."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    twin = tmp_path / "twin"
    shutil.copytree(HACKS / "predicted_inputs", twin)
    model = twin / "model_new.py"
    model.write_text(model.read_text().replace("PREDICT = True", "PREDICT = False"))
    task = load_task(MEAN_ROWS)
    attack, honest = evaluate(task, load_candidate(HACKS / "predicted_inputs"), config), evaluate(
        task, load_candidate(twin), config)
    assert attack.status == "ok" and honest.status == "ok", (attack.reason, honest.reason)
    attack_ratio, honest_ratio = attack.candidate_ms / attack.eager_ms, honest.candidate_ms / honest.eager_ms
    assert attack_ratio > 0.3 * honest_ratio, (attack.candidate_ms, attack.eager_ms, honest.candidate_ms,
                                               honest.eager_ms)


def test_a_call_computed_before_its_clock_starts_is_paid_by_its_real_time(fast_config):
    """early_start's native thread watches the input slot and computes each call's ReLU while the
    harness flushes the cache, before t0 (cpu: the harness publishes the inputs, then flushes);
    the timed call hands the finished result back. Before the candidate was held stopped through
    publish and flush it was paid 11.4x torch.compile and reward 3 (its honest twin: 1.08x, reward
    1). Held by SIGSTOP, a POSIX timer sending it SIGCONT every millisecond (also in early_start)
    undid each stop: level1/08_gelu paid 3.8x and 6.8x eager where its twin is 0.4-0.6x. Held by
    its cgroup's freezer, it is paid by its real time. Each against eager timed in its own window, as the reward
    compares it: the two evaluations run apart. On cuda the copy engines publish the inputs just
    before t0 (docs/security.md, "Computing while its inputs arrive")."""
    task = load_task(RELU_LARGE)
    attack = evaluate(task, load_candidate(HACKS / "early_start"), fast_config)
    honest = evaluate(task, load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config)
    assert attack.status == "ok" and honest.status == "ok", (attack.reason, honest.reason)
    attack_ratio, honest_ratio = attack.candidate_ms / attack.eager_ms, honest.candidate_ms / honest.eager_ms
    assert attack_ratio > 0.5 * honest_ratio, (attack.candidate_ms, attack.eager_ms, honest.candidate_ms,
                                               honest.eager_ms)


def test_a_candidate_that_spins_between_its_calls_does_not_slow_its_baselines(fast_config):
    """baseline_spinner spins whenever its own forward has not run for 15 ms, sending itself SIGCONT
    every millisecond: held by SIGSTOP, eager and torch.compile ran 1.74-1.79x slower in its window.
    Frozen in its cgroup while they run, its baselines run as an honest candidate's do (back to
    back on one machine, alternating twice, each one's least figure: what the machine's other work
    adds to one evaluation is not the candidate's doing)."""
    task = load_task(RELU_LARGE)
    runs: dict[str, list] = {"attack": [], "honest": []}
    for _ in range(2):
        runs["attack"].append(evaluate(task, load_candidate(HACKS / "baseline_spinner"), fast_config))
        runs["honest"].append(evaluate(task, load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config))
    assert all(r.status == "ok" for rs in runs.values() for r in rs), [r.reason for rs in runs.values() for r in rs]
    for figure in ("eager_ms", "compile_ms"):
        attack, honest = (min(getattr(r, figure) for r in runs[k]) for k in ("attack", "honest"))
        assert attack < 1.3 * honest, (figure, attack, honest)


def test_a_program_that_seals_its_input_slot_fails_its_own_call(fast_config):
    """On cpu the input slot is the program's own memory, written by the harness from outside
    (process_vm_writev): a candidate that makes it read-only fails the next call as its own runtime
    error (reward -1), not the harness's, and the harness goes on."""
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "sealed_slot"), fast_config)
    assert rec.status == "failed" and rec.failed_stage == "verify", rec.reason
    assert "could not be written into its input slot" in rec.reason and rec.reward == -1.0


def test_every_seed_is_drawn_on_its_own():
    """No seed a call's inputs come from is the init seed (which the candidate reads) plus an offset,
    and two evaluations share none."""
    from hpc.config import load_config
    from hpc.pipeline import Seeds

    cfg = load_config()
    cfg.timing.processes_cpu = 2   # each process's seeds drawn on their own too

    def drawn(seeds: Seeds) -> list[int]:
        return [seeds.probe, *(s for p in seeds.processes for s in [*(t["seed"] for t in p.trials), *p.timing])]

    a, b = Seeds.draw(cfg), Seeds.draw(cfg)
    assert len(a.processes) == 2 and len(set(drawn(a))) == len(drawn(a))
    assert all(abs(s - a.init) > 1 << 40 for s in drawn(a))
    assert not set(drawn(a)) & set(drawn(b))
    assert all(len(p.checked) == cfg.correctness.timed_checks for p in a.processes)
    assert [p.checked for p in a.processes] != [p.checked for p in b.processes]


def test_hang_is_killed_at_the_timeout(config):
    config.sandbox.timeout_s = 30
    rec = evaluate(load_task(RELU_TASK), load_candidate(HACKS / "hang"), config)
    assert rec.failed_stage == "verify" and "timed out" in rec.reason
    assert rec.reward == -1.0 and rec.wall_seconds < 90


def _write_tamper(workdir: Path, target: Path, payload: str) -> None:
    (workdir / "kernels").mkdir(parents=True)
    (workdir / "model_new.py").write_text((HACKS / "result_reuse" / "model_new.py").read_text()
                                          .replace("kernels.noop(x, x.numel())", "kernels.tamper(x, x.numel())"))
    (workdir / "kernels" / "tamper.cpp").write_text(f"""
#include <cstdint>
#include <cstdio>
extern "C" void tamper(float*, int64_t) {{
    if (FILE* f = std::fopen({json.dumps(str(target))}, "w")) {{ std::fputs({json.dumps(payload)}, f); std::fclose(f); }}
}}
""")


def test_candidate_cannot_rewrite_the_task(tmp_path, fast_config):
    task = tmp_path / "level1" / "relu.py"
    task.parent.mkdir()
    shutil.copy(RELU_TASK, task)
    before = task.read_bytes()
    hack = tmp_path / "tamper"
    _write_tamper(hack, task, "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
                              "        return torch.empty_like(x)\n")
    rec = evaluate(load_task(task), load_candidate(hack), fast_config)
    assert task.read_bytes() == before
    assert rec.failed_stage == "verify" and rec.reward == -1.0


def test_candidate_cannot_rewrite_torch_compiles_cached_code(tmp_path, fast_config):
    """The baselines are timed anew in every evaluation, but their compiled code is cached: a
    candidate that could rewrite it could slow torch.compile down for every later evaluation."""
    task = load_task(RELU_TASK)
    honest = evaluate(task, load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config)
    assert honest.status == "ok", honest.reason
    cached = sorted(p for p in (fast_config.cache_path() / "inductor").rglob("*") if p.is_file())
    assert cached, "torch.compile left nothing in the inductor cache"
    target = cached[-1]
    before = target.read_bytes()
    hack = tmp_path / "tamper"
    _write_tamper(hack, target, "import time; time.sleep(1)")
    evaluate(task, load_candidate(hack), fast_config)
    assert target.read_bytes() == before


def test_honest_workdir_is_paid(config, monkeypatch):
    """On cpu each program timed in 2 processes (timing.processes_cpu), each verified and checked on
    seeds of its own, the figures its fastest one's; on cuda one."""
    config.timing.processes_cpu = 2
    handshakes = []   # the empty program's cost and the least figure that stands out of its noise

    def measured(empty_ns: list[int]) -> tuple[float, float]:
        handshakes.append(handshake_ns(empty_ns))
        return handshakes[-1]

    monkeypatch.setattr(pipeline, "handshake_ns", measured)
    rec = evaluate(load_task(RELU_LARGE), load_candidate(TESTS / "fixtures" / "honest_relu"), config)
    assert rec.status == "ok", rec.reason
    assert rec.correct and rec.compiled and rec.reward >= 1.0
    seeds = json.loads(rec.seeds)
    processes = seeds["processes"]
    assert len(processes) == (2 if config.backend == "cpu" else 1)
    assert rec.trials == 7 * len(processes)   # each process verified on trials of its own
    assert rec.timed_checks == 3 * len(processes) * seeds["burst"]   # every call of 3 frames in each
    assert rec.candidate_ms > 0 and rec.eager_ms > 0 and rec.compile_ms > 0
    assert rec.min_bytes > 0 and (rec.backend == "cpu" or rec.candidate_ms > rec.floor_ms)
    rounds = json.loads(rec.config)["timing"]["rounds"]   # the speedups are read round by round, from the frames kept
    assert len(rec.eager_times_ms) == len(rec.compile_times_ms) == len(rec.candidate_times_ms)
    assert rec.speedup_eager == paired_ratio(rec.eager_times_ms, rec.candidate_times_ms, rounds)
    assert rec.speedup_compile == paired_ratio(rec.compile_times_ms, rec.candidate_times_ms, rounds)
    for own in processes:
        assert len(own["trials"]) == 7 and {t["distribution"] for t in own["trials"]} == {"default", "wide", "small"}
        assert len(own["timing"]) == 2 + 20 // len(processes) and len(own["timed_checks"]) == 3
    drawn = [s for own in processes for s in [*own["timing"], *(t["seed"] for t in own["trials"])]]
    assert len(set(drawn)) == len(drawn)   # no process sees another's inputs again
    assert len(rec.candidate_times_ms) == 20 // len(processes)   # the fastest process's frames
    conditions = json.loads(rec.conditions)
    for program in ("candidate", "eager", "compile:default"):
        medians = conditions[program]["process_medians_ms"]
        assert len(medians) == len(processes) and medians[conditions[program]["timed_in_process"]] == min(medians)
    assert conditions["candidate"]["process_medians_ms"][conditions["candidate"]["timed_in_process"]] == round(
        rec.candidate_ms, 6)
    stages = json.loads(rec.stage_seconds)    # the stages, and the device lock's waits and exclusive hold
    assert {"compile", "load", "verify", "profile"} <= set(stages)
    assert 0 < stages["lock_held_exclusive"] <= stages["load"] + stages["profile"] and stages["lock_wait_shared"] >= 0
    # the handshake's cost, measured on the empty program, is taken off where the calls stand out of its
    # noise; else the outside-clock times are the figures (a loaded machine's noise: a millisecond and more)
    ((overhead_ns, resolution_ns),) = handshakes
    raw_ms = [t + rec.overhead_ms for t in rec.candidate_times_ms]
    least_ms = max(0.0 if math.isnan(rec.floor_ms) else rec.floor_ms, resolution_ns / 1e6)
    stands_out = statistics.median(raw_ms) - overhead_ns / 1e6 >= least_ms
    assert overhead_ns > 0 and rec.overhead_ms == (overhead_ns / 1e6 if stands_out else 0.0)
    if config.backend == "cuda":   # graph replays, the GPU machine alone: its noise is microseconds, a call's 0.1 ms
        assert stands_out, (rec.candidate_times_ms, overhead_ns, resolution_ns)


@pytest.mark.slow
def test_honest_load_inline_single_file_is_paid(fast_config):
    """KernelBench's own format: compiled on first load (torch headers, slow), cached by content after."""
    candidate = load_candidate(TESTS / "fixtures" / "honest_relu_inline.py")
    first = evaluate(load_task(RELU_TASK), candidate, fast_config)
    assert first.status == "ok", first.reason
    assert first.correct and first.reward >= 1.0
    second = evaluate(load_task(RELU_TASK), candidate, fast_config)
    assert second.status == "ok" and second.wall_seconds < first.wall_seconds


def test_a_candidate_that_forges_only_in_a_later_process_is_rejected(fast_config):
    """Each program timed in 2 processes, its figure its fastest one's: a candidate honest in the
    process verified first and fast and wrong in the next (it tells them apart by a file in the one
    folder they share, its load_inline build folder) would be paid the second's time were that
    process not verified too."""
    fast_config.timing.processes_cpu = 2
    rec = evaluate(load_task(RELU_TASK), load_candidate(HACKS / "later_process.py"), fast_config)
    assert rec.failed_stage == "verify" and "of process 1" in rec.reason and "outside atol" in rec.reason, rec.reason
    assert rec.reward == -1.0 and not rec.correct


def test_a_time_below_the_hardware_floor_is_rejected(fast_config):
    """With ceilings that make ReLU's bytes take seconds, any real measurement is 'too fast'."""
    fast_config.floor.bandwidth_gb_s_cpu = 1e-6
    rec = evaluate(load_task(RELU_TASK), load_candidate(TESTS / "fixtures" / "honest_relu"), fast_config)
    assert rec.failed_stage == "profile" and "below the hardware floor" in rec.reason
    assert rec.min_bytes == 2 * 4 * (1 << 16) and rec.flops == 0.0 and rec.floor_ms > 1e3

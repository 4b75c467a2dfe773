"""Every shipped task has an honest CPU solution that passes the full pipeline (they are also SFT data)."""

from __future__ import annotations

import pytest

from hpc.candidate import load_candidate
from hpc.pipeline import evaluate
from hpc.suite import find_candidate, summary_table
from hpc.task import discover_tasks
from tests.conftest import ROOT

TASKS = discover_tasks(ROOT / "kernels" / "tasks")
SOLUTIONS = ROOT / "kernels" / "solutions"


def test_every_task_has_a_solution():
    assert [t.task_id for t in TASKS if find_candidate(t, SOLUTIONS) is None] == []


# Solutions far faster than eager on any x86 CPU (5x and more on the CPU machines measured,
# docs/benchmarks.md): every stage of the reward runs for them, and most must earn a speedup.
REWARDED = ("level1/07_rmsnorm", "level1/10_maxpool2d", "level2/06_layernorm_gelu_residual",
            "level2/07_swish_scale_add")


@pytest.mark.slow
def test_every_solution_is_correct_and_the_fastest_earn_a_speedup_reward(fast_config):
    """Every solution through compile, load and correctness (the baselines' compiles, a minute a
    task on two cores, are spent only on the rewarded few)."""
    assert set(REWARDED) <= {t.task_id for t in TASKS}
    records = [evaluate(t, load_candidate(find_candidate(t, SOLUTIONS)), fast_config,
                        stop_after="profile" if t.task_id in REWARDED else "verify") for t in TASKS]
    print(summary_table(records))
    failed = [(r.task_id, r.failed_stage, r.reason) for r in records if r.status != "ok"]
    assert failed == []
    assert all(r.correct for r in records)
    rewarded = [r for r in records if r.task_id in REWARDED]
    assert all(r.reward >= 1 for r in rewarded)
    assert sum(r.reward >= 2 for r in rewarded) >= 3, summary_table(rewarded)


def test_copies_of_a_shared_kernel_header_are_identical():
    """Workdirs are self-contained, so a header several solutions use lives in each: one version."""
    by_name: dict[str, set[bytes]] = {}
    for pattern in ("*/*/kernels/*.cuh", "*/*/kernels/*.h"):
        for header in SOLUTIONS.glob(pattern):
            by_name.setdefault(header.name, set()).add(header.read_bytes())
    assert {"vmath.h", "gemm.h", "conv.h"} <= by_name.keys()
    assert [name for name, versions in by_name.items() if len(versions) > 1] == []

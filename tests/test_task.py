"""Task files: validation, scales, and that every shipped task loads and runs at CPU scale."""

from __future__ import annotations

import pytest
import torch

from hpc.errors import TaskError
from hpc.task import BadTask, discover_suite, discover_tasks, load_task, load_task_module
from tests.conftest import RELU_TASK, ROOT

SUITE = ROOT / "kernels" / "tasks"


def test_relu_fixture_declares_a_cpu_scale():
    task = load_task(RELU_TASK)
    assert task.task_id == "level1/relu" and task.level == 1 and task.declared_scales == ("cpu",)
    assert load_task_module(RELU_TASK, "cpu").n == 1 << 16
    assert load_task_module(RELU_TASK, "gpu").n == 1 << 26


def test_plain_kernelbench_file_runs_at_its_own_sizes(tmp_path):
    plain = tmp_path / "19_ReLU.py"
    plain.write_text(RELU_TASK.read_text().split("SCALES")[0])
    task = load_task(plain)
    assert task.declared_scales == () and task.level == 0
    assert load_task_module(plain, "cpu").n == load_task_module(plain, "gpu").n == 1 << 26


@pytest.mark.parametrize("text, words", [
    ("def get_inputs(): pass\n", "missing Model"),
    ("class Model:\n  pass\ndef get_inputs(:\n", "syntax error"),
    ("class Model: pass\ndef get_inputs(): pass\ndef get_init_inputs(): pass\nSCALES = {'tpu': {}}\n", "tpu"),
    ("class Model: pass\ndef get_inputs(): pass\ndef get_init_inputs(): pass\nSCALES = [1]\n", "SCALES"),
])
def test_malformed_tasks_are_user_errors(tmp_path, text, words):
    path = tmp_path / "t.py"
    path.write_text(text)
    with pytest.raises(TaskError, match=words):
        load_task(path)


def test_a_suite_keeps_its_malformed_tasks_in_place_and_refuses_a_second_task_id(tmp_path):
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "a.py").write_text(RELU_TASK.read_text())
    (tmp_path / "level1" / "b.py").write_text("class Model:\n  pass\ndef get_inputs(:\n")
    (tmp_path / "x" / "level1").mkdir(parents=True)
    (tmp_path / "x" / "level1" / "a.py").write_text(RELU_TASK.read_text())
    suite = discover_suite(tmp_path)
    assert [(type(t).__name__, t.task_id) for t in suite] == [
        ("Task", "level1/a"), ("BadTask", "level1/b"), ("BadTask", "level1/a")]
    assert "b.py: syntax error at line 3" in suite[1].reason and suite[1].level == 1
    assert suite[2].reason.endswith(f"task id level1/a is also {tmp_path / 'level1' / 'a.py'}")
    with pytest.raises(TaskError, match="b.py: syntax error"):   # callers that need every task whole
        discover_tasks(tmp_path)
    assert isinstance(discover_suite(tmp_path / "level1" / "b.py")[0], BadTask)


def test_shipped_suite_has_the_promised_size():
    tasks = discover_tasks(SUITE)
    by_level = {lv: [t for t in tasks if t.level == lv] for lv in (1, 2, 3)}
    assert len(by_level[1]) >= 12 and len(by_level[2]) >= 8 and len(by_level[3]) >= 3
    assert all("cpu" in t.declared_scales for t in tasks)


@pytest.mark.parametrize("task", discover_tasks(SUITE), ids=lambda t: t.task_id)
def test_shipped_task_is_deterministic_and_input_dependent_at_cpu_scale(task):
    module = load_task_module(task.path, "cpu", module_name=f"t_{task.name}")
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).eval()
    with torch.no_grad():
        torch.manual_seed(1)
        x1 = module.get_inputs()
        torch.manual_seed(2)
        x2 = module.get_inputs()
        a, b, c = model(*x1), model(*x1), model(*x2)
    a, b, c = [o if isinstance(o, tuple) else (o,) for o in (a, b, c)]
    assert all(torch.equal(p, q) for p, q in zip(a, b)), "forward is not deterministic"
    assert any(not torch.allclose(p, q) for p, q in zip(a, c)), "output does not depend on the inputs"
    assert all(p.std() > 0 for p in a if p.numel() > 1), "output is constant"

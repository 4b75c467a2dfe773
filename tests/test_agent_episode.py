"""Whole episodes on the CPU backend, driven by a replayed script of replies, rewarded by the real
evaluator: a shipped task written through the tools and verified, profiled and paid; best-state
against final-state selection; single-turn mode; and the ways an episode ends (finish, the turn
limit, the context limit, a loop, a reply without a tool call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.agent.backend import LocalBackend
from hpc.agent.config import agent_config
from hpc.agent.episode import Episode
from hpc.agent.policy import ReplayPolicy
from hpc.task import load_task
from tests.conftest import ROOT, make_fast_config

TASK = ROOT / "kernels" / "tasks" / "level1" / "12_mean_dim.py"
SOLUTION = ROOT / "kernels" / "solutions" / "level1" / "12_mean_dim"
KERNEL = (SOLUTION / "kernels" / "reduce.cpp").read_text()
MODEL_NEW = (SOLUTION / "model_new.py").read_text()


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def small_eval_config(cache_dir: Path):
    """The real pipeline, cut to the fewest trials and timed calls that still exercise every stage."""
    cfg = make_fast_config(cache_dir)
    cfg.correctness.trials, cfg.correctness.distributions, cfg.correctness.timed_checks = 2, [], 2
    cfg.timing.warmup, cfg.timing.iterations, cfg.timing.calibration_calls = 1, 10, 10
    cfg.validate()
    return cfg


@pytest.fixture
def backend(cache_dir):
    return LocalBackend(small_eval_config(cache_dir))


def run(tmp_path: Path, backend, replies: list[str], **cfg) -> tuple[Episode, ReplayPolicy]:
    policy = ReplayPolicy(replies)
    root = tmp_path / f"episode-{len(list(tmp_path.iterdir()))}"
    episode = Episode(load_task(TASK), backend, agent_config(**cfg), root)
    episode.run(policy)
    return episode, policy


SOLVE_THEN_BREAK = [
    "<think>Column means: one pass over the rows.</think>" + call("read_file", path="model.py"),
    call("write_file", path="kernels/reduce.cpp", content=KERNEL)
    + call("write_file", path="model_new.py", content=MODEL_NEW.replace("kernels.sum_mid(", "kernels.sum_middle(")),
    call("compile") + call("verify"),
    call("edit_file", path="model_new.py", old_text="sum_middle", new_text="sum_mid") + call("verify"),
    call("profile"),
    call("write_file", path="model_new.py", content="import torch\n\nclass ModelNew(torch.nn.Module:\n"),
    call("finish"),
]


@pytest.mark.slow
@pytest.mark.parametrize("state", ["best", "final"])
def test_an_episode_that_writes_the_solution_is_paid_by_the_evaluator(tmp_path, backend, state):
    """Written through the tools, fixed after a failed verify, profiled, then broken at the end:
    the best state (the profiled one) earns >= 1, the final (broken) state -1."""
    episode, policy = run(tmp_path, backend, SOLVE_THEN_BREAK, state=state)
    traj = episode.finish()
    events = {(t.index, e.name): e for t in traj.turns for e in t.events}
    assert traj.end_reason == "finished" and policy.calls == len(SOLVE_THEN_BREAK)
    seen = {key: e.observation for key, e in events.items()}
    assert events[(3, "compile")].ok and "compiled" in events[(3, "compile")].observation, seen
    assert not events[(3, "verify")].ok and "sum_middle" in events[(3, "verify")].observation, seen
    assert events[(4, "verify")].ok and "correct:" in events[(4, "verify")].observation, seen
    profile = events[(5, "profile")]
    assert profile.ok and profile.reward >= 1 and "speedup" in profile.observation, seen
    assert profile.state == events[(4, "verify")].state != traj.final_state
    assert traj.final_reward == -1.0
    assert [(e.turn, e.correct) for e in traj.evaluations] == [(5, True), (0, False)]
    if state == "best":
        assert traj.selected_state == profile.state and traj.reward == profile.reward >= 1
        assert traj.record["correct"] and traj.record["status"] == "ok"
        assert "sum_mid(" in traj.record["candidate_source"]
    else:
        assert traj.selected_state == traj.final_state and traj.reward == -1.0
        assert traj.record["failed_stage"] == "static" and "syntax error" in traj.record["reason"]
    assert json.loads(json.dumps(traj.to_dict()))["reward"] == traj.reward
    episode.close()
    assert not episode.workdir.root.exists()


@pytest.mark.slow
def test_best_state_can_be_paid_by_a_fresh_evaluation(tmp_path, backend):
    """rescore_best: the chosen state is evaluated again, so a lucky timing of one profile call is
    not what pays."""
    replies = [SOLVE_THEN_BREAK[1].replace("sum_middle", "sum_mid"), call("profile"), SOLVE_THEN_BREAK[5],
               call("finish")]
    episode, _ = run(tmp_path, backend, replies, state="best", rescore_best=True, observation_role="tool")
    traj = episode.finish()
    profiled = episode.toolbox.records[(traj.turns[1].events[0].state, "profile")]
    assert traj.selected_state == traj.turns[1].events[0].state and traj.final_reward == -1.0
    assert traj.record["correct"] and traj.reward >= 1, traj.record["reason"]
    assert traj.record["timestamp"] > profiled.timestamp          # a new evaluation, not the profile's record
    assert traj.eval_record().reward == traj.reward
    assert [m["role"] for m in traj.messages[2:5]] == ["assistant", "tool", "assistant"]


@pytest.mark.slow
def test_single_turn_mode_evaluates_the_one_reply(tmp_path, backend):
    reply = ("Here is the whole solution.\n" + call("write_file", path="kernels/reduce.cpp", content=KERNEL)
             + call("write_file", path="model_new.py", content=MODEL_NEW) + call("profile"))
    episode, policy = run(tmp_path, backend, [reply, call("finish")], mode="single_turn")
    traj = episode.finish()
    assert traj.end_reason == "single_turn" and policy.calls == 1 and len(traj.turns) == 1
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant"]
    assert "Write the whole solution in this one reply" in traj.messages[0]["content"]
    assert "## Tools" not in traj.messages[0]["content"]
    assert [(e.name, e.ok, e.error) for e in traj.turns[0].events] == [
        ("write_file", True, ""), ("write_file", True, ""), ("profile", False, "not_run")]
    assert traj.reward >= 1 and traj.record["correct"], traj.record["reason"]


def test_malformed_and_unknown_calls_are_observations_and_the_episode_goes_on(tmp_path, backend):
    replies = ['<tool_call>{"name": "read_file", "arguments": {"path": "model.py"</tool_call>',
               call("run_python", code="print(1)") + call("write_file", path="notes.txt"),
               "<tool_call>" + call("read_file", path="model.py"),
               call("read_file", path="model.py"),
               call("finish")]
    episode, policy = run(tmp_path, backend, replies)
    traj = episode.finish()
    assert policy.calls == 5 and traj.end_reason == "finished"
    assert (traj.malformed_calls, traj.unknown_tool_calls, traj.bad_argument_calls) == (2, 1, 1)
    assert "not valid JSON" in traj.messages[3]["content"]
    assert "unknown tool 'run_python'" in traj.messages[5]["content"]
    assert "missing argument 'content'" in traj.messages[5]["content"]
    assert "class Model(nn.Module)" in traj.messages[9]["content"]
    # the untouched starter: its forward is unwritten and kernels/ is empty
    assert traj.reward == -1.0 and traj.record["failed_stage"] == "compile"


def test_the_turn_limit_ends_the_episode(tmp_path, backend):
    replies = [call("bash", command=f"echo turn {k}") for k in range(10)]
    episode, policy = run(tmp_path, backend, replies, max_turns=3)
    traj = episode.finish()
    assert traj.end_reason == "max_turns" and len(traj.turns) == 3 and policy.calls == 3
    assert "turn 2" in traj.messages[-1]["content"]
    with pytest.raises(RuntimeError, match="max_turns"):
        episode.step(replies[3])


def test_the_context_limit_counts_with_the_given_tokenizer(tmp_path, backend):
    counted: list[str] = []

    def chars(text: str) -> int:
        counted.append(text)
        return len(text)

    episode = Episode(load_task(TASK), backend, agent_config(max_context_tokens=24000, max_response_tokens=2000),
                      tmp_path / "episode", count_tokens=chars)
    start = episode.context_tokens()
    assert start == sum(len(m["content"]) + 4 for m in episode.messages)
    policy = ReplayPolicy([call("read_file", path="INSTRUCTIONS.md")] * 3 + [call("finish")])
    traj = episode.run(policy)
    assert traj.end_reason == "context" and policy.calls < 4
    assert episode.context_tokens() + 2000 > 24000 >= traj.turns[-1].prompt_tokens + 2000
    assert len(counted) == len(traj.messages)                 # each message counted once


@pytest.mark.parametrize("stop", [True, False])
def test_the_same_call_repeated_is_a_loop(tmp_path, backend, stop):
    replies = [call("read_file", path="model.py")] * 4 + [call("finish")]
    episode, policy = run(tmp_path, backend, replies, loop_repeats=3, stop_on_loop=stop)
    traj = episode.finish()
    assert traj.loop_detected and traj.turns[2].loop and not traj.turns[1].loop
    if stop:
        assert traj.end_reason == "loop" and policy.calls == 3
        assert traj.turns[2].events[0].error == "not_run"
    else:
        assert traj.end_reason == "finished" and policy.calls == 5
        assert "3 times in a row" in traj.messages[-4]["content"] and "4 times in a row" in traj.messages[-2]["content"]


def test_a_reply_without_a_tool_call_ends_the_episode_or_gets_a_reminder(tmp_path, backend):
    episode, policy = run(tmp_path, backend, ["I am done.", call("finish")])
    assert episode.finish().end_reason == "no_tool_call" and policy.calls == 1
    episode, policy = run(tmp_path, backend, ["I am done.", call("finish")], end_without_tool_call=False)
    assert episode.finish().end_reason == "finished" and policy.calls == 2
    assert "No tool call found" in episode.messages[3]["content"]

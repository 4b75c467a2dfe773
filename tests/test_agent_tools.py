"""The agent environment's parts without a policy model: the tool-call parser, the config, the
episode workdir, file tools confined to it, protected files, and the sandboxed bash tool.

Episodes here are stepped by hand and never finished, so no evaluation runs: these take seconds.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

import pytest

from hpc.agent.backend import LocalBackend
from hpc.agent.config import agent_config, load_agent_config
from hpc.agent.episode import Episode
from hpc.agent.toolcall import CallError, ToolCall, parse_tool_calls, render_result, truncate
from hpc.agent.tools import TOOLS
from hpc.agent.workdir import starter_model_new
from hpc.errors import UserError
from hpc.sandbox.process import isolation_support
from hpc.task import load_task
from hpc.verify.static import source_defect
from tests.conftest import ROOT, accepting, make_fast_config

TASK = ROOT / "kernels" / "tasks" / "level1" / "12_mean_dim.py"


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def episode(tmp_path, cache_dir):
    """An episode whose bash commands time out after 5 s (the timeout tests wait that long)."""
    ep = Episode(load_task(TASK), LocalBackend(make_fast_config(cache_dir)), agent_config(bash={"timeout_s": 5.0}),
                 tmp_path / "episode")
    yield ep
    ep.close()


@pytest.fixture
def patient_episode(tmp_path, cache_dir):
    """An episode with the default bash timeout, for commands that build and import torch: on a
    machine loaded by other test workers they take longer than 5 s."""
    ep = Episode(load_task(TASK), LocalBackend(make_fast_config(cache_dir)), agent_config(), tmp_path / "episode")
    yield ep
    ep.close()


def last_events(ep: Episode):
    return ep.turns[-1].events


# -- the tool-call format ------------------------------------------------------------------------
def test_parser_reads_every_block_in_order_and_ignores_reasoning():
    reply = ("<think>maybe " + call("bash", command="rm -rf kernels") + "</think>Plan: write, then check.\n"
             + call("write_file", path="kernels/a.cpp", content="int x;\n") + "\ntext between\n"
             + '<tool_call>```json\n{"name": "compile", "arguments": {}}\n```</tool_call>'
             + '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"model.py\\"}"}</tool_call>'
             + '<tool_call>{"name": "write_file", "arguments": {"path": "b.py", "content": "a\nb"}}</tool_call>')
    calls = parse_tool_calls(reply, TOOLS)
    assert [c.name for c in calls] == ["write_file", "compile", "read_file", "write_file"]
    assert all(isinstance(c, ToolCall) for c in calls)
    assert calls[0].arguments == {"path": "kernels/a.cpp", "content": "int x;\n"}
    assert calls[2].arguments == {"path": "model.py"}          # arguments as a JSON string
    assert calls[3].arguments["content"] == "a\nb"             # a raw newline inside a string


@pytest.mark.parametrize("block, kind, words", [
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "malformed", "not valid JSON"),
    ('<tool_call>["bash"]</tool_call>', "malformed", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "malformed", "no \"name\""),
    ('<tool_call>{"name": "bash", "args": {}}</tool_call>', "malformed", "unexpected key"),
    ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "malformed", "must be a JSON object"),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "malformed", "no closing"),
    ('<tool_call>{"name": "run_python", "arguments": {}}</tool_call>', "unknown_tool", "unknown tool 'run_python'"),
    ('<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>', "bad_arguments",
     "missing argument 'content'"),
    ('<tool_call>{"name": "compile", "arguments": {"fast": true}}</tool_call>', "bad_arguments",
     "unexpected argument(s) 'fast'"),
    ('<tool_call>{"name": "read_file", "arguments": {"path": "a", "start_line": "3"}}</tool_call>',
     "bad_arguments", "'start_line' must be an integer, got string"),
    ('<tool_call>{"name": "read_file", "arguments": {"path": "a", "end_line": true}}</tool_call>',
     "bad_arguments", "must be an integer, got boolean"),
])
def test_parser_turns_every_bad_block_into_an_error_that_says_why(block, kind, words):
    (parsed,) = parse_tool_calls(block, TOOLS)
    assert isinstance(parsed, CallError) and parsed.kind == kind
    assert words in parsed.message


def test_an_unclosed_block_does_not_swallow_the_next_one():
    calls = parse_tool_calls('<tool_call>{"name": "compile"' + call("verify"), TOOLS)
    assert isinstance(calls[0], CallError) and "no closing" in calls[0].message
    assert isinstance(calls[1], ToolCall) and calls[1].name == "verify"


def test_long_results_keep_their_start_and_end():
    text = "first line\n" + "x" * 50_000 + "\nlast line"
    cut = truncate(text, 1000)
    assert len(cut) <= 1000 and cut.startswith("first line") and cut.endswith("last line")
    omitted = int(cut.split("[... ")[1].split(" ")[0])
    marker = f"\n[... {omitted} characters omitted ...]\n"
    assert marker in cut and omitted == len(text) - (len(cut) - len(marker))
    rendered = render_result('bad"name', "body", False, 100)
    assert rendered.startswith('<tool_result name="?" status="error">')


# -- config ------------------------------------------------------------------------------------
def test_presets_carry_the_papers_turn_limits_and_errors_name_the_key(tmp_path):
    assert agent_config(preset="train").max_turns == 150
    assert agent_config(preset="eval").max_turns == 200
    assert agent_config().max_turns < 150 and agent_config().preset == "tiny"
    f = tmp_path / "agent.yaml"
    f.write_text("preset: train\nmax_turns: 40\nbash:\n  memory_gb: 4\n")
    cfg = load_agent_config(f)
    assert (cfg.max_turns, cfg.max_context_tokens, cfg.bash.memory_gb, cfg.bash.timeout_s) == (40, 131072, 4.0, 120.0)
    for text, key in (("max_turnz: 3\n", "agent.max_turnz"), ("bash:\n  timeout_s: soon\n", "agent.bash.timeout_s"),
                      ("state: luckiest\n", "agent.state"), ("max_turns: 0\n", "agent.max_turns"),
                      ("preset: huge\n", "agent.preset"), ("loop_repeats: 1\n", "agent.loop_repeats")):
        f.write_text(text)
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            load_agent_config(f)


# -- the workdir -------------------------------------------------------------------------------
def test_the_workdir_holds_the_task_instructions_and_a_starter_that_passes_the_rules(episode):
    work = episode.workdir.work
    assert (work / "model.py").read_bytes() == TASK.read_bytes()
    instructions = (work / "INSTRUCTIONS.md").read_text()
    assert "## Reward" in instructions and "<tool_call>" in instructions
    assert episode.messages[0]["content"] == (work / "INSTRUCTIONS.md").read_text()
    assert TASK.read_text() in episode.messages[1]["content"]
    assert list((work / "kernels").iterdir()) == []
    starter = (work / "model_new.py").read_text()
    assert "def __init__(self, dim):" in starter and "self.dim = dim" in starter
    assert source_defect(starter, "model_new.py") == ""
    for name in ("model.py", "INSTRUCTIONS.md"):
        assert not os.stat(work / name).st_mode & 0o222
    with pytest.raises(FileExistsError, match="its own folder"):
        Episode(episode.task, episode.backend, episode.cfg, episode.workdir.root)


def test_the_cpu_instructions_say_how_to_make_a_time_repeat(cache_dir):
    """A CPU kernel's scratch from malloc falls at an offset each process draws anew (docs/benchmarks.md):
    the CPU instructions say to align it; the CUDA ones, where allocations are aligned, do not."""
    import dataclasses

    from hpc.agent.instructions import render_instructions

    cpu = make_fast_config(cache_dir)
    assert "std::aligned_alloc(64, bytes)" in render_instructions(cpu, agent_config())
    assert "aligned_alloc" not in render_instructions(dataclasses.replace(cpu, backend="cuda"), agent_config())


def test_every_shipped_tasks_starter_passes_the_static_rules():
    for task in sorted((ROOT / "kernels" / "tasks").rglob("*.py")):
        assert source_defect(starter_model_new(task.read_text(), task.stem), "model_new.py") == "", task


def test_file_tools_stay_inside_the_workdir(episode, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP-SECRET-CONTENT")
    (episode.workdir.work / "link").symlink_to(outside)
    (episode.workdir.work / "inner").symlink_to("kernels")
    episode.step(call("read_file", path=str(outside / "secret.txt"))
                 + call("read_file", path="../../outside/secret.txt")
                 + call("read_file", path="link/secret.txt") + call("write_file", path="link/new.txt", content="x")
                 + call("write_file", path="kernels/../../escape.txt", content="x")
                 + call("write_file", path="inner/ok.cpp", content="int ok;\n"))
    events = last_events(episode)
    assert [e.ok for e in events] == [False, False, False, False, False, True]
    assert "absolute paths are not allowed" in events[0].observation
    assert "'..' is not allowed" in events[1].observation and "'..' is not allowed" in events[4].observation
    assert "outside the workdir" in events[2].observation and "outside the workdir" in events[3].observation
    assert not (outside / "new.txt").exists() and not (episode.workdir.root / "escape.txt").exists()
    assert (episode.workdir.work / "kernels" / "ok.cpp").read_text() == "int ok;\n"   # a link inside is fine
    assert not episode.done                                    # refusals are observations
    assert "TOP-SECRET-CONTENT" not in episode.messages[-1]["content"]


def test_protected_files_refuse_edits_and_are_restored_after_a_command(episode):
    work = episode.workdir.work
    original, instructions = (work / "model.py").read_bytes(), (work / "INSTRUCTIONS.md").read_bytes()
    episode.step(call("write_file", path="model.py", content="class Model: pass\n")
                 + call("edit_file", path="INSTRUCTIONS.md", old_text="Reward", new_text="Prize")
                 + call("write_file", path="./kernels/../model.py", content="x"))
    events = last_events(episode)
    assert not any(e.ok for e in events)
    assert "protected" in events[0].observation and "protected" in events[1].observation
    episode.step(call("bash", command="chmod u+w model.py && echo 'tampered' > model.py; rm -f INSTRUCTIONS.md; "
                                      "ln -s /etc/passwd INSTRUCTIONS.md; cat model.py"))
    (event,) = last_events(episode)
    assert "tampered" in event.observation                     # the command did change it ...
    assert "protected; your change to it was reverted" in event.observation
    assert event.restored == ["model.py", "INSTRUCTIONS.md"]
    assert (work / "model.py").read_bytes() == original         # ... and it was put back
    assert not (work / "INSTRUCTIONS.md").is_symlink() and (work / "INSTRUCTIONS.md").read_bytes() == instructions
    episode.step(call("bash", command="ln model.py hard.py && echo linked"))
    assert "linked" in last_events(episode)[0].observation
    inode = (work / "model.py").stat().st_ino
    episode.step(call("write_file", path="hard.py", content="through a hard link\n"))
    (event,) = last_events(episode)
    assert event.ok and "reverted" not in event.observation     # the write replaced the link, not model.py
    assert (work / "model.py").stat().st_ino == inode and (work / "model.py").read_bytes() == original


def test_edit_file_needs_one_exact_match(episode):
    episode.step(call("write_file", path="kernels/k.cpp", content="int a = 1;\nint b = 1;\n")
                 + call("edit_file", path="kernels/k.cpp", old_text="= 1;", new_text="= 2;")
                 + call("edit_file", path="kernels/k.cpp", old_text="int c", new_text="int d")
                 + call("edit_file", path="kernels/k.cpp", old_text="int b = 1;", new_text="int b = 3;")
                 + call("read_file", path="kernels/k.cpp", start_line=2, end_line=2))
    events = last_events(episode)
    assert [e.ok for e in events] == [True, False, False, True, True]
    assert "occurs 2 times" in events[1].observation and "not found" in events[2].observation
    assert events[4].observation.endswith("int b = 3;\n")


# -- bash --------------------------------------------------------------------------------------
needs_isolation = pytest.mark.skipif(
    not (isolation_support()["landlock_abi"] and isolation_support()["network_namespace"]),
    reason="needs Landlock and network namespaces")


@needs_isolation
def test_bash_runs_in_the_workdir_and_cannot_write_outside_it(episode, tmp_path):
    target = tmp_path / "written-by-bash.txt"
    episode.step(call("bash", command=f"pwd; echo hi > kernels/made.txt && echo inside-ok; "
                                      f"echo x > {target} || echo outside-refused; "
                                      f"touch {episode.workdir.snapshots}/x || echo snapshots-refused"))
    (event,) = last_events(episode)
    assert event.observation.splitlines()[1] == str(episode.workdir.work)
    assert "inside-ok" in event.observation and "outside-refused" in event.observation
    assert "snapshots-refused" in event.observation
    assert (episode.workdir.work / "kernels" / "made.txt").exists() and not target.exists()


@needs_isolation
def test_bash_reads_only_the_system_python_the_toolkit_and_the_episode(patient_episode, tmp_path):
    """No peeking at the shipped solutions, the tests or another episode; the toolchain still works:
    model_new.py builds its kernels and runs under torch exactly as a developer would try it."""
    solution = ROOT / "kernels" / "solutions" / "level1" / "12_mean_dim"
    (tmp_path / "other-episode.txt").write_text("someone else's kernel")
    work = patient_episode.workdir.work
    (work / "kernels" / "reduce.cpp").write_text((solution / "kernels" / "reduce.cpp").read_text())
    (work / "model_new.py").write_text((solution / "model_new.py").read_text())
    patient_episode.step(call("bash", command=f"cat {solution}/model_new.py > /dev/null && echo solution-read; "
                                              f"cat {tmp_path}/other-episode.txt || echo other-refused; "
                                              f"ls {ROOT}/tests > /dev/null || echo tests-refused; "
                                              "python -c 'import torch, model_new; "
                                              "print(model_new.ModelNew(0)(torch.ones(4, 3)))'"))
    (event,) = last_events(patient_episode)
    assert "solution-read" not in event.observation and "someone else" not in event.observation
    assert "other-refused" in event.observation and "tests-refused" in event.observation
    assert "tensor([1., 1., 1.])" in event.observation, event.observation


@needs_isolation
def test_bash_has_no_network(episode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    with accepting(server) as accepted:
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
        episode.step(call("bash", command=f'python -c "{connect}" && echo connected || echo no-connection'))
    (event,) = last_events(episode)
    assert "no-connection" in event.observation and not accepted


@needs_isolation
def test_bash_is_killed_at_its_time_limit_with_everything_it_started(episode):
    work = episode.workdir.work
    t0 = time.monotonic()
    episode.step(call("bash", command="(sleep 7; echo late > late.txt) & echo started; sleep 60"))
    (event,) = last_events(episode)
    assert time.monotonic() - t0 < 20
    assert not event.ok and "timed out after 5 s" in event.observation and "started" in event.observation
    episode.step(call("bash", command="(sleep 1; echo late > late2.txt) & setsid bash -c "
                                      "'sleep 1; echo late > late3.txt' > /dev/null 2>&1 & sleep 0.5; echo quick"))
    assert last_events(episode)[0].ok
    time.sleep(max(0.0, t0 + 8.5 - time.monotonic()))
    assert not any((work / f"late{k}.txt").exists() for k in ("", "2", "3"))   # nothing outlived its call


@needs_isolation
def test_bash_cannot_read_the_harness_environment(episode):
    from tests.test_confinement import process_with_secret_environment

    with process_with_secret_environment() as (helper, canary):
        episode.step(call("bash", command=f"cat /proc/{os.getpid()}/environ || echo harness-refused; "
                                          f"cat /proc/{helper}/environ || echo helper-refused; cat /proc/*/environ"))
    (event,) = last_events(episode)
    assert "harness-refused" in event.observation and "helper-refused" in event.observation
    assert canary not in event.observation


@needs_isolation
def test_bash_cannot_connect_to_a_host_unix_socket(episode, tmp_path):
    from tests.test_confinement import unix_server

    with unix_server(tmp_path) as (path, accepted):
        connect = f"import socket; socket.socket(socket.AF_UNIX).connect('{path}')"
        episode.step(call("bash", command=f'python -c "{connect}" && echo connected || echo no-connection'))
    (event,) = last_events(episode)
    assert "no-connection" in event.observation and "PermissionError" in event.observation and not accepted


@needs_isolation
def test_bash_creates_no_socket_of_any_family(episode):
    """AF_VSOCK, AF_NETLINK, AF_PACKET and every other family: EACCES (13) from the filter."""
    from tests.test_confinement import OPEN_EVERY_FAMILY

    script = episode.workdir.work / "families.py"
    script.write_text(OPEN_EVERY_FAMILY + "\nprint('FAMILIES', sorted({e for v in got.values() for e in v}, key=str))\n")
    episode.step(call("bash", command="python families.py"))
    (event,) = last_events(episode)
    assert "FAMILIES [13]" in event.observation, event.observation


@needs_isolation
def test_a_setsid_daemon_does_not_outlive_its_bash_call(episode):
    from tests.test_confinement import host_processes_with

    marker = f"{4000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9}"
    episode.step(call("bash", command=f"(setsid sleep {marker} > /dev/null 2>&1 &); sleep 0.3; echo spawned"))
    assert "spawned" in last_events(episode)[0].observation
    assert host_processes_with(marker) == []


@needs_isolation
def test_bash_output_is_cut_in_the_middle(episode):
    episode.step(call("bash", command="echo BEGIN; head -c 3000000 /dev/zero | tr '\\0' 'y'; echo; echo END; exit 3"))
    (event,) = last_events(episode)
    assert not event.ok and event.observation.startswith("exit code 3\nBEGIN")
    assert event.observation.rstrip().endswith("END") and "characters omitted" in event.observation
    assert len(event.observation) < episode.cfg.observation_chars + 100

"""Episodes driven through an OpenAI-compatible endpoint that fails or counts tokens its own way: a
scripted endpoint (the standard library's HTTP server on a free port) answering replies with usage,
or an error. An endpoint error mid-episode ends it with `endpoint_error` and keeps the turns so far;
`python -m hpc.agent` still writes the trajectory and never removes a --root folder it was given;
the context is counted as the endpoint reported it, not by a bytes-per-token estimate."""

from __future__ import annotations

import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hpc.agent.backend import failed_record
from hpc.agent.config import agent_config
from hpc.agent.episode import Episode, approx_tokens
from hpc.agent.openai_client import OpenAIChatPolicy
from hpc.config import load_config
from hpc.task import load_task
from tests.conftest import RELU_TASK

CONTEXT_ERROR = (400, {"error": {"message": "the prompt (2049 tokens) plus max_tokens (1) exceeds the model's context "
                                            "of 2048 tokens", "type": "invalid_request_error",
                                 "code": "context_length_exceeded"}})


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def answer(content: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> tuple[int, dict]:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    if prompt_tokens:
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    return 200, body


class _Scripted(BaseHTTPRequestHandler):
    """Answers the n-th request with the n-th (status, JSON body) of `script`; keeps the requests."""

    script: list[tuple[int, dict]] = []
    seen: list[dict] = []

    def do_POST(self):
        self.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        status, body = self.script[len(self.seen) - 1]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    """Start a scripted endpoint: `endpoint(script)` gives its base URL."""
    servers = []

    def start(script: list[tuple[int, dict]]) -> str:
        _Scripted.script, _Scripted.seen = script, []
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


class _Unmeasured:
    """A backend that evaluates nothing (these tests are about the conversation): every state fails."""

    config = load_config(backend="cpu", scale="cpu")

    def evaluate(self, task, candidate_dir, tool):
        return failed_record(task, self.config, "not evaluated in this test")


def episode(tmp_path: Path, **cfg) -> Episode:
    return Episode(load_task(RELU_TASK), _Unmeasured(), agent_config(**cfg), tmp_path / "episode")


def test_an_endpoint_error_ends_the_episode_and_keeps_its_turns(tmp_path, endpoint):
    url = endpoint([answer(call("read_file", path="model.py")), answer(call("read_file", path="model_new.py")),
                    CONTEXT_ERROR])
    with episode(tmp_path) as ep:
        trajectory = ep.run(OpenAIChatPolicy(url, "m", api_key_env=None, retries=2))
    assert trajectory.end_reason == "endpoint_error" and len(trajectory.turns) == 2 and len(_Scripted.seen) == 3
    assert "HTTP 400: the prompt (2049 tokens)" in trajectory.end_detail
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert trajectory.turns[0].events[0].ok and "import torch" in trajectory.turns[0].events[0].observation
    saved = json.loads(json.dumps(trajectory.to_dict()))
    assert saved["end_reason"] == "endpoint_error" and saved["end_detail"] == trajectory.end_detail


def test_the_context_is_counted_as_the_endpoint_reported_it(tmp_path, endpoint):
    """Reported long: the episode ends at the context limit after the first reply, though the
    conversation is short in bytes."""
    url = endpoint([answer(call("read_file", path="model.py"), 9000, 40), answer(call("finish"))])
    with episode(tmp_path, max_context_tokens=10000, max_response_tokens=1000) as ep:
        assert ep.context_tokens() < 5000
        trajectory = ep.run(OpenAIChatPolicy(url, "m", api_key_env=None))
        observation = ep.messages[-1]["content"]
    assert trajectory.end_reason == "context" and len(trajectory.turns) == 1 and len(_Scripted.seen) == 1
    assert trajectory.turns[0].prompt_tokens == 9000
    assert ep.context_tokens() == 9040 + approx_tokens(observation) + 4


def test_a_system_prompt_the_server_leaves_out_is_not_counted(tmp_path, endpoint):
    """Reported short (the server drops the instructions): the episode goes on where an estimate
    counting them would have ended it."""
    url = endpoint([answer(call("read_file", path="model.py"), 120, 30), answer(call("finish"), 400, 10)])
    probe = episode(tmp_path / "probe")
    start = probe.context_tokens()   # the system and task messages, estimated
    probe.close()
    with episode(tmp_path, max_context_tokens=start + 1000 + 50, max_response_tokens=1000) as ep:
        trajectory = ep.run(OpenAIChatPolicy(url, "m", api_key_env=None))
    assert trajectory.end_reason == "finished" and len(trajectory.turns) == 2
    assert [t.prompt_tokens for t in trajectory.turns] == [120, 400]


def test_python_m_hpc_agent_writes_the_trajectory_and_keeps_root_when_the_endpoint_fails(
        tmp_path, endpoint, cache_dir, monkeypatch, capsys):
    from hpc.agent.__main__ import main

    monkeypatch.setenv("HPC_CACHE_DIR", str(cache_dir))
    url = endpoint([answer(call("read_file", path="model.py"), 300, 20),
                    answer(call("read_file", path="model_new.py"), 700, 10), CONTEXT_ERROR])
    root, out = tmp_path / "given-root", tmp_path / "trajectory.json"
    assert main([str(RELU_TASK), "--openai-base-url", url, "--model", "m", "--api-key-env", "", "--retries", "0",
                 "--backend", "cpu", "--iterations", "10", "--root", str(root), "--out", str(out)]) == 1
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert summary["end_reason"] == "endpoint_error" and summary["turns"] == 2 and summary["root"] == str(root)
    assert "HTTP 400: the prompt (2049 tokens) plus max_tokens (1) exceeds" in summary["end_detail"]
    assert "error: turn 3 got no reply: OpenAI endpoint" in printed.err
    trajectory = json.loads(out.read_text())
    assert trajectory["end_reason"] == "endpoint_error" and len(trajectory["turns"]) == 2
    assert trajectory["turns"][1]["prompt_tokens"] == 700 and trajectory["record"]["reason"]
    assert (root / "work" / "model.py").is_file()   # the folder given is never removed


def test_a_given_root_is_kept_and_only_the_temporary_one_removed(tmp_path, endpoint, cache_dir, monkeypatch, capsys):
    from hpc.agent.__main__ import main

    monkeypatch.setenv("HPC_CACHE_DIR", str(cache_dir))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    args = [str(RELU_TASK), "--openai-base-url", None, "--model", "m", "--api-key-env", "", "--backend", "cpu",
            "--iterations", "10"]
    args[2] = endpoint([answer("No tool call: the episode ends.")])
    assert main(args + ["--root", str(tmp_path / "mine")]) == 0
    assert json.loads(capsys.readouterr().out)["end_reason"] == "no_tool_call"
    assert (tmp_path / "mine" / "work" / "model.py").is_file()
    args[2] = endpoint([answer("No tool call: the episode ends.")])
    assert main(args) == 0
    assert "root" not in json.loads(capsys.readouterr().out)
    assert not list(temporary.glob("hpc-agent-*"))

"""`hpc serve` and `OpenAIChatPolicy` against each other: a tiny random checkpoint served by the real
command on a free port, answered greedily exactly as `generate` answers in process, `n` samples and
usage counted, bad requests refused with OpenAI's error JSON (the server goes on), the API key
enforced, retries with backoff, and agent episodes driven over HTTP."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hpc.agent.openai_client import OpenAIChatPolicy
from hpc.errors import UserError
from hpc.policy.chat import chat_format
from hpc.policy.generate import SamplingParams, generate
from hpc.policy.tokenizer import ByteTokenizer
from tests.conftest import RELU_TASK, ROOT, make_fast_config

# megatron-core and torch.distributed.checkpoint warn about TE, Apex and their own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

TOK = ByteTokenizer()
FMT = chat_format(TOK, include_system=False)   # the server runs with --no-system: short prompts
KEY_ENV, KEY = "HPC_TEST_SERVE_KEY", "s3cret-key"
NAME = "tiny-test"
MESSAGES = [{"role": "system", "content": "You write kernels."}, {"role": "user", "content": "Add two vectors."}]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A tiny random policy in this process, saved as a checkpoint: (root, cfg, model)."""
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.config import policy_config
    from hpc.policy.model import build_policy
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel(seed=3)
    cfg = policy_config({"max_seq_len": 2048})
    net = build_policy(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():   # wider than the default init: peaked, prompt-dependent outputs
            p.normal_(0, 0.3)
    root = tmp_path_factory.mktemp("checkpoint") / "policy"
    save_checkpoint(root, 7, net, None, cfg)
    yield root, cfg, net
    teardown()


class Server:
    """`python -m hpc.cli serve` in a subprocess; `url` waits for its `serving ... on URL` line."""

    def __init__(self, args: list[str], log_dir):
        self.log = log_dir / "serve.log"
        env = {**os.environ, KEY_ENV: KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "hpc.cli", "serve", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True)
        self._url = None

    @property
    def url(self) -> str:
        deadline = time.monotonic() + 120
        while self._url is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("serving "):
                assert line.startswith(f"serving {NAME} on http://127.0.0.1:"), line
                self._url = line.split(" on ", 1)[1].strip()
            elif not line:
                pytest.fail(f"hpc serve did not start:\n{self.log.read_text()}")
        return self._url

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(local, tmp_path_factory):
    root, _, _ = local
    srv = Server(["--checkpoint", str(root), "--port", "0", "--model-name", NAME, "--api-key-env", KEY_ENV,
                  "--no-system"],
                 tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log.read_text()
    assert "serve: stopped" in srv.log.read_text() and "Traceback" not in srv.log.read_text()


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def client(server, **kw) -> OpenAIChatPolicy:
    return OpenAIChatPolicy(server.url + "/v1", NAME, api_key_env=KEY_ENV, timeout_s=60, **kw)


def post(url: str, body, key: str | None = KEY, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, key: str | None = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def local_replies(local, messages, n=1, **params) -> list[str]:
    _, cfg, net = local
    params = SamplingParams(stop_token_ids=[FMT.stop_id], **params)
    out = generate(net, cfg, TOK, [FMT.render(messages)] * n, params)
    return [TOK.decode(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens) for c in out], out


def test_greedy_replies_are_what_generate_gives_in_process(local, server):
    (expected,), (c,) = local_replies(local, MESSAGES, max_new_tokens=24, temperature=0)
    policy = client(server, temperature=0, max_tokens=24)
    assert policy.respond(MESSAGES) == expected
    second = [MESSAGES[1], {"role": "assistant", "content": expected}, {"role": "user", "content": "Faster."}]
    (expected2,), (c2,) = local_replies(local, second, max_new_tokens=24, temperature=0)
    assert policy.respond(second) == expected2 != expected
    assert policy.usage() == {"requests": 2, "prompt_tokens": len(FMT.render(MESSAGES)) + len(FMT.render(second)),
                              "completion_tokens": len(c.tokens) + len(c2.tokens), "retried": 0}
    assert policy.last_finish_reason == c2.finish_reason


def test_n_samples_in_one_request_and_their_usage(local, server):
    expected, out = local_replies(local, MESSAGES, n=2, max_new_tokens=12, temperature=1.0, seed=5)
    status, body = post(server.url, {"model": NAME, "messages": MESSAGES, "n": 2, "seed": 5, "temperature": 1.0,
                                     "max_completion_tokens": 12})
    assert status == 200 and body["object"] == "chat.completion" and body["model"] == NAME
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert [ch["message"] for ch in body["choices"]] == [{"role": "assistant", "content": t} for t in expected]
    assert [ch["finish_reason"] for ch in body["choices"]] == [c.finish_reason for c in out]
    assert expected[0] != expected[1]
    prompt = len(FMT.render(MESSAGES))
    completion = sum(len(c.tokens) for c in out)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    status, models = get(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [NAME]


def test_stop_strings_end_the_reply_and_are_left_out(local, server):
    (full,), _ = local_replies(local, MESSAGES, max_new_tokens=24, temperature=0)
    stop = next(ch for ch in full[3:] if ch != "\ufffd")   # a character the greedy reply reaches
    status, body = post(server.url, {"messages": MESSAGES, "temperature": 0, "max_tokens": 24, "stop": stop})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == full[:full.index(stop)]


@pytest.mark.parametrize("body, message", [
    ({"model": NAME}, "messages: required"),
    ({"messages": []}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature: expected a number"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p: must be in (0, 1]"),
    ({"messages": MESSAGES, "n": 0}, "n: must be >= 1"),
    ({"messages": MESSAGES, "stop": [""]}, "stop:"),
    ({"messages": MESSAGES, "max_tokens": 3000}, "exceeds the model's context of 2048"),
    ({"messages": MESSAGES, "stream": True}, "streaming is not supported"),
    (b"{not json", "not valid JSON"),
])
def test_bad_requests_are_400_and_the_server_goes_on(server, body, message):
    status, error = post(server.url, body)
    assert status == 400 and message in error["error"]["message"], error
    assert error["error"]["type"] == "invalid_request_error" and "Traceback" not in json.dumps(error)
    status, ok = post(server.url, {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and len(ok["choices"]) == 1


def test_unknown_paths_and_models_are_404_and_the_client_names_the_error(server):
    assert get(server.url + "/v1/engines")[0] == 404
    status, error = post(server.url, {"model": "gpt-9", "messages": MESSAGES})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    with pytest.raises(UserError, match=r"HTTP 400: the prompt \(\d+ tokens\) plus max_tokens \(3000\)"):
        client(server, max_tokens=3000).respond(MESSAGES)


def test_the_api_key_is_required(server, monkeypatch):
    assert get(server.url + "/v1/models", key=None)[0] == 401
    status, error = post(server.url, {"messages": MESSAGES}, key="wrong")
    assert status == 401 and error["error"]["code"] == "invalid_api_key"
    monkeypatch.delenv(KEY_ENV)
    policy = client(server, retries=3)
    with pytest.raises(UserError, match="HTTP 401: missing or wrong API key") as e:
        policy.respond(MESSAGES)
    assert len(str(e.value).splitlines()) == 1 and policy.retried == 0 and policy.requests == 0


class _Flaky(BaseHTTPRequestHandler):
    """503 (with Retry-After: 0) for the first `fail` requests, then a chat completion."""

    fail, seen = 2, []

    def do_POST(self):
        self.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        if len(self.seen) <= self.fail:
            data, status = b'{"error": {"message": "overloaded"}}', 503
        else:
            data, status = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                    "finish_reason": "stop"}],
                                       "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode(), 200
        self.send_response(status)
        self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_retries_back_off_then_give_up_in_one_line():
    _Flaky.fail, _Flaky.seen = 2, []
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stub.server_address[1]}/v1"
    try:
        policy = OpenAIChatPolicy(url, "m", api_key_env=None, temperature=0.5, max_tokens=7, retries=3,
                                  max_tokens_field="max_completion_tokens")
        assert policy.respond(MESSAGES) == "ok"
        assert policy.usage() == {"requests": 1, "prompt_tokens": 3, "completion_tokens": 1, "retried": 2}
        assert _Flaky.seen[-1] == {"model": "m", "messages": MESSAGES, "temperature": 0.5,
                                   "max_completion_tokens": 7}
        _Flaky.fail = 10
        with pytest.raises(UserError, match=r"gave up after 2 attempts: HTTP 503: overloaded"):
            OpenAIChatPolicy(url, "m", api_key_env=None, retries=1, backoff_s=0.01).respond(MESSAGES)
    finally:
        stub.shutdown()
        stub.server_close()
    t0 = time.monotonic()   # nobody listens there any more: connection refused, retried
    with pytest.raises(UserError, match="gave up after 3 attempts: cannot connect"):
        OpenAIChatPolicy(url, "m", api_key_env=None, retries=2, backoff_s=0.01).respond(MESSAGES)
    assert time.monotonic() - t0 < 5


def test_a_hf_directory_is_served_like_the_checkpoint(local, tmp_path):
    from hpc.policy.hf_convert import export_hf
    from hpc.policy.serve import ServerConfig, load_served_policy

    _, cfg, net = local
    hf = export_hf(net, cfg, tmp_path / "exported", "llama")
    served = load_served_policy(ServerConfig(hf=str(hf), tokenizer="byte", include_system=False), init=False)
    body = served.complete({"messages": MESSAGES, "temperature": 0, "max_tokens": 16}, max_n=1)
    (expected,), _ = local_replies(local, MESSAGES, max_new_tokens=16, temperature=0)
    assert body["model"] == "exported" and body["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("args, words", [
    ([], "one of the arguments --checkpoint --hf is required"),
    (["--checkpoint", "nowhere"], "serve: nowhere: no such folder"),
    (["--hf", ".", "--step", "3"], "--step needs --checkpoint"),
    (["--checkpoint", ".", "--api-key-env", "HPC_TEST_NO_SUCH_VARIABLE"], "that environment variable is not set"),
    (["--checkpoint", ".", "--port", "70000"], "--port: expected 0-65535"),
    (["--checkpoint", ".", "--chat-format", "alpaca"], "invalid choice"),
])
def test_bad_serve_arguments_are_one_line(args, words):
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], \
        proc.stderr


def _small_eval_config(cache_dir):
    cfg = make_fast_config(cache_dir)
    cfg.correctness.trials, cfg.correctness.distributions, cfg.correctness.timed_checks = 2, [], 2
    cfg.timing.warmup, cfg.timing.iterations, cfg.timing.calibration_calls = 1, 10, 10
    cfg.validate()
    return cfg


def test_a_single_turn_episode_driven_over_http(local, server, tmp_path, cache_dir):
    from hpc.agent.backend import LocalBackend
    from hpc.agent.config import agent_config
    from hpc.agent.episode import Episode
    from hpc.task import load_task

    backend = LocalBackend(_small_eval_config(cache_dir))
    policy = client(server, temperature=0, max_tokens=16)
    with Episode(load_task(RELU_TASK), backend, agent_config(mode="single_turn"), tmp_path / "episode") as episode:
        (expected,), _ = local_replies(local, episode.messages, max_new_tokens=16, temperature=0)
        traj = episode.run(policy)
    assert traj.end_reason == "single_turn" and len(traj.turns) == 1
    assert traj.turns[0].response == expected == traj.messages[-1]["content"]
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant"]
    assert traj.reward == backend.config.reward.incorrect and not traj.record["correct"]   # a random model
    assert policy.requests == 1 and policy.prompt_tokens == len(FMT.render(traj.messages[:2]))


def test_python_m_hpc_agent_takes_an_endpoint_or_replies(server, tmp_path, cache_dir, monkeypatch, capsys):
    from hpc.agent.__main__ import main

    monkeypatch.setenv("HPC_CACHE_DIR", str(cache_dir))
    assert main([str(RELU_TASK)]) == 2
    assert "exactly one of REPLIES" in capsys.readouterr().err
    assert main([str(RELU_TASK), "--openai-base-url", server.url + "/v1"]) == 2
    assert "--model NAME is required" in capsys.readouterr().err
    assert main([str(RELU_TASK), "replies.json", "--temperature", "0"]) == 2
    assert "--temperature: only with --openai-base-url" in capsys.readouterr().err
    out = tmp_path / "trajectory.json"
    assert main([str(RELU_TASK), "--openai-base-url", server.url + "/v1", "--model", NAME, "--api-key-env", KEY_ENV,
                 "--temperature", "0", "--max-tokens", "8", "--mode", "single_turn", "--backend", "cpu",
                 "--iterations", "10", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["end_reason"] == "single_turn" and summary["usage"]["requests"] == 1
    assert summary["usage"]["completion_tokens"] <= 8
    assert json.loads(out.read_text())["turns"][0]["response"] is not None

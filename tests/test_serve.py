"""`hpc serve` and `OpenAIChatPolicy` against each other: a tiny random checkpoint served by the real
command on a free port, answered greedily exactly as `generate` answers in process, `n` samples and
usage counted, bad requests refused with OpenAI's error JSON (the server goes on), the API key
enforced, retries with backoff, and agent episodes driven over HTTP. And the server as the official
`openai` client meets it: streaming, the trainer's log-probs, tools refused, the model by id and a
health check, bodies and prompts too large refused before they cost anything, a generating request
holding up no other, and a training run served with the tokenizer it trained with."""

from __future__ import annotations

import inspect
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

import openai
import pytest
import torch

from hpc.agent.openai_client import OpenAIChatPolicy
from hpc.errors import UserError
from hpc.policy.chat import ChatFormat, chat_format
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
MAX_REQUEST_BYTES = 65536
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
                  "--no-system", "--max-request-bytes", str(MAX_REQUEST_BYTES)],
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
    ({"messages": MESSAGES, "stream": "yes"}, "stream: expected true or false"),
    ({"messages": MESSAGES, "temperature": float("nan")}, "temperature: must be a finite number, got nan"),
    ({"messages": MESSAGES, "top_p": float("inf")}, "top_p: must be a finite number, got inf"),
    ({"messages": MESSAGES, "presence_penalty": float("-inf")}, "presence_penalty: must be a finite number"),
    ({"messages": MESSAGES, "frequency_penalty": 3}, "frequency_penalty: must be in [-2, 2]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role: expected one of system, user, assistant, tool, got 'wizard'"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools: not supported"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice: not supported"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]},
     "messages[0].tool_calls: tool calls are not supported"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20]"),
    ({"messages": MESSAGES, "seed": 1 << 63}, "seed: must be in [0, 9223372036854775807]"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "only with stream: true"),
    ({"messages": MESSAGES, "top_k": 5}, "Unrecognized request argument supplied: top_k"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "chunk_size": 2}},
     "Unrecognized request argument supplied: stream_options.chunk_size"),
    ({"messages": [{"role": "user", "content": "hi", "tags": []}]},
     "Unrecognized request argument supplied: messages[0].tags"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name: not supported"),
    ({"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty: not supported"),
    ({"messages": MESSAGES, "logit_bias": {"65": 5}}, "logit_bias: not supported"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format: not supported"),
    ({"messages": MESSAGES, "store": 0}, "store: not supported"),
    ({"messages": MESSAGES, "user": 7}, "user: expected a string"),
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
    body = served.complete(*served.request({"messages": MESSAGES, "temperature": 0, "max_tokens": 16}, max_n=1))
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


# -- the server as the official `openai` client meets it -------------------------------------------
def openai_client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_openai_client_fetches_the_model_by_id_and_health_needs_no_key(local, server):
    client_ = openai_client(server)
    assert [m.id for m in client_.models.list()] == [NAME]
    model = client_.models.retrieve(NAME)
    assert model.id == NAME and model.object == "model" and model.owned_by == "hpc"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client_.models.retrieve("gpt-9")
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, key="wrong").models.retrieve(NAME)
    assert get(server.url + "/health", key=None) == (200, {"status": "ok"})
    (expected,), _ = local_replies(local, MESSAGES, max_new_tokens=16, temperature=0)
    reply = client_.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == expected and reply.choices[0].logprobs is None


def test_tools_are_refused_by_name_not_ignored(server):
    tools = [{"type": "function", "function": {"name": "compile", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError, match="tools: not supported") as e:
        openai_client(server).chat.completions.create(model=NAME, messages=MESSAGES, tools=tools)
    assert e.value.code == "tools_not_supported"


def test_every_field_the_openai_client_can_send_is_honoured_accepted_or_refused():
    """The official client's parameters are OpenAI's request fields: each is classified (a new one
    would otherwise be refused as unrecognized, not silently ignored, but undocumented)."""
    from openai.resources.chat.completions import Completions

    from hpc.policy.openai_api import FIELDS

    sent = set(inspect.signature(Completions.create).parameters) - {"self", "extra_headers", "extra_query",
                                                                     "extra_body", "timeout"}
    assert sent <= set(FIELDS), sorted(sent - set(FIELDS))


def test_fields_asking_for_nothing_are_accepted_and_any_other_value_is_refused_by_name(local, server):
    (expected,), _ = local_replies(local, MESSAGES, max_new_tokens=8, temperature=0)
    create = openai_client(server).chat.completions.create
    reply = create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=8, presence_penalty=0,
                   frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="none",
                   modalities=["text"], store=False, service_tier="auto", user="u1", safety_identifier="s1",
                   prompt_cache_key="k1", metadata={"run": "test"})
    assert reply.choices[0].message.content == expected
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"65": 10}),
                         ("response_format", {"type": "json_object"}), ("reasoning_effort", "low"),
                         ("parallel_tool_calls", False), ("store", True), ("service_tier", "priority"),
                         ("prediction", {"type": "content", "content": "x"}), ("modalities", ["text", "audio"])):
        with pytest.raises(openai.BadRequestError, match=f"{field}: not supported by this server") as e:
            create(model=NAME, messages=MESSAGES, max_tokens=2, **{field: value})
        assert e.value.param == field and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: top_k") as e:
        create(model=NAME, messages=MESSAGES, max_tokens=2, extra_body={"top_k": 5, "repetition_penalty": 1.1})
    assert e.value.param == "top_k"


def test_a_stream_sends_the_reply_in_pieces_as_openai_does(local, server):
    (expected,), (c,) = local_replies(local, MESSAGES, max_new_tokens=40, temperature=0)
    chunks = list(openai_client(server).chat.completions.create(
        model=NAME, messages=MESSAGES, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert {(ch.object, ch.id, ch.model) for ch in chunks} == {("chat.completion.chunk", chunks[0].id, NAME)}
    *choices, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == len(FMT.render(MESSAGES))
    assert last.usage.completion_tokens == len(c.tokens)
    assert choices[0].choices[0].delta.role == "assistant"
    pieces = [ch.choices[0].delta.content for ch in choices if ch.choices[0].delta.content]
    assert "".join(pieces) == expected and len(pieces) > 3
    assert [ch.choices[0].finish_reason for ch in choices] == [None] * (len(choices) - 1) + [c.finish_reason]


def test_a_streamed_reply_stops_where_a_stop_string_begins(local, server):
    (full,), _ = local_replies(local, MESSAGES, max_new_tokens=40, temperature=0)
    start = next(k for k in range(8, len(full) - 1) if "\ufffd" not in full[k:k + 2])
    stop = full[start:start + 2]   # two characters: the first may be sent before the second decides
    chunks = openai_client(server).chat.completions.create(model=NAME, messages=MESSAGES, temperature=0,
                                                           max_tokens=40, stop=[stop], stream=True)
    choices = [ch.choices[0] for ch in chunks]
    assert "".join(ch.delta.content or "" for ch in choices) == full[:full.index(stop)]
    assert choices[-1].finish_reason == "stop"


def test_a_raw_stream_is_server_sent_events_ending_in_done(local, server):
    (expected,), (c,) = local_replies(local, MESSAGES, max_new_tokens=10, temperature=0)
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 10, "logprobs": True, "n": 2,
                       "stream": True}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        lines = r.read().decode().split("\n")
    events = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert all(not line for line in lines[1::2])   # each event is followed by a blank line
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    for index in (0, 1):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == index]
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == expected
        logprobs = [e for ch in mine if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert [bytes(e["bytes"]) for e in logprobs] == [TOK.token_bytes(t) for t in c.tokens]


@pytest.mark.parametrize("temperature", [0.7, 0])
def test_logprobs_are_those_the_trainer_computes(local, server, temperature):
    """At the request's temperature T (1 when greedy): the trainer's log-probs at rollout.temperature
    T, which are the sampler's, and the top tokens of log_softmax(logits / T)."""
    from hpc.policy.model import forward_logits, mask_padded_vocab, sequence_logprobs

    _, cfg, net = local
    (text,), (c,) = local_replies(local, MESSAGES, max_new_tokens=12, temperature=temperature, seed=11)
    reply = openai_client(server).chat.completions.create(model=NAME, messages=MESSAGES, temperature=temperature,
                                                          seed=11, max_tokens=12, logprobs=True, top_logprobs=3)
    assert reply.choices[0].message.content == text
    content = reply.choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [TOK.token_bytes(t) for t in c.tokens]
    prompt = FMT.render(MESSAGES)
    sequence = torch.tensor([prompt + c.tokens])
    scale = temperature or 1.0
    with torch.no_grad():
        trainer, _ = sequence_logprobs(net, sequence, None, cfg.vocab_size, False, scale)
        logits = forward_logits(net, sequence)[0, len(prompt) - 1:-1].float()
        top = torch.log_softmax(mask_padded_vocab(logits / scale, cfg.vocab_size), -1).topk(3)
    assert [e.logprob for e in content] == pytest.approx(trainer[0, len(prompt) - 1:].tolist(), abs=1e-5)
    assert [e.logprob for e in content] == pytest.approx(c.logprobs, abs=1e-4)     # the sampler's
    for e, values, ids in zip(content, top.values.tolist(), top.indices.tolist()):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(values, abs=1e-5)
        assert [bytes(t.bytes) for t in e.top_logprobs] == [TOK.token_bytes(i) for i in ids]


def test_a_body_over_the_limit_is_413_unread_and_the_server_goes_on(server):
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
    status, error = post(server.url, big)
    assert status == 413 and f"--max-request-bytes {MAX_REQUEST_BYTES}" in error["error"]["message"], error
    with pytest.raises(openai.APIStatusError) as e:
        openai_client(server).chat.completions.create(**big)
    assert e.value.status_code == 413
    assert post(server.url, {"messages": MESSAGES, "max_tokens": 2})[0] == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(local, monkeypatch):
    from hpc.policy.openai_api import RequestError
    from hpc.policy.serve import ServedPolicy

    _, cfg, net = local
    served = ServedPolicy(NAME, net, cfg, TOK, FMT)

    def render(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(ChatFormat, "render", render)
    with pytest.raises(RequestError, match="at least 2049 tokens, more than the model's context of 2048") as e:
        served.request({"messages": [{"role": "system", "content": "s" * 5000},
                                     {"role": "user", "content": "y" * 2049}]}, 1)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(AssertionError, match="tokenized"):   # the system message is left out (--no-system)
        served.request({"messages": [{"role": "system", "content": "s" * 5000},
                                     {"role": "user", "content": "y" * 2000}]}, 1)


def test_no_tokenizer_encodes_a_text_in_fewer_tokens_than_its_bound(tmp_path):
    from hpc.policy.tokenizer import train_bpe

    texts = ["def relu(x):\n    return torch.clamp(x, min=0)\n" * 20, "    " * 40 + "\n\n\n", "żółć ✓ 🙂 " * 30,
             "<|im_start|>user\n<|im_end|>" * 10]
    for split_words in (True, False):
        tok = train_bpe(texts, 400, tmp_path / f"bpe-{split_words}", split_words=split_words)
        for text in texts:
            assert len(tok.encode(text)) >= len(text.encode()) / tok.max_token_bytes, text
            assert b"".join(tok.token_bytes(t) for t in tok.encode(text)) == text.encode()


def test_a_generating_request_holds_up_no_other(server):
    times: dict[str, float] = {}

    def consume():
        stream = openai_client(server).chat.completions.create(model=NAME, messages=MESSAGES, temperature=0,
                                                               max_tokens=400, stream=True)
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                times.setdefault("first piece", time.monotonic())
        times["end"] = time.monotonic()

    streaming = threading.Thread(target=consume)
    streaming.start()
    deadline = time.monotonic() + 120
    while "first piece" not in times and streaming.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "first piece" in times and "end" not in times
    assert get(server.url + "/health", key=None)[0] == 200
    assert get(server.url + "/v1/models")[0] == 200
    assert post(server.url, {"messages": MESSAGES, "temperature": float("nan")})[0] == 400
    assert post(server.url, {"messages": [{"role": "user", "content": "z" * 3000}]})[0] == 400   # not tokenized
    assert post(server.url, {"messages": [{"role": "user", "content": "z" * MAX_REQUEST_BYTES}]})[0] == 413
    answered = time.monotonic()
    streaming.join(300)
    assert answered < times["end"], "the other requests waited for the generation"


# -- a training run's checkpoint -------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(local, tmp_path_factory):
    """A training run as jobs/train.py leaves one: a tiny policy trained with its own vocabulary
    (bpe:320, ChatML tokens) and without system messages. (run folder, tokenizer, cfg, model)."""
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.config import policy_config
    from hpc.policy.model import build_policy
    from hpc.policy.tokenizer import train_bpe
    from hpc.rl.checkpoints import CHECKPOINTS, STATE_FILE
    from hpc.rl.train_config import train_config, train_config_dict

    folder = tmp_path_factory.mktemp("run")
    tok = train_bpe(["def forward(self, x):\n    return torch.relu(x)\n" * 20, "Add two vectors. " * 20], 320,
                    folder / "tokenizer")
    cfg = policy_config({"max_seq_len": 512, "vocab_size": tok.vocab_size})
    net = build_policy(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    save_checkpoint(folder / CHECKPOINTS / "policy", 3, net, None, cfg)
    config = train_config({"tokenizer": "bpe:320", "include_system": False, "policy": {"max_seq_len": 512},
                           "agent": {"max_context_tokens": 512, "max_response_tokens": 128},
                           "stages": [{"kind": "sft", "steps": 3}]})
    saved = {"position": {"step": 3, "stage": 0, "stage_step": 3}, "reference": False,
             "config": train_config_dict(config)}
    (folder / CHECKPOINTS / f"{STATE_FILE}.3").write_text(json.dumps(saved, default=str))
    return folder, tok, cfg, net


@pytest.mark.parametrize("where", [".", "checkpoints", "checkpoints/policy", "checkpoints/policy/iter_0000003"])
def test_a_run_is_served_with_the_tokenizer_it_trained_with(run, where):
    from hpc.policy.serve import ServerConfig, load_served_policy

    folder, tok, cfg, net = run
    served = load_served_policy(ServerConfig(checkpoint=str(folder / where)), init=False)
    assert (served.tokenizer.vocab_size, served.format.name, served.format.include_system) == (tok.vocab_size,
                                                                                                "chatml", False)
    fmt = chat_format(tok, include_system=False)
    (c,) = generate(net, cfg, tok, [fmt.render(MESSAGES)],
                    SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[fmt.stop_id]))
    body = served.complete(*served.request({"messages": MESSAGES, "temperature": 0, "max_tokens": 12}, max_n=1))
    assert body["choices"][0]["message"]["content"] == tok.decode(c.tokens[:-1] if c.finish_reason == "stop"
                                                                  else c.tokens)
    assert body["usage"]["prompt_tokens"] == len(fmt.render(MESSAGES))
    assert served.name == (folder / where).resolve().name


def test_the_runs_own_tokenizer_may_be_named_from_a_copy(run, tmp_path):
    from hpc.policy.serve import ServerConfig, load_served_policy

    folder, tok, _, _ = run
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in (folder / "tokenizer").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    served = load_served_policy(ServerConfig(checkpoint=str(folder), tokenizer=str(copy), chat_format="chatml"),
                                init=False)
    assert served.tokenizer.vocab_size == tok.vocab_size


@pytest.mark.parametrize("override, words", [
    ({"tokenizer": "byte"}, r"--tokenizer byte: .* was trained with the tokenizer .*tokenizer; leave --tokenizer out"),
    ({"chat_format": "plain"}, "--chat-format plain: .* was trained with the chat format auto"),
])
def test_another_tokenizer_or_chat_format_than_the_runs_is_refused(run, override, words):
    from hpc.policy.serve import ServerConfig, load_served_policy

    with pytest.raises(UserError, match=words) as e:
        load_served_policy(ServerConfig(checkpoint=str(run[0]), **override), init=False)
    assert len(str(e.value).splitlines()) == 1


def test_hpc_serve_refuses_a_tokenizer_the_run_did_not_train_with_in_one_line(run):
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "serve", "--checkpoint", str(run[0]), "--tokenizer",
                           "byte", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "was trained with the tokenizer" in lines[0], proc.stderr


def test_a_checkpoint_outside_a_run_whose_vocabulary_is_not_bytes_needs_its_tokenizer(run, tmp_path):
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.serve import ServerConfig, load_served_policy

    folder, tok, cfg, net = run
    save_checkpoint(tmp_path / "policy", 1, net, None, cfg)
    with pytest.raises(UserError, match=f"records no tokenizer .* vocabulary of {tok.vocab_size} tokens is not the "
                                        "byte tokenizer's 259: name its tokenizer with --tokenizer"):
        load_served_policy(ServerConfig(checkpoint=str(tmp_path / "policy")), init=False)
    served = load_served_policy(ServerConfig(checkpoint=str(tmp_path / "policy"), tokenizer=str(folder / "tokenizer")),
                                init=False)
    assert served.tokenizer.vocab_size == tok.vocab_size

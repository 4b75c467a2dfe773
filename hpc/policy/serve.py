"""The project's policy behind an OpenAI-compatible chat-completions endpoint.

    hpc serve --checkpoint ROOT [--step N] | --hf DIR  [--tokenizer byte|DIR] [--chat-format auto|...]
        [--host 127.0.0.1] [--port 8000] [--model-name NAME] [--api-key-env VAR] [--dtype auto|fp32|bf16]

One model, one process, TP = 1 (gloo on CPU, NCCL on a GPU): what any OpenAI client, and the
agent's `OpenAIChatPolicy`, talks to. Standard library only (`http.server` and `json`); requests
are served by threads and generation is serialized by a lock (one batch at a time: the `n`
samples of one request are one batch).

    GET  /v1/models             {"object": "list", "data": [{"id": MODEL, ...}]}
    POST /v1/chat/completions   messages, max_tokens | max_completion_tokens, temperature, top_p,
                                stop (string or list), seed, n; OpenAI's response shape

Messages are rendered with the chat format (`hpc.policy.chat`); a reply ends at the format's stop
token (or the tokenizer's eos), which is left out of the content, or at a stop string, also left
out, or at `max_tokens` (finish_reason `length`). Without `max_tokens` a reply may fill the rest
of the context (`max_seq_len`). A bad request is OpenAI's error JSON with status 400 (401 without
the key, 404 for an unknown path or model), never a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.policy.chat import FORMATS, ChatFormat

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class ServerConfig:
    """What `hpc serve` loads and where it listens. Exactly one of `checkpoint` and `hf`."""

    checkpoint: str | None = None     # a dist_checkpointing root (hpc.policy.checkpoint)
    step: int | None = None           # its step (default: latest)
    hf: str | None = None             # a HF Llama / Qwen2 directory
    tokenizer: str | None = None      # byte | a HF directory (default: the HF dir, else byte)
    chat_format: str = "auto"
    model_name: str | None = None     # the model id clients name (default: the folder's name)
    host: str = "127.0.0.1"
    port: int = 8000                  # 0: a free port
    api_key_env: str | None = None    # require `Authorization: Bearer $VAR`
    dtype: str | None = None          # None: the checkpoint's (auto: bf16 on GPU, fp32 on CPU)
    include_system: bool = True       # False: system messages are left out of the prompt
    max_n: int = 16                   # most samples one request may ask for
    seed: int = 1234

    def validate(self) -> None:
        """Raise UserError (one line) at the first bad setting."""
        if (self.checkpoint is None) == (self.hf is None):
            raise UserError("serve: give exactly one of --checkpoint ROOT and --hf DIR")
        source = self.checkpoint if self.checkpoint is not None else self.hf
        if not Path(source).is_dir():
            raise UserError(f"serve: {source}: no such folder")
        if self.step is not None and (self.hf is not None or self.step < 0):
            raise UserError("serve: --step needs --checkpoint and must be >= 0")
        if self.chat_format not in FORMATS:
            raise UserError(f"serve: --chat-format: expected one of {', '.join(FORMATS)}, got {self.chat_format!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"serve: --dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"serve: --port: expected 0-65535, got {self.port}")
        if self.max_n < 1:
            raise UserError(f"serve: --max-n: must be >= 1, got {self.max_n}")
        if self.model_name is not None and not self.model_name.strip():
            raise UserError("serve: --model-name: empty")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise UserError(f"serve: --api-key-env {self.api_key_env}: that environment variable is not set")

    @property
    def name(self) -> str:
        if self.model_name:
            return self.model_name
        return Path(self.checkpoint if self.checkpoint is not None else self.hf).resolve().name or "policy"


class RequestError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A validated chat-completions request."""

    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    n: int


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{key}: expected a number, got {type(value).__name__}", key)
    if value < low or (low_open and value == low) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(400, f"{key}: must be in {interval}, got {value}", key)
    return float(value)


def _integer(body: dict, key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{key}: expected an integer, got {type(value).__name__}", key)
    if value < low:
        raise RequestError(400, f"{key}: must be >= {low}, got {value}", key)
    return value


def _content(value: Any, k: int) -> str:
    """A message's content: a string, or OpenAI's list of parts of which text parts are kept."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{k}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"messages[{k}].content: expected a string or a list of text parts, "
                            f"got {type(value).__name__}", "messages")


def parse_request(body: Any, max_n: int) -> ChatRequest:
    """The request's fields, validated; unknown fields (penalties, logit_bias, user, ...) are ignored."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if messages is None:
        raise RequestError(400, "messages: required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of messages", "messages")
    parsed = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{k}]: expected an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(400, f"messages[{k}].role: expected a non-empty string", "messages")
        parsed.append({"role": role, "content": _content(m.get("content"), k)})
    if body.get("stream"):
        raise RequestError(400, "stream: streaming is not supported", "stream")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop: expected a non-empty string or a list of them", "stop")
    n = _integer(body, "n", 1) or 1
    if n > max_n:
        raise RequestError(400, f"n: at most {max_n} samples per request, got {n}", "n")
    return ChatRequest(parsed, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                       _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), stop, _integer(body, "seed", 0), n)


class ServedPolicy:
    """The loaded model, its tokenizer and chat format; `complete` answers one request."""

    def __init__(self, name: str, model, cfg, tokenizer, fmt: ChatFormat):
        self.name, self.model, self.cfg, self.tokenizer, self.format = name, model, cfg, tokenizer, fmt
        self.created = int(time.time())
        self.stop_ids = sorted({fmt.stop_id, tokenizer.eos_id})
        self.lock = threading.Lock()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "hpc"}]}

    def complete(self, body: Any, max_n: int) -> dict[str, Any]:
        """The chat.completion object for a request body; RequestError for a bad one."""
        import torch

        from hpc.policy.generate import SamplingParams, generate

        if isinstance(body, dict) and body.get("model") not in (None, self.name):
            raise RequestError(404, f"the model {body.get('model')!r} does not exist (this server has "
                                    f"{self.name!r})", "model", "model_not_found")
        req = parse_request(body, max_n)
        prompt = self.format.render(req.messages)
        room = self.cfg.max_seq_len - len(prompt)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            raise RequestError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens "
                                    f"({req.max_tokens if req.max_tokens is not None else 1}) exceeds the "
                                    f"model's context of {self.cfg.max_seq_len} tokens", "messages",
                               "context_length_exceeded")
        params = SamplingParams(max_new_tokens=req.max_tokens or room, temperature=req.temperature,
                                top_p=req.top_p, stop=req.stop, stop_token_ids=self.stop_ids, seed=req.seed)
        device = next(self.model.parameters()).device
        with self.lock, (torch.cuda.device(device) if device.type == "cuda" else _nothing()):
            completions = generate(self.model, self.cfg, self.tokenizer, [prompt] * req.n, params)
        choices = []
        for i, c in enumerate(completions):
            choices.append({"index": i, "message": {"role": "assistant", "content": self._content(c, req.stop)},
                            "logprobs": None, "finish_reason": c.finish_reason})
        completion_tokens = sum(len(c.tokens) for c in completions)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt) + completion_tokens}}

    def _content(self, c, stops: list[str]) -> str:
        """The reply's text without its stop token or stop string."""
        if c.tokens and c.tokens[-1] in self.stop_ids:
            return self.tokenizer.decode(c.tokens[:-1])
        text = c.text
        if c.finish_reason == "stop":
            ends = [s for s in stops if text.endswith(s)]
            if ends:
                text = text[:-len(max(ends, key=len))]
        return text


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def load_served_policy(sc: ServerConfig, init: bool = True) -> ServedPolicy:
    """Start torch.distributed for this one process (unless `init` is False: the caller set up
    TP = PP = 1 already), build the policy and load its weights."""
    from hpc.policy.chat import chat_format
    from hpc.policy.config import ParallelSizes
    from hpc.policy.model import build_policy
    from hpc.policy.parallel import init_parallel
    from hpc.policy.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(sc.tokenizer or (sc.hf if sc.hf is not None else "byte"))
    fmt = chat_format(tokenizer, sc.chat_format, sc.include_system)
    if sc.hf is not None:
        from hpc.policy.hf_convert import hf_policy_config

        cfg = hf_policy_config(sc.hf, dtype=sc.dtype or "auto")
    else:
        from hpc.policy.checkpoint import checkpoint_config

        cfg = checkpoint_config(sc.checkpoint, sc.step)
        cfg.parallel = ParallelSizes()
        if sc.dtype is not None:
            cfg.dtype = sc.dtype
    if tokenizer.vocab_size > cfg.padded_vocab_size:
        raise UserError(f"serve: the tokenizer's {tokenizer.vocab_size} tokens do not fit the model's "
                        f"vocabulary of {cfg.vocab_size}")
    if init:   # a single process whatever launcher started it (srun's or torchrun's variables name other ranks)
        init_parallel(seed=sc.seed, environ={})
    model = build_policy(cfg)
    if sc.hf is not None:
        from hpc.policy.hf_convert import load_hf

        load_hf(model, sc.hf, cfg)
    else:
        from hpc.policy.checkpoint import load_checkpoint

        load_checkpoint(sc.checkpoint, model, step=sc.step)
    model.eval()
    return ServedPolicy(sc.name, model, cfg, tokenizer, fmt)


def make_handler(policy: ServedPolicy, api_key: str | None, max_n: int):
    """The request handler class for one served policy."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "hpc-serve"

        def log_message(self, format: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), format % args)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _path(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/") or "/"

        def _authorized(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

        def _handle(self, method: str) -> None:
            try:
                body = self._read_body() if method == "POST" else None
                if not self._authorized():
                    raise RequestError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                       code="invalid_api_key")
                path = self._path()
                routes = {"/v1/models": "GET", "/v1/chat/completions": "POST"}
                if path not in routes:
                    raise RequestError(404, f"unknown path {path} (this server has "
                                            f"{', '.join(f'{m} {p}' for p, m in routes.items())})",
                                       code="not_found")
                if routes[path] != method:
                    raise RequestError(405, f"{path}: use {routes[path]}", code="method_not_allowed")
                if path == "/v1/models":
                    self._send(200, policy.models())
                    return
                try:
                    payload = json.loads(body)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise RequestError(400, f"the request body is not valid JSON ({e})") from None
                self._send(200, policy.complete(payload, max_n))
            except RequestError as e:
                self._send(e.status, e.body())
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as e:   # the server's own fault: the traceback stays here
                log.exception("serve: %s %s failed", method, self.path)
                self._send(500, RequestError(500, f"internal error: {type(e).__name__}: {e}".splitlines()[0],
                                             kind="server_error").body())

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                raise RequestError(411, "a Content-Length header is required")
            if int(length) > MAX_BODY_BYTES:
                self.close_connection = True
                raise RequestError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            return self.rfile.read(int(length))

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("PUT")

        def do_DELETE(self) -> None:
            self._handle("DELETE")

    return Handler


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def serve(sc: ServerConfig, ready=None) -> int:
    """Load the policy, listen, print `serving NAME on http://HOST:PORT` and serve until SIGTERM
    or SIGINT. `ready(host, port)` is called instead of printing when given."""
    sc.validate()
    api_key = os.environ[sc.api_key_env] if sc.api_key_env is not None else None
    with warnings.catch_warnings():   # megatron's notes about Transformer Engine, Apex and deprecations
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        policy = load_served_policy(sc)
    try:
        server = ThreadingHTTPServer((sc.host, sc.port), make_handler(policy, api_key, sc.max_n))
    except OSError as e:
        raise UserError(f"serve: cannot listen on {sc.host}:{sc.port} ({e.strerror})") from None
    server.daemon_threads = True
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    host, port = server.server_address[:2]
    try:
        if ready is not None:
            ready(host, port)
        else:
            print(f"serving {policy.name} on http://{host}:{port}", flush=True)
        server.serve_forever()
    except _Stop:
        log.info("serve: stopped")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.server_close()
        from hpc.policy.parallel import teardown

        teardown()
    return 0


def add_arguments(p) -> None:
    """`hpc serve`'s options on an argparse parser."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="ROOT", help="a dist_checkpointing root (hpc.policy.checkpoint)")
    src.add_argument("--hf", metavar="DIR", help="a HuggingFace Llama / Qwen2 checkpoint directory")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: latest)")
    p.add_argument("--tokenizer", help="byte, or a HF directory / tokenizer.json (default: the --hf dir, else byte)")
    p.add_argument("--chat-format", default="auto", choices=FORMATS,
                   help="how messages become tokens (default: auto, from the tokenizer's special tokens)")
    p.add_argument("--no-system", action="store_true", help="leave system messages out of the prompt")
    p.add_argument("--model-name", help="the model id clients name (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    p.add_argument("--api-key-env", metavar="VAR", help="require Authorization: Bearer $VAR")
    p.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default: the checkpoint's; auto: bf16 on GPU)")
    p.add_argument("--max-n", type=int, default=16, help="most samples per request (default 16)")
    p.add_argument("--seed", type=int, default=1234, help="torch's seed at start")


def config_from_args(args) -> ServerConfig:
    sc = ServerConfig(checkpoint=args.checkpoint, step=args.step, hf=args.hf, tokenizer=args.tokenizer,
                      chat_format=args.chat_format, model_name=args.model_name, host=args.host, port=args.port,
                      api_key_env=args.api_key_env, dtype=args.dtype, include_system=not args.no_system,
                      max_n=args.max_n, seed=args.seed)
    sc.validate()
    return sc

"""The project's policy behind an OpenAI-compatible chat-completions endpoint.

    hpc serve --checkpoint RUN|ROOT [--step N] | --hf DIR  [--tokenizer byte|DIR] [--chat-format auto|...]
        [--host 127.0.0.1] [--port 8000] [--model-name NAME] [--api-key-env VAR] [--dtype auto|fp32|bf16]
        [--max-request-bytes N]

One model, one process, TP = 1 (gloo on CPU, NCCL on a GPU): what any OpenAI client, and the
agent's `OpenAIChatPolicy`, talks to. Standard library only (`http.server` and `json`).

A training run's checkpoint (the run folder, its checkpoints/ or checkpoints/policy/, or one
iter_N) is served with the tokenizer, chat format and system-message rule the run trained with,
as its trainer.json.N records them; naming another tokenizer or chat format is an error. A
checkpoint saved outside a run records no tokenizer: it gets --tokenizer (default byte), and a
byte default whose vocabulary is not the checkpoint's is refused.

    GET  /health                    {"status": "ok"} (no API key needed: for probes)
    GET  /v1/models                 {"object": "list", "data": [{"id": MODEL, ...}]}
    GET  /v1/models/MODEL           {"id": MODEL, "object": "model", ...}
    POST /v1/chat/completions       messages, max_tokens | max_completion_tokens, temperature, top_p,
                                    stop (string or list), seed, n, logprobs, top_logprobs, stream,
                                    stream_options.include_usage; OpenAI's response shape. Every other
                                    field is accepted only where it changes nothing in the answer, or
                                    refused by name (`hpc.policy.openai_api`)

Concurrency: every connection has its own thread, which reads, parses and tokenizes its request;
generation is serialized by a lock (one batch at a time: the `n` samples of one request are one
batch), so health checks, model lists and refusals never wait for it. What one request can cost
before generation is bounded: a body over `--max-request-bytes` is refused (413) from its
Content-Length before it is read, and a prompt whose bytes alone prove it longer than the context
(`Tokenizer.max_token_bytes`) is refused (400) before it is tokenized.

Messages are rendered with the chat format (`hpc.policy.chat`); a reply ends at the format's stop
token (or the tokenizer's eos), which is left out of the content, or at a stop string, also left
out, or at `max_tokens` (finish_reason `length`). Without `max_tokens` a reply may fill the rest
of the context (`max_seq_len`).

`stream: true` sends server-sent events as OpenAI does: `data: {chat.completion.chunk}` lines, the
first of each choice with `delta.role`, then `delta.content` pieces as tokens are generated (a
piece that may still become a stop string, or an incomplete UTF-8 character, waits for the next
token), a last chunk per choice with its `finish_reason`, the usage chunk when
`stream_options.include_usage`, and `data: [DONE]`.

`logprobs: true` gives, for every generated token (the stop token too: the trainer trains on it),
the log-prob the trainer computes for it (`hpc.policy.model.sequence_logprobs` over the prompt and
the reply) at the request's temperature T: log_softmax(logits / T) (T = 1 when greedy), the
distribution that sampled it before top-p, as the RL trainer computes it at rollout.temperature
T; and `top_logprobs: K` the K likeliest tokens at each position under the same distribution. A
stream sends them in one chunk per choice once its reply is complete (they need the whole reply).

A bad request is OpenAI's error JSON with status 400 (401 without the key, 404 for an unknown
path or model, 413 for a body too large), never a traceback.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from hpc.errors import TokenizerError, UsageError
from hpc.policy.chat import FORMATS, ChatFormat
from hpc.policy.openai_api import ChatRequest, RequestError, chunk, logprob_entry, parse_request, usage

log = logging.getLogger(__name__)

DTYPES = ("auto", "fp32", "bf16")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
LINGER_S = 5.0                     # most seconds spent draining a refused body (`_linger`)


@dataclass
class ServerConfig:
    """What `hpc serve` loads and where it listens. Exactly one of `checkpoint` and `hf`."""

    checkpoint: str | None = None     # a training run (or its checkpoint), or a dist_checkpointing root
    step: int | None = None           # its step (default: latest)
    hf: str | None = None             # a HF Llama / Qwen2 directory
    tokenizer: str | None = None      # byte | a HF directory (default: the run's, the HF dir, else byte)
    chat_format: str | None = None    # None: the run's, else auto
    model_name: str | None = None     # the model id clients name (default: the folder's name)
    host: str = "127.0.0.1"
    port: int = 8000                  # 0: a free port
    api_key_env: str | None = None    # require `Authorization: Bearer $VAR`
    dtype: str | None = None          # None: the checkpoint's (auto: bf16 on GPU, fp32 on CPU)
    include_system: bool | None = None   # False: system messages left out of the prompt (None: the run's, else True)
    max_n: int = 16                   # most samples one request may ask for
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES   # largest request body (413 beyond, unread)
    seed: int = 1234

    def validate(self) -> None:
        """Raise UserError (one line) at the first bad setting."""
        if (self.checkpoint is None) == (self.hf is None):
            raise UsageError("serve: give exactly one of --checkpoint ROOT and --hf DIR")
        source = self.checkpoint if self.checkpoint is not None else self.hf
        if not Path(source).is_dir():
            raise UsageError(f"serve: {source}: no such folder")
        if self.step is not None and (self.hf is not None or self.step < 0):
            raise UsageError("serve: --step needs --checkpoint and must be >= 0")
        if self.chat_format is not None and self.chat_format not in FORMATS:
            raise UsageError(f"serve: --chat-format: expected one of {', '.join(FORMATS)}, got {self.chat_format!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"serve: --dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"serve: --port: expected 0-65535, got {self.port}")
        if self.max_n < 1:
            raise UsageError(f"serve: --max-n: must be >= 1, got {self.max_n}")
        if self.max_request_bytes < 1:
            raise UsageError(f"serve: --max-request-bytes: must be >= 1, got {self.max_request_bytes}")
        if self.model_name is not None and not self.model_name.strip():
            raise UsageError("serve: --model-name: empty")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise UsageError(f"serve: --api-key-env {self.api_key_env}: that environment variable is not set")

    @property
    def name(self) -> str:
        if self.model_name:
            return self.model_name
        return Path(self.checkpoint if self.checkpoint is not None else self.hf).resolve().name or "policy"


class ServedPolicy:
    """The loaded model, its tokenizer and chat format. `request` validates a body into the request
    and its prompt's tokens; `complete` answers it whole, `stream` chunk by chunk."""

    def __init__(self, name: str, model, cfg, tokenizer, fmt: ChatFormat):
        self.name, self.model, self.cfg, self.tokenizer, self.format = name, model, cfg, tokenizer, fmt
        self.created = int(time.time())
        self.stop_ids = sorted({fmt.stop_id, tokenizer.eos_id})
        self.lock = threading.Lock()

    def model_object(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "hpc"}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_object()]}

    def request(self, body: Any, max_n: int) -> tuple[ChatRequest, list[int]]:
        """The validated request and its prompt's tokens; RequestError for a bad one, a prompt too
        long for the context among them (refused before tokenizing when its bytes prove it)."""
        if isinstance(body, dict) and body.get("model") not in (None, self.name):
            raise RequestError(404, f"the model {body.get('model')!r} does not exist (this server has "
                                    f"{self.name!r})", "model", "model_not_found")
        req = parse_request(body, max_n)
        rendered = [m for m in req.messages if m["role"] != "system" or self.format.include_system]
        fewest = sum(len(m["content"].encode("utf-8")) for m in rendered) // self.tokenizer.max_token_bytes
        if fewest >= self.cfg.max_seq_len:
            raise RequestError(400, f"the messages are at least {fewest} tokens, more than the model's context of "
                                    f"{self.cfg.max_seq_len} tokens", "messages", "context_length_exceeded")
        prompt = self.format.render(req.messages)
        room = self.cfg.max_seq_len - len(prompt)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            raise RequestError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens "
                                    f"({req.max_tokens if req.max_tokens is not None else 1}) exceeds the "
                                    f"model's context of {self.cfg.max_seq_len} tokens", "messages",
                               "context_length_exceeded")
        return req, prompt

    def complete(self, req: ChatRequest, prompt: list[int]) -> dict[str, Any]:
        """The chat.completion object answering `req`."""
        completions, logprobs = self._generate(req, prompt)
        choices = []
        for i, c in enumerate(completions):
            choices.append({"index": i, "message": {"role": "assistant", "content": self._content(c, req.stop)},
                            "logprobs": {"content": logprobs[i], "refusal": None} if logprobs else None,
                            "finish_reason": c.finish_reason})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": usage(len(prompt), sum(len(c.tokens) for c in completions))}

    def stream(self, req: ChatRequest, prompt: list[int], send: Callable[[dict[str, Any]], None]) -> None:
        """Answer `req` as chat.completion.chunk objects handed to `send` as they are ready (see the
        module docstring); what `send` raises (a client gone) ends the generation."""
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def piece(index: int, delta: dict[str, Any], **kw: Any) -> None:
            send(chunk(completion_id, created, self.name, index, delta, **kw))

        for i in range(req.n):
            piece(i, {"role": "assistant", "content": ""})
        sent = [""] * req.n

        def on_step(rows: list[list[int]], finished: list[bool]) -> None:
            for i, (tokens, done) in enumerate(zip(rows, finished)):
                text = "" if done else self._settled_text(tokens, req.stop)
                if len(text) > len(sent[i]) and text.startswith(sent[i]):
                    piece(i, {"content": text[len(sent[i]):]})
                    sent[i] = text

        completions, logprobs = self._generate(req, prompt, on_step)
        for i, c in enumerate(completions):
            content = self._content(c, req.stop)
            if not content.startswith(sent[i]):   # a tokenizer whose decoding of a prefix is no prefix
                log.warning("serve: streamed text of choice %d is not a prefix of its reply", i)
            elif len(content) > len(sent[i]):
                piece(i, {"content": content[len(sent[i]):]})
            if logprobs:
                piece(i, {}, logprobs=logprobs[i])
            piece(i, {}, finish_reason=c.finish_reason)
        if req.include_usage:
            send({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": self.name,
                  "choices": [], "usage": usage(len(prompt), sum(len(c.tokens) for c in completions))})

    def _generate(self, req: ChatRequest, prompt: list[int], on_step=None):
        """(the completions, their log-prob entries or None); the model is used by one request at a time."""
        import torch

        from hpc.policy.generate import SamplingParams, generate

        params = SamplingParams(max_new_tokens=req.max_tokens or self.cfg.max_seq_len - len(prompt),
                                temperature=req.temperature, top_p=req.top_p, stop=req.stop,
                                stop_token_ids=self.stop_ids, seed=req.seed)
        device = next(self.model.parameters()).device
        with self.lock, (torch.cuda.device(device) if device.type == "cuda" else _nothing()):
            completions = generate(self.model, self.cfg, self.tokenizer, [prompt] * req.n, params, on_step=on_step)
            temperature = req.temperature if req.temperature > 0 else 1.0   # greedy: the sampler's T = 1
            logprobs = [self._logprobs(prompt, c.tokens, req.top_logprobs, temperature) for c in completions] \
                if req.logprobs else None
        return completions, logprobs

    def _logprobs(self, prompt: list[int], tokens: list[int], top: int,
                  temperature: float) -> list[dict[str, Any]]:
        """The reply's log-prob entries: each token's log-prob as the trainer computes it at
        `temperature` (`sequence_logprobs` over prompt + reply) and, with `top`, the `top`
        likeliest tokens at its position (log_softmax(logits / temperature) of the same forward)."""
        import torch

        from hpc.policy.model import forward_logits, mask_padded_vocab, sequence_logprobs

        if not tokens:
            return []
        device = next(self.model.parameters()).device
        sequence = torch.tensor([prompt + tokens], dtype=torch.long, device=device)
        start = len(prompt) - 1   # position predicting the reply's first token
        with torch.no_grad():
            chosen = sequence_logprobs(self.model, sequence, None, self.cfg.vocab_size, False,
                                       temperature)[0][0, start:].tolist()
            alternatives: list[list[tuple[tuple[str, bytes], float]]] = [[] for _ in tokens]
            if top:
                logits = forward_logits(self.model, sequence)[0, start:-1]
                scaled = mask_padded_vocab(logits.float() / temperature, self.cfg.vocab_size)
                values, ids = torch.log_softmax(scaled, -1).topk(top)
                alternatives = [[(self._token(t), lp) for t, lp in zip(row_ids, row_values)]
                                for row_ids, row_values in zip(ids.tolist(), values.tolist())]
        return [logprob_entry(self._token(t), lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]

    def _token(self, token: int) -> tuple[str, bytes]:
        """A token as log-prob entries show it: its text (U+FFFD for part of a character) and its bytes."""
        return self.tokenizer.decode([token], skip_special=False), self.tokenizer.token_bytes(token)

    def _settled_text(self, tokens: list[int], stops: list[str]) -> str:
        """The text of a reply still being generated that no later token can change: without an
        incomplete UTF-8 character at its end, and without an end that may yet become a stop string."""
        text = self.tokenizer.decode(tokens).rstrip("\ufffd")
        pending = max((k for s in stops for k in range(1, len(s) + 1) if text.endswith(s[:k])), default=0)
        return text[:len(text) - pending]

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


def _tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json a tokenizer spec names (None: the byte tokenizer)."""
    if spec == "byte":
        return None
    return Path(spec) if Path(spec).is_file() else Path(spec) / "tokenizer.json"


def _same_tokenizer(a: str, b: str) -> bool:
    fa, fb = _tokenizer_file(a), _tokenizer_file(b)
    if fa is None or fb is None:
        return fa is fb
    try:
        return fa.read_bytes() == fb.read_bytes()
    except OSError:
        return False


def with_run_settings(sc: ServerConfig) -> ServerConfig:
    """`sc` completed from the training run whose checkpoint it names (`hpc.rl.checkpoints`): the
    checkpoint root and step, and the tokenizer, chat format and system-message rule the run
    trained with. A tokenizer or chat format other than the run's is a UserError. `--hf` and a
    checkpoint saved outside a run (no trainer.json.N beside it) are left as they are."""
    from hpc.policy.chat import chat_format
    from hpc.policy.checkpoint import checkpoint_dir
    from hpc.policy.tokenizer import load_tokenizer
    from hpc.rl.checkpoints import CHECKPOINTS, complete_step, find_policy_checkpoint

    if sc.checkpoint is None:
        return sc
    given = Path(sc.checkpoint).resolve()   # RUN, RUN/checkpoints, RUN/checkpoints/policy or its iter_N
    if all(complete_step(folder) is None for folder in (given / CHECKPOINTS, given, given.parent, given.parent.parent)):
        return sc
    ckpt = find_policy_checkpoint(given)
    if sc.step is not None:
        ckpt = find_policy_checkpoint(checkpoint_dir(ckpt.root, sc.step))
    run = ckpt.config
    if sc.tokenizer is not None and not _same_tokenizer(sc.tokenizer, ckpt.tokenizer):
        raise UsageError(f"serve: --tokenizer {sc.tokenizer}: {ckpt.run} was trained with the tokenizer "
                         f"{ckpt.tokenizer}; leave --tokenizer out to serve it with that one")
    if sc.chat_format is not None:
        tokenizer = load_tokenizer(ckpt.tokenizer)
        if chat_format(tokenizer, sc.chat_format).name != chat_format(tokenizer, run.chat_format).name:
            raise UsageError(f"serve: --chat-format {sc.chat_format}: {ckpt.run} was trained with the chat format "
                             f"{run.chat_format}; leave --chat-format out to serve it with that one")
    return dataclasses.replace(
        sc, checkpoint=str(ckpt.root), step=ckpt.step, tokenizer=ckpt.tokenizer, model_name=sc.name,
        chat_format=sc.chat_format or run.chat_format,
        include_system=run.include_system if sc.include_system is None else sc.include_system)


def load_served_policy(sc: ServerConfig, init: bool = True) -> ServedPolicy:
    """Start torch.distributed for this one process (unless `init` is False: the caller set up
    TP = PP = 1 already), build the policy and load its weights, with the tokenizer and chat
    format of its training run (`with_run_settings`)."""
    from hpc.policy.chat import chat_format
    from hpc.policy.config import ParallelSizes
    from hpc.policy.model import build_policy
    from hpc.policy.parallel import init_parallel
    from hpc.policy.tokenizer import load_tokenizer

    sc = with_run_settings(sc)
    tokenizer = load_tokenizer(sc.tokenizer or (sc.hf if sc.hf is not None else "byte"))
    fmt = chat_format(tokenizer, sc.chat_format or "auto", sc.include_system is not False)
    if sc.hf is not None:
        from hpc.policy.hf_convert import hf_policy_config

        cfg = hf_policy_config(sc.hf, dtype=sc.dtype or "auto")
    else:
        from hpc.policy.checkpoint import checkpoint_config

        cfg = checkpoint_config(sc.checkpoint, sc.step)
        cfg.parallel = ParallelSizes()
        if sc.dtype is not None:
            cfg.dtype = sc.dtype
        if sc.tokenizer is None and tokenizer.vocab_size != cfg.vocab_size:
            raise TokenizerError(f"serve: {sc.checkpoint} records no tokenizer (it was saved outside a training run) and "
                                 f"its vocabulary of {cfg.vocab_size} tokens is not the byte tokenizer's "
                                 f"{tokenizer.vocab_size}: name its tokenizer with --tokenizer")
    if tokenizer.vocab_size > cfg.padded_vocab_size:
        raise TokenizerError(f"serve: the tokenizer's {tokenizer.vocab_size} tokens do not fit the model's "
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


def make_handler(policy: ServedPolicy, api_key: str | None, max_n: int, max_request_bytes: int):
    """The request handler class for one served policy."""
    models_path = "/v1/models"

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

        def _route(self, method: str, path: str) -> None:
            routes = {"/health": "GET", models_path: "GET", f"{models_path}/MODEL": "GET",
                      "/v1/chat/completions": "POST"}
            route = f"{models_path}/MODEL" if path.startswith(models_path + "/") else path
            if route not in routes:
                raise RequestError(404, f"unknown path {path} (this server has "
                                        f"{', '.join(f'{m} {p}' for p, m in routes.items())})", code="not_found")
            if routes[route] != method:
                raise RequestError(405, f"{path}: use {routes[route]}", code="method_not_allowed")

        def _handle(self, method: str) -> None:
            try:
                body = self._read_body() if method == "POST" else None
                path = self._path()
                self._route(method, path)
                if path == "/health":   # before the key: probes carry none
                    self._send(200, {"status": "ok"})
                    return
                if not self._authorized():
                    raise RequestError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                       code="invalid_api_key")
                if path == models_path:
                    self._send(200, policy.models())
                    return
                if path.startswith(models_path + "/"):
                    model = urllib.parse.unquote(path[len(models_path) + 1:])
                    if model != policy.name:
                        raise RequestError(404, f"the model {model!r} does not exist (this server has "
                                                f"{policy.name!r})", "model", "model_not_found")
                    self._send(200, policy.model_object())
                    return
                try:
                    payload = json.loads(body)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise RequestError(400, f"the request body is not valid JSON ({e})") from None
                req, prompt = policy.request(payload, max_n)
                if req.stream:
                    self._stream(lambda send: policy.stream(req, prompt, send))
                else:
                    self._send(200, policy.complete(req, prompt))
            except RequestError as e:
                self._send(e.status, e.body())
                if e.status == 413:
                    self._linger(int(self.headers["Content-Length"]))
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            except Exception as e:   # the server's own fault: the traceback stays here
                log.exception("serve: %s %s failed", method, self.path)
                self._send(500, _server_error(e).body())

        def _stream(self, run: Callable[[Callable[[dict[str, Any]], None]], None]) -> None:
            """Server-sent events, HTTP/1.1 chunked: `data: JSON` per chunk `run` sends, then
            `data: [DONE]`. A failure once the stream has begun is an `error` event."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(data: bytes) -> None:
                data = b"data: " + data + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

            try:
                run(lambda payload: event(json.dumps(payload).encode()))
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as e:
                log.exception("serve: a stream failed")
                event(json.dumps(_server_error(e).body()).encode())
            event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                raise RequestError(411, "a Content-Length header is required")
            if int(length) > max_request_bytes:
                self.close_connection = True
                raise RequestError(413, f"the request body is {int(length)} bytes, more than this server's "
                                        f"--max-request-bytes {max_request_bytes}", code="request_too_large")
            return self.rfile.read(int(length))

        def _linger(self, unread: int) -> None:
            """After refusing a body unread: stop sending, then read and drop what the client still
            sends (for LINGER_S at most), so that closing the connection with unread data does not
            reset it before the client has read the answer ("lingering close")."""
            deadline = time.monotonic() + LINGER_S
            try:
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(LINGER_S)
                while unread > 0 and time.monotonic() < deadline:
                    data = self.rfile.read1(min(unread, 1 << 16))
                    if not data:
                        break
                    unread -= len(data)
            except OSError:
                pass

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("PUT")

        def do_DELETE(self) -> None:
            self._handle("DELETE")

    return Handler


def _server_error(e: Exception) -> RequestError:
    return RequestError(500, f"internal error: {type(e).__name__}: {e}".splitlines()[0], kind="server_error")


class _Server(ThreadingHTTPServer):
    """One thread per connection; a client that drops its connection is a log line, not a traceback."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            log.info("serve: %s closed its connection", client_address[0])
        else:
            log.exception("serve: a request from %s failed", client_address[0])


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
        server = _Server((sc.host, sc.port), make_handler(policy, api_key, sc.max_n, sc.max_request_bytes))
    except OSError as e:
        raise UsageError(f"serve: cannot listen on {sc.host}:{sc.port} ({e.strerror})") from None
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
    src.add_argument("--checkpoint", metavar="RUN|ROOT",
                     help="a training run (or one of its checkpoints: served with the run's tokenizer and chat "
                          "format), or a dist_checkpointing root (hpc.policy.checkpoint)")
    src.add_argument("--hf", metavar="DIR", help="a HuggingFace Llama / Qwen2 checkpoint directory")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: latest)")
    p.add_argument("--tokenizer", help="byte, or a HF directory / tokenizer.json (default: the run's, the --hf dir, "
                                       "else byte; another than the run's is refused)")
    p.add_argument("--chat-format", choices=FORMATS,
                   help="how messages become tokens (default: the run's, else auto: from the tokenizer's special "
                        "tokens; another than the run's is refused)")
    p.add_argument("--no-system", action="store_true",
                   help="leave system messages out of the prompt (default: as the run trained, else kept)")
    p.add_argument("--model-name", help="the model id clients name (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed)")
    p.add_argument("--api-key-env", metavar="VAR", help="require Authorization: Bearer $VAR")
    p.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default: the checkpoint's; auto: bf16 on GPU)")
    p.add_argument("--max-n", type=int, default=16, help="most samples per request (default 16)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"largest request body; larger ones get 413 unread (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--seed", type=int, default=1234, help="torch's seed at start")


def config_from_args(args) -> ServerConfig:
    sc = ServerConfig(checkpoint=args.checkpoint, step=args.step, hf=args.hf, tokenizer=args.tokenizer,
                      chat_format=args.chat_format, model_name=args.model_name, host=args.host, port=args.port,
                      api_key_env=args.api_key_env, dtype=args.dtype, include_system=False if args.no_system else None,
                      max_n=args.max_n, max_request_bytes=args.max_request_bytes, seed=args.seed)
    sc.validate()
    return sc

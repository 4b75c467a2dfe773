"""A policy behind any OpenAI-compatible chat-completions endpoint: a frontier model's API, vLLM,
or the project's own policy under `hpc serve`.

    policy = OpenAIChatPolicy("https://api.openai.com/v1", "gpt-4o", api_key_env="OPENAI_API_KEY")
    trajectory = Episode(task, backend, cfg, root).run(policy)
    policy.prompt_tokens, policy.completion_tokens, policy.requests

Standard library only (`urllib.request`). The base URL is the API root as OpenAI's clients take it
(ending in `/v1`); requests go to `BASE/chat/completions`. The key comes from the named
environment variable, read when the policy is made; without it no Authorization header is sent
(a local server). Connection errors, timeouts, 408, 409, 429 and 5xx are retried with exponential
backoff (a `Retry-After` header is honoured); 400, 401, 403, 404 and the rest are an
`EndpointError` (a UserError) at once, with the server's own message, and so is running out of
retries: an episode that meets one ends (`endpoint_error`) with its turns kept.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from hpc.errors import ConfigError, UserError

RETRY_STATUS = frozenset({408, 409, 429})


class EndpointError(UserError):
    """The endpoint refused or failed a request (after the retries): one line, its own message."""


class _Retry(Exception):
    """A failure worth another attempt; `wait` is the server's Retry-After (seconds) if it sent one."""

    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


class OpenAIChatPolicy:
    """`respond(messages) -> str` through `POST BASE/chat/completions` (the agent's Policy protocol).

    Sampling fields left None are not sent (the endpoint's defaults; some reasoning models refuse
    a temperature). `max_tokens_field` is `max_tokens`, or `max_completion_tokens` for endpoints
    that want that name. `extra` is merged into every request body. Usage totals (tokens as the
    endpoint counts them, requests, retries) accumulate on the instance; thread-safe.
    `last_usage` is the last answer's (prompt_tokens, completion_tokens) as the endpoint counted
    them (None when it sent no usage): how long the conversation is in the served model's tokens.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
                 temperature: float | None = None, top_p: float | None = None, max_tokens: int | None = None,
                 timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 seed: int | None = None, stop: list[str] | None = None, max_tokens_field: str = "max_tokens",
                 extra: dict[str, Any] | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"OpenAI endpoint: the base URL must start with http:// or https://, got {base_url!r}")
        if not model:
            raise ConfigError("OpenAI endpoint: a model name is required")
        if temperature is not None and not 0 <= temperature <= 2:
            raise ConfigError(f"OpenAI endpoint: temperature must be in [0, 2], got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"OpenAI endpoint: top_p must be in (0, 1], got {top_p}")
        if max_tokens is not None and max_tokens < 1:
            raise ConfigError(f"OpenAI endpoint: max_tokens must be >= 1, got {max_tokens}")
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ConfigError("OpenAI endpoint: retries and backoff must be >= 0, the timeout > 0")
        if max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ConfigError(f"OpenAI endpoint: max_tokens_field must be max_tokens or max_completion_tokens, "
                              f"got {max_tokens_field!r}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) if api_key_env else None
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.timeout_s, self.retries, self.backoff_s, self.max_backoff_s = timeout_s, retries, backoff_s, max_backoff_s
        self.seed, self.stop, self.max_tokens_field = seed, stop, max_tokens_field
        self.extra = dict(extra or {})
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.requests = 0             # answered requests
        self.retried = 0              # attempts that failed and were tried again
        self.last_finish_reason = ""
        self.last_usage: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:   # never the key
        return f"OpenAIChatPolicy({self.base_url!r}, {self.model!r}, api_key_env={self.api_key_env!r})"

    def usage(self) -> dict[str, int]:
        """The totals so far, for metrics."""
        with self._lock:
            return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens, "retried": self.retried}

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The request body for `messages`."""
        body: dict[str, Any] = {"model": self.model, "messages": [dict(m) for m in messages]}
        for key, value in (("temperature", self.temperature), ("top_p", self.top_p),
                           (self.max_tokens_field, self.max_tokens), ("seed", self.seed), ("stop", self.stop)):
            if value is not None:
                body[key] = value
        body.update(self.extra)
        return body

    def respond(self, messages: list[dict[str, str]]) -> str:
        """The first choice's content (empty when the endpoint sent none)."""
        return self.complete(messages)["choices"][0]["message"].get("content") or ""

    def complete(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The whole chat.completion object for `messages`, after retries."""
        data = json.dumps(self.body(messages)).encode()
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                response = self._post(data)
                break
            except _Retry as e:
                if attempt + 1 == attempts:
                    raise EndpointError(f"OpenAI endpoint {self.url}: gave up after {attempts} attempt"
                                        f"{'s' if attempts > 1 else ''}: {e}") from None
                with self._lock:
                    self.retried += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (1 + 0.25 * random.random())
                time.sleep(min(self.max_backoff_s, e.wait) if e.wait is not None else delay)
        self._check(response)
        usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.last_finish_reason = str(response["choices"][0].get("finish_reason") or "")
            self.last_usage = (prompt, completion) if prompt else None
        return response

    def _post(self, data: bytes) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = _error_message(e)
            if e.code in RETRY_STATUS or e.code >= 500:
                raise _Retry(f"HTTP {e.code}: {detail}", _retry_after(e)) from None
            raise EndpointError(f"OpenAI endpoint {self.url}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError, OSError)):
                raise _Retry(f"cannot connect ({_oneline(reason)})") from None
            raise EndpointError(f"OpenAI endpoint {self.url}: {_oneline(reason)}") from None
        except (TimeoutError, socket.timeout) as e:
            raise _Retry(f"no answer within {self.timeout_s:g} s ({_oneline(e)})") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise _Retry(f"connection lost ({type(e).__name__}: {_oneline(e)})") from None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _Retry(f"the answer is not JSON: {raw[:200]!r}") from None

    def _check(self, response: Any) -> None:
        ok = isinstance(response, dict) and isinstance(response.get("choices"), list) and response["choices"] \
            and isinstance(response["choices"][0], dict) and isinstance(response["choices"][0].get("message"), dict)
        if not ok:
            raise EndpointError(f"OpenAI endpoint {self.url}: not a chat completion: {json.dumps(response)[:200]}")


def _oneline(value: Any) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else type(value).__name__


def _error_message(e: urllib.error.HTTPError) -> str:
    """The `error.message` of OpenAI's error JSON, else the start of the body, else the reason."""
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        body = json.loads(raw)
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return _oneline(message)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    text = raw.decode("utf-8", errors="replace").strip()
    return _oneline(text[:300]) if text else _oneline(e.reason)


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    value = e.headers.get("Retry-After") if e.headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None

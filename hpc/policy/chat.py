"""Chat messages as token ids: the template a policy was trained with, applied one message at a
time so a multi-turn trajectory grows by appending (the tokens the policy generated are kept as
they were sampled, never re-encoded).

Three formats, picked from the tokenizer's special tokens unless named:
- `chatml` (Qwen2): `<|im_start|>role\\ncontent<|im_end|>\\n`; a reply stops at `<|im_end|>`.
- `llama3`: `<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`, after
  `<|begin_of_text|>`; a reply stops at `<|eot_id|>`.
- `plain` (the byte tokenizer, and any tokenizer without chat tokens): `<role>\\ncontent` and the
  eos token; a reply stops at eos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpc.errors import ConfigError, TokenizerError
from hpc.policy.tokenizer import Tokenizer

FORMATS = ("auto", "chatml", "llama3", "plain")


@dataclass(frozen=True)
class ChatFormat:
    name: str
    tokenizer: Tokenizer
    stop_id: int              # the token that ends an assistant reply
    include_system: bool = True   # False: system messages are left out (tiny models, short contexts)

    def begin(self) -> list[int]:
        """Tokens before the first message."""
        if self.name == "llama3":
            bos = self.tokenizer.token_id("<|begin_of_text|>")
            return [bos] if bos is not None else []
        return []

    def header(self, role: str) -> list[int]:
        """What precedes a message's content; the generation prompt is `header("assistant")`."""
        if self.name == "chatml":
            return self.tokenizer.encode(f"<|im_start|>{role}\n")
        if self.name == "llama3":
            return self.tokenizer.encode(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
        return self.tokenizer.encode(f"<{role}>\n")

    def after_reply(self) -> list[int]:
        """Template tokens that follow a reply's stop token (not generated, not trained on)."""
        return self.tokenizer.encode("\n") if self.name == "chatml" else []

    def message(self, role: str, content: str) -> list[int]:
        """One whole message (empty for a system message when `include_system` is False)."""
        if role == "system" and not self.include_system:
            return []
        return self.header(role) + self.tokenizer.encode(content) + [self.stop_id] + self.after_reply()

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The whole conversation, ready for the assistant's next reply."""
        ids = self.begin()
        for m in messages:
            ids += self.message(m["role"], m["content"])
        return ids + (self.header("assistant") if add_generation_prompt else [])


def chat_format(tokenizer: Tokenizer, name: str = "auto", include_system: bool = True) -> ChatFormat:
    """The format `name`, or for `auto` the one the tokenizer's special tokens belong to."""
    if name not in FORMATS:
        raise ConfigError(f"chat format: expected one of {', '.join(FORMATS)}, got {name!r}")
    if name == "auto":
        if tokenizer.token_id("<|im_start|>") is not None and tokenizer.token_id("<|im_end|>") is not None:
            name = "chatml"
        elif tokenizer.token_id("<|start_header_id|>") is not None and tokenizer.token_id("<|eot_id|>") is not None:
            name = "llama3"
        else:
            name = "plain"
    stop_token = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}.get(name)
    stop = tokenizer.eos_id if stop_token is None else tokenizer.token_id(stop_token)
    if stop is None:
        raise TokenizerError(f"chat format {name}: the tokenizer has no {stop_token} token")
    return ChatFormat(name, tokenizer, stop, include_system)

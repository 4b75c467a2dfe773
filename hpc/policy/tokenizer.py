"""Tokenizers behind one small interface: bytes for the tiny default, HF `tokenizers` for real models.

Both have `vocab_size`, `pad_id`, `bos_id` (or None), `eos_id`, `encode(text)`,
`decode(ids, skip_special=True)`, `token_bytes(id)`, `special_ids` and `max_token_bytes`.
`load_tokenizer("byte")` gives the byte tokenizer; a HF checkpoint directory (or its
tokenizer.json) gives the HF one.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from hpc.errors import TokenizerError


class Tokenizer(Protocol):
    """What generation and training need from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    special_ids: frozenset[int]
    max_token_bytes: int      # most UTF-8 bytes of input text one token covers: B bytes are >= B / this tokens

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for (part of a UTF-8 character, for some), a special
        token's own string."""
        ...

    def token_id(self, token: str) -> int | None:
        """The id of a special token's string, None when the vocabulary has no such token."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; then <|pad|>, <|bos|>, <|eos|>. Any text round-trips, and no
    vocabulary file is needed, so the tiny CPU policy works out of the box."""

    SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.vocab_size = 256 + len(self.SPECIALS)
        self.special_ids = frozenset(range(256, self.vocab_size))
        self.max_token_bytes = 1   # special-token strings are plain text here: a byte each

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of the UTF-8 bytes of `text` (special-token strings are plain text here)."""
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of the ids; an incomplete UTF-8 sequence decodes to U+FFFD."""
        out, pending = [], bytearray()
        for i in ids:
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special:
                out.append(self.SPECIALS[i - 256])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self.SPECIALS[token_id - 256].encode()

    def token_id(self, token: str) -> int | None:
        return 256 + self.SPECIALS.index(token) if token in self.SPECIALS else None


class HFTokenizer:
    """A HF `tokenizers` tokenizer.json, with pad/bos/eos from the checkpoint's config files
    (generation_config.json, then config.json, then tokenizer_config.json). Without a pad token
    the eos token pads (padding is masked anyway)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        root = path.parent if path.is_file() else path
        file = path if path.is_file() else path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{file}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        ids = _special_ids(root, self._tok)
        if ids.get("eos") is None:
            raise TokenizerError(f"{root}: no eos token in generation_config.json, config.json or tokenizer_config.json")
        self.eos_id = ids["eos"]
        self.bos_id = ids.get("bos")
        self.pad_id = ids["pad"] if ids.get("pad") is not None else self.eos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of `text`; special-token strings in it are recognized, no template is applied."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level vocabulary's entry spelled back into its bytes; otherwise (a special token,
        another kind of vocabulary) the token's decoded text."""
        entry = self._tok.id_to_token(token_id)
        alphabet = _byte_level_alphabet()
        if (token_id not in self.special_ids and entry is not None and type(self._tok.decoder).__name__ == "ByteLevel"
                and all(c in alphabet for c in entry)):
            return bytes(alphabet[c] for c in entry)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest vocabulary entry in UTF-8 bytes, which is never fewer than the bytes of text
        its token stands for (a byte-level entry spells each byte as one character, a sentencepiece
        one a space as U+2581); three times that behind a normalizer (composing characters, as
        NFC does, shortens a text at most threefold: three Hangul jamo into one syllable). A bound,
        found without tokenizing, on how few tokens a text can be: what lets a server refuse a
        prompt too long for its context before encoding it."""
        longest = max(len(token.encode("utf-8")) for token in self._tok.get_vocab(with_added_tokens=True))
        return longest * (3 if self._tok.normalizer is not None else 1)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (that of `tokenizers`' ByteLevel): the byte each character of a
    byte-level vocabulary entry spells. Printable bytes spell themselves; the others, in order,
    the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def _special_ids(root: Path, tok) -> dict[str, int | None]:
    """pad/bos/eos ids: config files give ids (eos may be a list: the first is taken) or, in
    tokenizer_config.json, token strings."""
    found: dict[str, int | None] = {}
    for name in ("generation_config.json", "config.json"):
        data = _json(root / name)
        for kind in ("pad", "bos", "eos"):
            value = data.get(f"{kind}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if found.get(kind) is None and isinstance(value, int):
                found[kind] = value
    data = _json(root / "tokenizer_config.json")
    for kind in ("pad", "bos", "eos"):
        token = data.get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if found.get(kind) is None and isinstance(token, str):
            found[kind] = tok.token_to_id(token)
    return found


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """"byte", or a HF checkpoint directory / tokenizer.json path."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike,
              split_words: bool = True) -> "HFTokenizer":
    """A byte-level BPE tokenizer with ChatML special tokens trained on `texts` and saved as a HF
    tokenizer directory (tokenizer.json + tokenizer_config.json): a tiny policy's own vocabulary,
    so a reply of kernel code is a few hundred tokens rather than thousands of bytes. With
    `split_words` False, merges may span spaces and lines: on a corpus of a few files whole lines
    become tokens (the CPU-scale default, where a reply must be short)."""
    from tokenizers import Tokenizer as HFCore
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFCore(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|pad|>"}))
    return HFTokenizer(out)

"""Byte tokenizer and the HF `tokenizers` wrapper behind one interface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.errors import TokenizerError
from hpc.policy.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["", "plain ascii", "__global__ void k(float* a) { a[i] += 1; }\n", "héllo wörld 🚀 ∑", "<|eos|> is text here"]


def make_hf_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained here (no download), with Qwen-style specials and
    the tokenizer_config.json that names them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(names))
    return directory


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True) + [tok.eos_id]) == text


def test_byte_tokenizer_specials():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.special_ids == {256, 257, 258}
    ids = tok.encode("a", add_bos=True) + [tok.eos_id]
    assert ids == [257, 97, 258]
    assert tok.decode(ids, skip_special=False) == "<|bos|>a<|eos|>"
    # An incomplete UTF-8 sequence is replaced, not an error (a sample can stop mid-character).
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trips(tmp_path, text):
    tok = load_tokenizer(make_hf_tokenizer(tmp_path))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    if text:
        assert len(ids) < len(text.encode()) or len(text) < 3   # merges were learned


def test_hf_tokenizer_special_ids(tmp_path):
    root = make_hf_tokenizer(tmp_path)
    tok = HFTokenizer(root / "tokenizer.json")
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 0, None)
    assert tok.special_ids == {0, 1, 2} and tok.vocab_size == 300
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == tok.eos_id and tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "hi<|im_end|>"
    # generation_config.json outranks tokenizer_config.json; a list of eos ids gives the first.
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert HFTokenizer(root).eos_id == 1


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)
    root = make_hf_tokenizer(tmp_path)
    (root / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no eos token"):
        HFTokenizer(root)

"""Generation with the KV cache: equal to full recomputation, padding-independent, log-probs as the
trainer computes them, stop tokens / strings / max tokens honoured, seeded sampling reproducible."""

from __future__ import annotations

import pytest
import torch

from hpc.policy.generate import SamplingParams, generate, sample_next
from hpc.policy.tokenizer import ByteTokenizer

# megatron-core and torch.distributed.checkpoint warn about TE, Apex and their own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

TOK = ByteTokenizer()
PROMPTS = [TOK.encode("__global__ void"), TOK.encode("x"), TOK.encode("int main() { return 0; }")]


@pytest.fixture(scope="module")
def policy():
    from hpc.policy import model
    from hpc.policy.config import policy_config
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel(seed=3)
    cfg = policy_config({"max_seq_len": 128})
    net = model.build_policy(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():   # wider than the default init: peaked, prompt-dependent outputs
            p.normal_(0, 0.3)
    yield cfg, net
    teardown()


def _full_logits(cfg, net, prompt, completion):
    from hpc.policy.model import forward_logits, mask_padded_vocab

    seq = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = mask_padded_vocab(forward_logits(net, seq), cfg.vocab_size)[0]
    return logits[len(prompt) - 1:-1], torch.tensor(completion)


def test_greedy_with_cache_equals_full_recompute(policy):
    cfg, net = policy
    out = generate(net, cfg, TOK, PROMPTS, SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[]))
    for prompt, c in zip(PROMPTS, out):
        assert len(c.tokens) == 24 and c.finish_reason == "length"
        logits, tokens = _full_logits(cfg, net, prompt, c.tokens)
        assert logits.argmax(-1).tolist() == c.tokens
        expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=1e-5)
    assert len({tuple(c.tokens) for c in out}) == len(PROMPTS)   # the prompts matter


def test_left_padded_rows_equal_unbatched(policy):
    cfg, net = policy
    params = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[])
    batched = generate(net, cfg, TOK, PROMPTS, params)
    for prompt, c in zip(PROMPTS, batched):
        alone = generate(net, cfg, TOK, [prompt], params)[0]
        assert alone.tokens == c.tokens
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=1e-5)


def test_sampled_logprobs_are_the_temperature_scaled_distribution(policy):
    cfg, net = policy
    params = SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=11, stop_token_ids=[])
    for prompt, c in zip(PROMPTS, generate(net, cfg, TOK, PROMPTS, params)):
        logits, tokens = _full_logits(cfg, net, prompt, c.tokens)
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible(policy):
    cfg, net = policy
    def run(seed):
        params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed, stop_token_ids=[])
        return [c.tokens for c in generate(net, cfg, TOK, PROMPTS, params)]
    assert run(5) == run(5)
    assert run(5) != run(6)
    greedy = generate(net, cfg, TOK, PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[]))
    assert run(5) != [c.tokens for c in greedy]


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]]).repeat(2000, 1)
    probs = torch.softmax(logits[0], -1)           # 0.66, 0.24, 0.09, 0.01
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, 1.0, 0.85, g)
    assert set(tokens.tolist()) == {0, 1}          # 0.66 + 0.24 reaches 0.85
    torch.testing.assert_close(logp, probs.log()[tokens])
    tokens, _ = sample_next(logits, 1.0, 1e-6, g)
    assert set(tokens.tolist()) == {0}
    tokens, _ = sample_next(logits, 1.0, 1.0, g)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


class Scripted(torch.nn.Module):
    """A stand-in policy that emits a fixed token sequence per row, to test the loop's
    stopping rules exactly."""

    def __init__(self, scripts: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.scripts, self.vocab, self.calls = scripts, vocab, 0

    def forward(self, tokens, position_ids, attention_mask, inference_context=None, runtime_gather_output=None):
        logits = torch.zeros(tokens.shape[0], 1, self.vocab)
        for i, script in enumerate(self.scripts):
            logits[i, 0, script[min(self.calls, len(script) - 1)]] = 50.0
        self.calls += 1
        return logits


def test_stop_strings_stop_tokens_and_max_tokens(policy):
    cfg, _ = policy
    scripts = [TOK.encode("ab</s>cd"), TOK.encode("xyz") + [TOK.eos_id, 65], TOK.encode("0123456789"),
               TOK.encode("caf") + TOK.encode("é")[:1] + TOK.encode("é")[1:] + TOK.encode("!!"),
               TOK.encode("q") + [TOK.bos_id, TOK.bos_id] + TOK.encode("z!")]
    params = SamplingParams(max_new_tokens=6, temperature=0, stop=["</s>", "é", "qz"])
    out = generate(Scripted(scripts, cfg.padded_vocab_size), cfg, TOK, [[65]] * 5, params)
    assert (out[0].tokens, out[0].text, out[0].finish_reason) == (TOK.encode("ab</s>"), "ab</s>", "stop")
    assert (out[1].tokens, out[1].text, out[1].finish_reason) == (TOK.encode("xyz") + [TOK.eos_id], "xyz", "stop")
    assert (out[2].tokens, out[2].text, out[2].finish_reason) == (TOK.encode("012345"), "012345", "length")
    # A stop string made of a multi-byte character stops at the byte that completes it.
    assert (out[3].tokens, out[3].text, out[3].finish_reason) == (TOK.encode("café"), "café", "stop")
    # Special tokens (not stop tokens) inside a stop string's span are left out of the text it matches.
    assert (out[4].tokens, out[4].text) == (TOK.encode("q") + [TOK.bos_id, TOK.bos_id] + TOK.encode("z"), "qz")
    assert all(len(c.logprobs) == len(c.tokens) for c in out)


def test_stop_tokens_without_stop_strings_match_the_per_row_path(policy):
    # Without stop strings the stop tokens are checked on the device; the per-row path (taken
    # with a stop string that never matches) must give the same completions.
    cfg, _ = policy
    scripts = [TOK.encode("ab") + [TOK.eos_id] + TOK.encode("cd"), TOK.encode("0123456789"),
               [TOK.eos_id, 66], TOK.encode("x") + [TOK.bos_id] + TOK.encode("yz")]
    stops = [TOK.eos_id, TOK.bos_id]
    fast = generate(Scripted(scripts, cfg.padded_vocab_size), cfg, TOK, [[65]] * 4,
                    SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=stops))
    assert [(c.tokens, c.text, c.finish_reason) for c in fast] == [
        (TOK.encode("ab") + [TOK.eos_id], "ab", "stop"), (TOK.encode("012345"), "012345", "length"),
        ([TOK.eos_id], "", "stop"), (TOK.encode("x") + [TOK.bos_id], "x", "stop")]
    assert all(len(c.logprobs) == len(c.tokens) for c in fast)
    slow = generate(Scripted(scripts, cfg.padded_vocab_size), cfg, TOK, [[65]] * 4,
                    SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=stops, stop=["never"]))
    assert fast == slow
    # Every row stopped early: the loop ends before max_new_tokens.
    net = Scripted(scripts[:1] + scripts[2:], cfg.padded_vocab_size)
    out = generate(net, cfg, TOK, [[65]] * 3, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=stops))
    assert [c.finish_reason for c in out] == ["stop"] * 3 and net.calls < 20


def test_bad_requests_are_refused(policy):
    cfg, net = policy
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(net, cfg, TOK, [[1] * 100], SamplingParams(max_new_tokens=64))
    with pytest.raises(ValueError, match="top_p"):
        generate(net, cfg, TOK, PROMPTS, SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="at least one token"):
        generate(net, cfg, TOK, [[]], SamplingParams())

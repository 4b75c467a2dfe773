"""The static decoder: its prefill and one-token steps give the megatron model's own logits
(left padding, GQA, qkv bias, rope scaling, both core attentions), never read a cache column
that is padding or not written yet, and give generate() the samples of megatron's loop; on
CUDA the graph-replayed step equals the eager one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpc.policy import decode, model
from hpc.policy.config import policy_config
from hpc.policy.decode import StaticDecoder
from hpc.policy.generate import SamplingParams, generate
from tests.test_policy_generate import PROMPTS, TOK, Scripted
from tests.test_policy_model import parallel  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

VARIANTS = {
    "local, GQA": dict(attention="local"),
    "sdpa, GQA": dict(attention="sdpa"),
    "sdpa, MHA, qkv bias": dict(attention="sdpa", num_query_groups=4, qkv_bias=True),
    "local, qkv bias, rope scaling": dict(attention="local", qkv_bias=True, rope_scaling_factor=8.0),
    "sdpa, rope scaling, 8 heads of 2 groups": dict(attention="sdpa", rope_scaling_factor=8.0,
                                                    num_attention_heads=8, head_dim=8),
}
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[])
SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=4, stop_token_ids=[])


def _policy(**overrides):
    cfg = policy_config({"max_seq_len": 64, "dtype": "fp32", **overrides})
    torch.manual_seed(0)
    net = model.build_policy(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():   # wider than the default init: peaked, position-dependent outputs
            p.normal_(0, 0.3)
    return cfg, net


def _batch(cfg, lengths, steps):
    """Random tokens [b, w + steps] whose rows start after w - length left-padding columns."""
    g = torch.Generator().manual_seed(1)
    width = max(lengths)
    tokens = torch.randint(0, cfg.vocab_size, (len(lengths), width + steps), generator=g)
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    for i, n in enumerate(lengths):
        pad[i, :width - n] = True
    return tokens, pad, width


def _decode(decoder, tokens, pad, width):
    """Logits [b, 1 + steps, V] of the prefill and of one step per column after the prompts."""
    key_pad = F.pad(pad, (0, decoder.max_len - pad.shape[1]))
    with torch.no_grad():
        out = [decoder.prefill(tokens[:, :width], pad[:, :width])]
        out += [decoder.step(tokens[:, col], torch.tensor(col), key_pad) for col in range(width, tokens.shape[1])]
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS)
def test_prefill_and_steps_equal_the_full_forward_of_each_row_alone(parallel, overrides):  # noqa: F811
    cfg, net = _policy(**overrides)
    lengths = [9, 3, 6]
    tokens, pad, width = _batch(cfg, lengths, steps=7)
    got = _decode(StaticDecoder(net, cfg, len(lengths), max_len=24), tokens, pad, width)
    for i, n in enumerate(lengths):
        with torch.no_grad():
            alone = model.forward_logits(net, tokens[i:i + 1, ~pad[i]])[0]
        torch.testing.assert_close(got[i], alone[n - 1:], atol=1e-4, rtol=1e-4)


def test_stale_cache_columns_are_never_read(parallel):  # noqa: F811
    # A reused decoder holds another batch's keys and values in the columns this batch has not
    # written yet (and in all of them before its prefill): masked, they change nothing.
    cfg, net = _policy(attention="sdpa")
    tokens, pad, width = _batch(cfg, [5, 2], steps=6)
    fresh = _decode(StaticDecoder(net, cfg, 2, max_len=20), tokens, pad, width)
    reused = StaticDecoder(net, cfg, 2, max_len=20)
    reused.keys.uniform_(-100, 100)
    reused.values.uniform_(-100, 100)
    torch.testing.assert_close(_decode(reused, tokens, pad, width), fresh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_generate_samples_what_megatrons_loop_samples(parallel, attention, monkeypatch):  # noqa: F811
    cfg, net = _policy(attention=attention, qkv_bias=True)
    steps = []
    step = StaticDecoder.step

    def counted(self, *args):
        steps.append(args)
        return step(self, *args)

    monkeypatch.setattr(StaticDecoder, "step", counted)
    for params in (GREEDY, SAMPLED):
        static = generate(net, cfg, TOK, PROMPTS, params, cuda_graphs=False)
        megatron = generate(net, cfg, TOK, PROMPTS, params, decoder="megatron")
        assert [c.tokens for c in static] == [c.tokens for c in megatron]
        for s, m in zip(static, megatron):
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(m.logprobs), atol=1e-5, rtol=1e-5)
    assert len(steps) == 2 * (GREEDY.max_new_tokens - 1)     # "auto" took the static decoder


def test_a_row_generates_alike_alone_and_in_a_padded_batch(parallel):  # noqa: F811
    cfg, net = _policy(attention="sdpa")
    batched = generate(net, cfg, TOK, PROMPTS, GREEDY, decoder="static")
    for prompt, c in zip(PROMPTS, batched):
        alone = generate(net, cfg, TOK, [prompt], GREEDY, decoder="static")[0]
        assert alone.tokens == c.tokens
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=1e-5)


def test_what_the_static_decoder_refuses(parallel, monkeypatch):  # noqa: F811
    cfg, net = _policy()
    with pytest.raises(ValueError, match="needs a megatron GPTModel"):
        generate(Scripted([[65]], cfg.padded_vocab_size), cfg, TOK, [[65]], GREEDY, decoder="static")
    with pytest.raises(ValueError, match="decoder must be one of"):
        generate(net, cfg, TOK, PROMPTS, GREEDY, decoder="vllm")
    monkeypatch.setattr(net.config, "pipeline_model_parallel_size", 2)    # a pipeline stage, not a replica
    with pytest.raises(ValueError, match="StaticDecoder: needs the whole model in one stage"):
        StaticDecoder(net, cfg, 2, 16)
    assert decode.unsupported(net) == "needs the whole model in one stage"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_graph_replays_the_eager_step(parallel):  # noqa: F811
    cfg, net = _policy(attention="sdpa", qkv_bias=True, dtype="bf16")
    prompts = PROMPTS * 8
    for params in (GREEDY, SAMPLED, SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=[])):
        graphed = generate(net, cfg, TOK, prompts, params)
        eager = generate(net, cfg, TOK, prompts, params, cuda_graphs=False)
        assert [c.tokens for c in graphed] == [c.tokens for c in eager]
        for g, e in zip(graphed, eager):    # the same kernels: equal, but allow bf16 rounding
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-2, rtol=1e-2)

"""The policy's training-step paths: log-probs and entropy computed a chunk of positions at a time
over the real vocabulary columns equal the full fp32 log-softmax (values and gradients, at
temperature 1 and at a sampling temperature: log_softmax(logits / T)), and their
compiled chunk kernels equal the eager ones; the LM head fused into them (`sequence_logprobs`)
gives the values and parameter gradients of the materialized logits; a right-padded batch runs
without an explicit mask and gives the same logits at its real positions, and the RMSNorms run in
the activations' dtype while their weights stay fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hpc.policy import model
from hpc.policy.model import mask_padded_vocab, token_logprobs, token_logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

VOCAB, WIDTH = 17, 24        # 7 padding columns
CHUNK = 4                    # positions a chunk when chunked: 11 positions are chunks of 4, 4, 3


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0):
    """The whole [..., T, W] log-softmax of logits / temperature in fp32 under autograd, padding
    masked; the entropy over the real columns only (at the padding p log p = 0 x -inf)."""
    full = torch.log_softmax(mask_padded_vocab(logits.float() / temperature, vocab_size), dim=-1)
    logp = full[..., :vocab_size]
    return full.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _logits(dtype: torch.dtype, shape: str, seed: int = 0, length: int = 12):
    """(the model's output [B, T, W] or [T, W], its next-token slice as callers take it, targets
    with some in the padding)."""
    g = torch.Generator().manual_seed(seed)
    lead = (3,) if shape == "[B, T, V]" else ()
    out = (3 * torch.randn(*lead, length, WIDTH, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (*lead, length - 1), generator=g)
    targets[..., 2] = VOCAB + 2
    return out, out[..., :-1, :], targets


def _chunk_elements(logits: torch.Tensor) -> int:
    """`_CHUNK_ELEMENTS` for chunks of CHUNK positions of these logits."""
    return CHUNK * logits[..., 0, :].numel()


def _loss(logp: torch.Tensor, entropy: torch.Tensor, grads: str, seed: int = 1) -> torch.Tensor:
    """A random weighting of what `grads` names: the upstream gradients g_logp and g_H, away
    from 0 so that a dropped term shows. A target in the padding makes the loss -inf, but its
    gradient (-p g_logp at the real columns) is finite."""
    g = torch.Generator().manual_seed(seed)
    w_logp, w_entropy = (torch.rand(logp.shape, generator=g) + 0.5 for _ in range(2))
    loss = torch.zeros(())
    if grads in ("both", "logp"):
        loss = loss + (logp * w_logp).sum()
    if grads in ("both", "entropy"):
        loss = loss - (entropy * w_entropy).sum()
    return loss


def _grad(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, out)
    return grad


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T=1", "T=0.7"])
@pytest.mark.parametrize("grads", ["both", "logp", "entropy"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one chunk", "chunks of 4, 4, 3"])
@pytest.mark.parametrize("shape", ["[B, T, V]", "[T, V]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_equal_the_full_log_softmax(dtype, shape, chunked, grads, temperature, monkeypatch):
    out, logits, targets = _logits(dtype, shape)
    if chunked:
        monkeypatch.setattr(model, "_CHUNK_ELEMENTS", _chunk_elements(logits))
    assert [len(range(11)[c]) for c in model._position_chunks(11, logits[..., 0, :].numel())] == \
        ([4, 4, 3] if chunked else [11])

    logp, entropy = token_logprobs_and_entropy(logits, targets, VOCAB, temperature)
    grad = _grad(out, _loss(logp, entropy, grads))
    ref_logp, ref_entropy = _reference(logits, targets, VOCAB, temperature)
    ref_grad = _grad(out, _loss(ref_logp, ref_entropy, grads))

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == targets.shape
    assert torch.all(logp[..., 2] == float("-inf"))
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    assert grad.dtype == dtype and torch.all(grad[..., VOCAB:] == 0) and torch.all(grad[..., -1, :] == 0)
    assert grad[..., :-1, :VOCAB].abs().min() > 0
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-5)
    else:   # both round the same fp32 gradient to bf16, up to fp32 rounding: at most an ulp apart
        torch.testing.assert_close(grad, ref_grad, rtol=2 ** -7, atol=1e-5)
    if grads == "logp":     # token_logprobs: the same values, and no entropy gradient at all
        alone = token_logprobs(logits, targets, VOCAB, temperature)
        assert torch.equal(alone, logp)
        torch.testing.assert_close(_grad(out, _loss(alone, entropy.detach(), "logp")), grad, rtol=0, atol=0)


@pytest.fixture
def no_recompile():
    """Recompiles raise, through dynamo's own config patch: pytest's monkeypatch, undone, deletes
    the key from dynamo's config module (and a later test's monkeypatch then fails)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def test_the_compiled_chunks_equal_the_eager_ones_and_compile_once(monkeypatch, no_recompile):
    """The CUDA path (the chunk functions under torch.compile) run by CPU inductor: the same
    values and gradients as eager, and one graph per function for chunks of 4, 4, 3 positions,
    another sequence length, a missing upstream gradient (dynamic shapes, zeros for None), and
    logits that do not require grad (scoring without a backward), and another temperature."""
    torch._dynamo.reset()
    model._compiled.cache_clear()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    results = {}
    for compiled in (False, True):
        monkeypatch.setattr(model, "_COMPILED_DEVICES", frozenset({"cpu"} if compiled else ()))
        for length, temperature in ((12, 1.0), (8, 1.0), (12, 0.7)):
            out, logits, targets = _logits(torch.bfloat16, "[B, T, V]", length=length)
            monkeypatch.setattr(model, "_CHUNK_ELEMENTS", _chunk_elements(logits))
            for grads in ("both", "logp", "entropy"):
                logp, entropy = token_logprobs_and_entropy(logits, targets, VOCAB, temperature)
                results[compiled, length, temperature, grads] = logp, entropy, _grad(out, _loss(logp, entropy, grads))
            with torch.no_grad():
                assert torch.equal(token_logprobs(logits.detach(), targets, VOCAB, temperature), logp.detach())
    assert model._compiled.cache_info().currsize == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    for (compiled, *key), (logp, entropy, grad) in results.items():
        if compiled:
            eager_logp, eager_entropy, eager_grad = results[False, *key]
            torch.testing.assert_close(logp, eager_logp, rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy, eager_entropy, rtol=0, atol=1e-5)
            assert torch.all(grad[..., VOCAB:] == 0)
            torch.testing.assert_close(grad, eager_grad, rtol=2 ** -7, atol=1e-5)


def _head_inputs(dtype: torch.dtype, length: int = 12, batch: int = 3, hidden: int = 8, seed: int = 2):
    """(hidden states [T, B, h] of `length` positions, a weight [WIDTH, h] with 7 padding rows,
    targets [B, T] with some in the padding), the first two leaves that require grad."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(length - 1, batch, hidden, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(WIDTH, hidden, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (batch, length - 1), generator=g)
    targets[..., 2] = VOCAB + 2
    return states, weight, targets


def _fused_and_materialized(states, weight, targets, grads: str, temperature: float):
    """((log p, H), (d hidden, d weight)) of the fused head, then the same of its logits
    materialized ([B, T, W], as GPTModel returns them) and fed to `token_logprobs_and_entropy`."""
    out = []
    for fused in (True, False):
        if fused:
            logp, entropy = model._LinearLogprobsEntropy.apply(states, weight, targets, VOCAB, True, temperature)
        else:
            logits = (states @ weight.t()).transpose(0, 1)
            logp, entropy = token_logprobs_and_entropy(logits, targets, VOCAB, temperature)
        out.append(((logp, entropy), torch.autograd.grad(_loss(logp, entropy, grads), (states, weight))))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T=1", "T=0.7"])
@pytest.mark.parametrize("grads", ["both", "logp", "entropy"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one chunk", "chunks of 4, 4, 3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_head_equals_its_materialized_logits(dtype, chunked, grads, temperature, monkeypatch):
    states, weight, targets = _head_inputs(dtype)
    if chunked:
        monkeypatch.setattr(model, "_CHUNK_ELEMENTS", CHUNK * 3 * VOCAB)
    lengths = [len(range(11)[c]) for c in model._position_chunks(11, 3 * VOCAB)]
    assert lengths == ([4, 4, 3] if chunked else [11])
    seen = []
    forward_chunk = model._forward_chunk
    monkeypatch.setattr(model, "_forward_chunk", lambda x, t, temp: seen.append(x.shape) or forward_chunk(x, t, temp))
    (values, (d_states, d_weight)), (ref_values, (ref_states, ref_weight)) = \
        _fused_and_materialized(states, weight, targets, grads, temperature)
    assert seen[:len(lengths)] == [(n, 3, VOCAB) for n in lengths]     # the fused chunks: real columns only

    assert all(v.dtype == torch.float32 and v.shape == targets.shape for v in values)
    assert torch.all(values[0][..., 2] == float("-inf"))
    for v, ref in zip(values, ref_values):
        torch.testing.assert_close(v, ref, rtol=0, atol=1e-5)
    assert d_states.dtype == d_weight.dtype == dtype
    assert torch.all(d_weight[VOCAB:] == 0) and d_weight[:VOCAB].abs().min() > 0
    if dtype == torch.float32:
        torch.testing.assert_close(d_states, ref_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d_weight, ref_weight, rtol=1e-5, atol=1e-5)
    else:   # the same bf16 logit gradients; the weight's summed over chunks in bf16
        torch.testing.assert_close(d_states, ref_states, rtol=2 ** -7, atol=1e-2)
        torch.testing.assert_close(d_weight, ref_weight, rtol=2 ** -6, atol=3e-2)


def test_the_fused_head_compiles_once_and_equals_eager(monkeypatch, no_recompile):
    """The fused head's CUDA path (its chunk functions under torch.compile) run by CPU inductor:
    the eager values and gradients, one graph per function over chunks of 4, 4, 3 positions,
    another sequence length, a missing upstream gradient, a forward without a backward and
    another temperature."""
    torch._dynamo.reset()
    model._compiled.cache_clear()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    monkeypatch.setattr(model, "_CHUNK_ELEMENTS", CHUNK * 3 * VOCAB)
    results = {}
    for compiled in (False, True):
        monkeypatch.setattr(model, "_COMPILED_DEVICES", frozenset({"cpu"} if compiled else ()))
        for length, temperature in ((12, 1.0), (8, 1.0), (12, 0.7)):
            states, weight, targets = _head_inputs(torch.bfloat16, length=length)
            for grads in ("both", "logp", "entropy"):
                logp, entropy = model._LinearLogprobsEntropy.apply(states, weight, targets, VOCAB, True, temperature)
                results[compiled, length, temperature, grads] = (logp, entropy, *torch.autograd.grad(
                    _loss(logp, entropy, grads), (states, weight)))
            with torch.no_grad():
                logp_only, none = model._LinearLogprobsEntropy.apply(states, weight, targets, VOCAB, False,
                                                                     temperature)
            assert none is None and torch.equal(logp_only, logp.detach())
    assert model._compiled.cache_info().currsize == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    for (compiled, *key), got in results.items():
        if compiled:
            for value, eager in zip(got, results[False, *key]):
                torch.testing.assert_close(value, eager, rtol=2 ** -7, atol=1e-5)


def test_rms_norm_runs_in_the_activation_dtype_with_its_weight_in_fp32():
    norm = model.ActivationDtypeRMSNorm(None, 8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 8)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6), rtol=0, atol=0)
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    torch.testing.assert_close(y, F.rms_norm(x.bfloat16(), (8,), norm.weight.bfloat16(), 1e-6), rtol=0, atol=0)
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and torch.isfinite(norm.weight.grad).all()


@pytest.fixture(scope="module")
def parallel():
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel(seed=5)
    yield
    teardown()


class _RMSNormDtypes(TorchFunctionMode):
    """Records (input dtype, weight dtype) of every F.rms_norm call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            weight = kwargs.get("weight", args[2] if len(args) > 2 else None)
            self.calls.append((args[0].dtype, weight.dtype))
        return func(*args, **kwargs)


def test_a_bf16_policy_keeps_fp32_norm_weights_and_runs_every_norm_in_bf16(parallel):
    from hpc.policy.config import policy_config

    cfg = policy_config({"max_seq_len": 32, "dtype": "bf16"})
    net = model.build_policy(cfg)
    norms = {name: p.dtype for name, p in net.named_parameters() if "layernorm" in name}
    assert len(norms) == 2 * cfg.num_layers + 1 and set(norms.values()) == {torch.float32}
    assert {p.dtype for name, p in net.named_parameters() if "layernorm" not in name} == {torch.bfloat16}
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with _RMSNormDtypes() as seen:
        logits = model.forward_logits(net, tokens)
    assert logits.dtype == torch.bfloat16
    assert seen.calls == [(torch.bfloat16, torch.bfloat16)] * (2 * cfg.num_layers + 1)


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_a_right_padded_batch_needs_no_explicit_mask(parallel, attention):
    from hpc.policy.config import policy_config

    cfg = policy_config({"max_seq_len": 32, "attention": attention})
    torch.manual_seed(0)
    net = model.build_policy(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():   # wider than the default init: padding that leaked would show
            p.normal_(0, 0.3)
    tokens = torch.randint(0, cfg.vocab_size, (3, 16))
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    pad[0, 9:] = pad[2, 4:] = True
    assert model.forward_mask(pad) is None and model.forward_mask(None) is None
    left = pad.flip(1)
    assert torch.equal(model.forward_mask(left), model.attention_mask(left))
    positions = model.position_ids(tokens)
    with torch.no_grad():
        explicit = net(tokens, positions, model.attention_mask(pad))
        causal = net(tokens, positions, None)
        trainer = model.forward_logits(net, tokens, pad)
    real = ~pad
    assert torch.equal(trainer, causal)
    if attention == "local":     # the same mask megatron builds: the same numbers
        assert torch.equal(causal[real], explicit[real])
    else:                        # torch's causal kernel against the masked one
        torch.testing.assert_close(causal[real], explicit[real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(causal[pad], explicit[pad])    # the padding positions' own outputs differ


def _policy(tie: bool):
    from hpc.policy.config import policy_config

    cfg = policy_config({"max_seq_len": 32, "tie_embeddings": tie})
    torch.manual_seed(0)
    net = model.build_policy(cfg)
    with torch.no_grad():
        for p in net.parameters():   # wider than the default init: logits of a few units
            p.normal_(0, 0.3)
    assert cfg.vocab_size < cfg.padded_vocab_size
    return cfg, net


def _batch(cfg, padding: str):
    """Tokens [3, 16] (row 1's last one in the vocabulary's padding: a target scored -inf) and
    the pad mask, right- or left-padded."""
    tokens = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(3))
    tokens[1, -1] = cfg.vocab_size + 1
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    pad[0, 9:] = pad[2, 4:] = True
    return tokens, pad if padding == "right" else pad.flip(1)


class _Calls:
    """Counts the calls of a module's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        module.register_forward_hook(lambda *_: setattr(self, "count", self.count + 1))


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T=1", "T=0.7"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no entropy"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_sequence_logprobs_equal_the_materialized_logits_path(parallel, tie, padding, entropy, temperature,
                                                              monkeypatch):
    """The fused LM head against `forward_logits` + `token_logprobs(_and_entropy)`: the same
    log-probs, entropy and gradient of every parameter (the tied embedding's, or the embedding's
    and the output layer's), over several chunks and the padded vocabulary, at temperature 1 and
    at a sampling temperature (log_softmax(logits / T), checked against the full log-softmax);
    the output layer never runs."""
    cfg, net = _policy(tie)
    tokens, pad = _batch(cfg, padding)
    monkeypatch.setattr(model, "_CHUNK_ELEMENTS", 4 * 3 * cfg.vocab_size)      # 15 positions: 4, 4, 4, 3
    seen = []
    write = model._write_grad_chunk
    monkeypatch.setattr(model, "_write_grad_chunk", lambda out, *a: seen.append(out.shape[0]) or write(out, *a))
    head = _Calls(net.output_layer)
    grads = "both" if entropy else "logp"
    results = []
    for fused in (True, False):
        net.zero_grad(set_to_none=True)
        if fused:
            logp, ent = model.sequence_logprobs(net, tokens, pad, cfg.vocab_size, entropy, temperature)
            assert head.count == 0 and net.post_process and seen == []
        else:
            logits = model.forward_logits(net, tokens, pad)[:, :-1]
            if entropy:
                logp, ent = token_logprobs_and_entropy(logits, tokens[:, 1:], cfg.vocab_size, temperature)
            else:
                logp, ent = token_logprobs(logits, tokens[:, 1:], cfg.vocab_size, temperature), None
            full_logp, full_ent = _reference(logits.detach(), tokens[:, 1:], cfg.vocab_size, temperature)
        assert (ent is None) != entropy
        _loss(logp, ent, grads).backward()
        if fused:
            assert seen == [4, 4, 4, 3] and head.count == 0
        results.append((logp, ent, {name: p.grad for name, p in net.named_parameters()}))
    (logp, ent, grads), (ref_logp, ref_ent, ref_grads) = results

    assert logp.shape == (3, 15) and logp[1, -1] == float("-inf") and torch.isfinite(logp[:, :-1]).all()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp, full_logp, rtol=0, atol=1e-5)
    if entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, full_ent, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6 * float(ref_grads[name].abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    out = "embedding.word_embeddings.weight" if tie else "output_layer.weight"
    assert torch.all(grads[out][cfg.vocab_size:] == 0) and grads[out][:cfg.vocab_size].abs().sum() > 0
    with torch.no_grad():      # scoring (the reference policy): the same values without a graph
        scored, none = model.sequence_logprobs(net, tokens, pad, cfg.vocab_size, False, temperature)
    assert none is None and torch.equal(scored, logp.detach())


def test_hidden_states_are_what_the_output_layer_reads_and_restore_post_process(parallel, monkeypatch):
    cfg, net = _policy(tie=True)
    tokens, pad = _batch(cfg, "left")
    with torch.no_grad():
        hidden = model.hidden_states(net, tokens, pad)
        logits = model.forward_logits(net, tokens, pad)
    assert hidden.shape == (16, 3, cfg.hidden_size) and net.post_process
    torch.testing.assert_close((hidden @ net.shared_embedding_or_output_weight().t()).transpose(0, 1), logits)

    def fail(*args, **kwargs):
        raise RuntimeError("decoder failed")

    monkeypatch.setattr(net.decoder, "forward", fail)
    with pytest.raises(RuntimeError, match="decoder failed"):
        model.hidden_states(net, tokens, pad)
    assert net.post_process is True


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T=1", "T=0.7"])
def test_sequence_logprobs_materialize_the_logits_under_tensor_parallelism(parallel, temperature, monkeypatch):
    """With TP > 1 (the logits' vocabulary split over ranks) the fused head does not apply: the
    output layer runs and `token_logprobs_and_entropy` reads its gathered logits (the same values,
    at any temperature, as `vocab_parallel_logprobs` on the unsplit logits)."""
    from megatron.core import parallel_state

    cfg, net = _policy(tie=True)
    tokens, pad = _batch(cfg, "right")
    head = _Calls(net.output_layer)
    with torch.no_grad():
        fused = model.sequence_logprobs(net, tokens, pad, cfg.vocab_size, True, temperature)
        assert head.count == 0
        local = model.forward_logits(net, tokens, pad, gather=False)[:, :-1]
        shard = model.vocab_parallel_logprobs(local, tokens[:, 1:], cfg.vocab_size, temperature)
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda *a, **k: 2)
        materialized = model.sequence_logprobs(net, tokens, pad, cfg.vocab_size, True, temperature)
    assert head.count == 2
    for a, b in zip(fused, materialized):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    real = tokens[:, 1:] < cfg.vocab_size    # a target in the padding: -inf here, a large finite -log p there
    torch.testing.assert_close(shard[real], fused[0][real], rtol=0, atol=1e-5)

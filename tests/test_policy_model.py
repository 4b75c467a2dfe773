"""The policy's training-step paths: log-probs and entropy computed a chunk of positions at a time
equal the full fp32 log-softmax (values and gradients), a right-padded batch runs without an
explicit mask and gives the same logits at its real positions, and the RMSNorms run in the
activations' dtype while their weights stay fp32."""

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


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int):
    """What the update computed before: the whole [..., T, V] log-softmax in fp32."""
    logp = torch.log_softmax(mask_padded_vocab(logits.float(), vocab_size), dim=-1)
    entropy = -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _logits(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the model's output [B, T, V], its next-token slice [B, T-1, V] as callers take it, targets)."""
    g = torch.Generator().manual_seed(seed)
    out = (3 * torch.randn(3, 12, WIDTH, generator=g)).to(dtype).requires_grad_()
    return out, out[:, :-1], torch.randint(0, VOCAB, (3, 11), generator=g)


@pytest.fixture(params=["one chunk", "chunks of 2 positions"])
def chunking(request, monkeypatch):
    if request.param != "one chunk":
        monkeypatch.setattr(model, "_CHUNK_ELEMENTS", 2 * 3 * WIDTH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_equal_the_full_log_softmax(dtype, chunking):
    out, logits, targets = _logits(dtype)
    g = torch.Generator().manual_seed(1)
    w_logp = torch.randn(targets.shape, generator=g)
    # |weight| < 1: the reference's entropy gradient at the masked columns is 0 * (-3.4e38 * w),
    # NaN (0 * -inf) once |w| >= 1; the chunked one sets those columns to 0 whatever w.
    w_entropy = torch.rand(targets.shape, generator=g) - 0.5

    logp, entropy = token_logprobs_and_entropy(logits, targets, VOCAB)
    (logp * w_logp + entropy * w_entropy).sum().backward()
    grad, out.grad = out.grad, None
    ref_logp, ref_entropy = _reference(logits, targets, VOCAB)
    (ref_logp * w_logp + ref_entropy * w_entropy).sum().backward()

    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    assert grad.dtype == dtype and torch.all(grad[..., VOCAB:] == 0)
    torch.testing.assert_close(grad, out.grad)


def test_logprobs_alone_and_a_target_in_the_padding(chunking):
    out, logits, targets = _logits(torch.float32)
    w = torch.randn(targets.shape)
    (token_logprobs(logits, targets, VOCAB) * w).sum().backward()
    grad, out.grad = out.grad, None
    (_reference(logits, targets, VOCAB)[0] * w).sum().backward()
    torch.testing.assert_close(grad, out.grad)
    # Only the entropy in the loss: its gradient alone.
    out.grad = None
    _, entropy = token_logprobs_and_entropy(logits, targets, VOCAB)
    (entropy * w.clamp(-0.9, 0.9)).sum().backward()
    grad, out.grad = out.grad, None
    (_reference(logits, targets, VOCAB)[1] * w.clamp(-0.9, 0.9)).sum().backward()
    torch.testing.assert_close(grad, out.grad)
    padding = torch.full_like(targets, VOCAB + 2)
    assert torch.all(token_logprobs(logits.detach(), padding, VOCAB) == float("-inf"))


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

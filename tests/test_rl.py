"""Advantages and losses of the RL update, checked against values worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hpc.errors import ConfigError
from hpc.policy.model import token_logprobs_and_entropy
from hpc.rl.advantages import (broadcast_to_tokens, gae, group_normalized, last_token_rewards, masked_mean,
                               masked_whiten)
from hpc.rl.batch import pack
from hpc.rl.config import load_rl_config
from hpc.rl.losses import explained_variance, kl_penalty, policy_loss, value_loss


def test_the_outcome_reward_lands_on_each_rows_last_generated_token():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    out = last_token_rewards(torch.tensor([3.0, -1.0, 2.0]), mask)
    assert out.tolist() == [[0, 0, 3, 0], [0, 0, 0, -1], [0, 0, 0, 0]]


def test_gae_matches_the_recursion_worked_by_hand():
    values = torch.tensor([[0.5, 1.0, 2.0]])
    rewards = torch.tensor([[0.0, 0.0, 3.0]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.95)
    d2 = 3.0 - 2.0
    d1 = 0.0 + 2.0 - 1.0
    d0 = 0.0 + 1.0 - 0.5
    a2, a1 = d2, d1 + 0.95 * d2
    a0 = d0 + 0.95 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + values)


def test_gae_with_lambda_one_is_the_return_less_the_value():
    values = torch.randn(4, 6)
    rewards = last_token_rewards(torch.tensor([1.0, -1.0, 3.0, 2.0]), torch.ones(4, 6))
    adv, ret = gae(rewards, values, torch.ones(4, 6), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, rewards.flip(1).cumsum(1).flip(1) - values, atol=1e-6)
    assert torch.allclose(ret, rewards.flip(1).cumsum(1).flip(1), atol=1e-6)


def test_gae_skips_observation_tokens_between_turns():
    """Masked positions (a tool's output) take no part: the result equals GAE on the generated
    tokens alone, and is zero on the masked ones."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1]])
    values = torch.tensor([[0.1, 0.4, 9.0, 9.0, 0.7, 9.0, 1.5]])
    rewards = last_token_rewards(torch.tensor([2.0]), mask)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    keep = mask[0].bool()
    alone, alone_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, 4), gamma=1.0, lam=0.95)
    assert torch.allclose(adv[:, keep], alone) and torch.allclose(ret[:, keep], alone_ret)
    assert adv[0, ~keep].abs().sum() == 0 and ret[0, ~keep].abs().sum() == 0


def test_grpo_normalizes_within_each_group_and_a_tied_group_carries_no_signal():
    rewards = torch.tensor([3.0, -1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_normalized(rewards, group_size=4)
    first = torch.tensor([3.0, -1.0, 1.0, 1.0])
    assert torch.allclose(adv[:4], (first - first.mean()) / (first.std() + 1e-6))
    assert adv[4:].abs().sum() == 0
    assert torch.allclose(group_normalized(rewards, 4, scale=False)[:4], first - 1.0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_normalized(rewards, 3)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2, 2, 0], [0, -1, -1]]


def test_masked_whiten_gives_zero_mean_unit_variance_on_the_mask_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = masked_whiten(x, mask)
    assert abs(float(masked_mean(w, mask))) < 1e-6
    assert abs(float(masked_mean(w ** 2, mask)) - 1.0) < 1e-4
    assert w[:, 2].abs().sum() == 0


def test_policy_loss_clips_asymmetrically():
    """A positive advantage stops pushing at ratio 1 + 0.28, a negative one at 1 - 0.2."""
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.1, 1.5, 0.9, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = policy_loss(new, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    loss.backward()
    grad = new.grad[0]
    assert grad[0] != 0 and grad[2] != 0          # inside the trust region: still pushing
    assert grad[1] == 0                            # 1.5 > 1.28 with A > 0: clipped
    assert grad[3] == 0                            # 0.5 < 0.8 with A < 0: clipped
    assert stats.clip_fraction == pytest.approx(0.5)
    expected = -(1.1 * 1 + 1.28 * 1 + 0.9 * -1 + 0.8 * -1) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert stats.ratio_max == pytest.approx(1.5, rel=1e-5)


def test_policy_loss_at_ratio_one_is_minus_the_mean_advantage_with_no_kl():
    lp = torch.randn(2, 5)
    adv = torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    loss, stats = policy_loss(lp, lp, adv, mask)
    assert float(loss) == pytest.approx(-float(masked_mean(adv, mask)), rel=1e-5)
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-7) and stats.clip_fraction == 0.0


def test_value_loss_plain_and_clipped():
    values = torch.tensor([[2.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    assert float(value_loss(values, old, returns, torch.ones(1, 2))) == pytest.approx(0.5 * (1 + 1) / 2)
    # clipped at 0.5 from old: the first value counts as max((2-1)^2, (0.5-1)^2) = 1
    assert float(value_loss(values, old, returns, torch.ones(1, 2), clip=0.5)) == pytest.approx(0.5 * (1 + 1) / 2)
    far = torch.tensor([[1.0, 0.0]])
    clipped = value_loss(far, old, torch.tensor([[3.0, 0.0]]), torch.ones(1, 2), clip=0.5)
    assert float(clipped) == pytest.approx(0.5 * (2.5 ** 2) / 2)      # (0.5 - 3)^2 is the larger error


def test_kl_estimators_entropy_and_explained_variance():
    p = torch.log(torch.tensor([0.5, 0.2]))
    q = torch.log(torch.tensor([0.25, 0.4]))
    assert torch.allclose(kl_penalty(p, q, "k1"), p - q)
    k3 = kl_penalty(p, q, "k3")
    assert (k3 >= 0).all() and kl_penalty(p, p, "k3").abs().max() < 1e-7
    with pytest.raises(ValueError):
        kl_penalty(p, q, "k2")
    # The padded vocabulary's columns add nothing, and the gradient stays finite.
    padded = torch.zeros(1, 12, requires_grad=True)
    _, entropy = token_logprobs_and_entropy(padded, torch.zeros(1, dtype=torch.long), 8)
    assert float(entropy.detach()[0]) == pytest.approx(math.log(8))
    entropy.sum().backward()
    assert torch.isfinite(padded.grad).all()
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, mask) == pytest.approx(0.0, abs=1e-6)
    same = torch.full_like(r, 3.0) + torch.randn_like(r) * 1e-7   # every sample paid alike, rounding left
    assert math.isnan(explained_variance(torch.zeros_like(r), same, mask))


def test_rl_config_defaults_are_the_papers_and_errors_name_the_key(tmp_path):
    cfg = load_rl_config()
    assert (cfg.algorithm, cfg.gamma, cfg.lam, cfg.clip_low, cfg.clip_high, cfg.actor_lr, cfg.critic_lr) == (
        "ppo", 1.0, 0.95, 0.2, 0.28, 3e-6, 6e-6)
    path = tmp_path / "rl.yaml"
    path.write_text("rl:\n  algorithm: grpo\n  group_size: 4\n")
    assert (load_rl_config(path).algorithm, load_rl_config(path).group_size) == ("grpo", 4)
    with pytest.raises(ConfigError, match="config rl.clip_hi: unknown key"):
        load_rl_config({"clip_hi": 0.3})
    with pytest.raises(ConfigError, match="config rl.algorithm: expected one of ppo, grpo"):
        load_rl_config({"algorithm": "dpo"})
    with pytest.raises(ConfigError, match="config rl.lam: expected float"):
        load_rl_config({"lam": "high"})


def test_rl_config_ppo_epochs_and_minibatches_are_integers_of_one_or_more():
    assert (load_rl_config().ppo_epochs, load_rl_config().minibatches) == (1, 1)
    cfg = load_rl_config({"ppo_epochs": 4, "minibatches": 8})
    assert (cfg.ppo_epochs, cfg.minibatches) == (4, 8)
    for key in ("ppo_epochs", "minibatches"):
        with pytest.raises(ConfigError, match=f"config rl.{key}: must be an integer >= 1, got 0"):
            load_rl_config({key: 0})
        with pytest.raises(ConfigError, match=f"config rl.{key}: expected int, got float 2.0"):
            load_rl_config({key: 2.0})
        with pytest.raises(ConfigError, match=f"config rl.{key}: expected int, got bool True"):
            load_rl_config({"rl": {key: True}})
        with pytest.raises(ConfigError, match=f"config rl.{key}: must be an integer >= 1, got 2.0"):
            dataclasses.replace(cfg, **{key: 2.0}).validate()


def test_selecting_rows_of_a_batch_is_packing_them_alone():
    """A minibatch: the rows in the order asked, their masks, log-probs and rewards with them, cut
    to the longest of them (padding the batch's other rows needed is dropped)."""
    seqs = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [8, 9], [3, 3, 3, 3]]
    generated = [[False, True, True], [False, False, True, True, False, True], [False, True],
                 [False, False, True, True]]
    logprobs = [[0.0, -0.5, -0.7], [0.0, 0.0, -1.0, -1.5, 0.0, -0.2], [0.0, -0.1], [0.0, 0.0, -2.0, -0.3]]
    rewards = [1.0, -1.0, 0.5, 2.0]
    full = pack(seqs, generated, logprobs, rewards, pad_id=0)
    for rows in ([2, 0], [1], [3, 1, 0, 2], [2], [0, 3]):
        alone = pack(*([x[i] for i in rows] for x in (seqs, generated, logprobs, rewards)), pad_id=0)
        got = full.select(rows)
        assert len(got) == len(rows)
        for field in ("tokens", "pad_mask", "action_mask", "old_logprobs", "rewards"):
            assert torch.equal(getattr(got, field), getattr(alone, field)), (rows, field)

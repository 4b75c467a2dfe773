"""The RL update on the real (tiny, CPU) megatron policy: the batch lines up with the sampler's
log-probs, and PPO (with its critic) and GRPO each learn a bandit the policy starts indifferent to."""

from __future__ import annotations

import pytest
import torch

from hpc.policy.generate import SamplingParams, generate
from hpc.policy.tokenizer import ByteTokenizer
from hpc.rl.batch import make_batch
from hpc.rl.config import load_rl_config
from hpc.rl.update import update

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

TOK = ByteTokenizer()
PROMPT = TOK.encode("kernel:")


@pytest.fixture(scope="module")
def parallel():
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel(seed=11)
    yield
    teardown()


def _models(seed: int):
    from hpc.policy import model
    from hpc.policy.config import policy_config

    torch.manual_seed(seed)
    cfg = policy_config({"max_seq_len": 64})
    return cfg, model.build_policy(cfg), model.build_critic(cfg)


def _p_low_byte(cfg, policy) -> float:
    """Probability that the first generated token is a byte below 128 (the bandit's good arm)."""
    from hpc.policy.model import forward_logits, mask_padded_vocab

    with torch.no_grad():
        logits = mask_padded_vocab(forward_logits(policy, torch.tensor([PROMPT])), cfg.vocab_size)[0, -1]
    return float(torch.softmax(logits.float(), -1)[:128].sum())


def _rollout(cfg, policy, n: int, seed: int):
    completions = generate(policy, cfg, TOK, [PROMPT] * n,
                           SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed, stop_token_ids=[]))
    rewards = [1.0 if c.tokens[0] < 128 else -1.0 for c in completions]
    return make_batch([PROMPT] * n, [c.tokens for c in completions], [c.logprobs for c in completions], rewards,
                      TOK.pad_id)


def test_a_fresh_batch_has_ratio_one_under_the_policy_that_sampled_it(parallel):
    """Left-padded prompts, right-padded completions: the update's recomputed log-probs at the
    action positions equal the sampler's, so the first PPO step sees ratio 1 and clips nothing."""
    from hpc.policy.model import forward_logits, token_logprobs

    cfg, policy, _ = _models(0)
    prompts = [TOK.encode("ab"), TOK.encode("a longer prompt")]
    outs = generate(policy, cfg, TOK, prompts, SamplingParams(max_new_tokens=5, seed=1, stop_token_ids=[]))
    batch = make_batch(prompts, [o.tokens for o in outs], [o.logprobs for o in outs], [1.0, -1.0], TOK.pad_id)
    assert batch.action_mask.sum(1).tolist() == [5.0, 5.0]
    with torch.no_grad():
        logp = token_logprobs(forward_logits(policy, batch.tokens, batch.pad_mask)[:, :-1], batch.tokens[:, 1:],
                              cfg.vocab_size)
    live = batch.action_mask.bool()
    assert torch.allclose(logp[live], batch.old_logprobs[live], atol=1e-4)
    stats = update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), batch, load_rl_config({"algorithm": "grpo",
                   "group_size": 2}), cfg.vocab_size)
    assert stats.clip_fraction == 0.0 and abs(stats.approx_kl) < 1e-6


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_updates_learn_a_bandit(parallel, algorithm):
    cfg, policy, critic = _models(1)
    rl = load_rl_config({"algorithm": algorithm, "group_size": 16, "actor_lr": 2e-2, "critic_lr": 2e-2})
    actor_opt = torch.optim.Adam(policy.parameters(), lr=rl.actor_lr)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=rl.critic_lr)
    before = _p_low_byte(cfg, policy)
    rewards = []
    for step in range(15):
        batch = _rollout(cfg, policy, 32, seed=100 + step)
        rewards.append(float(batch.rewards.mean()))
        stats = update(policy, actor_opt, batch, rl, cfg.vocab_size,
                       critic=critic if algorithm == "ppo" else None, critic_opt=critic_opt)
    after = _p_low_byte(cfg, policy)
    assert 0.35 < before < 0.65, before                    # indifferent at the start
    assert after > 0.85, (before, after, rewards)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    if algorithm == "ppo":
        assert stats.value_loss > 0 and stats.explained_variance == stats.explained_variance   # measured

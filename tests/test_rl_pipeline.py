"""The RL updates across two pipeline stages (two local gloo processes; and four, each stage
tensor-parallel over two) against one stage: the same PPO epochs (actor and critic,
minibatches, KL and entropy terms), SFT and value steps on the same batch from the same weights
give the same statistics on every rank as at one stage and leave the same weights (the tied
embedding's two copies included), and the whole replica that rollouts sample from, gathered
from the updated stages, samples what the one-stage policy does.
"""

from __future__ import annotations

import math
import random
import traceback
from pathlib import Path

import pytest
import torch

from hpc.policy.generate import SamplingParams
from hpc.policy.tokenizer import ByteTokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

TOK = ByteTokenizer()
PROMPTS = [[5, 17, 42, 9], [100], [7, 7, 7, 7, 7, 7, 7]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[])


def _cfg(pipeline: int, tensor: int = 1):
    from hpc.policy.config import policy_config

    return policy_config({"max_seq_len": 64, "parallel": {"pipeline": pipeline, "tensor": tensor}})  # tied embeddings


def _batch():
    """Five rows of different prompt and completion lengths (two microbatches of their own widths)."""
    from hpc.rl.batch import make_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 5, 2, 4, 6)]
    completions = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 2, 9, 3, 5)]
    logprobs = [(-5.5 + torch.rand(len(c), generator=g)).tolist() for c in completions]
    return make_batch(prompts, completions, logprobs, [1.0, -1.0, 0.5, -0.5, 1.0], TOK.pad_id)


def _exercise(policy, critic, cfg) -> dict:
    """PPO epochs, an SFT step and a value step (SGD: the step is linear in the gradient), then
    the updated log-probs and values, and the replica's greedy samples (one stage: the policy's)."""
    from hpc.policy import model
    from hpc.policy.generate import generate
    from hpc.rl.config import load_rl_config
    from hpc.rl.staged import critic_outputs, evaluate, pipeline_size
    from hpc.rl.supervised import reference_logprobs, sft_step, value_step
    from hpc.rl.update import ppo_epochs

    batch = _batch()
    rl = load_rl_config({"algorithm": "ppo", "kl_coef": 0.1, "entropy_coef": 0.01, "value_clip": 0.2,
                         "minibatches": 2, "ppo_epochs": 1, "lam": 0.9})
    actor_opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    before = reference_logprobs(policy, batch, cfg.vocab_size)
    stats = ppo_epochs(policy, actor_opt, batch, rl, cfg.vocab_size, critic=critic, critic_opt=critic_opt,
                       ref_logprobs=before * 0.9, rng=random.Random(0), microbatches=2)
    sft, _ = sft_step(policy, actor_opt, batch, cfg.vocab_size, microbatches=2)
    value = value_step(critic, critic_opt, batch, microbatches=2)[:2]
    replica = policy
    if pipeline_size() > 1:
        replica = model.build_replica(cfg)
        model.load_stages(replica, policy)
    return {"before": before, "stats": stats.as_dict(), "steps": [s.as_dict() for s in stats.steps], "sft": sft,
            "value": value, "after": reference_logprobs(policy, batch, cfg.vocab_size),
            "values": evaluate(critic, batch, critic_outputs())[0],
            "greedy": [(c.tokens, c.logprobs) for c in generate(replica, cfg, TOK, PROMPTS, GREEDY)]}


def _models(cfg, work: Path):
    from hpc.policy import model
    from hpc.policy.checkpoint import load_checkpoint

    policy, critic = model.build_policy(cfg), model.build_critic(cfg)
    load_checkpoint(work / "policy", policy)
    load_checkpoint(work / "critic", critic)
    return policy, critic


def _worker(work: Path, tensor: int) -> None:
    from hpc.policy.parallel import current_layout, init_parallel, teardown

    init_parallel(tensor=tensor, pipeline=2, seed=5)
    rank = current_layout().rank
    try:
        result = _exercise(*_models(_cfg(2, tensor), work), _cfg(2, tensor))
    except Exception:
        result = RuntimeError(traceback.format_exc())
    torch.save(result, work / f"rank{rank}.pt")
    teardown()


@pytest.fixture(scope="module", params=[1, 2], ids=["pp2", "tp2xpp2"])
def run(request, tmp_path_factory):
    """One stage here (from saved random weights, a non-zero value head), then the same on two
    stages of `request.param` tensor-parallel ranks each."""
    from hpc.policy import model
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.parallel import init_parallel, run_local, teardown

    work = tmp_path_factory.mktemp("pp")
    init_parallel(seed=5)
    try:
        cfg = _cfg(1)
        torch.manual_seed(0)
        policy, critic = model.build_policy(cfg), model.build_critic(cfg)
        torch.nn.init.normal_(critic.value_head.weight, std=0.3)
        save_checkpoint(work / "policy", 1, policy, None, cfg)
        save_checkpoint(work / "critic", 1, critic, None, cfg)
        one = _exercise(*_models(cfg, work), cfg)
    finally:
        teardown()
    tensor = request.param
    run_local(_worker, 2 * tensor, work, tensor)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2 * tensor)]
    for r in ranks:
        if isinstance(r, Exception):
            raise r
    return one, ranks


def _same_numbers(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), (key, a, b)


def _equal(a: dict, b: dict) -> bool:
    """Equal statistics, NaN (what a plain torch optimizer's step does not measure) equal to NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or math.isnan(a[k]) and math.isnan(b[k]) for k in a)


def test_every_rank_reports_the_last_stage_statistics(run):
    _, (first, *others) = run
    for other in others:
        assert _equal(first["stats"], other["stats"])
        assert len(first["steps"]) == len(other["steps"])
        assert all(_equal(a, b) for a, b in zip(first["steps"], other["steps"]))
        assert first["sft"] == other["sft"] and first["value"] == other["value"]
        for key in ("before", "after", "values"):
            assert torch.equal(first[key], other[key]), key


def test_two_stages_update_as_one_stage_does(run):
    """Losses and statistics of every step match, and the weights they leave give the same
    log-probs and values; the update moved them well beyond that tolerance."""
    one, (two, *_) = run
    torch.testing.assert_close(two["before"], one["before"], atol=1e-5, rtol=1e-5)
    _same_numbers(one["stats"], two["stats"], rel=1e-4)
    assert len(one["steps"]) == len(two["steps"]) == 2
    for a, b in zip(one["steps"], two["steps"]):
        _same_numbers(a, b, rel=1e-4)
    assert one["stats"]["value_loss"] > 0 and 0 < one["stats"]["clip_fraction"] < 1
    assert two["sft"] == pytest.approx(one["sft"], rel=1e-4)
    assert two["value"][0] == pytest.approx(one["value"][0], rel=1e-4)
    assert two["value"][1] == pytest.approx(one["value"][1], rel=1e-4, abs=1e-5)
    mask = _batch().action_mask.bool()
    torch.testing.assert_close(two["after"][mask], one["after"][mask], atol=1e-4, rtol=1e-4)
    assert (one["after"] - one["before"])[mask].abs().max() > 0.1
    torch.testing.assert_close(two["values"][mask], one["values"][mask], atol=1e-4, rtol=1e-4)


def test_the_replica_gathered_from_the_stages_samples_as_one_stage(run):
    one, ranks = run
    for r in ranks:
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(r["greedy"], one["greedy"]):
            assert tokens == ref_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)

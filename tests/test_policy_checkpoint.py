"""dist_checkpointing checkpoints: resume gives the same model, optimizer and step (TP=1 here;
resharding TP1 <-> TP2 in test_policy_tp2.py)."""

from __future__ import annotations

import json

import pytest
import torch

from hpc.errors import CheckpointError
from hpc.policy.checkpoint import checkpoint_dir, latest_step, load_checkpoint, save_checkpoint

# megatron-core and torch.distributed.checkpoint warn about TE, Apex and their own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

BATCH = torch.randint(0, 259, (3, 17), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def cfg():
    from hpc.policy.config import policy_config
    from hpc.policy.parallel import init_parallel, teardown

    init_parallel()
    yield policy_config({"tie_embeddings": False})
    teardown()


def _train_step(cfg, net, opt) -> float:
    from hpc.policy.model import forward_logits, token_logprobs

    loss = -token_logprobs(forward_logits(net, BATCH[:, :-1]), BATCH[:, 1:], cfg.vocab_size).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _fresh(cfg, seed):
    from hpc.policy.model import build_policy

    torch.manual_seed(seed)
    net = build_policy(cfg)
    return net, torch.optim.AdamW(net.parameters(), lr=0.5, weight_decay=0.3)


def test_resume_gives_the_same_model_optimizer_and_step(cfg, tmp_path):
    net, opt = _fresh(cfg, 0)
    opt.param_groups[0]["lr"] = 3e-3
    for _ in range(2):
        _train_step(cfg, net, opt)
    directory = save_checkpoint(tmp_path, 2, net, opt, cfg, extra={"data_offset": 96})
    assert directory == checkpoint_dir(tmp_path, 2) and latest_step(tmp_path) == 2
    meta = json.loads((directory / "hpc_policy.json").read_text())
    assert (meta["step"], meta["tensor_parallel"], meta["config"]["tie_embeddings"]) == (2, 1, False)

    other, other_opt = _fresh(cfg, 1)
    assert not torch.equal(other.embedding.word_embeddings.weight, net.embedding.word_embeddings.weight)
    step, extra = load_checkpoint(tmp_path, other, other_opt)
    assert (step, extra) == (2, {"data_offset": 96})
    for (key, a), b in zip(net.state_dict().items(), other.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), key
    assert other_opt.param_groups[0]["lr"] == 3e-3
    for p, q in zip(net.parameters(), other.parameters()):
        sa, sb = opt.state[p], other_opt.state[q]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 2
    # Training on from the checkpoint is training on from the original.
    assert _train_step(cfg, net, opt) == _train_step(cfg, other, other_opt)
    for a, b in zip(net.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_latest_moves_and_older_steps_stay_loadable(cfg, tmp_path):
    from hpc.policy.model import forward_logits

    net, opt = _fresh(cfg, 0)
    save_checkpoint(tmp_path, 1, net)
    with torch.no_grad():
        before = forward_logits(net, BATCH)
    _train_step(cfg, net, opt)
    save_checkpoint(tmp_path, 5, net)
    assert latest_step(tmp_path) == 5
    restored, _ = _fresh(cfg, 2)
    assert load_checkpoint(tmp_path, restored, step=1)[0] == 1
    with torch.no_grad():
        assert torch.equal(forward_logits(restored, BATCH), before)
    assert load_checkpoint(tmp_path, restored)[0] == 5


def test_critic_checkpoint_round_trip(cfg, tmp_path):
    from hpc.policy.model import attention_mask, build_critic, position_ids

    critic = build_critic(cfg)
    with torch.no_grad():
        critic.value_head.weight.normal_()
    save_checkpoint(tmp_path, 7, critic)
    torch.manual_seed(9)
    other = build_critic(cfg)
    load_checkpoint(tmp_path, other)
    args = (BATCH, position_ids(BATCH), attention_mask(torch.zeros_like(BATCH, dtype=torch.bool)))
    with torch.no_grad():
        values = critic(*args)
        assert values.shape == BATCH.shape and values.abs().max() > 0
        assert torch.equal(other(*args), values)


def test_missing_and_incomplete_checkpoints_are_refused(cfg, tmp_path):
    net, opt = _fresh(cfg, 0)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path, net)
    save_checkpoint(tmp_path, 3, net)
    with pytest.raises(CheckpointError, match="without optimizer"):
        load_checkpoint(tmp_path, net, opt)
    (checkpoint_dir(tmp_path, 3) / "hpc_policy.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path, net)


def test_a_killed_save_leaves_the_previous_checkpoint_and_a_resave_replaces(cfg, tmp_path):
    from hpc.policy.model import forward_logits

    net, opt = _fresh(cfg, 0)
    save_checkpoint(tmp_path, 1, net)
    (tmp_path / "iter_0000002.partial").mkdir()          # what a save killed half-way leaves
    (tmp_path / "iter_0000002.partial" / "junk").write_text("x")
    assert latest_step(tmp_path) == 1 and not checkpoint_dir(tmp_path, 2).exists()
    save_checkpoint(tmp_path, 2, net)
    _train_step(cfg, net, opt)
    save_checkpoint(tmp_path, 2, net)                    # the same step again: replaced whole
    assert not (tmp_path / "iter_0000002.partial").exists()
    restored, _ = _fresh(cfg, 4)
    load_checkpoint(tmp_path, restored)
    with torch.no_grad():
        assert torch.equal(forward_logits(restored, BATCH), forward_logits(net, BATCH))

"""Model parallelism over two local gloo processes. TP=2: HF logit parity and exact export,
generation equal to TP=1, vocabulary-parallel log-probs, checkpoint resharding TP1 <-> TP2 with
optimizer state, a rollout whose episodes the TP source rank alone scores. PP=2 (the same processes, parallel_state re-initialized): HF logit parity and
export across stages, the critic across stages, a TP=1 checkpoint loaded into two stages.
DP=2: two replicas save one checkpoint.

One launch of the two processes does all of it (each launch costs seconds on a 2-core machine);
the tests below check its results against TP=1 references computed in this process.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from hpc.policy.generate import SamplingParams

# megatron-core and torch.distributed.checkpoint warn about TE, Apex and their own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

BATCH = torch.randint(0, 259, (3, 17), generator=torch.Generator().manual_seed(1))
PROMPTS = [[5, 17, 42, 9], [100], [7, 7, 7, 7, 7, 7, 7]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[])
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=4, stop_token_ids=[])
FAMILIES = ("llama", "qwen2")


def _tiny():
    from hpc.policy.config import policy_config

    return policy_config({"tie_embeddings": False})


def _train_step(cfg, net, opt, vocab_parallel: bool) -> None:
    from hpc.policy.model import forward_logits, token_logprobs, vocab_parallel_logprobs

    if vocab_parallel:
        logp = vocab_parallel_logprobs(forward_logits(net, BATCH[:, :-1], gather=False), BATCH[:, 1:], cfg.vocab_size)
    else:
        logp = token_logprobs(forward_logits(net, BATCH[:, :-1]), BATCH[:, 1:], cfg.vocab_size)
    opt.zero_grad()
    (-logp.mean()).backward()
    opt.step()


def _logits(net) -> torch.Tensor:
    from hpc.policy.model import forward_logits

    with torch.no_grad():
        return forward_logits(net, BATCH)


def _tp2_worker(work: Path) -> None:
    """Runs in each of the two processes; writes rank{N}.pt with every result or the error."""
    from hpc.policy import hf_convert, model
    from hpc.policy.checkpoint import load_checkpoint, save_checkpoint
    from hpc.policy.generate import generate
    from hpc.policy.parallel import current_layout, init_parallel, teardown
    from hpc.policy.tokenizer import HFTokenizer

    layout = init_parallel(tensor=2)
    results: dict = {"layout": layout}

    def part(name, fn):
        try:
            results[name] = fn()
        except Exception:
            results[name] = RuntimeError(traceback.format_exc())

    def convert(family):
        directory = work / family
        cfg = hf_convert.hf_policy_config(directory, tensor=2)
        net = model.build_policy(cfg).eval()
        hf_convert.load_hf(net, directory, cfg)
        hf_convert.export_hf(net, cfg, work / f"export_{family}", family)
        tokens = BATCH % cfg.vocab_size
        with torch.no_grad():
            local = model.forward_logits(net, tokens, gather=False)
            gathered = model.forward_logits(net, tokens)
        out = {"logits": gathered, "local_width": local.shape[-1],
               "vp_logprobs": model.vocab_parallel_logprobs(local[:, :-1], tokens[:, 1:], cfg.vocab_size),
               "logprobs": model.token_logprobs(gathered[:, :-1], tokens[:, 1:], cfg.vocab_size)}
        if family == "llama":
            tok = HFTokenizer(directory)
            for decoder in ("static", "megatron"):
                out[f"greedy-{decoder}"] = generate(net, cfg, tok, PROMPTS, GREEDY, decoder=decoder)
                out[f"sampled-{decoder}"] = generate(net, cfg, tok, PROMPTS, SAMPLED, decoder=decoder)
        return out

    def reshard():
        cfg = _tiny()
        cfg.parallel.tensor = 2
        net = model.build_policy(cfg)
        opt = torch.optim.AdamW(net.parameters(), lr=1.0)
        step, _ = load_checkpoint(work / "ck_tp1", net, opt)
        loaded = _logits(net)
        _train_step(cfg, net, opt, vocab_parallel=True)
        save_checkpoint(work / "ck_tp2", step + 1, net, opt, cfg)
        return {"step": step, "loaded": loaded, "trained": _logits(net)}

    def convert_stages(family):
        directory = work / family
        cfg = hf_convert.hf_policy_config(directory, pipeline=2)
        net = model.build_policy(cfg).eval()
        hf_convert.load_hf(net, directory, cfg)
        hf_convert.export_hf(net, cfg, work / f"export_pp_{family}", family)
        logits = model.forward_logits(net, BATCH)
        critic = model.build_critic(cfg).eval()
        hf_convert.load_hf(critic, directory, cfg)
        if critic.post_process:
            output = net.output_layer.weight
            with torch.no_grad():
                critic.value_head.weight.copy_(output[5:6])
        with torch.no_grad():
            values = model.staged_forward(critic, BATCH)
        return {"logits": logits, "values": values}

    def reshard_stages():
        cfg = _tiny()
        cfg.parallel.pipeline = 2
        net = model.build_policy(cfg)
        load_checkpoint(work / "ck_tp1", net, step=1)
        return {"loaded": _logits(net), "layers": len(net.decoder.layers)}

    def tool_rank_rollout():
        """Two single-turn episodes under TP=2, scored by a real CPU evaluator that counts its calls."""
        from hpc.agent.backend import LocalBackend
        from hpc.agent.config import agent_config
        from hpc.agent.episode import Episode
        from hpc.policy.chat import chat_format
        from hpc.policy.tokenizer import load_tokenizer
        from hpc.rl.rollout import rollout
        from hpc.task import load_task
        from tests.conftest import RELU_TASK, make_fast_config

        class CountingBackend(LocalBackend):
            calls = 0

            def evaluate(self, *args, **kwargs):
                CountingBackend.calls += 1
                return super().evaluate(*args, **kwargs)

        cfg = _tiny()
        cfg.parallel.tensor = 2
        cfg.max_seq_len = 16384      # the instructions and task prompt in bytes, then a reply
        net = model.build_policy(cfg).eval()
        tok = load_tokenizer("byte")
        backend = CountingBackend(make_fast_config(work / f"cache{layout.rank}"))
        agent = agent_config({"mode": "single_turn", "max_context_tokens": 16384, "max_response_tokens": 16})
        episodes = [Episode(load_task(RELU_TASK), backend, agent, work / f"episodes{layout.rank}" / str(k))
                    for k in range(2)]
        try:
            samples, _ = rollout(net, cfg, chat_format(tok), episodes, [0, 0],
                                 SamplingParams(max_new_tokens=16, temperature=1.0, seed=3), 2)
        finally:
            for e in episodes:
                e.close()
        return {"evaluations": CountingBackend.calls, "tokens": [s.tokens for s in samples],
                "rewards": [s.reward for s in samples], "end": [s.trajectory.end_reason for s in samples]}

    for family in FAMILIES:
        part(family, lambda: convert(family))
    part("reshard", reshard)
    part("rollout", tool_rank_rollout)
    init_parallel(pipeline=2)
    results["pp_layout"] = current_layout()
    for family in FAMILIES:
        part(f"pp_{family}", lambda: convert_stages(family))
    part("pp_reshard", reshard_stages)

    def data_parallel():
        cfg = _tiny()
        net = model.build_policy(cfg)
        load_checkpoint(work / "ck_tp1", net, step=1)
        save_checkpoint(work / "ck_dp2", 1, net, None, cfg)
        return {"loaded": _logits(net)}

    init_parallel()
    results["dp_layout"] = current_layout()
    part("dp", data_parallel)
    torch.save(results, work / f"rank{layout.rank}.pt")
    teardown()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """TP=1 references here, then the TP=2 launch; returns (references, rank 0's, rank 1's results)."""
    from tests.test_policy_convert import hf_logits, make_hf_checkpoint

    from hpc.policy import hf_convert, model
    from hpc.policy.checkpoint import save_checkpoint
    from hpc.policy.generate import generate
    from hpc.policy.parallel import init_parallel, run_local, teardown
    from hpc.policy.tokenizer import HFTokenizer

    work = tmp_path_factory.mktemp("tp2")
    ref: dict = {}
    init_parallel()
    for family in FAMILIES:
        directory = make_hf_checkpoint(family, work / family, seed=3)
        ref[family] = {"hf": hf_logits(directory, BATCH % 300)}
    cfg = hf_convert.hf_policy_config(work / "llama")
    net = model.build_policy(cfg).eval()
    hf_convert.load_hf(net, work / "llama", cfg)
    tok = HFTokenizer(work / "llama")
    ref["greedy"] = generate(net, cfg, tok, PROMPTS, GREEDY)
    ref["sampled"] = generate(net, cfg, tok, PROMPTS, SAMPLED)

    cfg = _tiny()
    torch.manual_seed(0)
    net = model.build_policy(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    _train_step(cfg, net, opt, vocab_parallel=False)
    save_checkpoint(work / "ck_tp1", 1, net, opt, cfg)
    ref["loaded"] = _logits(net)
    _train_step(cfg, net, opt, vocab_parallel=False)
    ref["trained"] = _logits(net)
    teardown()

    run_local(_tp2_worker, 2, work)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return work, ref, ranks


def _result(ranks, name):
    for r in ranks:
        if isinstance(r[name], Exception):
            raise r[name]
    return ranks[0][name], ranks[1][name]


def test_layout(run):
    _, _, ranks = run
    assert [(r["layout"].tp_rank, r["layout"].tp_size, r["layout"].dp_size) for r in ranks] == [(0, 2, 1), (1, 2, 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_under_tp2(run, family):
    _, ref, ranks = run
    r0, r1 = _result(ranks, family)
    assert r0["local_width"] == 192                       # each rank holds half the padded vocabulary
    torch.testing.assert_close(r0["logits"][..., :300], ref[family]["hf"], atol=2e-5, rtol=1e-5)
    assert torch.equal(r0["logits"], r1["logits"])


@pytest.mark.parametrize("family", FAMILIES)
def test_export_under_tp2_is_exact(run, family):
    from safetensors.torch import load_file

    work, _, ranks = run
    _result(ranks, family)
    original = load_file(work / family / "model.safetensors")
    exported = load_file(work / f"export_{family}" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for key in original:
        assert torch.equal(original[key], exported[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_parallel_logprobs_equal_gathered(run, family):
    _, _, ranks = run
    r0, r1 = _result(ranks, family)
    torch.testing.assert_close(r0["vp_logprobs"], r0["logprobs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r1["vp_logprobs"], r0["logprobs"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decoder", ["static", "megatron"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_generation_under_tp2_equals_tp1(run, kind, decoder):
    """Both decoders under TP=2 (the static one with each rank's share of the heads and cache)
    sample what TP=1 samples."""
    _, ref, ranks = run
    r0, r1 = _result(ranks, "llama")
    for tp1, a, b in zip(ref[kind], r0[f"{kind}-{decoder}"], r1[f"{kind}-{decoder}"]):
        assert a.tokens == b.tokens == tp1.tokens
        assert a.logprobs == b.logprobs
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(tp1.logprobs), atol=1e-5, rtol=1e-5)


def test_checkpoint_tp1_loads_at_tp2_with_optimizer_state(run):
    """The TP=1 checkpoint gives the same logits at TP=2, and one more AdamW step there (with
    vocabulary-parallel log-probs) lands where the same step at TP=1 does: the optimizer's
    moments were resharded, not reset."""
    _, ref, ranks = run
    r0, r1 = _result(ranks, "reshard")
    assert r0["step"] == 1
    torch.testing.assert_close(r0["loaded"], ref["loaded"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r0["trained"], ref["trained"], atol=1e-4, rtol=1e-4)
    assert (r0["trained"] - r0["loaded"]).abs().max() > 1e-2
    assert torch.equal(r0["trained"], r1["trained"])


def test_checkpoint_tp2_loads_at_tp1(run):
    from hpc.policy import model
    from hpc.policy.checkpoint import load_checkpoint
    from hpc.policy.parallel import init_parallel, teardown

    work, _, ranks = run
    r0, _ = _result(ranks, "reshard")
    init_parallel()
    try:
        cfg = _tiny()
        net = model.build_policy(cfg)
        opt = torch.optim.AdamW(net.parameters(), lr=1.0)
        assert load_checkpoint(work / "ck_tp2", net, opt)[0] == 2
        torch.testing.assert_close(_logits(net), r0["trained"], atol=1e-5, rtol=1e-5)
        assert opt.param_groups[0]["lr"] == 1e-2 and float(opt.state[net.output_layer.weight]["step"]) == 2
    finally:
        teardown()


def test_a_tp_group_scores_each_episode_once_and_plays_it_identically(run):
    """The source rank runs the tools and scores; the other rank takes its messages and
    trajectories: the same samples on both, one evaluation per episode in all."""
    _, _, ranks = run
    first, second = _result(ranks, "rollout")
    assert first["evaluations"] == 2 and second["evaluations"] == 0
    assert first["tokens"] == second["tokens"] and first["rewards"] == second["rewards"]
    assert first["end"] == second["end"] == ["single_turn", "single_turn"]


def test_pipeline_layout(run):
    _, _, ranks = run
    layouts = [(r["pp_layout"].pp_rank, r["pp_layout"].pp_size, r["pp_layout"].tp_size) for r in ranks]
    assert layouts == [(0, 2, 1), (1, 2, 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_over_two_stages(run, family):
    _, ref, ranks = run
    first, last = _result(ranks, f"pp_{family}")
    assert first["logits"] is None and first["values"] is None
    torch.testing.assert_close(last["logits"][..., :300], ref[family]["hf"], atol=2e-5, rtol=1e-5)
    # The critic's trunk crosses the stages too; its head is output row 5 of the policy.
    torch.testing.assert_close(last["values"], last["logits"][..., 5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_over_two_stages_is_exact(run, family):
    from safetensors.torch import load_file

    work, _, ranks = run
    _result(ranks, f"pp_{family}")
    original = load_file(work / family / "model.safetensors")
    exported = load_file(work / f"export_pp_{family}" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for key in original:
        assert torch.equal(original[key], exported[key]), key


def test_checkpoint_tp1_loads_into_two_stages(run):
    _, ref, ranks = run
    first, last = _result(ranks, "pp_reshard")
    assert first["layers"] == last["layers"] == 2 and first["loaded"] is None
    torch.testing.assert_close(last["loaded"], ref["loaded"], atol=1e-5, rtol=1e-5)


def test_two_data_parallel_replicas_save_one_checkpoint(run):
    from hpc.policy import model
    from hpc.policy.checkpoint import load_checkpoint
    from hpc.policy.parallel import init_parallel, teardown

    work, ref, ranks = run
    assert [(r["dp_layout"].dp_rank, r["dp_layout"].dp_size) for r in ranks] == [(0, 2), (1, 2)]
    r0, r1 = _result(ranks, "dp")
    assert torch.equal(r0["loaded"], r1["loaded"])
    init_parallel()
    try:
        net = model.build_policy(_tiny())
        load_checkpoint(work / "ck_dp2", net)
        torch.testing.assert_close(_logits(net), ref["loaded"], atol=1e-5, rtol=1e-5)
    finally:
        teardown()


def test_cpu_shim_is_in_force_from_init_to_teardown_only():
    from hpc.policy import cpu_shim
    from hpc.policy.parallel import init_parallel, teardown

    if not cpu_shim.needed():
        pytest.skip("the shim applies only without CUDA")
    synchronize = torch.cuda.synchronize
    init_parallel()
    try:
        assert cpu_shim.applied() and torch.cuda.current_device() == "cpu" and torch.cuda.synchronize is not synchronize
    finally:
        teardown()
    assert not cpu_shim.applied() and torch.cuda.synchronize is synchronize
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()

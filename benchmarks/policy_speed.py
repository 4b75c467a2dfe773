"""Policy speed on one device: training-step throughput and MFU of the megatron-core policy, and
rollout tokens/s of `hpc.policy.generate` against HF transformers' `generate` on the same shape.

    python benchmarks/policy_speed.py --device cuda --preset 0.5b --out policy.json
    python benchmarks/policy_speed.py --device cuda --preset 1b --skip-gen --out policy-1b.json
    python benchmarks/policy_speed.py --device cpu --preset tiny --train-steps 2 --warmup 1 \
        --micro-batch 2 --seq 64 --gen-batch 4 --prompt-len 16 --new-tokens 8    # the code paths

Training (random init, one synthetic batch of `--micro-batch` x `--seq` tokens without padding,
AdamW as `hpc.rl.trainer` builds it, lr 1e-5, no weight decay): the loss is policy-gradient-like,
-mean(log p(next token) x advantage) with random N(0, 1) advantages, the log-probs (and the
entropy, the update's metric) computed as `hpc.rl.update` does (`sequence_logprobs`: on one
device the LM head fused into the fp32 log-probs a chunk of positions at a time, the logits
never materialized); `--loss ce` drops the advantages and the entropy (plain next-token
cross-entropy, as `hpc.rl.supervised.sft_step`). `--warmup` steps, then
`--train-steps` timed between synchronizations, then (on the GPU) `--profile-steps` under
torch.profiler, whose kernels are grouped (GEMM, attention, softmax / loss, optimizer, ...) to
show what limits MFU. Variants (`--train-variants`):

    sdpa           torch SDPA core attention, the step the trainer runs (`sequence_logprobs` with
                   the batch's padding mask: a right-padded batch gets no explicit mask, so the
                   causal flash kernel; the fused LM head), megatron's torch.compile'd fusions
                   on: the default
    sdpa-logits    sdpa with the logits materialized: `forward_logits`, then
                   `token_logprobs_and_entropy` on them (the step before the fused LM head)
    sdpa-repeat-kv sdpa with GQA's key/value heads repeated to the query heads (the copies
                   `enable_gqa` saves)
    sdpa-explicit-mask  sdpa-logits with the explicit [b, 1, s, s] mask (`attention_mask`) the
                   trainer passed before (memory-efficient kernel): what left padding still needs
    sdpa-nofusion  sdpa with megatron's fusions off
    local          megatron's own DotProductAttention (scores materialized, unfused softmax)
    sdpa-compile   sdpa with every transformer layer torch.compile'd (opt-in)

Model FLOPs per token (PaLM appendix B's convention; causal masking not discounted):

    F = 6 * (N_nonembed + V * h) + 12 * L * (heads * head_dim) * seq

N_nonembed: parameters other than the embedding; V * h: the output projection (tied to the
embedding here, but a matmul every token). MFU = F * tokens/s / peak (`--peak-tflops`, H200
bf16 dense 989). `mfu_excl_lm_head` drops the V * h term (6 * N_nonembed + the attention term).
The fused LM head's backward recomputes the logits (2 * V * h more per token), not counted, as
no recomputation is.

Rollout: `--gen-batch` prompts of `--prompt-len` random tokens, `--new-tokens` sampled at
temperature 1 (top-p 1, no stop token or string), so every row yields exactly `--new-tokens`.
Our loop (the policy config's defaults: SDPA attention and the fusions on the GPU; the static
decoder with its step replayed as a CUDA graph) is timed in full and prefill-only (their
difference gives the decode rate), then the same rollout with the static decoder's step run
eagerly and with megatron's own inference loop, then with the eos stop token
(checked on the device; the rows may stop early) and with a stop string that never matches (the
per-row Python path that stop strings need; `--skip-stop-string` leaves both out). HF: a random
`Qwen2ForCausalLM` (`LlamaForCausalLM` for a shape without qkv biases) of the same shape and
dtype, SDPA attention, `do_sample=True, top_k=0, top_p=1, min_new_tokens = max_new_tokens`.
The two models' weights are independent random draws: the figures compare speed only.

Every section catches its own errors (recorded as "error"); `--out` is rewritten after each one.
A training variant out of GPU memory is retried at half the micro-batch (recorded).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Less fragmentation between variants of different sizes (and after an out-of-memory retry).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from hpc.hardware import device_name, versions  # noqa: E402
from hpc.policy.config import PRESETS, PolicyModelConfig, policy_config  # noqa: E402
from hpc.policy.tokenizer import ByteTokenizer  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0

# name -> (policy.attention, policy.fusions, attention mask: "trainer" (`forward_mask` of the
# padding mask) | "explicit" (`attention_mask`), compile layers, GQA's key/value heads read in
# place by the flash kernel (False: repeated, as before `enable_gqa`), LM head: "fused"
# (`sequence_logprobs`) | "logits" (materialized, then `token_logprobs_and_entropy`))
VARIANTS = {
    "sdpa": ("sdpa", "auto", "trainer", False, True, "fused"),
    "sdpa-logits": ("sdpa", "auto", "trainer", False, True, "logits"),
    "sdpa-repeat-kv": ("sdpa", "auto", "trainer", False, False, "fused"),
    "sdpa-explicit-mask": ("sdpa", "auto", "explicit", False, True, "logits"),
    "sdpa-nofusion": ("sdpa", "off", "trainer", False, True, "fused"),
    "local": ("local", "auto", "trainer", False, True, "fused"),
    "sdpa-compile": ("sdpa", "auto", "trainer", True, True, "fused"),
}

# Kernel-name substrings -> category, first match wins (attention before GEMM: fmha kernels are
# CUTLASS GEMMs by name).
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "_mma", "wgmma", "s16816", "splitk")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax / loss", ("softmax", "nll", "cross_entropy", "logsumexp")),
    ("fused (triton)", ("triton",)),
    ("norm", ("rms", "norm")),
    ("copy / cast", ("copy", "cast", "convert", "transpose", "permute", "contiguous")),
    ("reduce / index", ("reduce", "gather", "scatter", "index", "cat", "arange", "where", "masked")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "fill", "mul", "add", "silu", "sigmoid",
                     "exp", "neg", "rsqrt", "pow")),
)


class BenchTokenizer(ByteTokenizer):
    """The byte tokenizer, decoding ids past its vocabulary (a large random policy samples
    them) as byte id % 256, so stop-string checks decode real text."""

    def decode(self, ids, skip_special: bool = True) -> str:
        return super().decode([i % 256 if i >= self.vocab_size else i for i in ids], skip_special)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    tail = traceback.format_exception(type(e), e, e.__traceback__)[-3:]
    return f"{type(e).__name__}: {e}"[:500] + "\n" + "".join(tail)[-1500:]


def _write(args: argparse.Namespace, figures: dict) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str) + "\n")


def model_config(args: argparse.Namespace, **overrides) -> PolicyModelConfig:
    base = policy_config({"preset": args.preset})
    need = max(args.seq, args.prompt_len + args.new_tokens)
    return policy_config({"preset": args.preset, "max_seq_len": max(base.max_seq_len, need), **overrides})


def flops_per_token(cfg: PolicyModelConfig, params: int, seq: int) -> dict:
    """The model FLOPs of one trained token (forward + backward); see the module docstring."""
    head = cfg.padded_vocab_size * cfg.hidden_size
    embedding = head if cfg.tie_embeddings else 2 * head     # input embedding (+ untied output layer)
    nonembed = params - embedding
    attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * seq
    return {"params": params, "non_embedding_params": nonembed, "lm_head_params": head,
            "attention_flops_per_token": attention,
            "matmul_flops_per_token": 6 * (nonembed + head),
            "flops_per_token": 6 * (nonembed + head) + attention,
            "flops_per_token_excl_lm_head": 6 * nonembed + attention}


# -- training ------------------------------------------------------------------------------------

def _categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _profile(step, steps: int, device: torch.device) -> dict:
    """Kernel time by category over `steps` steps (the device's kernels on CUDA, CPU ops else)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    wall_us = (time.perf_counter() - start) * 1e6
    by_cat: dict[str, float] = {}
    kernels: list[tuple[float, str, int]] = []
    for e in prof.key_averages():
        if cuda:
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = e.self_cuda_time_total
        else:
            if e.key.startswith("ProfilerStep"):
                continue
            t = e.self_cpu_time_total     # self times: no op counted twice
        if t <= 0:
            continue
        by_cat[_categorize(e.key)] = by_cat.get(_categorize(e.key), 0.0) + t
        kernels.append((t, e.key, e.count))
    busy = sum(by_cat.values())
    kernels.sort(reverse=True)
    return {
        "steps": steps, "profiled_wall_ms_per_step": wall_us / steps / 1e3, "busy_ms_per_step": busy / steps / 1e3,
        "ms_per_step_by_category": {k: round(v / steps / 1e3, 3) for k, v in
                                    sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "fraction_by_category": {k: round(v / busy, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "ms_per_step": round(t / steps / 1e3, 3), "calls_per_step": c / steps,
                         "category": _categorize(n)} for t, n, c in kernels[:20]],
    }


def train_variant(name: str, args: argparse.Namespace, device: torch.device, profile_steps: int) -> dict:
    from hpc.policy.model import (attention_mask, build_policy, count_parameters, forward_logits, position_ids,
                                  sequence_logprobs, token_logprobs, token_logprobs_and_entropy)

    attention, fusions, mask, compile_layers, native_gqa, head = VARIANTS[name]
    cfg = model_config(args, attention=attention, fusions=fusions)
    torch.manual_seed(args.seed)
    model = build_policy(cfg)
    model.train()
    if not native_gqa:
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.native_gqa = False
    if compile_layers:
        for layer in model.decoder.layers:
            layer.compile()
    params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    b, s = args.micro_batch, args.seq
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), device=device, generator=gen)
    advantages = torch.randn(b, s - 1, device=device, generator=gen)
    pad = torch.zeros(b, s, dtype=torch.bool, device=device)
    positions = position_ids(tokens)

    def logprobs() -> torch.Tensor:
        if head == "fused":
            return sequence_logprobs(model, tokens, pad, cfg.vocab_size, entropy=args.loss == "pg")[0]
        if mask == "explicit":
            logits = model(tokens, positions, attention_mask(pad))[:, :-1]
        else:
            logits = forward_logits(model, tokens, pad)[:, :-1]
        if args.loss == "pg":
            return token_logprobs_and_entropy(logits, tokens[:, 1:], cfg.vocab_size)[0]
        return token_logprobs(logits, tokens[:, 1:], cfg.vocab_size)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        logp = logprobs()
        loss = -(logp * advantages).mean() if args.loss == "pg" else -logp.mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    losses = []
    start = time.perf_counter()
    for _ in range(args.train_steps):
        losses.append(step())
    _sync(device)
    elapsed = time.perf_counter() - start
    f = flops_per_token(cfg, params, s)
    tps = b * s * args.train_steps / elapsed
    peak = args.peak_tflops * 1e12 if device.type == "cuda" else None
    out = {
        "attention": attention, "fusions": cfg.fusions_on(device.type == "cuda"), "mask": mask, "lm_head": head,
        "compiled_layers": compile_layers, "native_gqa": native_gqa, "micro_batch": b, "seq": s,
        "steps": args.train_steps,
        "warmup_steps": args.warmup, "warmup_s": round(warmup_s, 2),
        "step_ms": 1e3 * elapsed / args.train_steps, "tokens_per_s": tps,
        "model_tflops_per_s": f["flops_per_token"] * tps / 1e12,
        "mfu": f["flops_per_token"] * tps / peak if peak else None,
        "mfu_excl_lm_head": f["flops_per_token_excl_lm_head"] * tps / peak if peak else None,
        "loss_first_last": [float(losses[0]), float(losses[-1])],
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        **f,
    }
    if profile_steps > 0:
        prof = _profile(step, profile_steps, device)
        # Kernel time against the unprofiled step: the rest is the GPU waiting for the host.
        prof["idle_fraction"] = max(0.0, 1 - prof["busy_ms_per_step"] / out["step_ms"]) if device.type == "cuda" \
            else None
        cats = prof["ms_per_step_by_category"]
        gemm_ms, attn_ms = cats.get("gemm"), cats.get("attention")
        if gemm_ms:     # achieved GEMM rate: the non-attention matmul FLOPs over GEMM kernel time
            prof["gemm_tflops_per_s"] = f["matmul_flops_per_token"] * b * s / (gemm_ms / 1e3) / 1e12
        if attn_ms:     # causal: half the attention term is real work
            prof["attention_tflops_per_s_causal"] = f["attention_flops_per_token"] / 2 * b * s / (attn_ms / 1e3) / 1e12
        out["profile"] = prof
    return out


def run_training(args: argparse.Namespace, device: torch.device, figures: dict) -> None:
    train = figures["train"] = {
        "loss": ("policy-gradient-like: -mean(logp(next token) * advantage), advantages ~ N(0, 1)"
                 if args.loss == "pg" else "cross-entropy: -mean(logp(next token))"),
        "optimizer": "torch.optim.AdamW(lr=1e-5, weight_decay=0) on the model's parameters (as hpc.rl.trainer)",
        "flops_formula": "6 * (N_nonembed + V*h) + 12 * L * heads * head_dim * seq per token "
                         "(mfu_excl_lm_head: 6 * N_nonembed + 12 * L * heads * head_dim * seq)",
        "peak_tflops": args.peak_tflops if device.type == "cuda" else None,
        "variants": {},
    }
    for i, name in enumerate(v for v in args.train_variants.split(",") if v):
        if name not in VARIANTS:
            train["variants"][name] = {"error": f"unknown variant (one of {', '.join(VARIANTS)})"}
            continue
        print(f"--- train {name}", flush=True)
        run_args, oom = args, []
        while True:
            try:
                res = train_variant(name, run_args, device, args.profile_steps if i == 0 else 0)
            except torch.cuda.OutOfMemoryError as e:
                res = {"error": _error(e)}
            except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
                res = {"error": _error(e)}
                print(res["error"], file=sys.stderr, flush=True)
            _free(device)
            if "error" not in res or not res["error"].startswith("OutOfMemoryError") or run_args.micro_batch < 2:
                break
            oom.append(run_args.micro_batch)     # out of memory: once more at half the micro-batch
            print(f"out of memory at micro-batch {run_args.micro_batch}; trying {run_args.micro_batch // 2}",
                  flush=True)
            run_args = argparse.Namespace(**{**vars(run_args), "micro_batch": run_args.micro_batch // 2})
        if oom:
            res["out_of_memory_at_micro_batch"] = oom
        train["variants"][name] = res
        if "error" not in res:
            mfu = f", MFU {100 * res['mfu']:.1f}% ({100 * res['mfu_excl_lm_head']:.1f}% without the LM head)" \
                if res["mfu"] is not None else ""
            mem = f", peak memory {res['peak_memory_gib']:.1f} GiB" if res["peak_memory_gib"] is not None else ""
            print(f"train {name}: {res['tokens_per_s']:,.0f} tokens/s, {res['step_ms']:.1f} ms/step "
                  f"({res['micro_batch']} x {res['seq']}), {res['model_tflops_per_s']:.1f} model TFLOP/s{mfu}{mem}; "
                  f"loss {res['loss_first_last'][0]:.4f} -> {res['loss_first_last'][1]:.4f}", flush=True)
            if "profile" in res:
                p = res["profile"]
                idle = f", GPU idle {100 * p['idle_fraction']:.1f}%" if p["idle_fraction"] is not None else ""
                print(f"  profile: {p['busy_ms_per_step']:.1f} ms/step in kernels of {res['step_ms']:.1f} ms{idle}",
                      flush=True)
                for cat, ms in p["ms_per_step_by_category"].items():
                    print(f"    {cat:16s} {ms:8.2f} ms/step  {100 * p['fraction_by_category'][cat]:5.1f}%")
                if "gemm_tflops_per_s" in p:
                    print(f"    GEMM kernels run the matmul FLOPs at {p['gemm_tflops_per_s']:.0f} TFLOP/s", flush=True)
                if "attention_tflops_per_s_causal" in p:
                    print(f"    attention kernels at {p['attention_tflops_per_s_causal']:.0f} TFLOP/s "
                          f"(causal FLOPs)", flush=True)
        _write(args, figures)


# -- rollout -------------------------------------------------------------------------------------

def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, min(vocab, 256), (args.gen_batch, args.prompt_len), generator=g).tolist()


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def run_ours(args: argparse.Namespace, device: torch.device, gen_figs: dict) -> None:
    from hpc.policy.generate import SamplingParams, generate
    from hpc.policy.model import build_policy

    cfg = model_config(args)
    torch.manual_seed(args.seed)
    model = build_policy(cfg).eval()
    tok = BenchTokenizer()
    prompts = _prompts(args, cfg.vocab_size)

    def params(n: int, stop: list[str] | None = None, stop_ids: list[int] | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=1.0, top_p=1.0, stop=stop or [],
                              stop_token_ids=[] if stop_ids is None else stop_ids, seed=args.seed)

    generate(model, cfg, tok, prompts, params(min(4, args.new_tokens)))          # warm-up (compile, allocator)
    _, prefill_s = _timed(lambda: generate(model, cfg, tok, prompts, params(1)), device)
    out, total_s = _timed(lambda: generate(model, cfg, tok, prompts, params(args.new_tokens)), device)
    count = sum(len(c.tokens) for c in out)
    decode_steps = args.new_tokens - 1 if total_s > prefill_s else 0    # (timing noise on a busy CPU)
    ours = gen_figs["ours"] = {
        "attention": cfg.attention_impl(device.type == "cuda"), "fusions": cfg.fusions_on(device.type == "cuda"),
        "dtype": cfg.torch_dtype_name(device.type == "cuda"),
        "new_tokens": count, "seconds": total_s, "tokens_per_s": count / total_s,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": args.gen_batch * decode_steps / (total_s - prefill_s) if decode_steps else None,
        "decode_ms_per_step": 1e3 * (total_s - prefill_s) / decode_steps if decode_steps else None,
    }
    decode = (f"decode {ours['decode_ms_per_step']:.1f} ms/step = {ours['decode_tokens_per_s']:,.0f} tokens/s"
              if decode_steps else "decode n/a")
    print(f"ours: {count} tokens in {total_s:.2f} s = {ours['tokens_per_s']:,.0f} tokens/s "
          f"(prefill {1e3 * prefill_s:.0f} ms; {decode})", flush=True)
    # The same rollout through the other decoders (`hpc.policy.generate`): the static decoder's
    # step run eagerly, and megatron's own inference loop (what ran before the static decoder).
    for key, kw in (("ours_static_eager", {"cuda_graphs": False}), ("ours_megatron_loop", {"decoder": "megatron"})):
        generate(model, cfg, tok, prompts, params(min(4, args.new_tokens)), **kw)
        out, s_s = _timed(lambda: generate(model, cfg, tok, prompts, params(args.new_tokens), **kw), device)
        count = sum(len(c.tokens) for c in out)
        gen_figs[key] = {"new_tokens": count, "seconds": s_s, "tokens_per_s": count / s_s}
        print(f"ours, {key.removeprefix('ours_').replace('_', ' ')}: {count} tokens, {count / s_s:,.0f} tokens/s",
              flush=True)
    if not args.skip_stop_string:
        # A stop token the rows may sample (checked on the device), then a stop string that never
        # matches (each row's text checked in Python every step). Row lengths may differ from
        # new_tokens in the first: tokens/s counts what came back.
        for key, what, kw in (("ours_with_stop_token", "a stop token (checked on the device)",
                               {"stop_ids": [tok.eos_id]}),
                              ("ours_with_stop_string", "a stop string (per-row Python each step)",
                               {"stop": ["\x00never matched\x00"]})):
            out, s_s = _timed(lambda: generate(model, cfg, tok, prompts, params(args.new_tokens, **kw)), device)
            count = sum(len(c.tokens) for c in out)
            gen_figs[key] = {"new_tokens": count, "seconds": s_s, "tokens_per_s": count / s_s,
                             "stopped_rows": sum(c.finish_reason == "stop" for c in out)}
            print(f"ours with {what}: {count} tokens, {count / s_s:,.0f} tokens/s", flush=True)


def run_hf(args: argparse.Namespace, device: torch.device, gen_figs: dict) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpc.policy.hf_convert import hf_config_dict

    cfg = model_config(args)
    dtype = torch.bfloat16 if cfg.torch_dtype_name(device.type == "cuda") == "bf16" else torch.float32
    family = "qwen2" if cfg.qkv_bias else "llama"
    conf = hf_config_dict(cfg, family, dtype)
    conf.pop("architectures")
    hf_cfg = AutoConfig.for_model(conf.pop("model_type"), **conf)
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
            except TypeError:      # transformers 4.x
                model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    tok = BenchTokenizer()
    ids = torch.tensor(_prompts(args, cfg.vocab_size), device=device)
    mask = torch.ones_like(ids)

    def run(n: int):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                  top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_id,
                                  eos_token_id=tok.eos_id, use_cache=True)

    run(min(4, args.new_tokens))
    out, s = _timed(lambda: run(args.new_tokens), device)
    count = (out.shape[1] - ids.shape[1]) * out.shape[0]
    gen_figs["hf"] = {"model": type(model).__name__, "transformers": transformers.__version__,
                      "attn_implementation": getattr(model.config, "_attn_implementation", "sdpa"),
                      "dtype": str(dtype).removeprefix("torch."),
                      "new_tokens": count, "seconds": s, "tokens_per_s": count / s}
    print(f"HF {type(model).__name__}.generate: {count} tokens in {s:.2f} s = {count / s:,.0f} tokens/s", flush=True)


def run_rollout(args: argparse.Namespace, device: torch.device, figures: dict) -> None:
    gen_figs = figures["generate"] = {
        "batch": args.gen_batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "sampling": "temperature 1, top-p 1 (HF: top_k=0), no stop token; every row yields new_tokens",
        "note": "our policy and the HF model are independent random initializations of the same shape: "
                "a speed comparison, not an output comparison",
    }
    for part, fn in (("ours", run_ours), ("hf", run_hf)):
        if part == "hf" and args.skip_hf:
            continue
        print(f"--- generate {part}", flush=True)
        try:
            fn(args, device, gen_figs)
        except Exception as e:  # noqa: BLE001 - recorded, the next part runs
            gen_figs[part] = {"error": _error(e)}
            print(gen_figs[part]["error"], file=sys.stderr, flush=True)
        _free(device)
        _write(args, figures)
    ours, hf = gen_figs.get("ours", {}), gen_figs.get("hf", {})
    if "tokens_per_s" in ours and "tokens_per_s" in hf:
        gen_figs["ratio_ours_over_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        print(f"rollout tokens/s, ours / HF: {gen_figs['ratio_ours_over_hf']:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=tuple(PRESETS), default="0.5b")
    ap.add_argument("--train-steps", type=int, default=10, help="timed training steps (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed training steps first (default 3)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--loss", choices=("pg", "ce"), default="pg",
                    help="pg: -mean(logp * random advantages) (default); ce: plain cross-entropy")
    ap.add_argument("--train-variants", default="sdpa,sdpa-logits,sdpa-explicit-mask,sdpa-nofusion,local",
                    help=f"comma list of {', '.join(VARIANTS)} (default: all but the compiled one)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="steps of the first variant under torch.profiler (default 2 on cuda, 1 on cpu; 0: none)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                    help=f"the device's dense bf16 peak for MFU (default {H200_BF16_DENSE_TFLOPS:g}, H200)")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-gen", action="store_true")
    ap.add_argument("--skip-hf", action="store_true", help="no HF transformers comparison")
    ap.add_argument("--skip-stop-string", action="store_true", help="no run of our loop with a stop string")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.profile_steps is None:
        args.profile_steps = 2 if args.device == "cuda" else 1
    if min(args.train_steps, args.micro_batch, args.gen_batch, args.prompt_len, args.new_tokens) < 1 \
            or args.seq < 2 or args.warmup < 0:
        print("error: sizes and step counts must be >= 1 (--seq >= 2)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)

    import megatron.core

    from hpc.policy.parallel import init_parallel, teardown

    layout = init_parallel(seed=args.seed)
    device = torch.device(layout.device)
    vers = {**versions(), "megatron_core": megatron.core.__version__}
    try:
        import transformers
        vers["transformers"] = transformers.__version__
    except ImportError:
        vers["transformers"] = None
    figures = {
        "date": time.strftime("%Y-%m-%d"), "device": device_name(args.device), "versions": vers,
        "args": vars(args), "preset": args.preset, "model": {},
    }
    cfg = model_config(args)
    figures["model"] = {"preset": args.preset, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                        "heads": cfg.num_attention_heads, "kv_groups": cfg.num_query_groups,
                        "ffn_hidden_size": cfg.ffn_hidden_size, "padded_vocab_size": cfg.padded_vocab_size,
                        "dtype": cfg.torch_dtype_name(device.type == "cuda")}
    print(f"policy_speed: preset {args.preset} on {figures['device']} ({device}), torch {vers['torch']}, "
          f"megatron-core {vers['megatron_core']}, transformers {vers['transformers']}", flush=True)
    _write(args, figures)
    try:
        if not args.skip_train:
            run_training(args, device, figures)
        if not args.skip_gen:
            run_rollout(args, device, figures)
    finally:
        _write(args, figures)
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

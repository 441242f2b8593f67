"""Sampler throughput: our KV-cache sampler (model/sampler.generate) against transformers'
`GPT2LMHeadModel.generate(num_return_sequences=G)` on the same weights, prompts and settings, in the same run;
then prefix sharing (one prefill per prompt) against one prefill per sample, where a decode step spends its
time, and on CUDA the memory-bandwidth bound of decoding.

Fairness rules, all in one place:
- The same weights: our randomly initialised GPT-2 is exported with model.weights.save_hf and loaded with
  transformers.GPT2LMHeadModel.from_pretrained, in the same dtype; the largest logit difference on one prompt is
  reported, so a broken export cannot go unnoticed.
- The same prompts: random token ids, lengths uniform in [min_prompt_len, prompt_len], left-padded, with the
  attention mask. Throughput does not depend on which ids they are.
- The same distribution: temperature 1, no top-k (transformers' default would be 50), top-p 1, G samples per
  prompt (num_samples / num_return_sequences).
- The same work: a fixed number of new tokens. Ours with stop_ids=() (nothing stops a row), transformers with
  generation_config.eos_token_id = None (`min_new_tokens` would add a logits processor instead). So generated
  tokens = rows x new tokens in both.
- Timed: one untimed warm-up call per engine, then `repeats` rounds in which every engine runs once in turn
  (interleaved, so a change in the load of a shared machine hits all engines alike); the median time is reported,
  and a speed-up is the median of the per-round ratios.

Both engines copy the prompt's keys and values to each of the G rows and decode every row against its own copy;
ours computes the prompt once per group (prefill) where transformers computes it G times.
"""

import importlib.util
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import common
from bench.common import Timing, measure_interleaved, median_ratio, random_prompts, result, skipped, synchronize
from model.gpt2 import PRESETS, GPT2LMHeadModel, KVCache
from model.sampler import END_ID, EOS_ID, PAD_ID, generate, process_logits, sample_tokens

BENCH = "sampler"

# Memory bandwidth for the decode bound: H100 as measured in /work/shared/REFERENCE.md (datasheet 3.35 TB/s);
# H200 the datasheet figure, marked as such in the output.
MEMORY_BANDWIDTH = {"H100": (3.0e12, "measured, REFERENCE.md"), "H200": (4.8e12, "datasheet")}


@dataclass
class SamplerConfig:
    name: str
    """Named configuration, printed with every figure."""
    preset: str
    """model.gpt2.PRESETS key; randomly initialised (throughput does not depend on the weights' values)."""
    dtype: str
    """fp32 or bf16: the dtype of the weights and of the computation, in both engines."""
    prompt_len: int
    """Width of the left-padded prompt batch (the longest prompt)."""
    min_prompt_len: int
    """Shortest prompt; lengths are uniform in [min_prompt_len, prompt_len]."""
    new_tokens: int
    """Decode steps, forced in every engine."""
    group: int
    """G: samples per prompt (num_samples / num_return_sequences)."""
    rows: tuple[int, ...]
    """Batch sizes N = prompts x G of the ours-vs-transformers comparison."""
    share_prompts: int
    """Prompts in the prefix-sharing comparison (each with G samples); 0 skips it."""
    warmup: int = 1
    """Untimed calls per engine before timing."""
    repeats: int = 3
    """Timed rounds; the median is reported."""
    with_hf: bool = True
    """Run transformers' generate side by side (reported as not measured when transformers is missing)."""
    stage_steps: int = 8
    """Decode steps replayed stage by stage for the time breakdown; 0 skips it."""
    roofline: bool = False
    """Report decode throughput against the memory-bandwidth bound (CUDA only)."""


def configs(device: torch.device, quick: bool) -> list[SamplerConfig]:
    if device.type == "cuda":
        # GPT-2 124M at the reference GRPO shape: prompts up to 384 tokens, 56 new tokens, 64 samples per prompt;
        # N = 64 / 256 / 1024 are the batch sizes of REFERENCE.md's decode bounds.
        return [
            SamplerConfig(
                name="gpu-gpt2-124M" + ("-quick" if quick else ""),
                preset="gpt2",
                dtype="bf16",
                prompt_len=384,
                min_prompt_len=352,
                new_tokens=56,
                group=64,
                rows=(64, 256) if quick else (64, 256, 1024),
                share_prompts=4,
                repeats=2 if quick else 3,
                stage_steps=8,
                roofline=True,
            )
        ]
    if quick:
        return [
            SamplerConfig(
                name="cpu-tiny-quick",
                preset="tiny",
                dtype="fp32",
                prompt_len=64,
                min_prompt_len=48,
                new_tokens=16,
                group=8,
                rows=(16, 64),
                share_prompts=2,
                repeats=3,
                stage_steps=4,
            )
        ]
    return [
        SamplerConfig(
            name="cpu-tiny",
            preset="tiny",
            dtype="fp32",
            prompt_len=128,
            min_prompt_len=96,
            new_tokens=32,
            group=16,
            rows=(16, 64, 256),
            share_prompts=4,
            repeats=3,
            stage_steps=8,
        )
    ]


# ----------------------------------------------------------------------------------------------------
# Engines


def build_models(cfg: SamplerConfig, device: torch.device, workdir: Path):
    """(ours, transformers' model or None, max |logit difference| on one prompt or None, why transformers is absent)."""
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(PRESETS[cfg.preset]).eval()
    if not cfg.with_hf:
        return ours.to(device, dtype), None, None, "disabled in the configuration"
    if importlib.util.find_spec("transformers") is None:  # optional: the suite runs without it
        return ours.to(device, dtype), None, None, "transformers is not installed"
    import transformers

    from model.weights import save_hf

    transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the table
    folder = workdir / f"{cfg.name}-hf"
    save_hf(ours.state_dict(), ours.cfg, folder)
    # loaded in fp32, then cast: the same rounding of the same fp32 weights as ours
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).to(device, dtype).eval()
    hf.generation_config.eos_token_id = None  # nothing stops a row: the same decode steps as ours with stop_ids=()
    ours = ours.to(device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50000, (1, 64), generator=g).to(device)
    with torch.no_grad():
        ours_logits = ours(ids, torch.arange(64, device=device)[None]).float()
        hf_logits = hf(input_ids=ids).logits.float()
    return ours, hf, float((ours_logits - hf_logits).abs().max()), ""


def run_ours(model, ids, mask, G: int, new_tokens: int, seed: int):
    g = torch.Generator(device=ids.device).manual_seed(seed)
    return generate(model, ids, mask, G, new_tokens, temperature=1.0, top_k=0, top_p=1.0, generator=g, stop_ids=())


def run_hf(hf, ids, mask, G: int, new_tokens: int, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        return hf.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            num_return_sequences=G,
            pad_token_id=PAD_ID,
        )


def generated_tokens(out, prompt_width: int) -> int:
    """Tokens a call generated (every row decodes to the end: nothing stops a row)."""
    if isinstance(out, torch.Tensor):  # transformers: (N, P + new) ids
        return out.shape[0] * (out.shape[1] - prompt_width)
    return int(out.response_mask.sum())


def rate_details(t: Timing, prompt_width: int) -> dict:
    n = generated_tokens(t.outputs[-1], prompt_width)
    return {"seconds": t.median, "generated_tokens": n, "tokens_per_s": n / t.median, "timing": t.to_dict()}


# ----------------------------------------------------------------------------------------------------
# Where a decode step spends its time


@torch.no_grad()
def decode_stages(model, N: int, P: int, steps: int, device: torch.device, seed: int = 5) -> dict[str, float]:
    """Milliseconds per decode step in each stage of model/sampler.generate's loop (mean over `steps` steps),
    replayed by hand with a synchronize between stages, and of the prefill of N prompts. A replay, not a
    profile: if generate's loop changes, this must follow."""
    ids, mask = (t.to(device) for t in random_prompts(N, P, max(1, P - 32), model.cfg.vocab_size, seed=seed))
    g = torch.Generator(device=device).manual_seed(seed)
    secs: dict[str, float] = {}

    def stage(name, fn):
        synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0
        return out

    cache = KVCache(model.cfg, N, P + steps + 1, device)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    stage("prefill", lambda: model(ids, pos, mask, kv_cache=cache, logits_slice=slice(-1, None)))
    next_pos = mask.sum(-1)
    tok = torch.randint(0, 50000, (N,), device=device, generator=g)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    stop = torch.tensor((END_ID, EOS_ID), device=device)
    for t in range(steps):
        # each lambda runs at once inside stage(): the loop variables are bound by default arguments all the same
        h = stage(
            "body",
            lambda tok=tok, t=t: model.transformer(tok[:, None], (next_pos + t)[:, None], None, kv_cache=cache),
        )
        logits = stage("LM head", lambda h=h: model.lm_head(h[:, -1]))
        probs = stage("process_logits + softmax", lambda logits=logits: process_logits(logits).softmax(-1))
        tok = stage("sample_tokens", lambda probs=probs: sample_tokens(probs, g))
        stage(
            "bookkeeping",
            lambda probs=probs, tok=tok: (
                torch.where(~done, probs.gather(-1, tok[:, None]).squeeze(-1).log(), 0.0),
                done | torch.isin(tok, stop),
                bool(done.all()),
            ),
        )
    return {k: 1e3 * v / (1 if k == "prefill" else steps) for k, v in secs.items()}


STAGE_NOTES = {
    "body": "embeddings, blocks with KV-cache writes and masked SDPA, final norm",
    "LM head": "(N x d) @ (d x 50257)",
    "process_logits + softmax": "fp32 logits, temperature/top-k/top-p, softmax",
    "sample_tokens": "two-level inverse CDF, one uniform per row",
    "bookkeeping": "gather log-prob, stop test, all-done check (a host sync)",
}


# ----------------------------------------------------------------------------------------------------
# Memory-bandwidth bound of decoding (CUDA)


def decode_bound_tokens_per_s(
    n_params: int,
    bytes_per_param: int,
    kv_bytes_per_token: int,
    rows: int,
    prompt_len: int,
    steps: int,
    bandwidth: float,
) -> float:
    """Upper bound on decoded tokens/s when each decode step reads every weight once plus the cached keys and
    values of every row (REFERENCE.md: 247 MB of bf16 weights + 36,864 B per cached token for GPT-2 124M)."""
    seconds = sum(
        (n_params * bytes_per_param + rows * (prompt_len + t) * kv_bytes_per_token) / bandwidth for t in range(steps)
    )
    return rows * steps / seconds


def bandwidth_for(device: torch.device) -> tuple[float, str] | None:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in MEMORY_BANDWIDTH.items() if k in name), None)


# ----------------------------------------------------------------------------------------------------
# The benchmark


def bench_config(cfg: SamplerConfig, device: torch.device, workdir: Path) -> list[dict]:
    rows = []
    P, R, G = cfg.prompt_len, cfg.new_tokens, cfg.group
    ours, hf, logit_diff, why_no_hf = build_models(cfg, device, workdir)
    label = cfg.name
    print(
        f"[sampler] {label}: {cfg.preset} {cfg.dtype}, prompts {cfg.min_prompt_len}-{P} tokens, {R} new tokens forced, "
        f"G={G}, {cfg.warmup} warm-up + {cfg.repeats} interleaved repeats",
        flush=True,
    )
    if hf is None:
        rows.append(skipped(BENCH, f"{label}: transformers generate", why_no_hf, config=cfg))
    else:
        rows.append(
            result(
                BENCH,
                f"{label}: same weights, max |logit diff| ours vs transformers",
                logit_diff,
                "abs",
                note=f"{cfg.dtype}, one 64-token prompt",
                config=cfg,
            )
        )

    # 1. ours vs transformers generate, G samples per prompt, several batch sizes
    for N in cfg.rows:
        if N % G:
            raise ValueError(f"{label}: rows {N} not divisible by G={G}")
        B = N // G
        ids, mask = (t.to(device) for t in random_prompts(B, P, cfg.min_prompt_len, ours.cfg.vocab_size, seed=N))
        engines = {"ours": lambda r, i=ids, m=mask: run_ours(ours, i, m, G, r, seed=1)}
        if hf is not None:
            engines["transformers"] = lambda r, i=ids, m=mask: run_hf(hf, i, m, G, r, seed=1)
        for _ in range(cfg.warmup):
            for call in engines.values():
                call(R)
        timings = measure_interleaved({k: (lambda c=c: c(R)) for k, c in engines.items()}, device, cfg.repeats)
        for name, t in timings.items():
            d = rate_details(t, P)
            what = "model/sampler.generate" if name == "ours" else "GPT2LMHeadModel.generate(num_return_sequences=G)"
            rows.append(
                result(
                    BENCH,
                    f"{label} N={N} ({B} prompts x G={G}): {name}",
                    d["tokens_per_s"],
                    "tok/s",
                    note=f"{what}; {t.median:.3f} s/call{t.interference}",
                    config=cfg,
                    rows=N,
                    **d,
                )
            )
            print(f"  N={N:5d} {name:13s} {d['tokens_per_s']:12,.0f} generated tok/s ({t.median:.3f} s)", flush=True)
        if hf is not None:
            rows.append(
                result(
                    BENCH,
                    f"{label} N={N}: ours / transformers speed-up",
                    median_ratio(timings["ours"], timings["transformers"]),
                    "x",
                    note="median of per-repeat time ratios",
                    config=cfg,
                    rows=N,
                )
            )

    # 2. prefix sharing: S prompts x G samples with one prefill per prompt, against the same prompts repeated G
    #    times as separate rows (num_samples=1); the prefill share from calls that generate one token
    S = cfg.share_prompts
    if S > 0:
        ids, mask = (t.to(device) for t in random_prompts(S, P, cfg.min_prompt_len, ours.cfg.vocab_size, seed=100 + S))
        ids_rep, mask_rep = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)  # (S*G, P)
        calls = {
            "shared": lambda r: run_ours(ours, ids, mask, G, r, seed=2),
            "unshared": lambda r: run_ours(ours, ids_rep, mask_rep, 1, r, seed=2),
        }
        for _ in range(cfg.warmup):
            for call in calls.values():
                call(R)
        full = measure_interleaved({k: (lambda c=c: c(R)) for k, c in calls.items()}, device, cfg.repeats)
        prefill = measure_interleaved({k: (lambda c=c: c(1)) for k, c in calls.items()}, device, cfg.repeats)
        for mode in calls:
            d = rate_details(full[mode], P)
            share = prefill[mode].median / full[mode].median
            rows.append(
                result(
                    BENCH,
                    f"{label} {S} prompts x {G}: ours, prefix {mode}",
                    d["tokens_per_s"],
                    "tok/s",
                    note=f"{full[mode].median:.3f} s/call; prefill + 1 token {prefill[mode].median:.3f} s ({share:.0%})"
                    f"{full[mode].interference}",
                    config=cfg,
                    prefill=prefill[mode].to_dict(),
                    **d,
                )
            )
            print(
                f"  {S} prompts x {G} prefix {mode:9s} {d['tokens_per_s']:12,.0f} generated tok/s "
                f"({full[mode].median:.3f} s, prefill + 1 token {prefill[mode].median:.3f} s)",
                flush=True,
            )
        rows.append(
            result(
                BENCH,
                f"{label} {S} prompts x {G}: prefix shared / unshared speed-up",
                median_ratio(full["shared"], full["unshared"]),
                "x",
                note="median of per-repeat time ratios",
                config=cfg,
            )
        )

    # 3. where a decode step of ours spends its time
    if cfg.stage_steps > 0:
        N = max(cfg.rows)
        common.wait_if_asked(device)
        stages = decode_stages(ours, N, P, cfg.stage_steps, device)
        step_ms = sum(v for k, v in stages.items() if k != "prefill")
        for name, ms in stages.items():
            if name == "prefill":
                note = f"{N} prompts of up to {P} tokens, logits at the last position"
            else:
                note = f"{ms / step_ms:.0%} of a decode step; {STAGE_NOTES[name]}"
            rows.append(result(BENCH, f"{label} N={N} decode step: {name}", ms, "ms", note=note, config=cfg))
        rows.append(
            result(
                BENCH,
                f"{label} N={N} decode step: total",
                step_ms,
                "ms",
                note="replay with a synchronize between stages",
                config=cfg,
            )
        )
        print("  decode step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)

    # 4. memory-bandwidth bound of decoding (CUDA): weights once per step + every row's cached keys/values
    if cfg.roofline and device.type == "cuda":
        bw = bandwidth_for(device)
        if bw is None:
            rows.append(
                skipped(
                    BENCH,
                    f"{label}: decode bandwidth bound",
                    f"no bandwidth figure for {torch.cuda.get_device_name(device)}",
                    config=cfg,
                )
            )
        else:
            bandwidth, source = bw
            c = ours.cfg
            n_params = common.count_params(ours)
            bytes_per = 2 if cfg.dtype == "bf16" else 4
            kv_bytes = 2 * c.n_layer * c.n_embd * bytes_per  # k and v, every layer: 36,864 B for GPT-2 124M in bf16
            for N in cfg.rows:
                ids, mask = (t.to(device) for t in random_prompts(N, P, cfg.min_prompt_len, c.vocab_size, seed=7 + N))
                calls = {
                    "full": lambda i=ids, m=mask: run_ours(ours, i, m, 1, R, seed=3),
                    "prefill": lambda i=ids, m=mask: run_ours(ours, i, m, 1, 1, seed=3),
                }
                calls["full"]()
                t = measure_interleaved(calls, device, cfg.repeats)
                decode_rate = N * (R - 1) / max(t["full"].median - t["prefill"].median, 1e-9)
                bound = decode_bound_tokens_per_s(n_params, bytes_per, kv_bytes, N, P + 1, R - 1, bandwidth)
                rows.append(
                    result(
                        BENCH,
                        f"{label} N={N} G=1: decode tok/s, prefill excluded",
                        decode_rate,
                        "tok/s",
                        note=f"bound {bound:,.0f} tok/s = {100 * decode_rate / bound:.0f}% (weights "
                        f"{n_params * bytes_per / 1e6:.0f} MB + {kv_bytes:,} B per cached token per step at "
                        f"{bandwidth / 1e12:.1f} TB/s, {source})",
                        config=cfg,
                        bound=bound,
                        bandwidth=bandwidth,
                        timing=t["full"].to_dict(),
                        prefill=t["prefill"].to_dict(),
                    )
                )
                print(f"  decode bound N={N}: {decode_rate:,.0f} tok/s of {bound:,.0f}", flush=True)
    ours = hf = None  # frees the models (the timing lambdas hold the names, not them)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(device: torch.device, quick: bool, cfgs: list[SamplerConfig] | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as workdir:
        for cfg in cfgs or configs(device, quick):
            rows += bench_config(cfg, device, Path(workdir))
    return rows

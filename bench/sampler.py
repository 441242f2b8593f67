"""Sampler throughput: our KV-cache sampler (model/sampler.generate) against transformers'
generate(num_return_sequences=G) on the same weights, prompts and settings, interleaved; prefix sharing against one
prefill per sample; where a decode step spends its time (docs/benchmarks.md, "sampler": the fairness rules). The
decode step against its floor on a GPU: bench/decode_profile.py."""

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


@dataclass
class SamplerConfig:
    name: str  # named configuration, printed with every figure
    preset: str  # model.gpt2.PRESETS key, randomly initialised
    dtype: str  # fp32 or bf16: weights and computation, in both engines
    prompt_len: int  # the longest prompt (the left-padded batch's width); lengths uniform from min_prompt_len
    min_prompt_len: int
    new_tokens: int  # decode steps, forced in every engine
    group: int  # G: samples per prompt
    rows: tuple[int, ...]  # batch sizes N = prompts x G of ours against transformers
    share_prompts: int  # prompts of the prefix-sharing comparison (0: none)
    warmup: int = 1  # untimed calls per engine
    repeats: int = 3  # timed rounds; the median is reported
    with_hf: bool = True  # transformers' generate beside ours (a row says why when it is missing)
    stage_steps: int = 8  # decode steps replayed stage by stage (0: none)


def configs(device: torch.device, quick: bool) -> list[SamplerConfig]:
    if device.type == "cuda":  # GPT-2 124M at the reference GRPO shape; N = 64 / 256 / 1,024 as REFERENCE.md's bounds
        name, rows = ("gpu-gpt2-124M-quick", (64, 256)) if quick else ("gpu-gpt2-124M", (64, 256, 1024))
        return [SamplerConfig(name, "gpt2", "bf16", 384, 352, 56, 64, rows, 4, repeats=2 if quick else 3)]
    if quick:
        return [SamplerConfig("cpu-tiny-quick", "tiny", "fp32", 64, 48, 16, 8, (16, 64), 2, stage_steps=4)]
    return [SamplerConfig("cpu-tiny", "tiny", "fp32", 128, 96, 32, 16, (16, 64, 256), 4)]


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
    kwargs = dict(attention_mask=mask.long(), max_new_tokens=new_tokens, num_return_sequences=G, pad_token_id=PAD_ID)
    with torch.no_grad():  # the settings of run_ours
        return hf.generate(input_ids=ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **kwargs)


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
# The benchmark


def bench_config(cfg: SamplerConfig, device: torch.device, workdir: Path) -> list[dict]:
    P, R, G, label = cfg.prompt_len, cfg.new_tokens, cfg.group, cfg.name
    ours, hf, logit_diff, why_no_hf = build_models(cfg, device, workdir)
    prompts = f"prompts {cfg.min_prompt_len}-{P} tokens, {R} new tokens forced, G={G}"
    repeats = f"{cfg.warmup} warm-up + {cfg.repeats} interleaved repeats"
    print(f"[sampler] {label}: {cfg.preset} {cfg.dtype}, {prompts}, {repeats}", flush=True)

    def row(figure: str, value: float, unit: str, note: str = "", **details) -> dict:
        return result(BENCH, f"{label}{figure}", value, unit, note=note, config=cfg, **details)

    def timed(calls: dict, new_tokens: int, warmup: int) -> dict[str, Timing]:
        for _ in range(warmup):
            for call in calls.values():
                call(R)
        return measure_interleaved({k: (lambda c=c: c(new_tokens)) for k, c in calls.items()}, device, cfg.repeats)

    if hf is None:
        rows = [skipped(BENCH, f"{label}: transformers generate", why_no_hf, config=cfg)]
    else:
        same = ": same weights, max |logit diff| ours vs transformers"
        rows = [row(same, logit_diff, "abs", f"{cfg.dtype}, one 64-token prompt")]
    ratio_note = "median of per-repeat time ratios"

    # 1. ours vs transformers generate, G samples per prompt, several batch sizes
    for N in cfg.rows:
        if N % G:
            raise ValueError(f"{label}: rows {N} not divisible by G={G}")
        B = N // G
        ids, mask = (t.to(device) for t in random_prompts(B, P, cfg.min_prompt_len, ours.cfg.vocab_size, seed=N))
        engines = {"ours": lambda r, i=ids, m=mask: run_ours(ours, i, m, G, r, seed=1)}
        if hf is not None:
            engines["transformers"] = lambda r, i=ids, m=mask: run_hf(hf, i, m, G, r, seed=1)
        timings = timed(engines, R, cfg.warmup)
        for name, t in timings.items():
            d = rate_details(t, P)
            what = "model/sampler.generate" if name == "ours" else "GPT2LMHeadModel.generate(num_return_sequences=G)"
            note = f"{what}; {t.median:.3f} s/call{t.interference}"
            rows.append(row(f" N={N} ({B} prompts x G={G}): {name}", d["tokens_per_s"], "tok/s", note, rows=N, **d))
            print(f"  N={N:5d} {name:13s} {d['tokens_per_s']:12,.0f} generated tok/s ({t.median:.3f} s)", flush=True)
        if hf is not None:
            speed_up = median_ratio(timings["ours"], timings["transformers"])
            rows.append(row(f" N={N}: ours / transformers speed-up", speed_up, "x", ratio_note, rows=N))

    # 2. prefix sharing: S prompts x G samples, one prefill per prompt, against the prompts repeated G times as rows;
    #    the prefill's share from calls that generate one token
    S = cfg.share_prompts
    if S > 0:
        ids, mask = (t.to(device) for t in random_prompts(S, P, cfg.min_prompt_len, ours.cfg.vocab_size, seed=100 + S))
        ids_rep, mask_rep = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)  # (S*G, P)
        calls = {
            "shared": lambda r: run_ours(ours, ids, mask, G, r, seed=2),
            "unshared": lambda r: run_ours(ours, ids_rep, mask_rep, 1, r, seed=2),
        }
        full, prefill = timed(calls, R, cfg.warmup), timed(calls, 1, 0)
        for mode in calls:
            d, one = rate_details(full[mode], P), prefill[mode].median
            note = f"{full[mode].median:.3f} s/call; prefill + 1 token {one:.3f} s ({one / full[mode].median:.0%})"
            note += full[mode].interference
            name = f" {S} prompts x {G}: ours, prefix {mode}"
            rows.append(row(name, d["tokens_per_s"], "tok/s", note, prefill=prefill[mode].to_dict(), **d))
            rate = f"{d['tokens_per_s']:12,.0f} generated tok/s"
            print(f"  {S} prompts x {G} prefix {mode:9s} {rate} ({note})", flush=True)
        speed_up = median_ratio(full["shared"], full["unshared"])
        rows.append(row(f" {S} prompts x {G}: prefix shared / unshared speed-up", speed_up, "x", ratio_note))

    # 3. where a decode step of ours spends its time
    if cfg.stage_steps > 0:
        N = max(cfg.rows)
        common.wait_if_asked(device)
        stages = decode_stages(ours, N, P, cfg.stage_steps, device)
        step_ms = sum(v for k, v in stages.items() if k != "prefill")
        for name, ms in stages.items():
            note = f"{ms / step_ms:.0%} of a decode step; {STAGE_NOTES[name]}" if name != "prefill" else ""
            note = note or f"{N} prompts of up to {P} tokens, logits at the last position"
            rows.append(row(f" N={N} decode step: {name}", ms, "ms", note))
        rows.append(row(f" N={N} decode step: total", step_ms, "ms", "replay with a synchronize between stages"))
        print("  decode step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)

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

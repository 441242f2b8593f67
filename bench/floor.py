"""GRPO's step against its compute floor, stage by stage, at the side-by-side configuration of bench/trl_grpo.py
(cpu-trl-comparison on a CPU: the tiny GPT-2 with the full 50,257-word vocabulary, 8 prompts x 16 samples x 16 new
tokens, all 128 samples trained; on a GPU its gpu-trl-comparison).

    python -m bench.run_all --only floor                   # named only, like compile
    python -m bench.run_all --only floor --device cpu --threads 2

A stage's floor is the time of its matrix products alone, run with torch.mm at the shapes and counts the stage runs
them, on the same machine and threads, just before the step is timed: the LM head's products (the tiny model's
50,257 x 64 head is 97% of its weights) timed one by one, and the transformer body's FLOPs charged at the fastest
head product's rate (the body's 64-wide products run slower than that, so the floor stays a lower bound). What a
stage does beyond its products (softmax, the draw, gathers, FSDP's hooks, Python) is the gap between its measured
time and its floor. A product (m, k) x (k, n) is 2mkn FLOPs.

The products, with N sampled rows, K trained rows, prompts with T_p real tokens each and responses of R tokens
(the counts of the step just measured):
  generate   prefill: the body over each prompt's tokens once, the head at its last position; then for each later
             token, one decode step of the body and the head over the N rows (N x C times C x V)
  score      the reward model's body over each prompt once and every sampled response (prefix sharing: the packed
             rows hold each prompt once; its head is one number per sequence)
  reference  the frozen reference's body over the K trained rows (each prompt once: prefix sharing), its head at
             their response positions, in chunks of rlhf.logprobs.CHUNK positions on a CPU
  update     the policy's forward as the reference's, and its backward: the head's two products over all response
             positions at once (dh = G W, dW = G^T h) and the body's at twice its forward FLOPs
Attention's own products (scores and values, 4 T C per token and layer) are counted with the body.

On a GPU a decode step is bound by memory, not by its products: decode_floor counts the bytes a step must read (the
weights once, each prompt's keys and values once per group, each row's own ones) and its FLOPs, against
bench/common.py's GPU_PEAKS, the datasheets' bandwidth and dense bf16 peak (bench/decode_profile.py sets the recorded
step against it).
"""

import statistics
import time

import torch

from bench import common
from bench.common import GPU_PEAKS, result
from bench.grpo_step import STAGES, GRPOBenchConfig, measure_steps
from bench.trl_grpo import configs as side_by_side_configs
from model.gpt2 import PRESETS
from rlhf.logprobs import CHUNK, GPU_CHUNK_BYTES

BENCH = "floor"


def mm_seconds(m: int, k: int, n: int, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of one (m, k) x (k, n) product in fp32 (bf16 on a GPU), after one warm-up."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        common.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        common.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def decode_floor(cfg, prompts: int, prompt_len: float, group: int, new_tokens: int, bytes_per_value: int = 2) -> dict:
    """Bytes read and FLOPs of one decode step of prompts x group rows, averaged over the new tokens, with each prompt's
    keys and values stored once per group (prefix sharing). Read: every weight once (the tied head included), each
    prompt's keys and values (prompt_len positions) once, each row's own keys and values (new_tokens / 2 positions on
    average); the logits are not counted (a kernel that fused the head with the softmax and the draw would not write
    them). FLOPs: the body's and the head's products for every row, attention's 4 x context x C per layer and row."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    N = prompts * group
    weights = (12 * L * C * C + V * C + cfg.n_positions * C) * bytes_per_value
    kv_per_position = 2 * L * C * bytes_per_value
    prompt_kv = prompts * prompt_len * kv_per_position
    own_kv = N * (new_tokens / 2) * kv_per_position
    flops = N * (body_flops_per_token(cfg, prompt_len + new_tokens / 2) + 2 * C * V)
    return {
        "bytes": weights + prompt_kv + own_kv,
        "weights_bytes": weights,
        "prompt_kv_bytes": prompt_kv,
        "own_kv_bytes": own_kv,
        "flops": flops,
    }


def body_flops_per_token(cfg, context: float) -> float:
    """Forward FLOPs of the transformer body for one token attending to `context` positions: 2 x the 12 C^2 weights
    of each layer's products, plus attention's scores and values (4 x context x C per layer)."""
    return cfg.n_layer * (24 * cfg.n_embd**2 + 4 * context * cfg.n_embd)


def stage_products(bcfg: GRPOBenchConfig, counts: dict, device: torch.device) -> dict[str, dict]:
    """Per stage: the head's products as {(m, k, n): count} and the body's FLOPs, from the step's token counts."""
    cfg = PRESETS[bcfg.preset]
    C, V = cfg.n_embd, cfg.vocab_size
    G, N, K = bcfg.num_samples, counts["sequences"], counts["trained_sequences"]
    prompt_tokens = (counts["total_tokens"] - counts["generated_tokens"]) // G  # every prompt's real tokens, once
    generated = counts["generated_tokens"]
    trained_response = generated * K // N  # selection "all": K = N
    Tp, R = prompt_tokens / bcfg.prompts, bcfg.max_new_tokens
    chunk = CHUNK if device.type == "cpu" else max(CHUNK, GPU_CHUNK_BYTES // (4 * V))
    decode_steps = max(0, (generated - N) // N)  # tokens after the first, per row (rows that ran to the end)
    head_chunks = {}
    full, last = divmod(trained_response, chunk)
    head_chunks[(chunk, C, V)] = full
    if last:
        head_chunks[(last, C, V)] = 1
    context = Tp + R / 2
    return {
        "generate": {
            "head": {(bcfg.prompts, C, V): 1, (N, C, V): decode_steps},
            "body": prompt_tokens * body_flops_per_token(cfg, Tp / 2)
            + N * decode_steps * body_flops_per_token(cfg, context),
        },
        "score": {"head": {}, "body": (prompt_tokens + generated) * body_flops_per_token(cfg, context)},
        "reference": {
            "head": head_chunks,
            "body": (prompt_tokens + trained_response) * body_flops_per_token(cfg, context),
        },
        "update": {
            "head": head_chunks | {(trained_response, V, C): 1, (V, trained_response, C): 1},
            "body": 3 * (prompt_tokens + trained_response) * body_flops_per_token(cfg, context),
        },
    }


def gpu_stage_floors(bcfg: GRPOBenchConfig, counts: dict, gpu: str = "H100") -> dict[str, float]:
    """Seconds per stage a GPU cannot beat, from the step's token counts: each stage's products (stage_products) at
    the dense bf16 peak; for generate, the larger of that and its decode steps' reads (decode_floor per step, every
    generate call of gen_prompts prompts) at the memory bandwidth. The training and scoring stages' reads (weights
    once per micro-batch) are far below their products' time and not counted."""
    peak = GPU_PEAKS[gpu]
    cfg = PRESETS[bcfg.preset]
    floors = {
        stage: (sum(2 * a * b * c * n for (a, b, c), n in p["head"].items()) + p["body"]) / peak["flops_per_s"]
        for stage, p in stage_products(bcfg, counts, torch.device("cuda")).items()
    }
    G, N = bcfg.num_samples, counts["sequences"]
    prompt_len = (counts["total_tokens"] - counts["generated_tokens"]) / G / bcfg.prompts
    steps = max(0, (counts["generated_tokens"] - N) // N)
    calls = -(-bcfg.prompts // bcfg.gen_prompts)
    step_bytes = decode_floor(cfg, bcfg.gen_prompts, prompt_len, G, bcfg.max_new_tokens)["bytes"]
    floors["generate"] = max(floors["generate"], calls * steps * step_bytes / peak["bytes_per_s"])
    return floors


def run(device: torch.device, quick: bool) -> list[dict]:
    bcfg = side_by_side_configs(device, quick)[0]
    print(f"[{BENCH}] {bcfg.name}: {bcfg.describe()}", flush=True)
    m = measure_steps(bcfg, device)
    step = statistics.median(m["step_seconds"])
    measured = {k: statistics.median(v) for k, v in m["stage_seconds"].items()}
    products = stage_products(bcfg, m["counts"], device)
    timed = {shape: mm_seconds(*shape, device) for p in products.values() for shape in p["head"]}
    best_rate = max(2 * a * b * c / s for (a, b, c), s in timed.items())
    rows, floor_total, flops_total = [], 0.0, 0.0
    for stage in STAGES:
        if stage not in products:
            continue
        p = products[stage]
        head_flops = sum(2 * a * b * c * n for (a, b, c), n in p["head"].items())
        head_s = sum(timed[shape] * n for shape, n in p["head"].items())
        floor = head_s + p["body"] / best_rate
        floor_total += floor
        flops_total += head_flops + p["body"]
        shapes = ", ".join(
            f"{n} x ({a}x{b})@({b}x{c}) {timed[(a, b, c)] * 1e3:.2f} ms" for (a, b, c), n in p["head"].items()
        )
        note = (
            f"{(head_flops + p['body']) / 1e9:.1f} GFLOP (head {head_flops / 1e9:.1f}, body {p['body'] / 1e9:.2f}); "
            f"floor {floor:.3f} s ({shapes or 'no head'}); measured {measured[stage]:.3f} s"
        )
        rows.append(result(BENCH, f"{bcfg.name}: {stage}, measured / floor", measured[stage] / floor, "x", note=note))
        print(f"  {stage:9s} measured {measured[stage]:.3f} s, floor {floor:.3f} s: {note}", flush=True)
    rest = step - sum(measured[k] for k in products)
    rows.append(
        result(
            BENCH,
            f"{bcfg.name}: step, measured / floor",
            step / floor_total,
            "x",
            note=f"{flops_total / 1e9:.1f} GFLOP; floor {floor_total:.3f} s, step {step:.3f} s (select, advantages and "
            f"the rest {rest:.3f} s); fastest head product {best_rate / 1e9:.0f} GFLOP/s",
        )
    )
    print(f"  step measured {step:.3f} s, floor {floor_total:.3f} s ({flops_total / 1e9:.1f} GFLOP)", flush=True)
    return rows

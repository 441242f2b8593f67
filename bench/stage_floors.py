"""The compute a GRPO step's stages cannot avoid, from the step's token counts: arithmetic, no timing.
bench/grpo_step.py sets a GPU step's stages against gpu_stage_floors and bench/decode_profile.py the recorded decode
step against decode_floor. `bcfg` is a bench.grpo_step.GRPOBenchConfig (not imported: grpo_step imports this module).

What each stage counts (prefill and decode, the reward model, the reference's chunked head, the update's forward and
backward): docs/benchmarks.md, "GRPO's step against its compute floor"; each function's docstring below.
"""

from bench.common import GPU_PEAKS
from model.gpt2 import PRESETS
from rlhf.logprobs import CHUNK, GPU_CHUNK_BYTES


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


def stage_products(bcfg, counts: dict) -> dict[str, dict]:
    """Per stage: the head's products as {(m, k, n): count} (a GPU run's chunks) and the body's FLOPs."""
    cfg = PRESETS[bcfg.preset]
    C, V = cfg.n_embd, cfg.vocab_size
    G, N, K = bcfg.num_samples, counts["sequences"], counts["trained_sequences"]
    prompt_tokens = (counts["total_tokens"] - counts["generated_tokens"]) // G  # every prompt's real tokens, once
    generated = counts["generated_tokens"]
    trained_response = generated * K // N  # selection "all": K = N
    Tp, R = prompt_tokens / bcfg.prompts, bcfg.max_new_tokens
    chunk = max(CHUNK, GPU_CHUNK_BYTES // (4 * V))
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


def gpu_stage_floors(bcfg, counts: dict, gpu: str = "H100") -> dict[str, float]:
    """Seconds per stage a GPU cannot beat, from the step's token counts: each stage's products (stage_products) at
    the dense bf16 peak; for generate, the larger of that and its decode steps' reads (decode_floor per step, every
    generate call of gen_prompts prompts) at the memory bandwidth. The training and scoring stages' reads (weights
    once per micro-batch) are far below their products' time and not counted."""
    peak = GPU_PEAKS[gpu]
    cfg = PRESETS[bcfg.preset]
    floors = {
        stage: (sum(2 * a * b * c * n for (a, b, c), n in p["head"].items()) + p["body"]) / peak["flops_per_s"]
        for stage, p in stage_products(bcfg, counts).items()
    }
    G, N = bcfg.num_samples, counts["sequences"]
    prompt_len = (counts["total_tokens"] - counts["generated_tokens"]) / G / bcfg.prompts
    steps = max(0, (counts["generated_tokens"] - N) // N)
    calls = -(-bcfg.prompts // bcfg.gen_prompts)
    step_bytes = decode_floor(cfg, bcfg.gen_prompts, prompt_len, G, bcfg.max_new_tokens)["bytes"]
    floors["generate"] = max(floors["generate"], calls * steps * step_bytes / peak["bytes_per_s"])
    return floors

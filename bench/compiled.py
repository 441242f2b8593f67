"""--compile against eager: the sampler's decode tokens/s and one GRPO step (bench/grpo_step.py's, with its peak
memory against the estimate), the compilation timed apart (`python -m bench.run_all --only compile [--quick]`).
The first compiled call or step is timed alone (compilation + one call); then eager and compiled in turn. On a GPU each
decode shape's steps are recorded as CUDA graphs at their first use (model/sampler.StepGraph), on a CPU the decode
step is compiled once (model/sampler.compiled_decode_step).
"""

import statistics
import time
from dataclasses import dataclass, replace

import torch

from bench import common
from bench.common import measure_interleaved, random_prompts, result, synchronize
from bench.grpo_step import CPU_TINY_QUICK, GPU_REFERENCE, GRPOBenchConfig, measure_steps, memory_rows
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.sampler import generate

BENCH = "compile"


@dataclass
class DecodeCompileConfig:
    name: str  # named configuration, printed with every figure
    preset: str  # model.gpt2.PRESETS key, randomly initialised
    dtype: str  # fp32 or bf16
    prompts: int  # S: prompts per generate call
    group: int  # G: samples per prompt (rows = S x G)
    prompt_len: int  # the left-padded batch's width; lengths uniform from min_prompt_len
    min_prompt_len: int
    new_tokens: int  # decode steps, forced
    repeats: int = 3  # timed rounds; the median is reported


def configs(device: torch.device, quick: bool) -> tuple[DecodeCompileConfig, GRPOBenchConfig]:
    if device.type == "cuda":
        # gpt2 at the reference decode shape, 1,024 rows (16 prompts x 64 samples), and REFERENCE.md's GRPO step
        sampler = DecodeCompileConfig("gpu-gpt2-1024-rows", "gpt2", "bf16", 16, 64, 384, 352, 56, 2 if quick else 3)
        step = replace(GPU_REFERENCE, prompts=32 if quick else 256, repeats=2 if quick else 3)
        return sampler, step
    S, G, new = (2, 8, 16) if quick else (4, 16, 32)
    sampler = DecodeCompileConfig("cpu-tiny", "tiny", "fp32", S, G, 64, 48, new)
    step = replace(CPU_TINY_QUICK, name="cpu-tiny")
    return sampler, step


def bench_sampler(cfg: DecodeCompileConfig, device: torch.device) -> list[dict]:
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = GPT2LMHeadModel(PRESETS[cfg.preset]).to(device, dtype).eval()
    ids, mask = (
        t.to(device)
        for t in random_prompts(cfg.prompts, cfg.prompt_len, cfg.min_prompt_len, model.cfg.vocab_size, seed=0)
    )
    rows = cfg.prompts * cfg.group
    print(
        f"[{BENCH}] {cfg.name}: {cfg.preset} {cfg.dtype}, {cfg.prompts} prompts x {cfg.group} samples = {rows} rows, "
        f"{cfg.new_tokens} new tokens forced",
        flush=True,
    )

    def call(compiled: bool):
        g = torch.Generator(device=device).manual_seed(1)
        return generate(model, ids, mask, cfg.group, cfg.new_tokens, generator=g, stop_ids=(), compile=compiled)

    call(False)
    synchronize(device)
    t0 = time.perf_counter()
    call(True)
    synchronize(device)
    first = time.perf_counter() - t0
    with common.cuda_graph_recordings() as recorded:  # after the first call, none unless a call records again
        t = measure_interleaved({"eager": lambda: call(False), "compile": lambda: call(True)}, device, cfg.repeats)
    again = f", {recorded[0]} CUDA graphs recorded after the first call" if device.type == "cuda" else ""
    out = []

    def row(figure: str, value: float, unit: str, note: str, **details) -> None:
        out.append(result(BENCH, f"{cfg.name}: sampler, {figure}", value, unit, note=note, config=cfg, **details))

    for mode, timing in t.items():
        rate = rows * cfg.new_tokens / timing.median
        note = f"{timing.median:.3f} s/call, prefill included{again if mode == 'compile' else ''}{timing.interference}"
        row(mode, rate, "tok/s", note, timing=timing.to_dict())
        print(f"  sampler {mode:7s} {rate:12,.0f} tok/s ({timing.median:.3f} s/call{again})", flush=True)
    row(
        "compile / eager speed-up",
        common.median_ratio(t["compile"], t["eager"]),
        "x",
        "median of per-repeat time ratios",
    )
    compile_s = first - t["compile"].median
    row("compilation", compile_s, "s", f"first compiled call {first:.1f} s - median compiled call")
    print(f"  sampler compilation {compile_s:.1f} s", flush=True)
    return out


def bench_step(bcfg: GRPOBenchConfig, device: torch.device) -> list[dict]:
    out = []
    medians = {}
    for compiled in (False, True):
        b = GRPOBenchConfig(**{**bcfg.__dict__, "compile": compiled})
        mode = "compile" if compiled else "eager"
        print(f"[{BENCH}] {b.name} GRPO step, {mode}: {b.describe()}", flush=True)
        m = measure_steps(b, device)
        step = medians[mode] = statistics.median(m["step_seconds"])
        generate_s = statistics.median(m["stage_seconds"]["generate"])
        note = f"median of {len(m['step_seconds'])} steps; generate {generate_s:.3f} s"
        out.append(result(BENCH, f"{b.name}: GRPO step, {mode}", step, "s", note=note, config=b, measurements=m))
        out += memory_rows(b, m, BENCH, f"{b.name}: GRPO step, {mode}")
        if compiled:
            first = m["warmup_step_seconds"][0]
            note = f"warm-up step {first:.1f} s - median step"
            out.append(result(BENCH, f"{b.name}: GRPO step, compilation", first - step, "s", note=note, config=b))
        print(
            f"  step {step:.3f} s (generate {generate_s:.3f} s), warm-up step {m['warmup_step_seconds'][0]:.1f} s",
            flush=True,
        )
    ratio = medians["eager"] / medians["compile"]
    return out + [
        result(
            BENCH,
            f"{bcfg.name}: GRPO step, eager / compile",
            ratio,
            "x",
            note="ratio of median step times",
            config=bcfg,
        )
    ]


def run(device: torch.device, quick: bool) -> list[dict]:
    sampler, step = configs(device, quick)
    return bench_sampler(sampler, device) + bench_step(step, device)

"""--compile against eager on one GRPO step (bench/grpo_step.py's, with its peak memory against the estimate), the
compilation timed apart (`python -m bench.run_all --only compile [--quick]`): the warm-up step pays it. The sampler's
decode alone, eager against compiled at 64-1,024 rows: bench/decode_profile.py.
"""

import statistics
from dataclasses import replace

import torch

from bench.common import result
from bench.grpo_step import CPU_TINY_QUICK, GPU_REFERENCE, GRPOBenchConfig, measure_steps, memory_rows

BENCH = "compile"


def configs(device: torch.device, quick: bool) -> GRPOBenchConfig:
    if device.type == "cuda":  # REFERENCE.md's GRPO step
        return replace(GPU_REFERENCE, prompts=32 if quick else 256, repeats=2 if quick else 3)
    return replace(CPU_TINY_QUICK, name="cpu-tiny")


def bench_step(bcfg: GRPOBenchConfig, device: torch.device) -> list[dict]:
    out = []
    medians = {}
    for compiled in (False, True):
        b = replace(bcfg, compile=compiled)
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
        warm = m["warmup_step_seconds"][0]
        print(f"  step {step:.3f} s (generate {generate_s:.3f} s), warm-up step {warm:.1f} s", flush=True)
    ratio = medians["eager"] / medians["compile"]
    return out + [
        result(BENCH, f"{bcfg.name}: GRPO step, eager / compile", ratio, "x", "ratio of median step times", bcfg)
    ]


def run(device: torch.device, quick: bool) -> list[dict]:
    return bench_step(configs(device, quick), device)

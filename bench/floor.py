"""GRPO's step against its compute floor, stage by stage, at the TRL side-by-side configuration (bench/trl_grpo.py):
a stage's floor is its matrix products alone (bench/stage_floors.py stage_products), the head's timed one by one with
torch.mm at their shapes on the same machine and threads, the body's FLOPs charged at the fastest head product's rate
(a lower bound). What a stage does beyond them is the gap (docs/benchmarks.md, "GRPO's step against its compute floor").

    python -m bench.run_all --only floor --device cpu --threads 2
"""

import statistics
import time

import torch

from bench import common
from bench.common import result
from bench.grpo_step import STAGES, measure_steps
from bench.stage_floors import stage_products
from bench.trl_grpo import configs as side_by_side_configs

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

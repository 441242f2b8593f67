"""Where a decode step's time goes: host dispatch against kernel time, eager against graphed, at several row counts
(docs/benchmarks.md: "bench/gpu_all.sh", "Host work per decode token").

    python -m bench.decode_profile --out runs/bench/decode_profile.json      # on a GPU: gpt2 bf16, 64/256/1,024 rows
    python -m bench.decode_profile --device cpu --quick                    # the same steps on a CPU (tiny model)

16 prompts of 352-384 tokens x G samples (G = 4, 16, 64), prefix sharing, 56 new tokens forced. Per row count:
generate eager and compile=True (medians of 3 calls after a warm-up, which pays the compilation or the recording; the
CUDA graphs recorded after it, none unless a call records again), the non-view ATen ops the eager step dispatches per
token (any device), the decode step's floor (bench/stage_floors.py decode_floor), and on a GPU torch.profiler's
kernels, GPU time and launches per token and the graphed step against its floor.
"""

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench import common, profiling
from bench.stage_floors import decode_floor
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.sampler import generate

# ATen ops that return a view of their input or only rename it (no kernel runs); reshape, flatten and contiguous copy
# when the layout needs it, and the copy (a nested clone / copy_) is counted
VIEW_OPS = {
    f"aten::{name}"
    for name in "view _unsafe_view reshape transpose t permute slice select expand expand_as unsqueeze squeeze "
    "as_strided split split_with_sizes unbind chunk narrow alias detach lift_fresh view_as unflatten flatten "
    "_reshape_alias resolve_conj resolve_neg numpy_T contiguous".split()
}


def aten_parent(e):
    parent = e.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent


def top_level_ops(prof) -> Counter:
    """Non-view ATen ops with no ATen ancestor (what Python or a module dispatches), plus the copies a top-level
    view-like op made."""
    counts = Counter()
    for e in prof.events():
        if e.name.startswith("aten::") and e.name not in VIEW_OPS:
            parent = aten_parent(e)
            if parent is None or (parent.name in VIEW_OPS and aten_parent(parent) is None):
                counts[e.name] += 1
    return counts


def ops_per_token(
    model, ids, mask, G: int, share: bool = True, check_every: int = 1, short: int = 4, long: int = 12
) -> dict[str, float]:
    """Op name -> non-view ATen ops the eager sampler dispatches per decode token: (ops of a `long`-token call - ops of
    a `short`-token call) / (long - short), so the prefill and the per-call set-up cancel. Nothing stops a row."""

    def count(new: int) -> Counter:
        def call():
            g = torch.Generator(device=ids.device).manual_seed(0)
            generate(
                model, ids, mask, G, new, generator=g, stop_ids=(), prefix_sharing=share, done_check_every=check_every
            )

        call()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        return top_level_ops(prof)

    a, b = count(short), count(long)
    return {k: (b[k] - a[k]) / (long - short) for k in a | b}


def profile_rows(model, ids, mask, G: int, new: int, device, figure) -> None:
    S, P = ids.shape
    N = S * G
    print(f"[decode_profile] {S} x {G} = {N} rows, {P}-token prompts, {new} new tokens", flush=True)

    def call(compiled: bool):
        g = torch.Generator(device=device).manual_seed(1)
        return generate(model, ids, mask, G, new, generator=g, stop_ids=(), compile=compiled)

    seconds = {}
    for mode in ("eager", "compile"):
        t0 = time.perf_counter()
        call(mode == "compile")  # warm-up (the graphs' recording, or the compilation on a CPU)
        common.synchronize(device)
        warm = time.perf_counter() - t0
        with common.cuda_graph_recordings() as recorded:  # none after the warm-up unless a call records again
            seconds[mode] = common.measure(lambda m=mode: call(m == "compile"), device, warmup=0, repeats=3).median
        figure(f"{N} rows: generate {mode}, s/call", seconds[mode], "s", warmup_s=warm, graphs_recorded=recorded[0])
        figure(f"{N} rows: generate {mode}, tok/s", N * new / seconds[mode], "tok/s")
    figure(f"{N} rows: compile / eager speed-up", seconds["eager"] / seconds["compile"], "x")
    ops = ops_per_token(model, ids, mask, G, check_every=8 if device.type == "cuda" else 1)
    figure(f"{N} rows: eager, ATen ops per token", sum(ops.values()), "ops", ops=ops)
    floor = decode_floor(model.cfg, S, P, G, new, bytes_per_value=2)
    peaks = common.GPU_PEAKS["H100"]
    floor_s = max(floor["bytes"] / peaks["bytes_per_s"], floor["flops"] / peaks["flops_per_s"])
    figure(f"{N} rows: decode floor per token (H100)", 1e3 * floor_s, "ms", **floor)
    if device.type != "cuda":
        return
    for mode in ("eager", "compile"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(mode == "compile")
            torch.cuda.synchronize()
        k = profiling.profile_summary(prof, new)  # per token
        figure(f"{N} rows: {mode}, kernels per token", k["kernels"], "kernels", **k)
        figure(f"{N} rows: {mode}, GPU kernel time per token", k["kernel_ms"], "ms")
        print(f"    launches per token: {k['launches']}")
        for row in k["top"][:8]:
            print(f"    {row['us']:9.1f} us x{row['calls']:6.1f}  {row['kernel'][:90]}")
        if mode == "compile":
            wall = 1e3 * seconds["compile"] / new
            figure(f"{N} rows: graphed wall per token / floor", wall / (1e3 * floor_s), "x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 prompts x 8 samples, 8 tokens (a rehearsal)")
    ap.add_argument("--groups", type=int, nargs="*", default=[4, 16, 64], help="samples per prompt (rows = 16 x G)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.quick:
        preset, dtype, S, groups, P, Pmin, new = "tiny", torch.float32, 2, [8], 64, 48, 8
    else:
        preset, S, P, Pmin, new, groups = "gpt2", 16, 384, 352, 56, args.groups
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPT2LMHeadModel(PRESETS[preset]).to(device, dtype).eval()
    ids, mask = (t.to(device) for t in common.random_prompts(S, P, Pmin, model.cfg.vocab_size, seed=0))
    report = {"environment": common.environment(device), "config": f"{preset} {dtype}", "figures": []}

    def figure(name, value, unit, **details):
        report["figures"].append({"name": name, "value": value, "unit": unit, **details})
        print(f"  {name:<52} {value:>12,.4g} {unit}", flush=True)
        if args.out:  # written as each figure comes: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    for G in groups:
        profile_rows(model, ids, mask, G, new, device, figure)


if __name__ == "__main__":
    main()

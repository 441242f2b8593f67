"""Host work per decode token: the non-view ATen ops model/sampler.generate dispatches for each token it decodes,
counted with torch.profiler. On a GPU a small model's decode step is bound by this dispatch (5-10 us of host time
per eager op), not by the GPU, so the count is the device-independent measure of that overhead.

    python -m bench.decode_ops                     # gpt2 shape and tiny, prefix sharing on and off, eager
    python -m bench.decode_ops --preset gpt2 --fsdp true --compile true

Per configuration: one generate call of `--short` new tokens and one of `--long`, both profiled (CPU activities,
after an unprofiled warm-up call of each), and ops per decode token = (ops of the long call - ops of the short call)
/ (long - short): the prefill and the per-call set-up cancel, what remains is what every further token costs, the
sampler's bookkeeping included. An op is a top-level ATen op (an `aten::` event with no `aten::` ancestor: what
Python or a module dispatches, not the ops a composite op calls inside itself) that is not a view (view, reshape
that views, transpose, slice, select, expand, unsqueeze, ...: no kernel runs). With --compile the compiled step's
graph replays count as one op each (what runs there is generated code, not dispatched ATen ops).

Nothing stops a row (stop_ids=()), so every token decodes every row; the model is randomly initialised (the count
does not depend on the weights), fp32, on the CPU. --fsdp wraps the model in FSDP2 (world size 1, gloo) and
gathers its parameters once per call, as grpo.py's rollout does.
"""

import argparse
from collections import Counter
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.sampler import generate

# ATen ops that return a view of their input (no kernel runs) or only rename a tensor
VIEW_OPS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::slice",
    "aten::select",
    "aten::expand",
    "aten::expand_as",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::as_strided",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::chunk",
    "aten::narrow",
    "aten::alias",
    "aten::detach",
    "aten::lift_fresh",
    "aten::view_as",
    "aten::unflatten",
    "aten::flatten",
    "aten::_reshape_alias",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::numpy_T",
    "aten::contiguous",
}
# reshape, flatten and contiguous are views when the layout allows; when they copy, the copy appears as a nested
# aten::clone / aten::copy_, counted below


def aten_parent(e):
    """The nearest aten:: ancestor of profiler event e, or None."""
    parent = e.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent


def top_level_ops(prof) -> Counter:
    """Counter of the non-view ATen ops with no ATen ancestor, plus the copies that top-level view-like ops made
    (reshape or contiguous of a non-contiguous tensor runs aten::clone inside)."""
    counts = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in VIEW_OPS:
            continue
        parent = aten_parent(e)
        if parent is None or (parent.name in VIEW_OPS and aten_parent(parent) is None):
            counts[e.name] += 1
    return counts


def compiled_replays(prof) -> int:
    """Calls of compiled graphs (each replays one graph of generated code)."""
    return sum(1 for e in prof.events() if e.name.startswith("Torch-Compiled Region"))


def count_call(
    model, ids, mask, G: int, new_tokens: int, share: bool, check_every: int, compile_step: bool, gathered
) -> Counter:
    def call():
        with gathered(model):
            # compile named only when asked, so that this script also counts a sampler without the option
            generate(
                model,
                ids,
                mask,
                G,
                new_tokens,
                generator=torch.Generator().manual_seed(0),
                stop_ids=(),
                prefix_sharing=share,
                done_check_every=check_every,
                **({"compile": True} if compile_step else {}),
            )

    call()  # warm-up: first-call set-up (and compilation) is not per-token work
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    counts = top_level_ops(prof)
    if compile_step:
        counts["<compiled graph replay>"] = compiled_replays(prof)
    return counts


def ops_per_token(
    model,
    ids,
    mask,
    G: int,
    share: bool,
    check_every: int = 1,
    short: int = 4,
    long: int = 12,
    compile_step: bool = False,
    gathered=lambda m: nullcontext(),
) -> dict[str, float]:
    """Op name -> non-view ATen ops per decode token: (ops of a `long`-token call - ops of a `short`-token call) /
    (long - short)."""
    a, b = (count_call(model, ids, mask, G, n, share, check_every, compile_step, gathered) for n in (short, long))
    return {k: (b[k] - a[k]) / (long - short) for k in a | b}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["gpt2", "tiny"], help="model.gpt2.PRESETS keys")
    p.add_argument("--prompts", type=int, default=2, help="prompts per call")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt width")
    p.add_argument("--short", type=int, default=4, help="new tokens of the short call")
    p.add_argument("--long", type=int, default=12, help="new tokens of the long call")
    p.add_argument("--fsdp", choices=["true", "false"], default="false", help="FSDP2-wrap the model (world size 1)")
    p.add_argument("--compile", choices=["true", "false"], default="false", help="generate(compile=True)")
    p.add_argument(
        "--check_every",
        type=int,
        default=1,
        help="generate's done_check_every: 1 as on a CPU, 8 as on a GPU (its default there)",
    )
    p.add_argument("--top", type=int, default=0, help="also print the N most frequent ops per token")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gathered = lambda m: nullcontext()  # noqa: E731
    if args.fsdp == "true":
        from utils.dist import setup_distributed
        from utils.fsdp import gathered_params, shard_model

        setup_distributed("cpu")
        gathered = gathered_params
    compile_step = args.compile == "true"
    for preset in args.preset:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(PRESETS[preset]).eval()
        if args.fsdp == "true":
            shard_model(model, None)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.cfg.vocab_size, (args.prompts, args.prompt_len), generator=g)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, : args.prompt_len // 4] = False  # one left-padded prompt
        for share in (True, False):
            per_token = ops_per_token(
                model, ids, mask, args.group, share, args.check_every, args.short, args.long, compile_step, gathered
            )
            total = sum(per_token.values())
            c = model.cfg
            print(
                f"decode_ops {preset} ({c.n_layer} layers, {c.n_embd} wide) prefix "
                f"{'shared' if share else 'unshared'} fsdp={args.fsdp} compile={args.compile} "
                f"check_every={args.check_every}: {total:.1f} non-view ATen ops per decode token "
                f"({args.prompts} prompts x {args.group} samples, {args.short} vs {args.long} new tokens)",
                flush=True,
            )
            for name, n in sorted(per_token.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"    {n:7.2f} {name}")


if __name__ == "__main__":
    main()

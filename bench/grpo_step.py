"""One GRPO step (rollouts.step.train_step on models built as grpo.main() builds them, random prompts): time and share
per stage, generated and total tokens/s per device, peak memory against rollouts/memory.py's estimate; and memory_fit,
the largest GPT-2 whose step runs in 24 GiB (docs/benchmarks.md, "grpo" and "memory_fit")."""

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import grpo
import rollouts.step
from bench import common
from bench.common import mib, peak_memory, random_prompts, reset_peak_memory, result, synchronize
from bench.stage_floors import gpu_stage_floors
from data.tokenizer import get_tokenizer
from model.weights import model_config
from rollouts.batches import per_rank_sizes
from rollouts.memory import step_memory
from rollouts.metrics import StepResult
from rollouts.models import Models, build_models
from rollouts.prompts import PromptSet
from rollouts.sampling import RewardSpec
from utils.dist import setup_distributed
from utils.fsdp import resolve_dtype
from utils.optim import build_optimizer, build_scheduler

BENCH = "grpo"
STAGES = ("generate", "score", "select", "advantages", "reference", "update")
SAME_AS_GRPO = (  # GRPOBenchConfig's fields that grpo.Config has under the same name and meaning
    "rewards num_samples num_kept selection max_new_tokens gen_prompts micro_batch_size score_micro_batch_size "
    "lora_rank compile frozen_cpu_offload"
).split()


@dataclass
class GRPOBenchConfig:
    name: str  # named configuration, printed with every figure
    preset: str  # model.gpt2.PRESETS key of the policy and the reward model, randomly initialised
    prompts: int  # grpo --prompts_per_step
    num_samples: int  # G
    num_kept: int  # K (selection "all" keeps G)
    selection: str  # grpo --selection
    max_new_tokens: int
    prompt_len: int  # the longest prompt (the left-padded batch's width); lengths uniform from min_prompt_len
    min_prompt_len: int
    gen_prompts: int  # prompts per generate call
    micro_batch_size: int  # sequences per forward/backward of the policy and the reference
    score_micro_batch_size: int  # sequences per reward-model forward
    warmup: int = 1  # untimed steps first
    repeats: int = 3  # timed steps; medians are reported
    rewards: str = "reward_model"  # grpo --rewards (functions score the random prompts' decoded text)
    lora_rank: int = 0  # grpo --lora_rank (r > 0: the reference is the policy with its adapters off)
    compile: bool = False  # grpo --compile (the warm-up step pays the compilation)
    frozen_cpu_offload: bool = False  # grpo --frozen_cpu_offload (a GPU only)
    # bench/trl_grpo.py only: TRL's bf16 mixed precision; None: on a GPU only (True is TRL's default on a CPU too)
    trl_bf16: bool | None = None

    def grpo_config(self) -> grpo.Config:
        """grpo.Config of this benchmark (everything else at grpo.py's defaults: temperature 1, beta 0.04, ...)."""
        same = {k: getattr(self, k) for k in SAME_AS_GRPO}
        renamed = dict(model=self.preset, reward_model=self.preset, max_prompt_len=self.prompt_len)
        fixed = dict(random_init=True, reward_random_init=True, warmup_steps=0)  # random weights, no warm-up
        cfg = grpo.Config(**same, **renamed, **fixed, prompts_per_step=self.prompts)
        cfg.validate()
        return cfg

    def describe(self) -> str:
        kept = f"{self.selection} keeps {self.num_samples if self.selection == 'all' else self.num_kept}"
        rewards = "" if self.rewards == "reward_model" else f", rewards {self.rewards}"
        return (
            f"{self.preset}, {self.prompts} prompts ({self.min_prompt_len}-{self.prompt_len} tokens) x "
            f"{self.num_samples} samples x {self.max_new_tokens} new tokens, {kept}, micro-batch "
            f"{self.micro_batch_size}, RM micro-batch {self.score_micro_batch_size}{rewards}"
        )


# REFERENCE.md's GRPO step: 256 prompts (~384 tokens) x 64 samples x 56 new tokens, all 16,384 scored, RSO keeps 8;
# the other benchmarks' steps are it or a CPU one with some fields replaced (dataclasses.replace)
GPU_REFERENCE = GRPOBenchConfig("gpu-reference", "gpt2", 256, 64, 8, "rso", 56, 384, 352, 16, 32, 128)
CPU_TINY = GRPOBenchConfig("cpu-tiny", "tiny", 8, 16, 4, "rso", 16, 64, 48, 8, 16, 64)
CPU_TINY_QUICK = GRPOBenchConfig("cpu-tiny-quick", "tiny", 4, 8, 4, "rso", 8, 48, 32, 4, 16, 32)


def configs(device: torch.device, quick: bool) -> list[GRPOBenchConfig]:
    if device.type == "cuda":
        return [replace(GPU_REFERENCE, name="gpu-gpt2-124M-quick", prompts=32, repeats=2) if quick else GPU_REFERENCE]
    return [CPU_TINY_QUICK if quick else CPU_TINY]


@dataclass
class StepInputs:
    """What grpo.main() hands rollouts.step.train_step, built as main() builds it."""

    cfg: grpo.Config
    models: Models
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    prompts: PromptSet
    spec: RewardSpec
    world: int


def build(bcfg: GRPOBenchConfig, device: torch.device) -> StepInputs:
    """grpo.main()'s set-up for train_step, random weights (seed 0) and random prompts, every reward source on each."""
    cfg = bcfg.grpo_config()
    world = setup_distributed(device.type).world_size
    per_rank_sizes(cfg, world)  # the exact-division checks of main()
    sources = cfg.sources()
    torch.manual_seed(0)
    models = build_models(cfg, sources, resolve_dtype(cfg.dtype, device), device)
    # only reward functions read text: without them no tokenizer is loaded (the GPU image may lack its BPE files)
    tok = get_tokenizer() if any(s.fn is not None for s in sources) else None
    spec = RewardSpec(sources, cfg.normalize_reward_fns, tok)
    optimizer = build_optimizer(models.policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, 1000, cfg.min_lr_ratio)
    ids, mask = random_prompts(bcfg.prompts, bcfg.prompt_len, bcfg.min_prompt_len, models.policy.cfg.vocab_size, seed=0)
    texts = [tok.decode(i[m].tolist()) if tok else "" for i, m in zip(ids, mask, strict=True)]
    prompts = PromptSet(
        ids.to(device),
        mask.to(device),
        texts,
        list(range(bcfg.prompts)),
        torch.ones(bcfg.prompts, len(sources), dtype=torch.bool),
        f"bench {bcfg.name} random prompts",
    )
    models.policy.train()
    return StepInputs(cfg, models, optimizer, scheduler, prompts, spec, world)


def token_counts(r: StepResult, prompts: PromptSet, G: int) -> dict[str, int]:
    """Sampled sequences, generated tokens, every token of every sampled sequence, trained sequences and tokens."""
    generated = int(r.samples.response_mask.sum())
    return {
        "sequences": r.samples.response_ids.shape[0],
        "generated_tokens": generated,
        "total_tokens": int(prompts.mask.sum()) * G + generated,
        "trained_sequences": r.rows_BK.numel(),
        "trained_tokens": int(sum(int(b.attention_mask.sum()) for b in r.batches)),
    }


def measure_steps(bcfg: GRPOBenchConfig, device: torch.device) -> dict:
    """Warm-up and timed train_step calls: step seconds (device synchronised), stage seconds, token counts, peak
    memory and its estimate."""
    s = build(bcfg, device)

    def one_step(step: int):  # 1-based, as train_step counts
        common.wait_if_asked(device)
        busy0, cpu0 = common.machine_busy_seconds(), time.process_time()
        synchronize(device)
        t0 = time.perf_counter()
        r = rollouts.step.train_step(s.models, s.optimizer, s.scheduler, s.prompts, s.spec, s.cfg, step)
        synchronize(device)
        seconds = time.perf_counter() - t0
        others = None
        if busy0 is not None:
            others = max(0.0, (common.machine_busy_seconds() - busy0 - (time.process_time() - cpu0)) / seconds)
        return seconds, r.seconds, token_counts(r, s.prompts, s.cfg.num_samples), others

    warmup_seconds = [one_step(i + 1)[0] for i in range(bcfg.warmup)]
    was_reset = reset_peak_memory(device)
    steps = [one_step(bcfg.warmup + i + 1) for i in range(bcfg.repeats)]
    peak, peak_what = peak_memory(device, was_reset)
    world = s.world
    dtype = resolve_dtype(s.cfg.dtype, device)
    gpt = model_config(bcfg.preset, True)
    reward_cfg = gpt if any(src.fn is None for src in s.spec.sources) else None
    estimate = step_memory(s.cfg, gpt, reward_cfg, world, torch.finfo(dtype or torch.float32).bits // 8)
    s = None  # drops the models and optimizer (one_step's closure holds the name, not them)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "device_type": device.type,
        "world_size": world,
        "warmup_step_seconds": warmup_seconds,
        "step_seconds": [t[0] for t in steps],
        "stage_seconds": {k: [t[1][k] for t in steps] for k in STAGES},  # KeyError if train_step renames a stage
        "counts": steps[-1][2],
        "others_cores": [t[3] for t in steps if t[3] is not None],
        "peak_memory_bytes": peak,
        "peak_memory_what": peak_what,
        "estimated_peak_bytes": estimate.peak,
        "estimated_bytes": vars(estimate),
    }


def step_rows(bcfg: GRPOBenchConfig, m: dict, bench: str = BENCH, label: str = "ours") -> list[dict]:
    """The table rows of one measured configuration."""
    step = statistics.median(m["step_seconds"])
    c, world, name = m["counts"], m["world_size"], f"{bcfg.name} {label}"
    busy = max(m["others_cores"], default=0)
    busy = f"; other processes used up to {busy:.1f} cores" if busy >= 0.1 else ""

    def row(figure: str, value: float, unit: str, note: str = "", **details) -> dict:
        return result(bench, f"{name}: {figure}", value, unit, note=note, config=bcfg, **details)

    steps = f"median of {len(m['step_seconds'])} steps after {bcfg.warmup} warm-up{busy}"
    rows = [row("step", step, "s", steps, measurements=m)]
    medians = {k: statistics.median(v) for k, v in m["stage_seconds"].items()}
    medians["other"] = statistics.median(
        s - sum(m["stage_seconds"][k][i] for k in STAGES) for i, s in enumerate(m["step_seconds"])
    )
    rows += [row(k, medians[k], "s", f"{medians[k] / step:.1%} of the step") for k in (*STAGES, "other")]
    if m.get("device_type") == "cuda":  # each stage against what an H100 cannot beat
        for k, floor in gpu_stage_floors(bcfg, c).items():
            note = f"floor {floor * 1e3:.1f} ms (bench/stage_floors.py gpu_stage_floors), measured {medians[k]:.3f} s"
            rows.append(row(f"{k} / H100 floor", medians[k] / floor, "x", note))
    generated = f"{c['generated_tokens']:,} generated tokens ({c['sequences']:,} sequences) per step"
    total = f"{c['total_tokens']:,} prompt + generated tokens of all sampled sequences per step"
    trained = f"{c['trained_tokens']:,} tokens of {c['trained_sequences']:,} trained sequences"
    rows += [
        row("generated tokens/s per device", c["generated_tokens"] / step / world, "tok/s", generated),
        row("total tokens/s per device", c["total_tokens"] / step / world, "tok/s", total),
        row("update tokens/s", c["trained_tokens"] / medians["update"], "tok/s", trained),
    ]
    return rows + memory_rows(bcfg, m, bench, name)


GAP = 0.10  # a measured peak further than this from the estimate is flagged (issue 53: within 10% or explained)


def memory_rows(bcfg: GRPOBenchConfig, m: dict, bench: str, name: str) -> list[dict]:
    """The measured peak, rollouts/memory.py's estimate, and measured / estimated, flagged beyond GAP."""
    measured, estimated = m["peak_memory_bytes"], m["estimated_peak_bytes"]
    ratio = measured / estimated
    flag = f"GAP over {GAP:.0%}" if abs(ratio - 1) > GAP else f"within {GAP:.0%}"
    print(f"  peak memory {mib(measured):,.0f} MiB measured, {mib(estimated):,.0f} MiB estimated: {flag}", flush=True)
    if m["device_type"] != "cuda":
        flag += " (the CPU's peak is the process's RSS: not comparable)"
    parts = ", ".join(f"{k} {mib(v):,.0f}" for k, v in m["estimated_bytes"].items())
    rows = [(f"{name}: peak memory", mib(measured), "MiB", m["peak_memory_what"])]
    rows.append(
        (f"{name}: estimated peak memory", mib(estimated), "MiB", f"rollouts/memory.py's step estimate ({parts} MiB)")
    )
    rows.append((f"{name}: peak memory, measured / estimated", ratio, "x", flag))
    return [result(bench, *r[:3], note=r[3], config=bcfg) for r in rows]


def bench_config(bcfg: GRPOBenchConfig, device: torch.device, bench: str = BENCH, label: str = "ours") -> list[dict]:
    print(f"[{bench}] {bcfg.name}: {bcfg.describe()}; {bcfg.warmup} warm-up + {bcfg.repeats} timed steps", flush=True)
    m = measure_steps(bcfg, device)
    step = statistics.median(m["step_seconds"])
    stages = ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in m["stage_seconds"].items())
    print(f"  step {step:.3f} s: {stages}", flush=True)
    return step_rows(bcfg, m, bench, label)


def run(device: torch.device, quick: bool, cfgs: list[GRPOBenchConfig] | None = None) -> list[dict]:
    rows = []
    for bcfg in cfgs or configs(device, quick):
        rows += bench_config(bcfg, device)
    return rows


# ----------------------------------------------------------------------------------------------------
# memory_fit (run_all --only memory_fit): the largest GPT-2 whose GRPO step runs in a 24 GiB GPU

FIT_PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
FIT_BENCH = "memory_fit"
FIT_CAP_GIB = 24.0  # a 24 GB card, as the reference implementation's
# the step: 4 prompts x 64 samples, RSO keeps 8 (32 sequences trained), the reference step's lengths, micro-batches
# small enough that the weights, not one micro-batch's activations, decide what fits
FIT = replace(GPU_REFERENCE, name="fit-24GiB", prompts=4, gen_prompts=4, micro_batch_size=4, score_micro_batch_size=32)
FIT = replace(FIT, warmup=1, repeats=1)
FIT_CHILD_S = 150  # a child's time limit: process start, random weights on the CPU, a warm-up step and a timed one
FIT_BUDGET_S = {True: 180, False: 540}  # the whole search, by --quick: within bench/gpu_all.sh's memory_fit check


def fit_config(preset: str, offload: bool, device: torch.device) -> GRPOBenchConfig:
    """FIT with `preset` (on a CPU the quick tiny step: the search's plumbing, nothing capped)."""
    base = FIT if device.type == "cuda" else replace(CPU_TINY_QUICK, warmup=1, repeats=1)
    name = f"{base.name} {preset}{' offload' if offload else ''}"
    return replace(base, name=name, preset=preset, frozen_cpu_offload=offload)


def fit_child(preset: str, offload: bool, cap_gib: float, device: torch.device) -> dict:
    """One GRPO step of `preset` in this process, the GPU capped at `cap_gib` (set_per_process_memory_fraction):
    {"outcome": "ran", step seconds, measured and estimated peak} or {"outcome": "out of memory", the error's first
    line}. Run by `python -m bench.grpo_step PRESET`, one preset per process: an out-of-memory error leaves nothing
    behind for the next preset."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
    try:
        m = measure_steps(fit_config(preset, offload, device), device)
    except torch.OutOfMemoryError as e:
        return {"outcome": "out of memory", "error": str(e).splitlines()[0][:300]}
    return {
        "outcome": "ran",
        "step_seconds": statistics.median(m["step_seconds"]),
        "peak_bytes": m["peak_memory_bytes"],
        "estimated_peak_bytes": m["estimated_peak_bytes"],
    }


def run_child(preset: str, offload: bool, device: torch.device, timeout_s: float) -> dict:
    """fit_child in a process of its own; a crash or a timeout is an outcome too, with the end of its output."""
    cmd = [sys.executable, "-m", "bench.grpo_step", preset, "--cap_gib", str(FIT_CAP_GIB), "--device", device.type]
    cmd += ["--offload"] if offload else []
    try:
        p = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": f"timeout ({timeout_s:.0f} s)"}
    lines = [line for line in p.stdout.splitlines() if line.startswith(FIT_MARK)]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"outcome": f"error (exit {p.returncode})", "error": tail[0][:300]}
    return json.loads(lines[-1][len(FIT_MARK) :])


FIT_MARK = "memory_fit result: "


def largest_that_runs(presets: tuple[str, ...], runs: Callable[[str], dict], first: int) -> tuple[str | None, dict]:
    """The largest of `presets` (smallest first) for which runs(preset)["outcome"] == "ran", trying as few as it can:
    from presets[first] up while each runs, else down until one does (a larger model needs more memory than a smaller
    one). Returns it (None: none ran) and every outcome by preset."""
    tried: dict[str, dict] = {}
    i = first
    while 0 <= i < len(presets) and presets[i] not in tried:
        tried[presets[i]] = runs(presets[i])
        i += 1 if tried[presets[i]]["outcome"] == "ran" else -1
    ran = [p for p in presets if tried.get(p, {}).get("outcome") == "ran"]
    return (ran[-1] if ran else None), tried


def first_guess(presets: tuple[str, ...], offload: bool, device: torch.device) -> int:
    """Index of the largest preset whose rollouts/memory.py estimate fits the cap (0 when none does)."""
    fits = [0]
    for i, preset in enumerate(presets):
        bcfg = fit_config(preset, offload, device)
        gpt = model_config(preset, True)
        dtype_bytes = 2 if device.type == "cuda" else 4
        if step_memory(bcfg.grpo_config(), gpt, gpt, 1, dtype_bytes).peak <= FIT_CAP_GIB * 2**30:
            fits.append(i)
    return fits[-1]


def memory_fit(device: torch.device, quick: bool, runs: Callable[[str, bool, float], dict] | None = None) -> list[dict]:
    """For --frozen_cpu_offload false and true: the largest GPT-2 preset whose GRPO step (FIT) runs within FIT_CAP_GIB,
    each preset in a process of its own (run_child, or `runs(preset, offload, timeout_s)`), starting from the
    estimate's guess; a row per preset tried (its step time, measured and estimated peak, or why it did not run) and
    one with the answer. On a CPU: the tiny and small presets, nothing capped, without offload (it needs a GPU)."""
    runs = runs or (lambda preset, offload, timeout_s: run_child(preset, offload, device, timeout_s))
    presets = FIT_PRESETS if device.type == "cuda" else ("tiny", "small")
    deadline = time.perf_counter() + FIT_BUDGET_S[quick]
    rows = []
    for offload in (False, True):
        mode = "with --frozen_cpu_offload" if offload else "without offload"
        if offload and device.type != "cuda":
            rows.append(common.skipped(FIT_BENCH, f"memory_fit {mode}", "CPU offload needs a GPU"))
            continue

        def one(preset: str, offload: bool = offload, mode: str = mode) -> dict:
            left = deadline - time.perf_counter()
            if left < 20:
                return {"outcome": "not run: out of time"}
            print(f"[memory_fit] {preset} {mode}, capped at {FIT_CAP_GIB:g} GiB ...", flush=True)
            r = runs(preset, offload, min(FIT_CHILD_S, left))
            print(f"  {preset} {mode}: {r}", flush=True)
            return r

        best, tried = largest_that_runs(presets, one, first_guess(presets, offload, device))
        for preset, r in tried.items():
            cfg = fit_config(preset, offload, device)
            if r["outcome"] != "ran":
                why = f"not measured: {r['outcome']}" + (f": {r['error']}" if r.get("error") else "")
                rows.append(result(FIT_BENCH, f"{cfg.name}: GRPO step", None, "", note=why, config=cfg))
                continue
            peaks = f"peak {mib(r['peak_bytes']):,.0f} MiB, estimated {mib(r['estimated_peak_bytes']):,.0f} MiB "
            peaks += f"(measured / estimated {r['peak_bytes'] / r['estimated_peak_bytes']:.2f})"
            rows.append(result(FIT_BENCH, f"{cfg.name}: GRPO step", r["step_seconds"], "s", peaks, cfg, **r))
        skipped = [p for p in presets if p not in tried]
        note = (
            best or "none ran"
        ) + f"; {FIT.describe() if device.type == 'cuda' else 'tiny step on a CPU, nothing capped'}"
        note += f"; not tried: {', '.join(skipped)} (the search's order)" if skipped else ""
        layers = None if best is None else model_config(best, True).n_layer
        answer = f"memory_fit {mode}: largest GPT-2 in {FIT_CAP_GIB:g} GiB"
        rows.append(result(FIT_BENCH, answer, layers, "layers", note=note, largest=best))
    return rows


def main(argv=None) -> None:
    """The memory_fit child: one preset's GRPO step under the cap, its outcome printed as one JSON line."""
    import argparse

    ap = argparse.ArgumentParser(description=fit_child.__doc__)
    ap.add_argument("preset", choices=FIT_PRESETS + ("tiny", "small"))
    ap.add_argument("--cap_gib", type=float, default=FIT_CAP_GIB)
    ap.add_argument("--offload", action="store_true", help="--frozen_cpu_offload true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    r = fit_child(args.preset, args.offload, args.cap_gib, torch.device(args.device))
    print(FIT_MARK + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

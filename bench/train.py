"""SFT, reward-model and DPO optimizer steps through the scripts' own functions (accumulate_gradients, clipping,
AdamW), FSDP2 in a one-process group: tokens/s, model TFLOP/s, MFU on a GPU with a known peak, peak memory; and
(train_profile) where such a step's time goes. Method and FLOP formula: docs/benchmarks.md, "train" and
"train_profile"."""

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import dpo
import reward_model
import sft
from bench import common, profiling
from bench.common import GPU_PEAKS, count_params, measure, result
from data.tldr import collate_pairs, collate_sft
from data.tokenizer import END_ID
from model.gpt2 import PRESETS, GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from rlhf.losses import preference_loss
from utils.dist import setup_distributed
from utils.fsdp import resolve_dtype, shard_model
from utils.optim import build_optimizer, clip_grad_norm

BENCH = "train"
MEASURED_PEAK_H100 = 800e12  # REFERENCE.md: a large bf16 matrix product on one H100


@dataclass
class TrainConfig:
    name: str  # named configuration, printed with every figure
    preset: str  # model.gpt2.PRESETS key, randomly initialised
    batch_rows: int  # rows (SFT) or pairs (reward model, DPO) per optimizer step
    micro_rows: int  # rows or pairs per forward/backward
    prompt_len: int  # longest prompt (the left-padded prompt block's width); lengths uniform from min_prompt_len
    min_prompt_len: int
    response_len: int  # longest response, end token included; lengths uniform from min_response_len
    min_response_len: int
    warmup: int = 1  # untimed optimizer steps first
    repeats: int = 3  # timed optimizer steps; the median is reported
    compile: bool = False  # the scripts' --compile: each block of the trained model compiled (the warm-up pays it)


def configs(device: torch.device, quick: bool) -> list[TrainConfig]:
    if device.type == "cuda":
        name, repeats = ("gpu-gpt2-124M-quick", 2) if quick else ("gpu-gpt2-124M", 3)
        return [TrainConfig(name, "gpt2", 64, 16, 384, 352, 56, 40, repeats=repeats)]
    if quick:
        return [TrainConfig("cpu-tiny-quick", "tiny", 16, 8, 64, 48, 16, 8)]
    return [TrainConfig("cpu-tiny", "tiny", 32, 16, 128, 96, 32, 16)]


# ----------------------------------------------------------------------------------------------------
# Batches and FLOPs


def random_rows(n: int, cfg: TrainConfig, vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """n (prompt, response) token-id lists; responses end with END_ID like data.tldr.encode_response; the first
    row has the longest prompt and response, so every batch is exactly the configured width."""
    g = torch.Generator().manual_seed(seed)
    top = min(vocab_size, 50000)
    prompts, responses = [], []
    for i in range(n):
        p, r = cfg.prompt_len, cfg.response_len
        if i > 0:
            p = int(torch.randint(cfg.min_prompt_len, cfg.prompt_len + 1, (), generator=g))
            r = int(torch.randint(cfg.min_response_len, cfg.response_len + 1, (), generator=g))
        prompts.append(torch.randint(0, top, (p,), generator=g).tolist())
        responses.append(torch.randint(0, top, (r - 1,), generator=g).tolist() + [END_ID])
    return prompts, responses


def sft_micro_batches(cfg: TrainConfig, vocab_size: int, seed: int = 0, rows: tuple | None = None) -> list[dict]:
    """collate_sft micro-batches of `rows` (prompts, responses), or of random rows when None."""
    prompts, responses = rows or random_rows(cfg.batch_rows, cfg, vocab_size, seed)
    m = cfg.micro_rows
    return [collate_sft(prompts[i : i + m], responses[i : i + m]) for i in range(0, cfg.batch_rows, m)]


def random_pairs(n: int, cfg: TrainConfig, vocab_size: int, seed: int) -> tuple[list[list[int]], ...]:
    """n (prompt, chosen, rejected) token-id lists, as random_rows."""
    prompts, chosen = random_rows(n, cfg, vocab_size, seed)
    _, rejected = random_rows(n, cfg, vocab_size, seed + 1)
    return prompts, chosen, rejected


def pair_micro_batches(cfg: TrainConfig, vocab_size: int, seed: int = 0, rows: tuple | None = None) -> list[dict]:
    """collate_pairs micro-batches of `rows` (prompts, chosen, rejected), or of random pairs when None."""
    prompts, chosen, rejected = rows or random_pairs(cfg.batch_rows, cfg, vocab_size, seed)
    m = cfg.micro_rows
    return [
        collate_pairs(prompts[i : i + m], chosen[i : i + m], rejected[i : i + m]) for i in range(0, cfg.batch_rows, m)
    ]


def batch_tokens(micro: list[dict]) -> tuple[int, int]:
    """(real tokens, response tokens) of one optimizer step."""
    return (sum(int(b["attention_mask"].sum()) for b in micro), sum(int(b["response_mask"].sum()) for b in micro))


def matmul_params(c: GPTConfig, n_unique_params: int, lm_head: bool) -> tuple[int, int]:
    """(N of the MFU formula, of which the LM head): unique parameters minus the position embedding, and minus the
    token embedding too when there is no LM head to reuse it (a reward model)."""
    head = c.vocab_size * c.n_embd
    n = n_unique_params - c.n_positions * c.n_embd - (0 if lm_head else head)
    return n, head if lm_head else 0


def flops_per_step(
    c: GPTConfig, n: int, head: int, micro: list[dict], forward_passes: float = 3.0, packed_pairs: bool = False
) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one optimizer step; forward_passes 3 (forward + backward), 4 with a frozen
    reference's forward (DPO). model: 2 N + 4 L d T per real token and pass; executed: every padded position through
    the body (`packed_pairs`: each pair's prompt once, as reward_model.py and dpo.py run them), the head at response
    positions only."""
    model = executed = 0.0
    for b in micro:
        rows, width = b["input_ids"].shape
        attn = 4 * c.n_layer * c.n_embd * width  # QK^T and AV, forward, per token
        model += float(b["attention_mask"].sum()) * forward_passes * (2 * n + attn)
        body = b["n_pairs"] * b["prompt_len"] + rows * b["response_ids"].shape[1] if packed_pairs else rows * width
        executed += body * forward_passes * (2 * (n - head) + attn)
        executed += rows * b["response_ids"].shape[1] * forward_passes * 2 * head
    return model, executed


def throughput_rows(name: str, cfg: TrainConfig, device, timing, s: "Stage", bench: str = BENCH) -> list[dict]:
    """Tokens/s, rows or pairs/s, model and executed TFLOP/s and (on a GPU with a known peak) MFU of one step."""
    seconds = timing.median
    real, response = batch_tokens(s.micro)
    model_flops, executed = s.flops
    d = dict(seconds=seconds, real_tokens=real, response_tokens=response, model_flops=model_flops)
    d.update(executed_flops=executed, n_matmul_params=s.n, timing=timing.to_dict())

    def row(figure: str, value: float, unit: str, note: str = "", **details) -> dict:
        return result(bench, f"{name}: {figure}", value, unit, note=note, config=cfg, **details)

    tokens = f"{seconds:.3f} s/step, {real:,} real tokens ({response:,} response) per step{timing.interference}"
    tflops = f"{s.formula} per real token, N={s.n / 1e6:.2f}M; executed {executed / seconds / 1e12:.3g} TFLOP/s "
    tflops += "(head at response positions, padding included)"
    rows = [
        row("tokens/s", real / seconds, "tok/s", tokens, **d),
        row(f"{s.unit}/s", cfg.batch_rows / seconds, f"{s.unit}/s"),
        row("model TFLOP/s", model_flops / seconds / 1e12, "TFLOP/s", tflops),
    ]
    gpu = next((k for k in GPU_PEAKS if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    if gpu is not None:  # a GPU whose peak is known
        peak = GPU_PEAKS[gpu]["flops_per_s"]
        mfu = f"model FLOPs / {peak / 1e12:.0f} TFLOP/s ({gpu} dense bf16 datasheet); "
        mfu += f"{100 * model_flops / seconds / MEASURED_PEAK_H100:.1f}% of ~800 measured; "
        mfu += f"executed FLOPs: {100 * executed / seconds / peak:.1f}%"
        rows.append(row("MFU", 100 * model_flops / seconds / peak, "%", mfu))
    print(f"  {name}: {real / seconds:,.0f} tok/s, {model_flops / seconds / 1e12:.3g} model TFLOP/s", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------
# Steps


def build_sharded(model: torch.nn.Module, device: torch.device, compile_blocks: bool = False) -> torch.nn.Module:
    """FSDP2 as the scripts wrap it (bf16 compute on GPU, fp32 on CPU); `compile_blocks`: --compile's blocks."""
    shard_model(model, resolve_dtype("auto", device), compile_blocks=compile_blocks)
    return model.to(device)


def optimizer_steps(model, accumulate: Callable[[], object]) -> Callable[[], object]:
    """A step of `model` (sharded, in train mode): accumulate's gradients, clipped at 1.0, then AdamW at lr 1e-5;
    returns what accumulate returned (the loss or the metrics)."""
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0)
    model.train()

    def step():
        out = accumulate()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out

    return step


def sft_step(model, micro: list[dict], world: int, device, compile_blocks: bool = False) -> Callable[[], float]:
    """One SFT optimizer step over `micro` as sft.py takes it; shards `model` first."""
    model = build_sharded(model, device, compile_blocks)
    return optimizer_steps(model, lambda: sft.accumulate_gradients(model, micro, world, device))


def reward_model_step(
    model, micro: list[dict], world: int, n_pairs: int, device, prefix_sharing: bool = True, compile_blocks=False
) -> Callable[[], dict]:
    """One reward-model optimizer step over `micro` (n_pairs pairs in all) as reward_model.py takes it."""
    model = build_sharded(model, device, compile_blocks)
    return optimizer_steps(
        model, lambda: reward_model.accumulate_gradients(model, micro, world, n_pairs, device, prefix_sharing)
    )


def dpo_step(
    policy, micro: list[dict], world: int, n_pairs: int, device, beta=0.1, prefix_sharing=True, compile_blocks=False
) -> Callable[[], dict]:
    """One DPO optimizer step over `micro` as dpo.py takes it, the frozen reference a copy of `policy` (bf16 on GPU,
    as dpo.main stores it)."""
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    dtype = resolve_dtype("auto", device)
    if dtype is not None:
        reference.to(dtype)
    shard_model(reference, None)
    reference.to(device)
    policy = build_sharded(policy, device, compile_blocks)
    loss_fn = preference_loss(dpo.Config(beta=beta))
    args = (policy, reference, micro, world, n_pairs, loss_fn, beta, device, prefix_sharing)
    return optimizer_steps(policy, lambda: dpo.accumulate_gradients(*args))


@dataclass
class Stage:
    """One stage's optimizer step at a configuration, built and ready to call, with what its figures need."""

    label: str  # the stage and the functions its step runs
    step: Callable[[], object]
    micro: list[dict]
    flops: tuple[float, float]  # (model, executed) FLOPs per step
    n: int  # N of the MFU formula
    unit: str  # what a row of the batch is: rows or pairs
    formula: str = "6N + 12LdT"


STAGES = ("SFT", "reward model", "DPO")


def build_stage(stage: str, cfg: TrainConfig, device: torch.device, world: int) -> Stage:
    """The model (random weights, seed 0), micro-batches and step of `stage` (one of STAGES) at `cfg`."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}, expected one of {STAGES}")
    torch.manual_seed(0)
    model = (RewardModel if stage == "reward model" else GPT2LMHeadModel)(PRESETS[cfg.preset])
    n, head = matmul_params(model.cfg, count_params(model), lm_head=stage != "reward model")
    if stage == "SFT":
        micro = sft_micro_batches(cfg, model.cfg.vocab_size)
        step = sft_step(model, micro, world, device, cfg.compile)
        flops = flops_per_step(model.cfg, n, head, micro)
        return Stage("SFT (sft.accumulate_gradients + AdamW)", step, micro, flops, n, "rows")
    micro = pair_micro_batches(cfg, model.cfg.vocab_size)
    if stage == "reward model":
        step = reward_model_step(model, micro, world, cfg.batch_rows, device, compile_blocks=cfg.compile)
        flops = flops_per_step(model.cfg, n, head, micro, packed_pairs=True)
        return Stage("reward model (reward_model.accumulate_gradients + AdamW)", step, micro, flops, n, "pairs")
    step = dpo_step(model, micro, world, cfg.batch_rows, device, compile_blocks=cfg.compile)
    flops = flops_per_step(model.cfg, n, head, micro, forward_passes=4.0, packed_pairs=True)  # + the reference
    formula = "8N + 16LdT (with the reference's forward)"
    return Stage("DPO (dpo.accumulate_gradients + AdamW)", step, micro, flops, n, "pairs", formula)


def measure_stage(stage: str, cfg: TrainConfig, device: torch.device, world: int) -> tuple:
    """(Stage, Timing, peak bytes, what they are) over its warm-up and timed steps."""
    s = build_stage(stage, cfg, device, world)
    was_reset = common.reset_peak_memory(device)
    t = measure(s.step, device, warmup=cfg.warmup, repeats=cfg.repeats)
    return (s, t, *common.peak_memory(device, was_reset))


def bench_stage(stage: str, cfg: TrainConfig, device: torch.device, world: int) -> list[dict]:
    """Throughput of `stage` at `cfg`, and its peak memory over the timed steps."""
    s, t, peak, what = measure_stage(stage, cfg, device, world)
    rows = throughput_rows(f"{cfg.name} {s.label}", cfg, device, t, s)
    rows.append(result(BENCH, f"{cfg.name} {stage}: peak memory", common.mib(peak), "MiB", note=what, config=cfg))
    print(f"  {cfg.name} {stage}: peak memory {common.mib(peak):,.0f} MiB ({what})", flush=True)
    return rows


def run(device: torch.device, quick: bool, cfgs: list[TrainConfig] | None = None) -> list[dict]:
    world = setup_distributed(device.type).world_size  # a one-process group: FSDP runs the same code as on 8 GPUs
    rows = []
    for cfg in cfgs or configs(device, quick):
        print(f"[train] {cfg.name}: {describe(cfg)}; {cfg.warmup} warm-up + {cfg.repeats} timed steps", flush=True)
        for stage in STAGES:
            rows += bench_stage(stage, cfg, device, world)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if device.type != "cuda":
            why = "not reported on CPU: no meaningful peak for a shared CPU; model TFLOP/s is shown"
            rows.append(result(BENCH, f"{cfg.name}: MFU", None, "", note=why, config=cfg))
    return rows


def describe(cfg: TrainConfig) -> str:
    return (
        f"{cfg.preset}, {cfg.batch_rows} rows/pairs per step in micro-batches of {cfg.micro_rows}, prompts "
        f"{cfg.min_prompt_len}-{cfg.prompt_len}, responses {cfg.min_response_len}-{cfg.response_len} tokens"
        + (", compiled blocks" if cfg.compile else "")
    )


# ----------------------------------------------------------------------------------------------------
# Profile (run_all --only train_profile): where a step's time goes, and the options that may win it back

PROFILE = "train_profile"
# profiled beside the configuration: fewer, larger kernels (twice the rows per micro-batch), fused ones (--compile)
VARIANTS: dict[str, Callable[[TrainConfig], TrainConfig]] = {
    "as configured": lambda c: c,
    "micro-batch x2": lambda c: replace(c, micro_rows=min(c.batch_rows, 2 * c.micro_rows)),
    "--compile": lambda c: replace(c, compile=True),
}


def profile_plan(device: torch.device, quick: bool) -> list[tuple[str, str]]:
    """(variant, stage) pairs: every stage as configured and with micro-batches x2; --compile on a GPU only (at --quick
    the SFT step alone: compiling takes minutes of a GPU check's ten)."""
    plan = [(v, s) for v in ("as configured", "micro-batch x2") for s in STAGES]
    if device.type == "cuda":
        plan += [("--compile", s) for s in (("SFT",) if quick else STAGES)]
    return plan


def profile_stage(
    stage: str, variant: str, cfg: TrainConfig, device: torch.device, world: int, steps: int = 2
) -> list[dict]:
    """Throughput and peak memory of `stage` at VARIANTS[variant](cfg), unprofiled; then one step under HostSyncs and
    `steps` under torch.profiler (profile_summary): wall against kernel time, GPU busy, launches, host
    synchronisations, the top kernels and host ops."""
    cfg = VARIANTS[variant](cfg)
    name = f"{cfg.name} {stage}, {variant}"
    print(f"[{PROFILE}] {name}: {describe(cfg)}", flush=True)
    s, t, peak, what = measure_stage(stage, cfg, device, world)
    rows = throughput_rows(name, cfg, device, t, s, bench=PROFILE)
    rows.append(result(PROFILE, f"{name}: peak memory", common.mib(peak), "MiB", note=what, config=cfg))
    batches = [v for b in s.micro for v in b.values() if isinstance(v, torch.Tensor)]
    with profiling.HostSyncs(device, batches) as syncs:
        s.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        common.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            s.step()
        common.synchronize(device)
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
    k = profiling.profile_summary(prof, steps)
    on_gpu = device.type == "cuda"
    kernels = "GPU kernels" if on_gpu else "ATen ops (self CPU time)"
    details = {"profile": k, "host_syncs": dict(syncs.counts)}

    def row(figure: str, value: float, unit: str, note: str = "", **extra) -> None:
        rows.append(result(PROFILE, f"{name}: {figure}", value, unit, note=note, config=cfg, **extra))

    unprofiled = f"{steps} steps under torch.profiler; unprofiled median {t.median * 1e3:.1f} ms"
    row("wall per step, profiled", wall_ms, "ms", unprofiled, **details)
    row(f"{kernels} per step", k["kernel_ms"], "ms", f"{k['kernel_ms'] / wall_ms:.1%} of the profiled wall")
    if on_gpu:
        busy = f"union of the kernels' intervals: {k['busy_ms'] / wall_ms:.1%} of the wall; the rest "
        busy += f"({wall_ms - k['busy_ms']:.1f} ms) the GPU waits for the host"
        row("GPU busy per step", k["busy_ms"], "ms", busy)
    launches = ", ".join(f"{n} {c:,.0f}" for n, c in k["launches"].items())
    row("kernel launches per step" if on_gpu else "ATen ops per step", sum(k["launches"].values()), "calls", launches)
    counted = ", ".join(f"{n} {c}" for n, c in sorted(syncs.counts.items())) or "none"
    if on_gpu:
        waits = ", ".join(f"{n} {c:g}" for n, c in k["syncs"].items()) or "none"
        counted += f"; the profiler's CUDA calls that wait: {sum(k['syncs'].values()):g} ({waits})"
    row("host synchronisations per step", syncs.total, "calls", "counted by bench.profiling.HostSyncs: " + counted)
    print(f"  wall {wall_ms:.1f} ms/step profiled ({t.median * 1e3:.1f} unprofiled), {kernels} {k['kernel_ms']:.1f}")
    print(f"  host synchronisations per step: {dict(syncs.counts)}" + (f"; CUDA calls: {k['syncs']}" if on_gpu else ""))
    for top in k["top"][:8]:
        print(f"    {top['us'] / 1e3:8.2f} ms x{top['calls']:6.1f}  {top['kernel'][:90]}")
    print("  top host ops: " + ", ".join(f"{o['op']} {o['us'] / 1e3:.2f} ms" for o in k["top_host_ops"][:6]))
    return rows


def profile(device: torch.device, quick: bool, cfgs: list[TrainConfig] | None = None) -> list[dict]:
    world = setup_distributed(device.type).world_size
    rows = []
    for cfg in cfgs or configs(device, quick):
        for variant, stage in profile_plan(device, quick):
            rows += profile_stage(stage, variant, cfg, device, world)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows

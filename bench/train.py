"""Training throughput of SFT, reward-model and DPO optimizer steps: tokens/s, model TFLOP/s and (on a GPU with a
known peak) MFU.

Each step is what the scripts run per optimizer step, through their own functions: forward and backward over the
micro-batches (sft.accumulate_gradients, reward_model.accumulate_gradients, dpo.accumulate_gradients), gradient
clipping, AdamW step, zero_grad; models FSDP2-sharded in a one-process group with the scripts' dtype rule (bf16
parameters on GPU, fp32 on CPU). Batches are random token ids in data.tldr's layout (left-padded prompts,
right-padded responses ending with the end token), built by data.tldr.collate_sft / collate_pairs, so padding and
position ids are what training sees. A script that does not import, or whose function changed signature, fails the
benchmark with its error: the figures are of the scripts' own code or none.

FLOPs (forward + backward, per optimizer step), the PaLM/Chinchilla convention:
    model FLOPs = sum over real (non-padding) tokens of (6 N + 12 L d T)
N: parameters that take part in matrix products (the tied embedding/head counted once, as the head; position
embeddings and, for the reward model, the token embedding excluded: lookups are not FLOPs); L layers, d width,
T the padded sequence width (the attention term). DPO adds the frozen reference's forward pass, 2 N + 4 L d T per
token, so 8 N + 16 L d T. The formula counts the LM head at every token, as llm.c's and nanoGPT's MFU do; our
losses compute it at response positions only, so the FLOPs actually executed (padding included, head at response
positions) are reported beside it.
    MFU = model FLOPs / step seconds / peak, peak = 989 TFLOP/s (dense bf16, H100/H200 SXM datasheet); the
utilisation against REFERENCE.md's measured ~800 TFLOP/s is in the note. On CPU, MFU is not reported: no peak
figure for a shared 2-core virtual machine would mean anything; model TFLOP/s is.
"""

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import dpo
import reward_model
import sft
from bench import common
from bench.common import GPU_PEAKS, measure, result
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
    name: str
    """Named configuration, printed with every figure."""
    preset: str
    """model.gpt2.PRESETS key, randomly initialised."""
    batch_rows: int
    """Rows per optimizer step (SFT), or pairs per step (reward model, DPO)."""
    micro_rows: int
    """Rows (or pairs) per forward/backward."""
    prompt_len: int
    """Longest prompt (the width of the left-padded prompt block)."""
    min_prompt_len: int
    """Shortest prompt; lengths uniform in between."""
    response_len: int
    """Longest response, end token included."""
    min_response_len: int
    """Shortest response."""
    warmup: int = 1
    """Untimed optimizer steps first."""
    repeats: int = 3
    """Timed optimizer steps; the median is reported."""
    compile: bool = False
    """Each transformer block of the trained model under torch.compile, as the scripts' --compile
    (utils/fsdp.py shard_model's compile_blocks); the warm-up step pays the compilation."""


def configs(device: torch.device, quick: bool) -> list[TrainConfig]:
    if device.type == "cuda":
        return [
            TrainConfig(
                "gpu-gpt2-124M" + ("-quick" if quick else ""),
                "gpt2",
                batch_rows=64,
                micro_rows=16,
                prompt_len=384,
                min_prompt_len=352,
                response_len=56,
                min_response_len=40,
                repeats=2 if quick else 3,
            )
        ]
    if quick:
        return [
            TrainConfig(
                "cpu-tiny-quick",
                "tiny",
                batch_rows=16,
                micro_rows=8,
                prompt_len=64,
                min_prompt_len=48,
                response_len=16,
                min_response_len=8,
                repeats=3,
            )
        ]
    return [
        TrainConfig(
            "cpu-tiny",
            "tiny",
            batch_rows=32,
            micro_rows=16,
            prompt_len=128,
            min_prompt_len=96,
            response_len=32,
            min_response_len=16,
        )
    ]


# ----------------------------------------------------------------------------------------------------
# Batches and FLOPs


def random_rows(n: int, cfg: TrainConfig, vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """n (prompt, response) token-id lists; responses end with END_ID like data.tldr.encode_response; the first
    row has the longest prompt and response, so every batch is exactly the configured width."""
    g = torch.Generator().manual_seed(seed)
    top = min(vocab_size, 50000)
    prompts, responses = [], []
    for i in range(n):
        p = cfg.prompt_len if i == 0 else int(torch.randint(cfg.min_prompt_len, cfg.prompt_len + 1, (), generator=g))
        r = (
            cfg.response_len
            if i == 0
            else int(torch.randint(cfg.min_response_len, cfg.response_len + 1, (), generator=g))
        )
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
    """(model FLOPs, executed FLOPs) of one optimizer step. forward_passes: 3 for forward + backward (backward
    costs two forwards), 4 when a frozen reference adds one forward (DPO).

    model: per real token of the prompt + response rows 2 N + 4 L d T per forward-pass equivalent (6 N + 12 L d T
    for training). executed: every padded position through the body, the head only at response positions. With
    `packed_pairs` (collate_pairs batches run as packed rows, reward_model.py's and dpo.py's default), each pair's
    prompt goes through the body once, so less is executed than the model FLOPs count."""
    model = executed = 0.0
    for b in micro:
        rows, width = b["input_ids"].shape
        attn = 4 * c.n_layer * c.n_embd * width  # QK^T and AV, forward, per token
        model += float(b["attention_mask"].sum()) * forward_passes * (2 * n + attn)
        body = b["n_pairs"] * b["prompt_len"] + rows * b["response_ids"].shape[1] if packed_pairs else rows * width
        executed += body * forward_passes * (2 * (n - head) + attn)
        executed += rows * b["response_ids"].shape[1] * forward_passes * 2 * head
    return model, executed


def peak_for(device: torch.device) -> tuple[float, str] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((v["flops_per_s"], k) for k, v in GPU_PEAKS.items() if k in name), None)


def throughput_rows(
    name: str,
    cfg: TrainConfig,
    device,
    timing,
    micro: list[dict],
    flops: tuple[float, float],
    n: int,
    unit_name: str,
    formula: str = "6N + 12LdT",
) -> list[dict]:
    """Tokens/s, pairs or rows/s, model and executed TFLOP/s and (on a GPU with a known peak) MFU of one step."""
    seconds = timing.median
    real, response = batch_tokens(micro)
    model_flops, executed = flops
    d = {
        "seconds": seconds,
        "real_tokens": real,
        "response_tokens": response,
        "model_flops": model_flops,
        "executed_flops": executed,
        "n_matmul_params": n,
        "timing": timing.to_dict(),
    }
    rows = [
        result(
            BENCH,
            f"{name}: tokens/s",
            real / seconds,
            "tok/s",
            note=f"{seconds:.3f} s/step, {real:,} real tokens ({response:,} response) per step{timing.interference}",
            config=cfg,
            **d,
        ),
        result(BENCH, f"{name}: {unit_name}/s", cfg.batch_rows / seconds, f"{unit_name}/s", config=cfg),
        result(
            BENCH,
            f"{name}: model TFLOP/s",
            model_flops / seconds / 1e12,
            "TFLOP/s",
            note=f"{formula} per real token, N={n / 1e6:.2f}M; executed {executed / seconds / 1e12:.3g} TFLOP/s "
            f"(head at response positions, padding included)",
            config=cfg,
        ),
    ]
    peak = peak_for(device)
    if peak is not None:
        value, gpu = peak
        rows.append(
            result(
                BENCH,
                f"{name}: MFU",
                100 * model_flops / seconds / value,
                "%",
                note=f"model FLOPs / {value / 1e12:.0f} TFLOP/s ({gpu} dense bf16 datasheet); "
                f"{100 * model_flops / seconds / MEASURED_PEAK_H100:.1f}% of ~800 measured; "
                f"executed FLOPs: {100 * executed / seconds / value:.1f}%",
                config=cfg,
            )
        )
    print(
        f"  {name}: {real / seconds:,.0f} tok/s, {model_flops / seconds / 1e12:.3g} model TFLOP/s "
        f"({seconds:.3f} s/step)",
        flush=True,
    )
    return rows


# ----------------------------------------------------------------------------------------------------
# Steps


def optimizer_step(model, optimizer) -> None:
    clip_grad_norm(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_sharded(model: torch.nn.Module, device: torch.device, compile_blocks: bool = False) -> torch.nn.Module:
    """FSDP2 wrapping as the scripts do it: bf16 compute on GPU, fp32 on CPU (resolve_dtype "auto"); with
    `compile_blocks`, --compile's per-block torch.compile."""
    shard_model(model, resolve_dtype("auto", device), compile_blocks=compile_blocks)
    return model.to(device)


def unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def sft_step(
    model: GPT2LMHeadModel, micro: list[dict], world: int, device: torch.device, compile_blocks: bool = False
) -> Callable[[], float]:
    """One SFT optimizer step over `micro` as sft.py takes it (sft.accumulate_gradients: completion-only NLL over
    the step's response tokens, then clipping, AdamW, zero_grad); shards `model` first."""
    model = build_sharded(model, device, compile_blocks)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0)
    model.train()

    def step():
        loss = sft.accumulate_gradients(model, micro, world, device)
        optimizer_step(model, optimizer)
        return loss

    return step


def reward_model_step(
    model: RewardModel,
    micro: list[dict],
    world: int,
    n_pairs: int,
    device: torch.device,
    prefix_sharing: bool = True,
    compile_blocks: bool = False,
) -> Callable[[], dict]:
    """One reward-model optimizer step over `micro` (collate_pairs batches of `n_pairs` pairs in all) as
    reward_model.py takes it (Bradley-Terry loss, mean over the step's pairs); shards `model` first."""
    model = build_sharded(model, device, compile_blocks)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0)
    model.train()

    def step():
        metrics = reward_model.accumulate_gradients(model, micro, world, n_pairs, device, prefix_sharing)
        optimizer_step(model, optimizer)
        return metrics

    return step


def dpo_step(
    policy: GPT2LMHeadModel,
    micro: list[dict],
    world: int,
    n_pairs: int,
    device: torch.device,
    beta: float = 0.1,
    prefix_sharing: bool = True,
    compile_blocks: bool = False,
) -> Callable[[], dict]:
    """One DPO optimizer step over `micro` as dpo.py takes it (sigmoid loss, the frozen reference a copy of
    `policy` made here, stored in bf16 on GPU as dpo.main does, its log-probs computed inside the step); shards
    both."""
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    dtype = resolve_dtype("auto", device)
    if dtype is not None:
        reference.to(dtype)  # as dpo.main: the frozen reference is stored in bf16 on GPU
    shard_model(reference, None)
    reference.to(device)
    policy = build_sharded(policy, device, compile_blocks)
    optimizer = build_optimizer(policy, lr=1e-5, weight_decay=0.0)
    dpo_cfg = dpo.Config(beta=beta)
    loss_fn = preference_loss(dpo_cfg)
    policy.train()

    def step():
        metrics = dpo.accumulate_gradients(
            policy, reference, micro, world, n_pairs, loss_fn, dpo_cfg.beta, device, prefix_sharing
        )
        optimizer_step(policy, optimizer)
        return metrics

    return step


@dataclass
class Stage:
    """One stage's optimizer step at a configuration, built and ready to call, with what its figures need."""

    label: str
    """The stage and the functions the step runs, for the figures' names."""
    step: Callable[[], object]
    micro: list[dict]
    flops: tuple[float, float]
    """(model FLOPs, executed FLOPs) per step (flops_per_step)."""
    n: int
    """N of the MFU formula."""
    unit: str
    """What a row of the batch is: rows (SFT) or pairs."""
    formula: str = "6N + 12LdT"


STAGES = ("SFT", "reward model", "DPO")


def build_stage(stage: str, cfg: TrainConfig, device: torch.device, world: int) -> Stage:
    """The models (random weights, seed 0), micro-batches and step of `stage` (one of STAGES) at `cfg`."""
    torch.manual_seed(0)
    if stage == "SFT":
        model = GPT2LMHeadModel(PRESETS[cfg.preset])
        n, head = matmul_params(model.cfg, unique_params(model), lm_head=True)
        micro = sft_micro_batches(cfg, model.cfg.vocab_size)
        return Stage(
            "SFT (sft.accumulate_gradients + AdamW)",
            sft_step(model, micro, world, device, cfg.compile),
            micro,
            flops_per_step(model.cfg, n, head, micro),
            n,
            "rows",
        )
    if stage == "reward model":
        model = RewardModel(PRESETS[cfg.preset])
        n, head = matmul_params(model.cfg, unique_params(model), lm_head=False)
        micro = pair_micro_batches(cfg, model.cfg.vocab_size)
        return Stage(
            "reward model (reward_model.accumulate_gradients + AdamW)",
            reward_model_step(model, micro, world, cfg.batch_rows, device, compile_blocks=cfg.compile),
            micro,
            flops_per_step(model.cfg, n, head, micro, packed_pairs=True),
            n,
            "pairs",
        )
    if stage == "DPO":
        policy = GPT2LMHeadModel(PRESETS[cfg.preset])
        n, head = matmul_params(policy.cfg, unique_params(policy), lm_head=True)
        micro = pair_micro_batches(cfg, policy.cfg.vocab_size)
        return Stage(
            "DPO (dpo.accumulate_gradients + AdamW)",
            dpo_step(policy, micro, world, cfg.batch_rows, device, compile_blocks=cfg.compile),
            micro,
            # + the reference's forward
            flops_per_step(policy.cfg, n, head, micro, forward_passes=4.0, packed_pairs=True),
            n,
            "pairs",
            formula="8N + 16LdT (with the reference's forward)",
        )
    raise ValueError(f"unknown stage {stage!r}, expected one of {STAGES}")


def bench_stage(stage: str, cfg: TrainConfig, device: torch.device, world: int) -> list[dict]:
    """Throughput of `stage` at `cfg`, and its peak memory over the timed steps."""
    s = build_stage(stage, cfg, device, world)
    was_reset = common.reset_peak_memory(device)
    t = measure(s.step, device, warmup=cfg.warmup, repeats=cfg.repeats)
    peak, what = common.peak_memory(device, was_reset)
    name = f"{cfg.name} {s.label}"
    rows = throughput_rows(name, cfg, device, t, s.micro, s.flops, s.n, s.unit, s.formula)
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
            rows.append(
                result(
                    BENCH,
                    f"{cfg.name}: MFU",
                    None,
                    "",
                    note="not reported on CPU: no meaningful peak for a shared CPU; model TFLOP/s is shown",
                    config=cfg,
                )
            )
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
# each a change to the configuration, profiled beside it in the same run: fewer, larger kernels per step (twice the
# rows per micro-batch, as memory allows), and the scripts' --compile (compiled blocks: fewer, fused kernels)
VARIANTS: dict[str, Callable[[TrainConfig], TrainConfig]] = {
    "as configured": lambda c: c,
    "micro-batch x2": lambda c: replace(c, micro_rows=min(c.batch_rows, 2 * c.micro_rows)),
    "--compile": lambda c: replace(c, compile=True),
}


def profile_plan(device: torch.device, quick: bool) -> list[tuple[str, str]]:
    """(variant, stage) pairs to profile: every stage as configured and with larger micro-batches; compiled blocks on
    a GPU only (a CPU takes minutes to compile), every stage, or at --quick the SFT step alone (compilation takes a
    minute or more of a GPU check's ten)."""
    plan = [(v, s) for v in ("as configured", "micro-batch x2") for s in STAGES]
    if device.type == "cuda":
        plan += [("--compile", s) for s in (("SFT",) if quick else STAGES)]
    return plan


def profile_stage(
    stage: str, variant: str, cfg: TrainConfig, device: torch.device, world: int, steps: int = 2
) -> list[dict]:
    """Throughput of `stage` at VARIANTS[variant](cfg), unprofiled (throughput_rows, with peak memory), then one step
    under bench.common.HostSyncs (the host's waits for the device, counted) and `steps` steps under torch.profiler
    (CPU activities, and CUDA on a GPU): per step the kernels' time against the wall clock, the device's busy time
    and what is left of the wall (the host's: launches, Python, waits), kernel launches, synchronising calls, the top
    kernels and the top host ops (bench.common.profile_summary)."""
    cfg = VARIANTS[variant](cfg)
    s = build_stage(stage, cfg, device, world)
    name = f"{cfg.name} {stage}, {variant}"
    print(f"[{PROFILE}] {name}: {describe(cfg)}", flush=True)
    was_reset = common.reset_peak_memory(device)
    t = measure(s.step, device, warmup=cfg.warmup, repeats=cfg.repeats)
    peak, what = common.peak_memory(device, was_reset)
    rows = throughput_rows(name, cfg, device, t, s.micro, s.flops, s.n, s.unit, s.formula)
    rows.append(result(PROFILE, f"{name}: peak memory", common.mib(peak), "MiB", note=what, config=cfg))
    for r in rows:
        r["bench"] = PROFILE
    batches = [v for b in s.micro for v in b.values() if isinstance(v, torch.Tensor)]
    with common.HostSyncs(device, batches) as syncs:
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
    k = common.profile_summary(prof, steps)
    on_gpu = device.type == "cuda"
    kernels = "GPU kernels" if on_gpu else "ATen ops (self CPU time)"
    details = {"profile": k, "host_syncs": dict(syncs.counts)}

    def row(figure: str, value: float, unit: str, note: str = "", **extra) -> None:
        rows.append(result(PROFILE, f"{name}: {figure}", value, unit, note=note, config=cfg, **extra))

    row(
        "wall per step, profiled",
        wall_ms,
        "ms",
        f"{steps} steps under torch.profiler; unprofiled median {t.median * 1e3:.1f} ms",
        **details,
    )
    row(f"{kernels} per step", k["kernel_ms"], "ms", f"{k['kernel_ms'] / wall_ms:.1%} of the profiled wall")
    if on_gpu:
        row(
            "GPU busy per step",
            k["busy_ms"],
            "ms",
            f"union of the kernels' intervals: {k['busy_ms'] / wall_ms:.1%} of the wall; the rest "
            f"({wall_ms - k['busy_ms']:.1f} ms) the GPU waits for the host",
        )
    row(
        "kernel launches per step" if on_gpu else "ATen ops per step",
        sum(k["launches"].values()),
        "calls",
        ", ".join(f"{n} {c:,.0f}" for n, c in k["launches"].items()),
    )
    waits = sum(k["syncs"].values())
    row(
        "host synchronisations per step",
        syncs.total,
        "calls",
        "counted by bench.common.HostSyncs: "
        + (", ".join(f"{n} {c}" for n, c in sorted(syncs.counts.items())) or "none")
        + (
            f"; the profiler's CUDA calls that wait: {waits:g} ("
            + (", ".join(f"{n} {c:g}" for n, c in k["syncs"].items()) or "none")
            + ")"
            if on_gpu
            else ""
        ),
    )
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

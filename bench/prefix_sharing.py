"""Prefix sharing (grpo --prefix_sharing) on a GRPO step of real TL;DR prompts: each prompt computed and stored once
per group against every sample carrying its own copy, interleaved in one run, per stage (docs/benchmarks.md,
"prefix_sharing").

    python -m bench.run_all --only prefix_sharing [--data DIR]   # the configurations below, for the device present

Per mode (the method: docs/benchmarks.md): step and stage seconds, tokens per stage, one generate call's KV cache
(rollouts/memory.kv_cache_bytes) and the step's peak memory; then unshared / shared.
"""

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import grpo
from bench import common
from bench.grpo_step import STAGES
from data.tldr import PROMPT_COLUMNS, PromptDataset, load_rows, pad_prompts
from data.tokenizer import get_tokenizer
from rollouts.memory import kv_cache_bytes
from rollouts.metrics import StepResult
from rollouts.models import build_models
from rollouts.prompts import PromptSet
from rollouts.sampling import RewardSpec, model_rows
from rollouts.step import train_step
from utils.dist import setup_distributed
from utils.fsdp import resolve_dtype
from utils.optim import build_optimizer, build_scheduler

BENCH = "prefix_sharing"
PROMPTS_FILE = "tldr-validation-sample.jsonl"  # in run_all --data
SAME_AS_GRPO = (  # PrefixBenchConfig's fields that grpo.Config has under the same name and meaning
    "num_samples num_kept max_new_tokens max_prompt_len gen_prompts micro_batch_size score_micro_batch_size".split()
)


@dataclass
class PrefixBenchConfig:
    name: str = "tldr"  # named configuration, printed with every figure
    preset: str = "tiny"  # model.gpt2.PRESETS key of the policy and the reward model, randomly initialised
    prompts: int = 4  # prompts per step: the first N rows of the data file
    num_samples: int = 16  # G
    num_kept: int = 8  # K, kept by RSO
    max_new_tokens: int = 53
    max_prompt_len: int = 512  # grpo --max_prompt_len: where prompts are cut
    gen_prompts: int = 16  # prompts per generate call
    micro_batch_size: int = 32  # sequences per forward/backward of the policy and the reference
    score_micro_batch_size: int = 64  # sequences per reward-model forward
    repeats: int = 2  # interleaved pairs of steps (shared, unshared); medians are reported
    data: str = ""  # the TL;DR prompt rows (jsonl with a prompt column): run() sets it from its data folder

    def grpo_config(self, shared: bool) -> grpo.Config:
        same = {k: getattr(self, k) for k in SAME_AS_GRPO}
        renamed = dict(model=self.preset, reward_model=self.preset, prompts_per_step=self.prompts)
        fixed = dict(random_init=True, reward_random_init=True, lr=1e-12, warmup_steps=0)  # the same weights each step
        cfg = grpo.Config(**same, **renamed, **fixed, prefix_sharing=shared)
        cfg.validate()
        return cfg


def tldr_prompt_set(bcfg: PrefixBenchConfig, n_sources: int, device) -> PromptSet:
    """The first bcfg.prompts TL;DR prompts, tokenized and cut as grpo.py does, left-padded."""
    rows = load_rows(bcfg.data, "validation", PROMPT_COLUMNS)[: bcfg.prompts]
    if len(rows) < bcfg.prompts:
        raise ValueError(f"{bcfg.data} holds {len(rows)} prompts, the benchmark asks for {bcfg.prompts}")
    data = PromptDataset(rows, get_tokenizer(), bcfg.max_prompt_len, name=bcfg.data)
    ids, mask = pad_prompts(data.prompts)
    every_source = torch.ones(len(rows), n_sources, dtype=torch.bool)
    return PromptSet(ids.to(device), mask.to(device), data.texts, list(range(len(rows))), every_source, bcfg.data)


def stage_tokens(r: StepResult, prompts: PromptSet, cfg: grpo.Config, model_cfg) -> dict[str, int]:
    """Tokens each stage processes in this step (module docstring); also the KV cache bytes of the first call."""
    G, new, dtype_bytes = cfg.num_samples, cfg.max_new_tokens, 4 if prompts.ids.device.type == "cpu" else 2
    kv_positions, first_call = 0, None
    for s in range(0, prompts.ids.shape[0], cfg.gen_prompts):
        mask = prompts.mask[s : s + cfg.gen_prompts]
        B, P = mask.shape[0], int(mask.any(0).sum())  # the call's own width, as rollout() cuts it
        kv_positions += B * P + B * G * new if cfg.prefix_sharing else B * G * (P + new)
        if first_call is None:
            first_call = kv_cache_bytes(model_cfg, B, G, P, new, dtype_bytes, cfg.prefix_sharing)
    N, score_tokens = r.samples.response_ids.shape[0], 0
    for s in range(0, N, cfg.score_micro_batch_size):
        rows = torch.arange(s, min(s + cfg.score_micro_batch_size, N), device=prompts.ids.device)
        responses = (r.samples.response_ids[rows], r.samples.response_mask[rows])
        batch = model_rows(prompts.ids, prompts.mask, *responses, rows // G, cfg.prefix_sharing)
        score_tokens += int(batch["attention_mask"].sum())
    trained = sum(int(b.attention_mask.sum()) for b in r.batches)
    return {
        "generate": kv_positions,
        "score": score_tokens,
        "reference": trained,
        "update": trained * cfg.policy_epochs,
        "kv_cache_bytes": first_call,
    }


def measure(bcfg: PrefixBenchConfig, device: torch.device) -> dict:
    """Interleaved shared / unshared train_step calls on one set of models: per mode, step and stage seconds, stage
    tokens, KV cache bytes of a generate call, step peak memory."""
    setup_distributed(device.type)
    cfgs = {mode: bcfg.grpo_config(mode == "shared") for mode in ("shared", "unshared")}
    sources = cfgs["shared"].sources()
    torch.manual_seed(0)
    models = build_models(cfgs["shared"], sources, resolve_dtype(cfgs["shared"].dtype, device), device)
    spec = RewardSpec(sources, True, None)
    optimizer = build_optimizer(models.policy, 1e-12, 0.0)
    scheduler = build_scheduler(optimizer, 0, 1000, 1.0)
    prompts = tldr_prompt_set(bcfg, len(sources), device)
    models.policy.train()
    out = {mode: {"step": [], "stages": {k: [] for k in STAGES}, "peak": []} for mode in cfgs}
    for i in range(bcfg.repeats):
        for mode, cfg in cfgs.items():
            common.wait_if_asked(device)  # run_all --wait_quiet
            was_reset = common.reset_peak_memory(device)
            common.synchronize(device)
            t0 = time.perf_counter()
            r = train_step(models, optimizer, scheduler, prompts, spec, cfg, step=i + 1)
            common.synchronize(device)
            m = out[mode]
            m["step"].append(time.perf_counter() - t0)
            for k in STAGES:
                m["stages"][k].append(r.seconds[k])
            m["peak"].append(common.peak_memory(device, was_reset)[0])
            m["tokens"] = stage_tokens(r, prompts, cfg, models.policy.cfg)
            m["peak_what"] = common.peak_memory(device, was_reset)[1]
            stages = ", ".join(f"{k} {r.seconds[k]:.2f}" for k in STAGES)
            print(f"  {mode} step {m['step'][-1]:.2f} s: {stages}", flush=True)
    out["prompt_lengths"] = prompts.mask.sum(-1).tolist()
    print(f"  prompt lengths {out['prompt_lengths']}", flush=True)
    return out


def rows_of(bcfg: PrefixBenchConfig, m: dict) -> list[dict]:
    """Table rows: per mode the step, each stage with its tokens, the KV cache and the peak; the ratios."""

    def row(figure: str, value: float, unit: str, note: str = "", **details) -> dict:
        return common.result(BENCH, f"{bcfg.name}{figure}", value, unit, note=note, config=bcfg, **details)

    rows, med = [], {}
    for mode in ("shared", "unshared"):
        t, peak = m[mode]["tokens"], common.mib(max(m[mode]["peak"]))
        med[mode] = {"step": statistics.median(m[mode]["step"])}
        med[mode].update((k, statistics.median(v)) for k, v in m[mode]["stages"].items())
        steps = f"median of {bcfg.repeats}, interleaved"
        rows.append(row(f" {mode}: step", med[mode]["step"], "s", steps, measurements=m[mode]))
        rows += [row(f" {mode}: {k}", med[mode][k], "s", f"{t[k]:,} tokens" if k in t else "") for k in STAGES]
        kv = common.mib(t["kv_cache_bytes"])
        rows.append(row(f" {mode}: KV cache of a generate call", kv, "MiB", "from the shapes"))
        rows.append(row(f" {mode}: step peak memory", peak, "MiB", m[mode]["peak_what"]))
    for k in ("step", "score", "reference", "update", "generate"):
        rows.append(row(f": unshared / shared, {k}", med["unshared"][k] / med["shared"][k], "x"))
    kv = m["shared"]["tokens"]["kv_cache_bytes"] / m["unshared"]["tokens"]["kv_cache_bytes"]
    return rows + [row(": shared / unshared, KV cache", kv, "x")]


def configs(device: torch.device, quick: bool) -> list[PrefixBenchConfig]:
    if device.type == "cuda":  # the reference configuration: 256 prompts x 64 samples -> 8 kept, 53 new tokens, gpt2
        name, prompts = "gpu-reference-tldr", 32 if quick else 256
        return [PrefixBenchConfig(name, "gpt2", prompts, 64, 8, score_micro_batch_size=128, repeats=2)]
    if quick:  # tiny holds 512 positions: prompts cut at 448 leave room for the new tokens
        return [PrefixBenchConfig("cpu-tiny-tldr-quick", "tiny", 2, 8, 4, 16, max_prompt_len=448, repeats=1)]
    # the gpt2 shape on 2 CPU cores: 4 prompts (230, 311, 371 and 375 tokens), so a pair of steps takes minutes
    return [PrefixBenchConfig("cpu-gpt2-tldr", "gpt2", prompts=4, repeats=2)]


def run(device: torch.device, quick: bool, cfgs: list[PrefixBenchConfig] | None = None, data=None) -> list[dict]:
    """`data`: the folder of PROMPTS_FILE, for the configurations whose own `data` is not set; without the file a
    configuration is a row saying why it was not measured."""
    rows = []
    for bcfg in cfgs or configs(device, quick):
        if not bcfg.data and data is not None:
            bcfg = replace(bcfg, data=str(Path(data) / PROMPTS_FILE))
        if not bcfg.data or not Path(bcfg.data).is_file():
            why = f"{bcfg.data or PROMPTS_FILE} not found (run_all --data: the folder of the real TL;DR rows)"
            rows.append(common.skipped(BENCH, f"{bcfg.name}: prefix sharing", why, config=bcfg))
            continue
        print(
            f"[{BENCH}] {bcfg.name}: {bcfg.prompts} TL;DR prompts x {bcfg.num_samples} samples -> {bcfg.num_kept} "
            f"kept, {bcfg.max_new_tokens} new tokens, {bcfg.repeats} interleaved pairs on {device}",
            flush=True,
        )
        rows += rows_of(bcfg, measure(bcfg, device))
    return rows

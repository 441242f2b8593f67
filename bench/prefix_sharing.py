"""Prefix sharing (grpo --prefix_sharing) on a TL;DR-shaped GRPO step: each prompt computed and stored once per group
against every sample carrying its own copy, interleaved in one run, per stage.

    python -m bench.run_all --only prefix_sharing   # the configurations below, for the device present
    python -m bench.prefix_sharing --preset tiny    # one configuration from the command line
    python -m bench.prefix_sharing --preset gpt2 --prompts 2 --repeats 2

The prompts are real TL;DR prompts from ../shared/data (tldr-validation-sample.jsonl, the first --prompts rows, cut
at 512 tokens as grpo.py cuts them), so the prompt lengths are TL;DR's; 53 new tokens, G = 16 samples per prompt,
RSO keeps K = 8 (on GPU the reference configuration, 256 prompts x 64 samples -> 8); policy, reference and reward
model are randomly initialised GPT-2s of --preset (fp32 on CPU, bf16 on GPU). Each repeat runs rollouts.step.train_step
once shared and once unshared at the same step index (the same sampling stream) with the learning rate at a
negligible 1e-12, so both see the same weights and sample the same responses;
the two modes alternate so that a change in the machine's load hits both alike.

Figures per mode (median over repeats, no warm-up step; ratio = unshared / shared):
- seconds of the whole step and of each stage (train_step's own StepResult.seconds);
- tokens processed per stage: generate, the positions held in the KV caches of the step's generate calls (what
  every decode step reads); score, the real tokens the reward model's forwards compute; reference and update, the
  real tokens of the packed or prompt + response rows of the trained micro-batches;
- memory: the KV cache of one generate call (bytes, from the shapes: rollouts/memory.kv_cache_bytes, which
  tests/test_prefix_sharing.py checks against what the sampler allocates), and the step's peak
  (torch.cuda.max_memory_allocated on GPU; on CPU the process's peak RSS, weights included).
"""

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
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
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tldr-validation-sample.jsonl"


@dataclass
class PrefixBenchConfig:
    name: str = "tldr"
    """Named configuration, printed with every figure."""
    preset: str = "tiny"
    """model.gpt2.PRESETS key of the policy and the reward model, randomly initialised."""
    prompts: int = 4
    """Prompts per step: the first N rows of the data file."""
    num_samples: int = 16
    """G: responses sampled per prompt."""
    num_kept: int = 8
    """K: responses RSO keeps per prompt."""
    max_new_tokens: int = 53
    """Response tokens sampled at most."""
    max_prompt_len: int = 512
    """Prompts are cut at this many tokens (grpo --max_prompt_len)."""
    gen_prompts: int = 16
    """Prompts per generate call."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the policy and the reference."""
    score_micro_batch_size: int = 64
    """Sequences per reward-model forward."""
    repeats: int = 2
    """Interleaved pairs of steps (shared, unshared); medians are reported."""
    data: str = str(DATA)
    """TL;DR prompt rows (jsonl with a prompt column)."""

    def grpo_config(self, shared: bool) -> grpo.Config:
        cfg = grpo.Config(
            model=self.preset,
            random_init=True,
            reward_model=self.preset,
            reward_random_init=True,
            max_prompt_len=self.max_prompt_len,
            num_samples=self.num_samples,
            num_kept=self.num_kept,
            max_new_tokens=self.max_new_tokens,
            gen_prompts=self.gen_prompts,
            prompts_per_step=self.prompts,
            micro_batch_size=self.micro_batch_size,
            score_micro_batch_size=self.score_micro_batch_size,
            lr=1e-12,
            warmup_steps=0,
            prefix_sharing=shared,
        )
        cfg.validate()
        return cfg


def tldr_prompt_set(bcfg: PrefixBenchConfig, n_sources: int, device) -> PromptSet:
    """The first bcfg.prompts TL;DR prompts, tokenized and cut as grpo.py does, left-padded."""
    rows = load_rows(bcfg.data, "validation", PROMPT_COLUMNS)[: bcfg.prompts]
    if len(rows) < bcfg.prompts:
        raise ValueError(f"{bcfg.data} holds {len(rows)} prompts, the benchmark asks for {bcfg.prompts}")
    data = PromptDataset(rows, get_tokenizer(), bcfg.max_prompt_len, name=bcfg.data)
    ids, mask = pad_prompts(data.prompts)
    return PromptSet(
        ids.to(device),
        mask.to(device),
        data.texts,
        list(range(len(rows))),
        torch.ones(len(rows), n_sources, dtype=torch.bool),
        bcfg.data,
    )


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
        batch = model_rows(
            prompts.ids,
            prompts.mask,
            r.samples.response_ids[rows],
            r.samples.response_mask[rows],
            rows // G,
            cfg.prefix_sharing,
        )
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
            print(
                f"  {mode} step {m['step'][-1]:.2f} s: " + ", ".join(f"{k} {r.seconds[k]:.2f}" for k in STAGES),
                flush=True,
            )
    out["prompt_lengths"] = prompts.mask.sum(-1).tolist()
    print(f"  prompt lengths {out['prompt_lengths']}", flush=True)
    return out


def rows_of(bcfg: PrefixBenchConfig, m: dict) -> list[dict]:
    """Table rows: per mode the step, each stage with its tokens, the KV cache and the peak; the ratios."""
    rows = []
    med = {
        mode: {
            "step": statistics.median(m[mode]["step"]),
            **{k: statistics.median(v) for k, v in m[mode]["stages"].items()},
        }
        for mode in ("shared", "unshared")
    }
    for mode in ("shared", "unshared"):
        t = m[mode]["tokens"]
        rows.append(
            common.result(
                BENCH,
                f"{bcfg.name} {mode}: step",
                med[mode]["step"],
                "s",
                note=f"median of {bcfg.repeats}, interleaved",
                config=bcfg,
                measurements=m[mode],
            )
        )
        for k in STAGES:
            note = f"{t[k]:,} tokens" if k in t else ""
            rows.append(common.result(BENCH, f"{bcfg.name} {mode}: {k}", med[mode][k], "s", note=note, config=bcfg))
        rows.append(
            common.result(
                BENCH,
                f"{bcfg.name} {mode}: KV cache of a generate call",
                common.mib(t["kv_cache_bytes"]),
                "MiB",
                note="from the shapes",
                config=bcfg,
            )
        )
        rows.append(
            common.result(
                BENCH,
                f"{bcfg.name} {mode}: step peak memory",
                common.mib(max(m[mode]["peak"])),
                "MiB",
                note=m[mode]["peak_what"],
                config=bcfg,
            )
        )
    for k in ("step", "score", "reference", "update", "generate"):
        rows.append(
            common.result(
                BENCH, f"{bcfg.name}: unshared / shared, {k}", med["unshared"][k] / med["shared"][k], "x", config=bcfg
            )
        )
    rows.append(
        common.result(
            BENCH,
            f"{bcfg.name}: shared / unshared, KV cache",
            m["shared"]["tokens"]["kv_cache_bytes"] / m["unshared"]["tokens"]["kv_cache_bytes"],
            "x",
            config=bcfg,
        )
    )
    return rows


def configs(device: torch.device, quick: bool) -> list[PrefixBenchConfig]:
    if device.type == "cuda":
        # the reference configuration: 256 prompts x 64 samples -> 8 kept, 53 new tokens, gpt2
        return [
            PrefixBenchConfig(
                "gpu-reference-tldr",
                "gpt2",
                prompts=32 if quick else 256,
                num_samples=64,
                num_kept=8,
                score_micro_batch_size=128,
                repeats=2,
            )
        ]
    if quick:  # tiny holds 512 positions: prompts cut at 448 leave room for the 53 new tokens
        return [
            PrefixBenchConfig(
                "cpu-tiny-tldr-quick",
                "tiny",
                prompts=2,
                num_samples=8,
                num_kept=4,
                max_new_tokens=16,
                max_prompt_len=448,
                repeats=1,
            )
        ]
    # gpt2 (124M) shape on 2 shared CPU cores: 4 prompts (230, 311, 371 and 375 tokens; the file's mean is 345), so
    # one interleaved pair takes minutes, not hours
    return [PrefixBenchConfig("cpu-gpt2-tldr", "gpt2", prompts=4, repeats=2)]


def run(device: torch.device, quick: bool, cfgs: list[PrefixBenchConfig] | None = None) -> list[dict]:
    rows = []
    for bcfg in cfgs or configs(device, quick):
        print(
            f"[{BENCH}] {bcfg.name}: {bcfg.prompts} TL;DR prompts x {bcfg.num_samples} samples -> {bcfg.num_kept} "
            f"kept, {bcfg.max_new_tokens} new tokens, {bcfg.repeats} interleaved pairs on {device}",
            flush=True,
        )
        rows += rows_of(bcfg, measure(bcfg, device))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, value in asdict(PrefixBenchConfig()).items():
        parser.add_argument(f"--{name}", type=type(value), default=value, help=f"PrefixBenchConfig.{name}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--out", default="", help="write the figures and the environment as JSON here")
    args = vars(parser.parse_args())
    device, out = torch.device(args.pop("device")), args.pop("out")
    rows = run(device, False, [PrefixBenchConfig(**args)])
    print(common.format_table(rows))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            json.dumps({"environment": common.environment(device), "rows": rows}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()

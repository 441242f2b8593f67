"""One full GRPO step at a named configuration: time and share per stage, generated and total tokens/s per
device, peak memory.

The step is grpo.main()'s stages 2-7 (generate, score, select, advantages, reference log-probs, update), called
through grpo.py's own stage functions on FSDP-sharded models built as main() builds them (policy, frozen reference
copy, frozen reward model; bf16 parameters on GPU, fp32 on CPU), with grpo.StageTimer (which synchronises the GPU
around each stage). grpo.py has no single-step function, so `grpo_step` below repeats main()'s glue between the
stage functions; if that loop changes, this must follow. Data loading (stage 1) and logging (stage 8) are left
out: prompts are random token ids already on the device.

Figures (world size 1, so "per device" is the whole step):
- step seconds: median over `repeats` steps after `warmup` untimed steps;
- per stage: median seconds, and share = stage median / step median ("other" is the step minus its stages);
- generated tokens/s = response tokens sampled (up to and including each end token) / step seconds;
- total tokens/s = (real prompt tokens x G + generated tokens) / step seconds, i.e. every token of every sampled
  sequence, verl's `perf/throughput` definition;
- update tokens/s = real tokens of the K x prompts trained sequences / update seconds;
- peak memory over the timed steps: torch.cuda.max_memory_allocated on GPU, the process's max RSS on CPU.
"""

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from bench import common
from bench.common import mib, peak_memory, random_prompts, reset_peak_memory, result, synchronize

BENCH = "grpo"
STAGES = ("generate", "score", "select", "advantages", "reference", "update")


@dataclass
class GRPOBenchConfig:
    name: str
    """Named configuration, printed with every figure."""
    preset: str
    """model.gpt2.PRESETS key of the policy and the reward model, randomly initialised."""
    prompts: int
    """Prompts per step (grpo --prompts_per_step)."""
    num_samples: int
    """G: responses sampled per prompt."""
    num_kept: int
    """K: responses kept per prompt for the update (ignored by selection "all", which keeps G)."""
    selection: str
    """grpo --selection: rso, top_bottom, uniform or all."""
    max_new_tokens: int
    """Response tokens sampled at most."""
    prompt_len: int
    """Longest prompt (the width of the left-padded batch)."""
    min_prompt_len: int
    """Shortest prompt; lengths are uniform in [min_prompt_len, prompt_len]."""
    gen_prompts: int
    """Prompts per generation call (x G rows in the KV cache)."""
    micro_batch_size: int
    """Sequences per forward/backward of the policy and the reference."""
    score_micro_batch_size: int
    """Sequences per reward-model forward."""
    warmup: int = 1
    """Untimed steps first (allocator, kernel selection, first-call set-up)."""
    repeats: int = 3
    """Timed steps; medians are reported."""

    def grpo_config(self):
        """grpo.Config of this benchmark (everything else at grpo.py's defaults: temperature 1, beta 0.04, ...)."""
        import grpo

        cfg = grpo.Config(
            policy=self.preset, policy_random_init=True, reward_model=self.preset, reward_random_init=True,
            max_prompt_len=self.prompt_len, num_samples=self.num_samples, max_new_tokens=self.max_new_tokens,
            gen_prompts=self.gen_prompts, selection=self.selection, num_kept=self.num_kept,
            prompts_per_step=self.prompts, micro_batch_size=self.micro_batch_size,
            score_micro_batch_size=self.score_micro_batch_size, warmup_steps=0,
        )
        cfg.validate()
        return cfg

    def describe(self) -> str:
        kept = f"{self.selection} keeps {self.num_samples if self.selection == 'all' else self.num_kept}"
        return (f"{self.preset}, {self.prompts} prompts ({self.min_prompt_len}-{self.prompt_len} tokens) x "
                f"{self.num_samples} samples x {self.max_new_tokens} new tokens, {kept}, micro-batch "
                f"{self.micro_batch_size}, RM micro-batch {self.score_micro_batch_size}")


def configs(device: torch.device, quick: bool) -> list[GRPOBenchConfig]:
    if device.type == "cuda":
        if quick:
            return [GRPOBenchConfig("gpu-gpt2-124M-quick", "gpt2", prompts=32, num_samples=64, num_kept=8,
                                    selection="rso", max_new_tokens=56, prompt_len=384, min_prompt_len=352,
                                    gen_prompts=16, micro_batch_size=32, score_micro_batch_size=128, repeats=2)]
        # REFERENCE.md's GRPO step: 256 prompts x 64 samples x 56 new tokens, prompts ~384 tokens, the reward
        # model on all 16,384 samples, RSO keeps 8 per prompt, 2,048 sequences trained
        return [GRPOBenchConfig("gpu-reference", "gpt2", prompts=256, num_samples=64, num_kept=8, selection="rso",
                                max_new_tokens=56, prompt_len=384, min_prompt_len=352, gen_prompts=16,
                                micro_batch_size=32, score_micro_batch_size=128)]
    if quick:
        return [GRPOBenchConfig("cpu-tiny-quick", "tiny", prompts=4, num_samples=8, num_kept=4, selection="rso",
                                max_new_tokens=8, prompt_len=48, min_prompt_len=32, gen_prompts=4,
                                micro_batch_size=16, score_micro_batch_size=32, repeats=3)]
    return [GRPOBenchConfig("cpu-tiny", "tiny", prompts=8, num_samples=16, num_kept=4, selection="rso",
                            max_new_tokens=16, prompt_len=64, min_prompt_len=48, gen_prompts=8, micro_batch_size=16,
                            score_micro_batch_size=64)]


def build(bcfg: GRPOBenchConfig, device: torch.device):
    """(grpo.Config, policy, reference, reward model, optimizer, scheduler, world size), as grpo.main builds them."""
    import grpo
    from model.weights import build_policy, build_reward_model
    from utils.dist import setup_distributed
    from utils.fsdp import resolve_dtype, shard_model
    from utils.optim import build_optimizer, build_scheduler

    cfg = bcfg.grpo_config()
    world = setup_distributed(device.type).world_size
    grpo.per_rank_sizes(cfg, world)  # the exact-division checks of main()
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, cfg.policy_random_init)
    reference = grpo.freeze(copy.deepcopy(policy))
    reward_model = grpo.freeze(build_reward_model(cfg.reward_model, cfg.reward_random_init))
    shard_model(policy, dtype, activation_checkpointing=cfg.activation_checkpointing)
    policy.to(device)
    for frozen in (reference, reward_model):
        shard_model(frozen, dtype)
        frozen.to(device)
    optimizer = build_optimizer(policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, 1000, cfg.min_lr_ratio)
    policy.train()
    return cfg, policy, reference, reward_model, optimizer, scheduler, world


def grpo_step(policy, reference, reward_model, optimizer, scheduler, prompt_ids, prompt_mask, cfg, world, device,
              generator) -> tuple[dict[str, float], dict[str, int]]:
    """grpo.main()'s stages 2-7 on one batch of prompts: (seconds per stage, token counts)."""
    import grpo
    from utils.dist import all_reduce_sum
    from rlhf.grpo import global_normalize, group_center, group_normalize, penalize_missing_end

    G = cfg.num_samples
    timer = grpo.StageTimer(device)
    # 2. generate G responses per prompt; rows b*G .. b*G+G-1 belong to prompt b
    with timer("generate"):
        samples = grpo.rollout(policy, prompt_ids, prompt_mask, cfg, G, generator)
    # 3. score: raw RM score -> penalty without an end token -> RM gain/bias
    with timer("score"):
        raw = grpo.score(reward_model, prompt_ids, prompt_mask, samples, G, cfg.score_micro_batch_size)
        rewards = reward_model.normalize(penalize_missing_end(raw, samples.has_end, cfg.missing_end_penalty))
    # 4. select K of G per prompt
    with timer("select"):
        idx_BK, _ = grpo.select(rewards.view(-1, G), cfg, generator)
        rows_BK = idx_BK + G * torch.arange(idx_BK.shape[0], device=device)[:, None]
        rows_N = rows_BK.flatten()
    # 5. advantages over the selected samples, then over the global batch
    with timer("advantages"):
        rewards_BK = rewards[rows_BK]
        advantages = (group_normalize(rewards_BK) if cfg.scale_by_std else group_center(rewards_BK)).flatten()
        if cfg.global_norm:
            advantages = global_normalize(advantages, all_reduce_sum)
        batches = grpo.build_training_batches(prompt_ids, prompt_mask, samples, rows_N, advantages, G,
                                              cfg.micro_batch_size)
    # 6. reference log-probs (and the old policy's with mu > 1)
    with timer("reference"):
        grpo.add_logprobs(reference, batches, "ref_logprobs", cfg, gather=True)
        if cfg.policy_epochs > 1:
            grpo.add_logprobs(policy, batches, "old_logprobs", cfg, gather=False)
    # 7. update the policy
    with timer("update"):
        grpo.policy_update(policy, optimizer, scheduler, batches, cfg, world, device)
    generated = int(samples.response_mask.sum())
    counts = {
        "sequences": samples.response_ids.shape[0],
        "generated_tokens": generated,
        "total_tokens": int(prompt_mask.sum()) * G + generated,
        "trained_sequences": int(rows_N.numel()),
        "trained_tokens": int(sum(int(b["attention_mask"].sum()) for b in batches)),
    }
    return dict(timer.seconds), counts


def measure_steps(bcfg: GRPOBenchConfig, device: torch.device) -> dict:
    """Warm-up and timed steps at one configuration: per-step seconds (wall clock, device synchronised), stage
    seconds, token counts and peak memory."""
    cfg, policy, reference, reward_model, optimizer, scheduler, world = build(bcfg, device)
    prompt_ids, prompt_mask = (
        t.to(device) for t in random_prompts(bcfg.prompts, bcfg.prompt_len, bcfg.min_prompt_len,
                                             policy.cfg.vocab_size, seed=0))

    def one_step(i: int):
        generator = torch.Generator(device=device).manual_seed(1000 + i)
        common.wait_if_asked(device)
        busy0, cpu0 = common.machine_busy_seconds(), time.process_time()
        synchronize(device)
        t0 = time.perf_counter()
        stages, counts = grpo_step(policy, reference, reward_model, optimizer, scheduler, prompt_ids, prompt_mask,
                                   cfg, world, device, generator)
        synchronize(device)
        seconds = time.perf_counter() - t0
        others = None
        if busy0 is not None:
            others = max(0.0, (common.machine_busy_seconds() - busy0 - (time.process_time() - cpu0)) / seconds)
        return seconds, stages, counts, others

    for i in range(bcfg.warmup):
        one_step(i)
    was_reset = reset_peak_memory(device)
    steps = [one_step(bcfg.warmup + i) for i in range(bcfg.repeats)]
    peak, peak_what = peak_memory(device, was_reset)
    del policy, reference, reward_model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "world_size": world,
        "step_seconds": [s[0] for s in steps],
        "stage_seconds": {k: [s[1].get(k, 0.0) for s in steps] for k in STAGES},
        "counts": steps[-1][2],
        "others_cores": [s[3] for s in steps if s[3] is not None],
        "peak_memory_bytes": peak,
        "peak_memory_what": peak_what,
    }


def step_rows(bcfg: GRPOBenchConfig, m: dict, bench: str = BENCH, label: str = "ours") -> list[dict]:
    """The table rows of one measured configuration."""
    step = statistics.median(m["step_seconds"])
    c, world = m["counts"], m["world_size"]
    busy = f"; other processes used up to {max(m['others_cores']):.1f} cores" if max(m["others_cores"], default=0) >= 0.1 else ""
    name = f"{bcfg.name} {label}"
    details = {"measurements": m}
    rows = [result(bench, f"{name}: step", step, "s",
                   note=f"median of {len(m['step_seconds'])} steps after {bcfg.warmup} warm-up{busy}",
                   config=bcfg, **details)]
    medians = {k: statistics.median(v) for k, v in m["stage_seconds"].items()}
    other = statistics.median(s - sum(m["stage_seconds"][k][i] for k in STAGES) for i, s in enumerate(m["step_seconds"]))
    for k in (*STAGES, "other"):
        seconds = medians.get(k, other)
        rows.append(result(bench, f"{name}: {k}", seconds, "s", note=f"{seconds / step:.1%} of the step", config=bcfg))
    rows += [
        result(bench, f"{name}: generated tokens/s per device", c["generated_tokens"] / step / world, "tok/s",
               note=f"{c['generated_tokens']:,} generated tokens ({c['sequences']:,} sequences) per step", config=bcfg),
        result(bench, f"{name}: total tokens/s per device", c["total_tokens"] / step / world, "tok/s",
               note=f"{c['total_tokens']:,} prompt + generated tokens of all sampled sequences per step", config=bcfg),
        result(bench, f"{name}: update tokens/s", c["trained_tokens"] / medians["update"], "tok/s",
               note=f"{c['trained_tokens']:,} tokens of {c['trained_sequences']:,} trained sequences", config=bcfg),
        result(bench, f"{name}: peak memory", mib(m["peak_memory_bytes"]), "MiB", note=m["peak_memory_what"],
               config=bcfg),
    ]
    return rows


def bench_config(bcfg: GRPOBenchConfig, device: torch.device, bench: str = BENCH, label: str = "ours") -> list[dict]:
    print(f"[{bench}] {bcfg.name}: {bcfg.describe()}; {bcfg.warmup} warm-up + {bcfg.repeats} timed steps", flush=True)
    m = measure_steps(bcfg, device)
    step = statistics.median(m["step_seconds"])
    print(f"  step {step:.3f} s: " + ", ".join(
        f"{k} {statistics.median(v):.3f} s" for k, v in m["stage_seconds"].items()), flush=True)
    return step_rows(bcfg, m, bench, label)


def run(device: torch.device, quick: bool, cfgs: list[GRPOBenchConfig] | None = None) -> list[dict]:
    rows = []
    for bcfg in cfgs or configs(device, quick):
        rows += bench_config(bcfg, device)
    return rows

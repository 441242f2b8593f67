"""GRPO: Group Relative Policy Optimization of a GPT-2 policy on Reddit TL;DR prompts, against a reward model, reward
functions of the text, or a weighted sum of both.

    torchrun --nproc_per_node=2 grpo.py                              # policy runs/sft/hf, reward model runs/rm/hf
    python grpo.py --policy runs/sft/hf --reward_model runs/rm/hf    # one device
    python grpo.py --rewards "gold_reward + 0.5*format" --lora_rank 8 --policy_epochs 2   # no reward model at all
    python grpo.py --help                                            # every option (docs/grpo.md, docs/lora_rewards.md)

One step (DeepSeekMath, arXiv 2402.03300, section 4), as the numbered stages of main():

    1. sample prompts     prompts_per_step prompts, split over ranks
    2. generate           G = num_samples responses per prompt; the prompt's KV cache is shared by its group
    3. score              every reward source (--rewards) on the samples it applies to: the reward model (penalty
                          for no end token in raw RM units, then gain/bias) and functions of the text (whitened
                          over the global batch); their weighted sum is the reward (rlhf/rewards.py)
    4. select             K = num_kept of G per prompt (RSO rejection sampling at temperature beta_rs, ...)
    5. advantages         group normalization over the K selected, then over the whole batch across ranks
    6. reference          log-probs of the selected responses under the frozen reference policy (with LoRA: the
                          policy with its adapters off); refreshed from the policy every --ref_refresh_every steps
    7. update             clipped ratio + beta * k3 KL - entropy_coef * entropy, response tokens only, loss / global
                          normaliser; mu = --policy_epochs optimizer steps per batch of rollouts
    8. log, evaluate, checkpoint

The math (selection, advantages, loss, aggregation) lives in rlhf/grpo.py, one pure function per variant.
Sampling and selection draw from a torch.Generator seeded from (seed, step, rank), so a resumed run repeats
the same samples and losses bit for bit.
"""

import copy
import hashlib
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from data.tldr import (
    PREF_COLUMNS,
    PROMPT_COLUMNS,
    DataError,
    PromptDataset,
    ShardedLoader,
    load_optional_column,
    load_rows,
    pad_prompts,
)
from data.synthetic import gold_reward as synthetic_gold_reward
from data.tokenizer import END_ID, get_tokenizer
from evaluation.preference import build_eval_set, evaluate_policy, policy_logps
from model.sampler import SampleOutput, generate, process_logits, processed_logprobs
from model.lora import AdaptersOff, LoRAConfig, apply_lora, has_lora, merge_adapters_, trainable_summary
from model.weights import build_policy, build_reward_model, model_config, save_export
from utils.checkpoint import (
    export_model,
    find_checkpoint,
    full_model_state,
    load_checkpoint,
    restore_loader,
    save_checkpoint,
    set_full_model_state,
    update_best,
)
from utils.config import ConfigError, check_context, config_to_dict, parse_config, require_nonempty
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed
from utils.fsdp import gathered_params, resolve_dtype, set_gradient_sync, shard_model
from rlhf.grpo import (
    AGGREGATIONS,
    entropy_bonus,
    global_normalize,
    group_center,
    group_normalize,
    grpo_token_loss,
    penalize_missing_end,
    select_all,
    select_rso,
    select_top_bottom,
    select_uniform,
    token_entropy,
)
from utils.guard import NonFiniteGuard, StopSignal, check_rewards, exit_on_error
from utils.logging import Logger, progress
from utils.optim import build_optimizer, build_scheduler, clip_grad_norm
from rlhf.rewards import (
    REWARD_MODEL,
    RewardSource,
    combine_sources,
    load_function,
    normalize_sources,
    parse_rewards,
    row_sources,
    score_functions,
    source_stats,
)


TASK_REWARDS = {"gold_reward": synthetic_gold_reward}  # --rewards gold_reward: the embedded task's gold reward


@dataclass
class Config(LoRAConfig):  # --lora_rank, --lora_alpha, --lora_dropout, --lora_targets (model/lora.py)
    # --- models
    policy: str = "runs/sft/hf"
    """Starting policy, also the frozen reference (with LoRA: the policy's own base weights, adapters off): a
    Hugging Face-format folder (sft.py's hf/), a hub name, or with --policy_random_init a preset (tiny, small, ...)."""
    policy_random_init: bool = False
    """Random GPT-2 initialisation of the preset named by --policy (tests and smoke runs)."""
    reward_model: str = "runs/rm/hf"
    """Reward model: reward_model.py's hf/ folder (its gain/bias come from reward_normalization.json), or with
    --reward_random_init a preset. Loaded only when --rewards names reward_model."""
    reward_random_init: bool = False
    """Random reward model of the preset named by --reward_model, gain 1 and bias 0 (tests and smoke runs)."""
    cpu_offload: bool = False
    """Keep the frozen reference and reward model's sharded parameters on the CPU between uses (needs a GPU). With
    LoRA the reference is the policy itself and is not offloaded."""
    # --- data
    train_data: str = "trl-lib/tldr"
    """Training prompts (column prompt): a hub dataset name, a .jsonl/.parquet file, or a folder of them."""
    train_split: str = "train"
    """Split of --train_data (hub datasets and folders)."""
    val_data: str = "trl-lib/tldr"
    """Validation prompts for the reward of greedy/sampled summaries; empty string to skip."""
    val_split: str = "validation"
    """Split of --val_data."""
    pref_data: str = "trl-lib/tldr-preference"
    """Preference pairs for the implicit-reward accuracy (evaluate.py); empty string to skip."""
    pref_split: str = "validation"
    """Split of --pref_data."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""
    # --- sampling
    num_samples: int = 64
    """G: responses sampled per prompt."""
    max_new_tokens: int = 53
    """Response tokens sampled at most, the end token included."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the ratio's and KL's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables. The loss's log-probs use the same masking."""
    top_k: int = 0
    """Top-k sampling; 0 disables. The loss's log-probs use the same masking."""
    gen_prompts: int = 16
    """Prompts per generation call on each rank (x num_samples sequences in the KV cache)."""
    # --- rewards and selection
    rewards: str = "reward_model"
    """The training reward, "+"-joined terms [WEIGHT*]SOURCE; a SOURCE is reward_model (--reward_model), a built-in
    function (format, length, gold_reward) or a "module:function" of (prompt text, response text) -> number, e.g.
    "reward_model + 0.5*format" or "gold_reward" (then no reward model is loaded). Each source is normalized on
    its own, then weighted and summed (rlhf/rewards.py, docs/lora_rewards.md)."""
    reward_column: str = "reward_fns"
    """Optional column of --train_data / --val_data naming, per row, the sources that apply to it ("gold_reward,
    format" or a list of names); rows without it, or a dataset without the column, get every source."""
    normalize_reward_fns: bool = True
    """Whiten each reward function's values over the step's global batch (all samples it applies to, all ranks)
    before weighting; false uses their raw values. The reward model keeps its own gain/bias normalization."""
    reward_length_target: int = 24
    """Words the built-in `length` reward function aims at (0 at the target, -1 at none or twice as many)."""
    missing_end_penalty: float = 1.0
    """Subtracted from the *raw* reward-model score of a response without an end token, before the gain/bias
    normalization (so gain * penalty in normalized units)."""
    selection: Literal["rso", "top_bottom", "uniform", "all"] = "rso"
    """How K of the G samples are kept: rso (RSO rejection sampling, arXiv 2309.06657), top_bottom (the K/2 best
    and K/2 worst), uniform (K at random), all (K = G)."""
    num_kept: int = 8
    """K: samples kept per prompt for the update (ignored by --selection all)."""
    beta_rs: float = 2.0
    """RSO temperature: acceptance probability exp((r - r_max) / beta_rs) on normalized rewards."""
    # --- advantages
    scale_by_std: bool = True
    """Divide by the group's std in group normalization; false gives Dr. GRPO's r - mean (arXiv 2503.20783)."""
    global_norm: bool = True
    """After group normalization, whiten the advantages over the whole batch across all ranks."""
    # --- loss
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo"
    """Aggregation: grpo (per-sequence mean, then mean over sequences), bnpo/dapo (mean over all tokens),
    dr_grpo (sum / (sequences x max_new_tokens)); every normaliser is global over ranks and micro-batches."""
    eps_low: float = 0.2
    """Clip the ratio below at 1 - eps_low."""
    eps_high: float = 0.2
    """Clip the ratio above at 1 + eps_high (DAPO's clip-higher uses 0.28)."""
    beta: float = 0.04
    """Weight of the k3 KL to the reference policy (also the beta of the implicit reward in evaluation)."""
    policy_epochs: int = 1
    """mu: optimizer steps over each batch of rollouts. The ratio's old log-probs are the sampling policy's,
    computed once before the first step (ratio exactly 1 there); 1: the detached current ones (ratio 1 in value)."""
    ref_refresh_every: int = 0
    """Make the current policy the new reference every N steps (with LoRA: merge the adapters into the base
    weights); the KL term is exactly 0 right after. 0 keeps the starting policy as reference."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef x the token entropy of the (temperature / top-k / top-p processed)
    policy from the loss, aggregated like the loss; 0 disables."""
    # --- optimisation
    prompts_per_step: int = 256
    """Global prompts per step, over all ranks (x num_kept sequences in the update)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the policy and reference on each rank."""
    score_micro_batch_size: int = 128
    """Sequences per reward-model forward on each rank."""
    steps: int = 0
    """GRPO steps; 0 means one epoch over the training prompts."""
    lr: float = 3e-6
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 10
    """Linear warmup (optimizer steps) before cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay on weight matrices."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    # --- evaluation and logging
    eval_every: int = 50
    """Evaluate every N steps, before the first and after the last; 0 only after the last; -1 never."""
    eval_prompts: int = 256
    """Validation prompts whose summaries the reward model scores (the first N)."""
    eval_greedy: bool = True
    """Greedy summaries in evaluation; false samples at --temperature / --top_p / --top_k."""
    pref_pairs: int = 512
    """Preference pairs for the implicit-reward accuracy (the first N); 0 for all."""
    pref_max_response_len: int = 64
    """Tokens kept of each preference response, the end token included."""
    gold_reward_fn: str = ""
    """Optional "module:function" of (prompt text, response text) -> float, logged (never trained on, unless it is
    also in --rewards) as reward/gold_mean over every step's samples, e.g. data.synthetic:gold_reward."""
    table_every: int = 20
    """Log a table of sample responses every N steps; 0 disables."""
    table_prompts: int = 2
    """Prompts (with all their selected samples) in each table, from rank 0."""
    # --- run
    save_every: int = 50
    """Resumable checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    """Resumable checkpoints kept (the best one is kept as well)."""
    best_metric: str = "eval/reward"
    """Evaluation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables. The default needs the summary evaluation (--val_data);
    without it, eval/pref_accuracy (or nothing, without --pref_data either)."""
    best_mode: Literal["min", "max"] = "max"
    """min: a lower --best_metric is better; max: a higher one."""
    out_dir: str = "runs/grpo"
    """Run directory: checkpoints/, hf/ (the Hugging Face-format export), metrics.jsonl, tables, wandb/."""
    resume: bool = True
    """Resume from the newest checkpoint in --out_dir when there is one (false refuses to start over on top of one)."""
    resume_from: str = ""
    """Start from this checkpoint (a checkpoint folder, or another run directory) when --out_dir has none yet."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop (nothing is stepped or saved; the newest checkpoint is the last
    good state) or skip the optimizer step (no scheduler step either). Reward-model scores that are NaN or
    constant always stop the run."""
    seed: int = 1
    """Seed of data order, sampling and selection (streams derived from seed, step and rank)."""
    device: str = "auto"
    """auto, cuda or cpu."""
    dtype: str = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU). Gradients are reduced in fp32."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward to save memory."""
    wandb_mode: str = "auto"
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise)."""
    wandb_project: str = "tldr-rlhf"
    """wandb project."""
    run_name: str = "grpo"
    """wandb run name."""

    @property
    def kept(self) -> int:
        """K actually kept per prompt."""
        return self.num_samples if self.selection == "all" else self.num_kept

    @property
    def uses_reward_model(self) -> bool:
        return any(s.fn is None for s in parse_rewards(self.rewards, self.reward_length_target, TASK_REWARDS))

    def validate(self) -> None:
        require_nonempty(self, "policy", "rewards", "train_data", "out_dir")
        if self.uses_reward_model:  # also parses --rewards (and imports its functions): a typo fails here
            require_nonempty(self, "reward_model")
        self.validate_lora()
        if self.ref_refresh_every < 0 or self.entropy_coef < 0 or self.reward_length_target <= 0:
            raise ConfigError("--ref_refresh_every and --entropy_coef must be >= 0 and --reward_length_target > 0")
        for name in ("save_every", "grad_clip", "warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        for name in (
            "num_samples", "num_kept", "max_new_tokens", "max_prompt_len", "gen_prompts", "prompts_per_step",
            "micro_batch_size", "score_micro_batch_size", "policy_epochs", "pref_max_response_len", "table_prompts",
            "keep_last",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.kept > self.num_samples:
            raise ConfigError(
                f"--num_kept {self.num_kept} exceeds --num_samples {self.num_samples}: the group of samples per prompt "
                f"must be at least as large as the number kept from it"
            )
        if self.selection == "top_bottom" and self.kept % 2:
            raise ConfigError(f"--selection top_bottom needs an even --num_kept, got {self.num_kept}")
        if self.selection == "rso" and not self.beta_rs > 0:
            raise ConfigError(f"--beta_rs must be > 0, got {self.beta_rs}")
        if self.kept < 2 and self.scale_by_std:
            raise ConfigError("group normalization with std scaling needs at least 2 kept samples per prompt")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0 (greedy evaluation: --eval_greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"--top_p must be in (0, 1] and --top_k >= 0, got {self.top_p}, {self.top_k}")
        if self.eps_low < 0 or self.eps_high < 0 or self.beta < 0:
            raise ConfigError("--eps_low, --eps_high and --beta must be >= 0")
        if self.steps < 0 or self.eval_prompts < 0 or self.pref_pairs < 0:
            raise ConfigError("--steps, --eval_prompts and --pref_pairs must be >= 0")
        if self.wandb_mode not in ("online", "offline", "disabled", "auto"):
            raise ConfigError(f"--wandb_mode must be online, offline, disabled or auto, got '{self.wandb_mode}'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"--device must be auto, cuda or cpu, got '{self.device}'")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"--dtype must be auto, bf16 or fp32, got '{self.dtype}'")


def per_rank_sizes(cfg: Config, world: int) -> tuple[int, int]:
    """(prompts per rank, training micro-batches per rank), with exact-division checks."""
    if cfg.prompts_per_step % world:
        raise ConfigError(f"--prompts_per_step {cfg.prompts_per_step} must be divisible by the world size {world}")
    prompts = cfg.prompts_per_step // world
    if (prompts * cfg.kept) % cfg.micro_batch_size:
        raise ConfigError(
            f"{prompts} prompts per rank x {cfg.kept} kept samples = {prompts * cfg.kept} sequences must be divisible "
            f"by --micro_batch_size {cfg.micro_batch_size}"
        )
    return prompts, prompts * cfg.kept // cfg.micro_batch_size


def stream_seed(*parts) -> int:
    """A 63-bit seed from (seed, step, rank, stream name): independent streams that a resumed run can rebuild."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# ----------------------------------------------------------------------------------------------------
# Rows: left-padded prompt + right-padded response, the layout of data.tldr.collate_sft


def prompt_response_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict:
    """collate_sft's layout from tensors: prompts (n, P) left-padded, responses (n, R) right-padded.

    Columns that are padding in every row are dropped first (leading prompt columns, trailing response columns),
    so a micro-batch is only as wide as its own longest prompt and response. Position ids count real tokens
    from 0 (GPT-2's positions are absolute, so left padding must not shift them)."""
    first = int(prompt_mask.any(0).long().argmax())  # first column where some prompt has a real token
    width = int(response_mask.any(0).sum())  # right padding: columns with some real response token
    prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (n, P'+R')
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (n, P'+R')
    position_ids = (attention_mask.long().cumsum(dim=1) - 1) * attention_mask  # (n, P'+R')
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "prompt_len": prompt_ids.shape[1],
    }


def response_logits(model, batch: dict) -> torch.Tensor:
    """Logits (n, R, V) at the columns P-1 .. P+R-2 that predict the response tokens."""
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    return model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], logits_slice=slice(P - 1, P + R - 1))


# ----------------------------------------------------------------------------------------------------
# Stages


@torch.no_grad()
def rollout(policy, prompt_ids, prompt_mask, cfg: Config, num_samples: int, generator, greedy: bool = False) -> SampleOutput:
    """Generate num_samples responses per prompt in calls of cfg.gen_prompts prompts, parameters gathered once.
    Returns (B * num_samples, max_new_tokens) tensors grouped by prompt."""
    was_training = policy.training
    policy.eval()
    parts = []
    with gathered_params(policy):
        for s in range(0, prompt_ids.shape[0], cfg.gen_prompts):
            ids, mask = prompt_ids[s : s + cfg.gen_prompts], prompt_mask[s : s + cfg.gen_prompts]
            first = int(mask.any(0).long().argmax())  # this chunk's own left padding only
            parts.append(generate(
                policy, ids[:, first:], mask[:, first:], num_samples, cfg.max_new_tokens,
                temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, generator=generator,
            ))
    policy.train(was_training)
    fields = ("response_ids", "response_mask", "logprobs", "has_end")
    return SampleOutput(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))


@torch.no_grad()
def score(reward_model, prompt_ids, prompt_mask, samples: SampleOutput, group: int, micro: int) -> torch.Tensor:
    """Raw reward-model score (N,) of every prompt + response row, read at the row's last real token: the end token,
    or the last sampled token when the response ran out of tokens. Row n belongs to prompt n // group."""
    N = samples.response_ids.shape[0]
    scores = []
    with gathered_params(reward_model):
        for s in range(0, N, micro):
            rows = torch.arange(s, min(s + micro, N), device=prompt_ids.device)
            batch = prompt_response_rows(
                prompt_ids[rows // group], prompt_mask[rows // group], samples.response_ids[rows], samples.response_mask[rows]
            )
            scores.append(reward_model(batch["input_ids"], batch["position_ids"], batch["attention_mask"]))
    return torch.cat(scores).float()


def select(rewards_BG: torch.Tensor, cfg: Config, generator) -> tuple[torch.Tensor, dict]:
    """Indices (B, K) of the kept samples and per-prompt stats (visited candidates, rounds)."""
    if cfg.selection == "rso":
        return select_rso(rewards_BG, cfg.kept, cfg.beta_rs, generator)
    if cfg.selection == "top_bottom":
        return select_top_bottom(rewards_BG, cfg.kept)
    if cfg.selection == "uniform":
        return select_uniform(rewards_BG, cfg.kept, generator)
    return select_all(rewards_BG)


def build_training_batches(prompt_ids, prompt_mask, samples: SampleOutput, rows_N: torch.Tensor, advantages_N, group, micro):
    """Micro-batches of the selected rows: prompt + response layout, plus advantages and the sampler's log-probs."""
    batches = []
    for s in range(0, rows_N.shape[0], micro):
        rows = rows_N[s : s + micro]
        batch = prompt_response_rows(
            prompt_ids[rows // group], prompt_mask[rows // group], samples.response_ids[rows], samples.response_mask[rows]
        )
        batch["advantages"] = advantages_N[s : s + micro]
        batch["sampler_logprobs"] = samples.logprobs[rows][:, : batch["response_ids"].shape[1]]
        batches.append(batch)
    return batches


@torch.no_grad()
def add_logprobs(model, batches: list[dict], key: str, cfg: Config, gather: bool) -> None:
    """batch[key] = processed log-probs (n, R) of the responses under `model` (no gradient). `gather`: keep the
    parameters gathered over all micro-batches (a frozen model); otherwise FSDP's per-block gathers (the policy,
    whose training forward this must match)."""
    with gathered_params(model) if gather else nullcontext():
        for batch in batches:
            logits = response_logits(model, batch)
            batch[key] = processed_logprobs(logits, batch["response_ids"], cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)


def policy_update(
    policy, optimizer, scheduler, batches: list[dict], cfg: Config, world: int, device,
    guard: NonFiniteGuard | None = None, step: int = 0,
) -> dict:
    """cfg.policy_epochs optimizer steps over this rank's micro-batches; returns global metrics. `guard` checks each
    epoch's loss and gradient norm before its optimizer step (stop, or skip that optimizer and scheduler step).

    Every aggregation is sum(w * loss) / Z with token weights w from the mask and a normaliser Z summed over
    micro-batches and ranks before any backward (rlhf/grpo.py). FSDP averages gradients over ranks, so each
    rank's loss is multiplied by the world size: the reduced gradient is that of the global loss, for any world
    size and micro-batch size."""
    weigh = AGGREGATIONS[cfg.loss_type]
    weights = [weigh(b["response_mask"], cfg.max_new_tokens) for b in batches]
    normaliser = all_reduce_sum(sum(z for _, z in weights).to(device).double()).float()
    # sums per epoch: loss, kl, clipped tokens, entropy, |logp - sampler logp|, tokens outside the top-k/top-p
    # set of the training forward, response tokens, |ratio - 1|
    sums = torch.zeros(cfg.policy_epochs, 8, dtype=torch.float64, device=device)
    grad_norm, skipped = 0.0, 0
    for epoch in range(cfg.policy_epochs):
        epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
        for i, (batch, (w, _)) in enumerate(zip(batches, weights)):
            set_gradient_sync(policy, i == len(batches) - 1)
            mask = batch["response_mask"]
            logits = response_logits(policy, batch)  # (n, R, V)
            logp = processed_logprobs(logits, batch["response_ids"], cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
            # mu = 1: old = current, detached, so the ratio is 1 in value and d ratio = d logp (trl PR #2565);
            # mu > 1: the sampling policy's log-probs, so the ratio moves away from 1 after the first step
            old = logp.detach() if cfg.policy_epochs == 1 else batch["old_logprobs"]
            loss_NT, stats = grpo_token_loss(
                logp, old, batch["ref_logprobs"], batch["advantages"], mask, cfg.eps_low, cfg.eps_high, cfg.beta
            )
            # the entropy of what is sampled: temperature, top-k and top-p applied (differentiable when it is a bonus)
            with nullcontext() if cfg.entropy_coef > 0 else torch.no_grad():
                entropy = token_entropy(process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p))  # (n, R)
            if cfg.entropy_coef > 0:
                loss_NT = entropy_bonus(loss_NT, entropy, mask, cfg.entropy_coef)
            loss = (w * loss_NT).sum()
            (loss * world / normaliser).backward()
            epoch_loss += loss.detach().double()
            with torch.no_grad():
                in_support = mask & torch.isfinite(logp)
                gap = torch.where(in_support, (logp.detach() - batch["sampler_logprobs"]).abs(), 0.0)
                sums[epoch] += torch.stack([
                    loss.detach().double(), stats["kl"].sum().double(), stats["clipped"].sum().double(),
                    (entropy.detach() * mask).sum().double(), gap.sum().double(), (mask & ~in_support).sum().double(),
                    mask.sum().double(), stats["ratio_deviation"].sum().double(),
                ])
        epoch_grad_norm = clip_grad_norm(policy, cfg.grad_clip)
        grad_norm += epoch_grad_norm
        if guard is None or guard.ok(step, {"train/loss": float(epoch_loss), "train/grad_norm": epoch_grad_norm}):
            optimizer.step()
            scheduler.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    per_epoch = all_reduce_sum(sums)  # (mu, 8)
    loss, kl, clipped, entropy, gap, outside, tokens, ratio_dev = per_epoch.sum(0).tolist()
    mu = cfg.policy_epochs
    metrics = {
        "train/loss": loss / float(normaliser) / mu,
        "train/kl": kl / tokens,
        "train/clip_fraction": clipped / tokens,
        "train/ratio_deviation": ratio_dev / tokens,
        "train/entropy": entropy / tokens,
        "train/logprob_gap_to_sampler": gap / tokens,
        "train/outside_top_k_p_fraction": outside / tokens,
        "train/grad_norm": grad_norm / mu,
        "train/lr": scheduler.get_last_lr()[0],
        "train/skipped": skipped / mu,
    }
    if mu > 1:  # how far each update moved from the sampling policy: epoch 1 is exactly 0
        for epoch, e in enumerate(per_epoch.tolist(), start=1):
            metrics[f"train/epoch_{epoch}/clip_fraction"] = e[2] / e[6]
            metrics[f"train/epoch_{epoch}/ratio_deviation"] = e[7] / e[6]
            metrics[f"train/epoch_{epoch}/kl"] = e[1] / e[6]
    return metrics


def global_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of x over all ranks."""
    x = x.double().flatten()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    n, s, sq = all_reduce_sum(torch.stack([count, x.sum(), (x * x).sum()])).tolist()
    mean = s / n
    return mean, max(sq / n - mean * mean, 0.0) ** 0.5


def all_reduce_max(x: float, device) -> float:
    t = torch.tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@dataclass
class PromptSet:
    """Prompts of this rank with what the reward sources need: token ids (B, P) left-padded, texts, dataset rows
    (for error messages) and which sources apply to each prompt (B, S)."""

    ids: torch.Tensor
    mask: torch.Tensor
    texts: list[str]
    rows: list[int]
    applies: torch.Tensor


def source_applies(cfg: Config, data: str, split: str, n_rows: int, sources: list[RewardSource]) -> torch.Tensor:
    """(n_rows, S) bool: the sources each row of `data` names in its --reward_column; every source without one."""
    column = load_optional_column(data, split, cfg.reward_column) if cfg.reward_column else None
    if column is None:
        return torch.ones(n_rows, len(sources), dtype=torch.bool)
    if len(column) != n_rows:
        raise DataError(f"{data}[{split}]: {len(column)} values in column {cfg.reward_column!r} for {n_rows} rows")
    return row_sources(column, sources, f"{data}[{split}] column {cfg.reward_column!r}")


@torch.no_grad()
def score_sources(
    sources: list[RewardSource], reward_model, prompts: PromptSet, samples: SampleOutput, group: int, cfg: Config, tok,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(values (N, S) fp64, raw reward-model scores (N,) or None, applies (N, S)) of N = B * group samples, row n
    belonging to prompt n // group. Function columns hold the functions' values on the samples they apply to (0
    elsewhere); the reward-model column is left 0 for the caller, which adds the penalty and gain/bias to `raw`.
    The reward model scores every sample (a column of 0s where it does not apply)."""
    device = prompts.ids.device
    N = samples.response_ids.shape[0]
    applies = prompts.applies.repeat_interleave(group, 0)  # (N, S)
    values = torch.zeros(applies.shape, dtype=torch.float64)
    if any(s.fn is not None for s in sources):
        of = [n // group for n in range(N)]
        values = score_functions(
            sources, applies, [prompts.texts[b] for b in of], decode_responses(tok, samples), [prompts.rows[b] for b in of],
            where,
        )
    raw = None
    if reward_model is not None:
        raw = score(reward_model, prompts.ids, prompts.mask, samples, group, cfg.score_micro_batch_size)  # (N,)
    return values.to(device), raw, applies.to(device)


def reward_model_column(sources: list[RewardSource]) -> int | None:
    return next((i for i, s in enumerate(sources) if s.name == REWARD_MODEL), None)


@torch.no_grad()
def evaluate_summaries(
    policy, reward_model, sources: list[RewardSource], val: PromptSet, cfg: Config, step: int, rank: int, device, tok,
) -> dict:
    """One greedy (or sampled) summary per validation prompt, scored by every source, over all ranks.

    eval/reward: the weighted sum of the sources' values before any batch whitening (reward model: gain/bias
    normalized, no penalty; functions: raw); eval/reward_penalized: the reward model's with the missing-end penalty;
    eval/reward_<name>: each function's mean over the prompts it applies to."""
    generator = torch.Generator(device=device).manual_seed(stream_seed(cfg.seed, step, rank, "eval"))
    samples = rollout(policy, val.ids, val.mask, cfg, 1, generator, greedy=cfg.eval_greedy)
    values, raw, applies = score_sources(sources, reward_model, val, samples, 1, cfg, tok, f"{cfg.val_data}[{cfg.val_split}]")
    penalized = torch.zeros(values.shape[0], device=device)
    rm = reward_model_column(sources)
    if rm is not None:
        values[:, rm] = reward_model.normalize(raw).double()
        penalized = reward_model.normalize(penalize_missing_end(raw, samples.has_end, cfg.missing_end_penalty))
    weights = torch.tensor([s.weight for s in sources], dtype=torch.float64)
    total = combine_sources(torch.where(applies, values, 0.0), weights)  # (n,)
    count_S, mean_S, _ = source_stats(values, applies, all_reduce_sum)
    count = torch.tensor(float(values.shape[0]), device=device, dtype=torch.float64)
    n, r, rp, end, length = all_reduce_sum(torch.stack([
        count, total.sum(), penalized.double().sum(), samples.has_end.double().sum(), samples.response_mask.double().sum(),
    ])).tolist()
    out = {"eval/reward": r / n, "eval/end_fraction": end / n, "eval/response_length": length / n}
    if rm is not None:
        out["eval/reward_penalized"] = rp / n
    for i, source in enumerate(sources):
        if source.fn is not None and count_S[i] > 0:
            out[f"eval/reward_{source.name}"] = float(mean_S[i])
    return out


@torch.no_grad()
def refresh_reference(policy, reference) -> None:
    """The reference becomes the current policy. With LoRA (the reference is the policy with adapters off) the
    adapters are merged into the base weights and B is zeroed; otherwise every parameter shard of the policy is
    copied into the reference's, which FSDP sharded alike (same model, same ranks). Outside forward only."""
    if isinstance(reference, AdaptersOff):
        merge_adapters_(policy)
        return
    for (name, p), (ref_name, q) in zip(policy.named_parameters(), reference.named_parameters(), strict=True):
        if name != ref_name:
            raise RuntimeError(f"reference parameter {ref_name} does not match the policy's {name}")
        local = p.to_local() if hasattr(p, "to_local") else p
        (q.to_local() if hasattr(q, "to_local") else q).copy_(local)


class StageTimer:
    """Wall-clock seconds per named stage; synchronises the GPU so a stage is charged for its own kernels."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] += time.perf_counter() - t0


def sample_table(tok, prompts, samples: SampleOutput, rows_BK, values, applies, rewards, advantages, cfg: Config) -> list[list]:
    """Rows of the sample table: the first cfg.table_prompts prompts of this rank with their selected samples: the
    prompt, the response, each source's value (None where it does not apply), the reward, the advantage, has_end."""
    table = []
    for b in range(min(cfg.table_prompts, rows_BK.shape[0])):
        for j, n in enumerate(rows_BK[b].tolist()):
            ids = samples.response_ids[n][samples.response_mask[n]].tolist()
            table.append([
                tok.decode(prompts[b]), tok.decode(ids),
                *(float(v) if a else None for v, a in zip(values[n].tolist(), applies[n].tolist())),
                float(rewards[n]), float(advantages[b * rows_BK.shape[1] + j]), bool(samples.has_end[n]),
            ])
    return table


def decode_responses(tok, samples: SampleOutput) -> list[str]:
    """Response texts as generated: up to and including the first end token; a stop at EOS reads as "\n"."""
    texts = []
    for ids, mask, ended in zip(samples.response_ids.tolist(), samples.response_mask.tolist(), samples.has_end.tolist()):
        ids = [t for t, m in zip(ids, mask) if m]
        if ended and ids[-1] != END_ID:
            ids = ids[:-1] + [END_ID]
        texts.append(tok.decode(ids))
    return texts


def freeze(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def main(cfg: Config) -> dict:
    # set-up: distributed, and every check that needs no data and no weights: sizes, the models' configs and context
    # lengths, the run directory and the checkpoint to resume from (all before any model is built or put on a GPU)
    dist_info = setup_distributed(cfg.device)
    rank, world, device = dist_info.rank, dist_info.world_size, dist_info.device
    prompts_per_rank, n_micro = per_rank_sizes(cfg, world)
    G, K = cfg.num_samples, cfg.kept
    gold_reward = load_function(cfg.gold_reward_fn, "--gold_reward_fn") if cfg.gold_reward_fn else None
    sources = parse_rewards(cfg.rewards, cfg.reward_length_target, TASK_REWARDS)  # the reward model and/or functions
    rm_column = reward_model_column(sources)
    model_cfg = model_config(cfg.policy, cfg.policy_random_init)
    check_context(model_cfg, cfg.max_prompt_len, cfg.max_new_tokens, "policy")
    if cfg.pref_data and cfg.eval_every >= 0:
        check_context(model_cfg, cfg.max_prompt_len, cfg.pref_max_response_len, "policy")
    if rm_column is not None:
        rm_cfg = model_config(cfg.reward_model, cfg.reward_random_init)
        check_context(rm_cfg, cfg.max_prompt_len, cfg.max_new_tokens, "reward model")
    meta = {"stage": "grpo", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()}
    run_dir = Path(cfg.out_dir)
    ckpt = find_checkpoint(run_dir, cfg.resume, cfg.resume_from, meta)
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)

    # set-up: data; training prompts sharded per rank, with the reward sources that apply to each row; validation
    # prompts and preference pairs split over ranks
    tok = get_tokenizer()
    train_rows = load_rows(cfg.train_data, cfg.train_split, PROMPT_COLUMNS)
    train_name = f"{cfg.train_data}[{cfg.train_split}]"
    train = PromptDataset(train_rows, tok, cfg.max_prompt_len, name=train_name)
    train_applies = source_applies(cfg, cfg.train_data, cfg.train_split, len(train), sources)  # (rows, S)
    loader = ShardedLoader(len(train), prompts_per_rank, rank, world, cfg.seed, collate=lambda idx: idx)
    total_steps = cfg.steps or loader.batches_per_epoch
    val_prompts = pref_set = None
    if cfg.val_data and cfg.eval_every >= 0 and cfg.eval_prompts > 0:
        val_rows = load_rows(cfg.val_data, cfg.val_split, PROMPT_COLUMNS)
        val_applies = source_applies(cfg, cfg.val_data, cfg.val_split, len(val_rows), sources)[: cfg.eval_prompts]
        val_rows = val_rows[: cfg.eval_prompts]
        per_rank = len(val_rows) // world  # the same number on every rank: the evaluation ends in collectives
        if per_rank == 0:
            raise DataError(f"{cfg.val_data}[{cfg.val_split}]: {len(val_rows)} validation prompts cannot be split over "
                            f"{world} ranks; use more rows, or --eval_prompts 0 to skip the summary evaluation")
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        val = PromptDataset([val_rows[i] for i in mine], tok, cfg.max_prompt_len, name=f"{cfg.val_data}[{cfg.val_split}]")
        val_ids, val_mask = (t.to(device) for t in pad_prompts(val.prompts))
        val_prompts = PromptSet(val_ids, val_mask, val.texts, list(mine), val_applies[rank * per_rank : (rank + 1) * per_rank])
    if cfg.pref_data and cfg.eval_every >= 0:
        pref_rows = load_rows(cfg.pref_data, cfg.pref_split, PREF_COLUMNS)
        pref_rows = pref_rows[: cfg.pref_pairs] if cfg.pref_pairs else pref_rows
        pref_set = build_eval_set(
            pref_rows, tok, cfg.max_prompt_len, cfg.pref_max_response_len, cfg.micro_batch_size, rank, world,
            name=f"{cfg.pref_data}[{cfg.pref_split}]",
        )

    # set-up: models, all FSDP-sharded: the policy (trained; with LoRA frozen plus trainable adapters), the reference
    # (a frozen copy of the starting weights, random init included; with LoRA the policy with adapters off, no
    # copy), the frozen reward model (only when --rewards uses it)
    policy = build_policy(cfg.policy, cfg.policy_random_init)
    reference = None if cfg.lora_enabled else freeze(copy.deepcopy(policy))
    if cfg.lora_enabled:
        apply_lora(policy, cfg)
    reward_model = freeze(build_reward_model(cfg.reward_model, cfg.reward_random_init)) if rm_column is not None else None
    if rank == 0:
        print(f"grpo: {trainable_summary(policy)}; rewards: " + " + ".join(f"{s.weight:g}*{s.name}" for s in sources))
    shard_model(policy, dtype, activation_checkpointing=cfg.activation_checkpointing)
    policy.to(device)
    for frozen in (reference, reward_model):
        if frozen is None:
            continue
        shard_model(frozen, dtype, cpu_offload=cfg.cpu_offload)
        if not cfg.cpu_offload:
            frozen.to(device)
    if reference is None:
        reference = AdaptersOff(policy)
    save_reference = cfg.ref_refresh_every > 0 and not has_lora(policy)  # with LoRA the model state holds it
    optimizer = build_optimizer(policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, total_steps * cfg.policy_epochs, cfg.min_lr_ratio)

    # set-up: resume: weights, optimizer, schedule, every rank's RNG, data position, best evaluation so far (sampling
    # and selection streams are rebuilt from (seed, step, rank))
    step, best = 0, None
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy, optimizer, scheduler, meta, rank)
        step, best = state["step"], state["extra"].get("best")
        restore_loader(loader, ckpt, state["extra"])
        if save_reference and "reference" in state["extra"]:  # a refreshed reference (full fine-tuning)
            set_full_model_state(reference, state["extra"]["reference"])
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}")

    logger = Logger(run_dir, config_to_dict(cfg), cfg.wandb_project, cfg.run_name, cfg.wandb_mode, rank == 0, resume_step=step)
    if rank == 0:
        print(
            f"grpo: {len(train)} prompts, world {world}, {prompts_per_rank} prompts x {G} samples -> {K} kept per rank, "
            f"{n_micro} micro-batches, {total_steps} steps"
        )
    ref_pref_logps = policy_logps(reference, pref_set, device) if pref_set is not None else None

    def evaluate_now(step: int) -> dict:
        out = {}
        if val_prompts is not None:
            out.update(evaluate_summaries(policy, reward_model, sources, val_prompts, cfg, step, rank, device, tok))
        if pref_set is not None:
            pref = evaluate_policy(policy, ref_pref_logps, pref_set, cfg.beta, device)
            out.update({f"eval/pref_{k}": v for k, v in pref.items()})
        return out

    weights_S = torch.tensor([s.weight for s in sources], dtype=torch.float64)
    normalize_S = torch.tensor([s.fn is not None and cfg.normalize_reward_fns for s in sources])
    per_row_sources = not bool(train_applies.all())  # a reward column: log the share of samples each source scores
    best_metric = cfg.best_metric
    if best_metric == "eval/reward" and val_prompts is None:  # the default, without the summary evaluation
        best_metric = "eval/pref_accuracy" if pref_set is not None else ""
    if step == 0 and cfg.eval_every > 0:
        logger.log(evaluate_now(0), 0)
    batches_iter = iter(loader)
    bar = progress(total_steps, step, rank == 0, "grpo")
    policy.train()
    metrics: dict = {}
    guard = NonFiniteGuard("grpo", cfg.on_nonfinite, device)
    stopping = False
    with StopSignal() as stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            timer = StageTimer(device)
            t_step = time.perf_counter()
            generator = torch.Generator(device=device).manual_seed(stream_seed(cfg.seed, step, rank, "rollout"))

            # 0. iterative GRPO: every ref_refresh_every steps the current policy becomes the reference
            if cfg.ref_refresh_every > 0 and step > 0 and step % cfg.ref_refresh_every == 0:
                refresh_reference(policy, reference)
                if pref_set is not None:  # the implicit reward beta * log(pi / pi_ref) is relative to the new reference
                    ref_pref_logps = policy_logps(reference, pref_set, device)

            # 1. sample prompts (this rank's slice of the global batch)
            with timer("sample"):
                prompt_index = next(batches_iter)
                prompts = [train.prompts[i] for i in prompt_index]
                prompt_ids, prompt_mask = (t.to(device) for t in pad_prompts(prompts))  # (B, P) left-padded
                batch_prompts = PromptSet(
                    prompt_ids, prompt_mask, [train.texts[i] for i in prompt_index], list(prompt_index),
                    train_applies[prompt_index],
                )

            # 2. generate G responses per prompt; rows b*G .. b*G+G-1 belong to prompt b
            with timer("generate"):
                samples = rollout(policy, prompt_ids, prompt_mask, cfg, G, generator)  # (N, max_new_tokens), N = B*G

            # 3. score every source on the samples it applies to. Reward model: raw score -> minus the penalty (raw
            #    units) without an end token -> RM gain/bias; a reward model returning NaN, or one score for every
            #    sample of every rank, stops the run here. Functions: their values, whitened over the global batch; a
            #    function that raises or returns a non-number stops the run naming itself and the row. The reward is
            #    the weighted sum (rlhf/rewards.py)
            with timer("score"):
                values, raw, applies = score_sources(sources, reward_model, batch_prompts, samples, G, cfg, tok, train_name)
                if raw is not None:
                    check_rewards(raw, "grpo", step + 1, device)
                    penalized = penalize_missing_end(raw, samples.has_end, cfg.missing_end_penalty)
                    values[:, rm_column] = reward_model.normalize(penalized).double()
                x = normalize_sources(values, applies, normalize_S, all_reduce_sum)  # (N, S)
                rewards = combine_sources(x, weights_S).float()  # (N,)

            # 4. select K of G per prompt, from the combined rewards
            with timer("select"):
                idx_BK, rs = select(rewards.view(-1, G), cfg, generator)  # (B, K) columns of each group
                rows_BK = idx_BK + G * torch.arange(idx_BK.shape[0], device=device)[:, None]  # (B, K) rows of N
                rows_N = rows_BK.flatten()  # (B*K,)

            # 5. advantages: group normalization over the *selected* samples, then over the global batch (all ranks)
            with timer("advantages"):
                rewards_BK = rewards[rows_BK]  # (B, K)
                advantages = (group_normalize(rewards_BK) if cfg.scale_by_std else group_center(rewards_BK)).flatten()  # (B*K,)
                if cfg.global_norm:
                    advantages = global_normalize(advantages, all_reduce_sum)
                batches = build_training_batches(prompt_ids, prompt_mask, samples, rows_N, advantages, G, cfg.micro_batch_size)

            # 6. reference log-probs (frozen, parameters gathered once; with LoRA the policy with adapters off); with
            #    mu > 1 also the sampling policy's (the weights that generated), from the training forward so the
            #    ratio of the first update is exactly 1
            with timer("reference"):
                add_logprobs(reference, batches, "ref_logprobs", cfg, gather=True)
                if cfg.policy_epochs > 1:
                    add_logprobs(policy, batches, "old_logprobs", cfg, gather=False)

            # 7. update the policy; a non-finite loss or gradient norm stops the run, or skips the optimizer step
            with timer("update"):
                metrics = policy_update(policy, optimizer, scheduler, batches, cfg, world, device, guard, step + 1)
            step += 1

            # 8. log
            step_seconds = time.perf_counter() - t_step
            reward_mean, reward_std = global_mean_std(rewards)
            kept_mean, kept_std = global_mean_std(rewards_BK)
            n_prompts, visited, rounds, ended, generated, kept_len, train_tokens = all_reduce_sum(torch.stack([
                torch.tensor(float(idx_BK.shape[0]), dtype=torch.float64, device=device), rs["visited"].double().sum(),
                rs["rounds"].double().sum(), samples.has_end.double().sum(), samples.response_mask.double().sum(),
                samples.response_mask[rows_N].double().sum(), sum(b["attention_mask"].sum() for b in batches).double(),
            ])).tolist()
            n_samples = n_prompts * G
            metrics.update({
                "reward/mean": reward_mean, "reward/std": reward_std,
                "reward/selected_mean": kept_mean, "reward/selected_std": kept_std,
                "rs/acceptance_rate": n_prompts * K / visited,
                "rs/rounds_mean": rounds / n_prompts,
                "rs/rounds_max": all_reduce_max(float(rs["rounds"].max()), device),
                "rs/pool_reward_mean": reward_mean, "rs/pool_reward_std": reward_std,
                "rs/selected_reward_mean": kept_mean, "rs/selected_reward_std": kept_std,
                "sample/end_fraction": ended / n_samples,
                "sample/response_length": generated / n_samples,
                "sample/selected_response_length": kept_len / (n_prompts * K),
                "perf/step_seconds": step_seconds,
                "perf/generate_tokens_per_second": generated / timer.seconds["generate"],
                "perf/tokens_per_second": generated / step_seconds,
                "perf/tokens_per_second_per_device": generated / step_seconds / world,
                "perf/update_tokens_per_second": train_tokens * cfg.policy_epochs / timer.seconds["update"],
            })
            if raw is not None:
                metrics["reward/raw_mean"], metrics["reward/raw_std"] = global_mean_std(raw)
            # every source on the samples it applies to, before whitening (the reward model's: penalty, gain/bias)
            count_S, mean_S, std_S = source_stats(values, applies, all_reduce_sum)
            for i, source in enumerate(sources):
                metrics[f"reward/{source.name}_mean"], metrics[f"reward/{source.name}_std"] = float(mean_S[i]), float(std_S[i])
                if per_row_sources:
                    metrics[f"reward/{source.name}_fraction"] = float(count_S[i]) / n_samples
            if gold_reward is not None:  # a monitored reward, e.g. the synthetic task's gold reward
                texts = decode_responses(tok, samples)
                gold = torch.tensor(
                    [float(gold_reward(train.texts[prompt_index[n // G]], t)) for n, t in enumerate(texts)], device=device
                )  # (N,)
                metrics["reward/gold_mean"], metrics["reward/gold_std"] = global_mean_std(gold)
            for name, seconds in timer.seconds.items():
                metrics[f"perf/{name}_seconds"] = seconds
                metrics[f"perf/{name}_share"] = seconds / step_seconds
            if cfg.eval_every >= 0 and (step == total_steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)):
                metrics.update(evaluate_now(step))
            logger.log(metrics, step)
            if cfg.table_every > 0 and step % cfg.table_every == 0:
                table = sample_table(tok, prompts, samples, rows_BK, values, applies, rewards, advantages, cfg)
                columns = ["prompt", "response", *(s.name for s in sources), "reward", "advantage", "has_end"]
                logger.table("samples", columns, table, step)
            bar.update(1)
            bar.set_postfix(reward=f"{reward_mean:.3f}", kl=f"{metrics['train/kl']:.4f}")

            # 9. checkpoint: on schedule, at the end, at a new best evaluation metric, or when a signal came
            best, improved = update_best(best, metrics, best_metric, cfg.best_mode, step)
            stopping = stop.requested(device)
            if stopping or improved or step == total_steps or (cfg.save_every > 0 and step % cfg.save_every == 0):
                extra = {"loader": loader.state_dict(), "best": best}
                if save_reference:  # a refreshed reference is no longer the starting policy (a collective)
                    extra["reference"] = full_model_state(reference)
                save_checkpoint(
                    run_dir, step, policy, optimizer, scheduler, meta, extra=extra,
                    keep_last=cfg.keep_last, rank=rank, best=best if improved else None,
                )
            if stopping:
                break
    bar.close()

    # 10. export a Hugging Face-format folder (not after a signal: the run is not finished)
    if stopping:
        stop.report(step, run_dir / "checkpoints", rank)
    else:
        export_model(policy, lambda sd: save_export(policy, sd, model_cfg, run_dir / "hf"), rank)
        if rank == 0:
            print(f"exported {run_dir / 'hf'}; final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    logger.finish()
    cleanup_distributed()
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

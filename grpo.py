"""GRPO: Group Relative Policy Optimization of a GPT-2 policy on Reddit TL;DR prompts, against a reward model, reward
functions of the text, or a weighted sum of both.

    torchrun --nproc_per_node=2 grpo.py                              # policy runs/sft/hf, reward model runs/rm/hf
    python grpo.py --model runs/sft/hf --reward_model runs/rm/hf     # one device
    python grpo.py --rewards "gold_reward + 0.5*format" --lora_rank 8 --policy_epochs 2   # no reward model at all
    python grpo.py --help                                            # every option (docs/grpo.md, docs/lora_rewards.md)

One step (DeepSeekMath, arXiv 2402.03300, section 4); main() runs 0, 1, 8 and 9, train_step() runs 2-7:

    0. refresh reference  every --ref_refresh_every steps the current policy becomes the reference
    1. sample prompts     prompts_per_step prompts, split over ranks
    2. generate           G = num_samples responses per prompt; the prompt's KV cache is shared by its group
    3. score              every reward source (--rewards) on the samples it applies to: the reward model (penalty
                          for no end token in raw RM units, then gain/bias) and functions of the text (whitened
                          over the global batch); their weighted sum is the reward (rlhf/rewards.py)
    4. select             K = num_kept of G per prompt (RSO rejection sampling at temperature beta_rs, ...); with
                          --min_group_std the groups whose kept rewards tie are dropped (DAPO's dynamic sampling)
    5. advantages         group normalization over the K selected (float64 statistics), then over the whole batch
                          across ranks; with --kl_in reward after beta x the KL estimate leaves each reward
    6. reference          log-probs of the selected responses under the frozen reference policy (with LoRA: the
                          policy with its adapters off); with mu > 1 also the sampling policy's
    7. update             clipped ratio (per token, or per sequence: --importance_level) x the rollout correction
                          + beta * KL estimate (--kl_estimator) - entropy_coef * entropy, response tokens only, loss /
                          global normaliser; mu = --policy_epochs optimizer steps per batch of rollouts
    8. log, evaluate      one line of metrics per step; every --eval_every steps the evaluation
    9. checkpoint

The math (selection, advantages, loss, aggregation, reward sources) lives in rlhf/, one pure function per variant.
Sampling and selection draw from a torch.Generator seeded from (seed, step, rank), so a resumed run repeats the
same samples and losses bit for bit.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch

from data.synthetic import gold_reward as synthetic_gold_reward
from data.tldr import PROMPT_COLUMNS, PromptDataset, ShardedLoader, load_rows
from data.tokenizer import get_tokenizer
from evaluation.preference import evaluate_policy, policy_logps
from evaluation.summaries import evaluate_summaries, load_eval_sets, sample_table
from model.lora import LoRAConfig, trainable_summary
from model.sampler import SampleOutput
from model.weights import save_export
from rlhf.grpo import (
    AGGREGATIONS,
    Objective,
    informative_groups,
    mismatch_stats,
    penalize_missing_end,
    select,
    sequence_kl,
)
from rlhf.logprobs import linear_processed_logprobs
from rlhf.rewards import RewardSource, combine_sources, load_function, normalize_sources, parse_rewards
from rollouts.batches import (
    MicroBatch,
    build_training_batches,
    kept_advantages,
    pad_micro_batches,
    per_rank_sizes,
    with_advantages,
)
from rollouts.metrics import StepResult, gold_metrics, step_metrics, update_metrics
from rollouts.models import Models, build_models, check_models, check_step_fits, refresh_reference, sharded_module
from rollouts.prompts import PromptSet, prompt_set, source_applies
from rollouts.sampling import RewardSpec, Scores, rollout, source_values, warn_constant_sources
from utils.config import ConfigError, DataConfig, DecodeConfig, OptimConfig, RunConfig, parse_config, require_nonempty
from utils.dist import all_reduce_max, all_reduce_named, all_reduce_sum, rank_and_world, stream
from utils.fsdp import gathered_params
from utils.guard import NonFiniteGuard, check_rewards, exit_on_error
from utils.logging import StageTimer, perf_metrics
from utils.optim import accumulate_micro_batches, build_optimizer, build_scheduler, guarded_step
from utils.run import end_of_step, finish, resume, start_run

TASK_REWARDS = {"gold_reward": synthetic_gold_reward}  # --rewards gold_reward: the embedded task's gold reward


@dataclass
class Config(RunConfig, OptimConfig, DataConfig, LoRAConfig, DecodeConfig):  # the option groups of utils/config.py
    # --- models
    model: str = "runs/sft/hf"
    """Starting policy, also the frozen reference (with LoRA: the policy's own base weights, adapters off): a
    Hugging Face-format folder (sft.py's hf/), a hub name, or with --random_init a preset (tiny, small, ...)."""
    random_init: bool = False
    """Random GPT-2 initialisation of the preset named by --model (tests and smoke runs)."""
    reward_model: str = "runs/rm/hf"
    """Reward model: reward_model.py's hf/ folder (its gain/bias come from reward_normalization.json), or with
    --reward_random_init a preset. Loaded only when --rewards names reward_model."""
    reward_random_init: bool = False
    """Random reward model of the preset named by --reward_model, gain 1 and bias 0 (tests and smoke runs)."""
    frozen_cpu_offload: bool = False
    """Keep the frozen models' (reference, reward model) sharded parameters on the CPU between uses (needs a GPU).
    With LoRA the reference is the policy itself and is not offloaded."""
    # --- data
    val_rows: int = 256
    pref_data: str = "trl-lib/tldr-preference"
    """Preference pairs for the implicit-reward accuracy (evaluation/preference.py); empty string to skip."""
    pref_split: str = "validation"
    """Split of --pref_data."""
    pref_rows: int = 512
    """Preference pairs used (the first N); 0 for all."""
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
    """Prompts per generation call on each rank (x num_samples sequences in the KV cache). Checked against the
    device's free memory before the first step (rollouts/memory.py)."""
    prefix_sharing: bool = True
    """Compute and store each prompt once per group: one copy of its KV cache for its G samples while generating,
    and packed rows with the prompt once for its responses in the reward model, the reference and the update
    (same numbers up to float rounding); false gives every sample its own copy of the prompt."""
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
    min_group_std: float = 0.0
    """Dynamic sampling (DAPO, arXiv 2503.14476): drop the groups whose K kept rewards have a std (float64) below
    this, measured after selection; they would have advantage ~0 and only dilute the batch. The batch shrinks (the
    share dropped is logged as sample/dropped_group_fraction); no other prompts are drawn. 0 keeps every group."""
    # --- objective
    scale_by_std: bool = True
    """Divide by the group's std in group normalization; false gives Dr. GRPO's r - mean (arXiv 2503.20783)."""
    global_norm: bool = True
    """After group normalization, whiten the advantages over the whole batch across all ranks."""
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo"
    """Aggregation: grpo (per-sequence mean, then mean over sequences), bnpo/dapo (mean over all tokens),
    dr_grpo (sum / (sequences x max_new_tokens)); every normaliser is global over ranks and micro-batches."""
    eps_low: float = 0.2
    """Clip the ratio below at 1 - eps_low."""
    eps_high: float = 0.2
    """Clip the ratio above at 1 + eps_high (DAPO's clip-higher uses 0.28)."""
    importance_level: Literal["token", "sequence"] = "token"
    """token: one ratio pi/pi_old per token (GRPO); sequence: GSPO's (arXiv 2507.18071) one ratio per response,
    exp(mean over its tokens of the log-ratio), clipped per sequence, each sequence counting once whatever its
    length under every --loss_type. GSPO clips much tighter (eps_low 3e-4, eps_high 4e-4 in the paper)."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Correct the policy loss for the sampler / trainer mismatch, rho = exp(training-forward log-prob - sampler
    log-prob) at the sampling weights: tis multiplies it by min(rho, cap) (truncated importance sampling), mis by
    rho, or 0 beyond the cap (masked); per token, or per sequence with --importance_level sequence. The mismatch is
    logged whatever this is (train/mismatch/*)."""
    rollout_correction_cap: float = 3.0
    """The cap of --rollout_correction (> 0)."""
    beta: float = 0.04
    """Weight of the KL to the reference policy (also the beta of the implicit reward in evaluation)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(pi || pi_ref), log r = ref - logp: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r (DeepSeekMath's). As a loss term k2's gradient is unbiased, k3's is the forward KL's and k1's
    is 0 in expectation (arXiv 2512.21852; docs/grpo.md)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where beta x KL goes: loss (a per-token term of the loss) or reward (beta x the response's summed estimate,
    detached, subtracted from its reward before group normalization; with k1 the unbiased policy-gradient choice).
    Selection uses the reward without it."""
    kl_ratio: bool = False
    """Multiply the loss's KL estimate by the ratio pi/pi_old (pi_old detached, value 1 when on-policy): the
    gradient-corrected estimator, whose gradient is unbiased for k1 and k3 (--kl_in loss only)."""
    policy_epochs: int = 1
    """mu: optimizer steps over each batch of rollouts. The ratio's old log-probs are the sampling policy's,
    computed once before the first step (ratio exactly 1 there); 1: the detached current ones (ratio 1 in value)."""
    ref_refresh_every: int = 0
    """Make the current policy the new reference every N steps (with LoRA: merge the adapters into the base
    weights); the KL term is exactly 0 right after. 0 keeps the starting policy as reference."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef x the token entropy of the (temperature / top-k / top-p processed)
    policy from the loss, aggregated like the loss; 0 disables. Negative: an entropy penalty, which sharpens the
    policy towards its own most likely tokens (entropy minimisation)."""
    entropy_every: int = 1
    """Log train/entropy every N steps (1: every step; 0: never). It comes from the log-softmax the log-probs
    already compute, but still costs an exp and a multiply-sum over the vocabulary at every response token; a
    step that does not log it skips that. With --entropy_coef != 0 it is computed (and logged) every step."""
    # --- batch sizes and optimisation
    prompts_per_step: int = 256
    """Global prompts per step, over all ranks (x num_kept sequences in the update)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the policy and reference on each rank."""
    score_micro_batch_size: int = 128
    """Sequences per reward-model forward on each rank."""
    lr: float = 3e-6
    warmup_steps: int = 10
    # --- evaluation and logging
    eval_every: int = 50
    """Evaluate before the first step, every N steps and after the last; 0: only after the last; -1: never."""
    eval_greedy: bool = True
    """Greedy summaries in evaluation; false samples at --temperature / --top_p / --top_k."""
    pref_max_response_len: int = 64
    """Tokens kept of each preference response, the end token included."""
    gold_reward_fn: str = ""
    """Optional "module:function" of (prompt text, response text) -> float, logged (never trained on, unless it is
    also in --rewards) as reward/gold_mean over every step's samples, e.g. data.synthetic:gold_reward."""
    gold_parts_fn: str = ""
    """Optional "module:function" of (prompt text, response text) -> {name: number}, the parts of the gold reward,
    each logged as gold/<name> (its mean over every step's samples), e.g. data.synthetic:gold_parts."""
    table_every: int = 20
    """Log a table of sample responses every N steps; 0 disables."""
    table_prompts: int = 2
    """Prompts (with all their selected samples) in each table, from rank 0."""
    save_every: int = 50
    best_metric: str = "eval/reward"
    """Evaluation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables. The default needs the summary evaluation (--val_data);
    without it, eval/pref_accuracy (or nothing, without --pref_data either)."""
    best_mode: Literal["min", "max"] = "max"
    out_dir: str = "runs/grpo"
    run_name: str = "grpo"

    @property
    def kept(self) -> int:
        """K actually kept per prompt."""
        return self.num_samples if self.selection == "all" else self.num_kept

    def keep_best_by(self, summaries: bool, preferences: bool) -> str:
        """--best_metric; its default eval/reward needs the summary evaluation, else eval/pref_accuracy or none."""
        if self.best_metric != "eval/reward" or summaries:
            return self.best_metric
        return "eval/pref_accuracy" if preferences else ""

    def sources(self) -> list[RewardSource]:
        """The reward sources of --rewards (imports their functions: a typo fails here)."""
        return parse_rewards(self.rewards, self.reward_length_target, TASK_REWARDS)

    def objective(self) -> Objective:
        """The loss's options bound once (rlhf/grpo.py Objective): its terms then take tensors only."""
        return Objective(
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            importance_level=self.importance_level,
            rollout_correction=self.rollout_correction,
            rollout_correction_cap=self.rollout_correction_cap,
            beta=self.beta if self.kl_in == "loss" else 0.0,
            kl_estimator=self.kl_estimator,
            kl_ratio=self.kl_ratio,
            entropy_coef=self.entropy_coef,
        )

    def validate(self) -> None:
        require_nonempty(self, "rewards")
        if any(s.fn is None for s in self.sources()):
            require_nonempty(self, "reward_model")
        self.validate_shared()  # --model, data, run, optimisation and LoRA options
        for name in ("ref_refresh_every", "entropy_every", "eps_low", "eps_high", "beta", "pref_rows", "min_group_std"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "num_samples",
            "num_kept",
            "max_new_tokens",
            "gen_prompts",
            "prompts_per_step",
            "micro_batch_size",
            "score_micro_batch_size",
            "policy_epochs",
            "pref_max_response_len",
            "table_prompts",
            "reward_length_target",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.kept > self.num_samples:
            raise ConfigError(
                f"--num_kept {self.num_kept} exceeds --num_samples {self.num_samples}: the group of "
                f"samples per prompt must be at least as large as the number kept from it"
            )
        if self.selection == "top_bottom" and self.kept % 2:
            raise ConfigError(f"--selection top_bottom needs an even --num_kept, got {self.num_kept}")
        if self.selection == "rso" and not self.beta_rs > 0:
            raise ConfigError(f"--beta_rs must be > 0, got {self.beta_rs}")
        if self.kept < 2 and self.scale_by_std:
            raise ConfigError("group normalization with std scaling needs at least 2 kept samples per prompt")
        if not self.rollout_correction_cap > 0:
            raise ConfigError(f"--rollout_correction_cap must be > 0, got {self.rollout_correction_cap}")
        if self.min_group_std > 0 and self.kept < 2:
            raise ConfigError(
                f"--min_group_std measures the spread of each group's kept rewards: it needs at least 2 "
                f"kept samples per prompt, got {self.kept}"
            )
        if self.kl_ratio and self.kl_in != "loss":
            raise ConfigError("--kl_ratio weights the loss's KL term: it needs --kl_in loss, got --kl_in reward")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0 (greedy evaluation: --eval_greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"--top_p must be in (0, 1] and --top_k >= 0, got {self.top_p}, {self.top_k}")


# ----------------------------------------------------------------------------------------------------
# Stages 2-7


def score_rewards(
    spec: RewardSpec, reward_model, prompts: PromptSet, samples: SampleOutput, cfg: Config, step: int
) -> Scores:
    """Stage 3 of step `step` (1-based). Reward model: raw score -> minus the penalty (raw units) without an end
    token -> RM gain/bias; a reward model returning NaN, or one score for every sample of every rank, stops the run
    here. Functions: their
    values, whitened over the global batch; a function that raises or returns a non-number stops the run naming
    itself and the row. The reward is the weighted sum (rlhf/rewards.py)."""
    scores = source_values(spec, reward_model, prompts, samples, cfg.num_samples, cfg)
    if scores.raw is not None:
        check_rewards(scores.raw, "grpo", step, prompts.ids.device)
        penalized = penalize_missing_end(scores.raw, samples.has_end, cfg.missing_end_penalty)
        scores.values[:, spec.rm_column] = reward_model.normalize(penalized).double()
    warn_constant_sources(spec, scores.values, scores.applies, step)
    x = normalize_sources(scores.values, scores.applies, spec.normalize_S, all_reduce_sum)  # (N, S)
    scores.total = combine_sources(x, spec.weights_S).float()  # (N,)
    return scores


def response_logprobs(model, batch: MicroBatch, cfg: Config, with_entropy: bool = False):
    """(processed log-probs (n, R), entropy (n, R) or None) of the response tokens: temperature, top-k and top-p
    applied as the sampler drew them, in one chunked pass with the LM head inside it (rlhf/logprobs.py), so the
    (n, R, V) logits are never materialised. Predicted at columns P-1 .. P+R-2 of prompt + response rows, or at their
    places in packed rows (each prompt's last token, then the response's own columns); the head runs only at the
    micro-batch's response tokens (`head_positions`, found when it was built: no host read here), 0 log-prob and
    entropy at padding, which every loss and sum masks out."""
    n, R = batch.response_ids.shape
    targets = batch.response_ids
    if batch.layout is not None:  # one packed row: the head runs at its n*R predicting positions
        mask, where = batch.layout, batch.layout.logits_index().view(1, n * R)
        targets = targets.reshape(1, n * R)
    else:
        P = batch.prompt_len
        mask, where = batch.attention_mask, slice(P - 1, P + R - 1)
    head = partial(
        linear_processed_logprobs,
        targets_NR=targets,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        with_entropy=with_entropy,
        positions_K=batch.head_positions,
    )
    logp, entropy = model(batch.input_ids, batch.position_ids, mask, logits_slice=where, head=head)
    return logp.view(n, R), entropy.view(n, R) if entropy is not None else None


@torch.no_grad()
def batch_logprobs(model, batches: list[MicroBatch], cfg: Config, gather: bool) -> list[torch.Tensor]:
    """Processed log-probs (n, R) of each micro-batch's responses under `model` (no gradient). `gather`: keep the
    parameters gathered over all micro-batches (a frozen model, or with LoRA the policy seen with adapters off);
    otherwise FSDP's per-block gathers (the policy, whose training forward this must match)."""
    with gathered_params(sharded_module(model)) if gather else nullcontext():
        return [response_logprobs(model, batch, cfg)[0] for batch in batches]


def diagnostics(logp: torch.Tensor, old: torch.Tensor, batch: MicroBatch) -> tuple[dict, dict]:
    """What the loss does not use, of one micro-batch (no graph), as named fp64 sums and maxima over its response
    tokens: the sampler / trainer mismatch at the sampling weights (`old`: the training forward's log-probs there;
    rlhf/grpo.py mismatch_stats), and the tokens outside the training forward's top-k / top-p set with the |log-prob
    gap| to the sampler on the others."""
    mask = batch.response_mask
    with torch.no_grad():
        mismatch = mismatch_stats(old, batch.sampler_logprobs, mask)
        in_support = mask & torch.isfinite(logp)  # outside: a token the training forward's top-k/top-p set excludes
        gap = torch.where(in_support, (logp.detach() - batch.sampler_logprobs).abs(), 0.0)
        sums = {
            "sampler_gap": gap.sum().double(),
            "outside_support": (mask & ~in_support).sum().double(),
            "mismatch_tokens": mismatch["tokens"],
            "mismatch_outside": mismatch["outside_band"],
            "mismatch_gap": mismatch["abs_log_gap"],
        }
    return sums, {"mismatch_gap_max": mismatch["max_abs_log_gap"]}


def micro_batch_loss(
    policy, batch: MicroBatch, w: torch.Tensor, objective: Objective, cfg: Config, with_entropy: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """sum(w * per-token loss) of one micro-batch (with its graph), its named sums (fp64 scalars, no graph: the loss,
    the terms' statistics, `tokens`, and diagnostics()) and named maxima. The entropy is computed when the objective
    has an entropy term or `with_entropy` (to log it). No host read: it compiles as one graph
    (tests/test_grpo.py)."""
    mask = batch.response_mask
    # the processed log-probs and the entropy of what is sampled (temperature, top-k and top-p applied) in one
    # chunked pass over the vocabulary (rlhf/logprobs.py); the entropy is differentiable, used only as a bonus
    with_entropy = with_entropy or objective.needs_entropy
    logp, entropy = response_logprobs(policy, batch, cfg, with_entropy)  # (n, R) each
    # mu = 1: old = current, detached, so the ratio is 1 in value and d ratio = d logp (trl PR #2565);
    # mu > 1: the sampling policy's log-probs, so the ratio moves away from 1 after the first step
    old = logp.detach() if cfg.policy_epochs == 1 else batch.old_logprobs
    # --rollout_correction reweights the policy term by the training forward's / the sampler's probability ratio
    correction, corrected = objective.correction(old, batch.sampler_logprobs, mask)
    loss_NT, stats = objective.token_loss(
        logp, old, batch.ref_logprobs, batch.advantages, mask, weights_NT=w, correction=correction, entropy_NT=entropy
    )
    loss = (w * loss_NT).sum()
    sums, maxima = diagnostics(logp, old, batch)
    with torch.no_grad():
        sums |= {"loss": loss.detach().double(), "tokens": mask.sum().double(), "corrected": corrected.sum().double()}
        sums |= {name: t.sum().double() for name, t in stats.items()}  # kl, clipped, ratio_deviation
        if with_entropy:
            sums["entropy"] = (entropy.detach() * mask).sum().double()
    return loss, sums, maxima


def policy_update(
    policy,
    optimizer,
    scheduler,
    batches: list[MicroBatch],
    cfg: Config,
    world: int,
    device,
    *,
    guard: NonFiniteGuard | None = None,
    step: int = 1,
) -> dict:
    """cfg.policy_epochs optimizer steps over this rank's micro-batches (optimizer step `step`, 1-based, of the run);
    returns global metrics. `guard` checks each epoch's loss and gradient norm before its optimizer step (stop, or
    skip that optimizer and scheduler step).

    Every aggregation is sum(w * loss) / Z with token weights w from the mask and a normaliser Z summed over
    micro-batches and ranks before any backward (rlhf/grpo.py); utils/optim.py accumulate_micro_batches scales each
    rank's loss so the reduced gradient is that of the global loss, for any world size and micro-batch size."""
    objective = cfg.objective()
    weigh = AGGREGATIONS[cfg.loss_type]
    weights = [weigh(b.response_mask, cfg.max_new_tokens) for b in batches]  # (token weights (n, R), Z part)
    normaliser = all_reduce_sum(sum((z for _, z in weights), torch.zeros(())).to(device).double()).float()
    if float(normaliser) == 0:  # --min_group_std dropped every group of every rank: no step, on every rank alike
        return {"train/skipped": 1.0, "train/lr": scheduler.get_last_lr()[0]}
    log_entropy = cfg.entropy_coef != 0 or (cfg.entropy_every > 0 and step % cfg.entropy_every == 0)

    def loss_of(micro: tuple[MicroBatch, torch.Tensor]):
        batch, w = micro
        loss, sums, maxima = micro_batch_loss(policy, batch, w, objective, cfg, log_entropy)
        return loss, (sums, maxima)

    micro_batches = [(b, w) for b, (w, _) in zip(batches, weights)]
    epoch_sums, steps, gap_max = [], [], torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(cfg.policy_epochs):
        outputs = accumulate_micro_batches(policy, micro_batches, loss_of, world, normaliser)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = {k: sum((s[k] for s, _ in outputs), zero) for k in outputs[0][0]}  # this epoch's, over micro-batches
        for _, maxima in outputs:
            gap_max = torch.maximum(gap_max, maxima["mismatch_gap_max"])
        steps.append(
            guarded_step(policy, optimizer, scheduler, guard, step, {"train/loss": float(sums["loss"])}, cfg.grad_clip)
        )
        epoch_sums.append(sums)
    epochs = all_reduce_named(epoch_sums)  # mu x {name: global sum}: one collective
    return update_metrics(epochs, all_reduce_max(float(gap_max), device), float(normaliser), steps, cfg, log_entropy)


def kl_in_reward(batches: list[MicroBatch], rewards_BK: torch.Tensor, keep_B: torch.Tensor, cfg: Config):
    """--kl_in reward: beta x each kept response's KL estimate (--kl_estimator, summed over its tokens, from the
    micro-batches' sampling-policy and reference log-probs) leaves its reward, and the advantages are recomputed.
    Returns the new advantages (B*K,) and the penalty (B, K) (0 for dropped groups)."""
    real = [b for b in batches if not b.filler]
    kl_N = (
        torch.cat([sequence_kl(b.old_logprobs, b.ref_logprobs, b.response_mask, cfg.kl_estimator) for b in real])
        if real
        else rewards_BK.new_zeros(0)
    )  # (kept rows,)
    kl_penalty_BK = torch.zeros_like(rewards_BK)
    kl_penalty_BK[keep_B] = cfg.beta * kl_N.float().view(-1, cfg.kept)
    return kept_advantages(rewards_BK - kl_penalty_BK, keep_B, cfg), kl_penalty_BK


def train_step(
    models: Models,
    optimizer,
    scheduler,
    prompts: PromptSet,
    spec: RewardSpec,
    cfg: Config,
    step: int,
    guard: NonFiniteGuard | None = None,
) -> StepResult:
    """Stages 2-7 of GRPO step `step` (1-based) on this rank's prompts; collective over ranks."""
    rank, world = rank_and_world()
    device, G, timer = prompts.ids.device, cfg.num_samples, StageTimer(prompts.ids.device)
    generator = stream(cfg.seed, step - 1, rank, "rollout", device=device)  # keyed by the steps before this one
    # 2. generate G responses per prompt; rows b*G .. b*G+G-1 belong to prompt b
    with timer("generate"):
        samples = rollout(models.policy, prompts.ids, prompts.mask, cfg, G, generator)  # (B*G, max_new_tokens)
    # 3. score every source on the samples it applies to; the training reward is their weighted sum
    with timer("score"):
        scores = score_rewards(spec, models.reward_model, prompts, samples, cfg, step)
    # 4. select K of G per prompt, from the combined rewards
    with timer("select"):
        idx_BK, selection_stats = select(scores.total.view(-1, G), cfg.selection, cfg.kept, cfg.beta_rs, generator)
        rows_BK = idx_BK + G * torch.arange(idx_BK.shape[0], device=device)[:, None]  # (B, K) rows of B*G
        # dynamic sampling (--min_group_std): drop the groups whose kept rewards (nearly) tie
        keep_B = informative_groups(scores.total[rows_BK], cfg.min_group_std)  # (B,)
    # 5. advantages: group normalization over the *selected* samples, then over the global batch (all ranks)
    with timer("advantages"):
        rewards_BK = scores.total[rows_BK]  # (B, K)
        advantages = kept_advantages(rewards_BK, keep_B, cfg)  # (B*K,)
        kept_N = keep_B.repeat_interleave(cfg.kept)  # (B*K,)
        batches = build_training_batches(
            prompts.ids,
            prompts.mask,
            samples,
            rows_BK.flatten()[kept_N],
            advantages[kept_N],
            G,
            cfg.micro_batch_size,
            cfg.prefix_sharing,
        )
        if cfg.min_group_std > 0:  # as many micro-batches on every rank, whatever each kept
            filler = build_training_batches(
                prompts.ids, prompts.mask, samples, rows_BK.flatten()[:1], advantages[:1], G, 1, cfg.prefix_sharing
            )[0]
            batches = pad_micro_batches(batches, filler, device)
    # 6. reference log-probs (frozen, parameters gathered once; with LoRA the policy with adapters off); with mu > 1
    #    or the KL in the reward also the sampling policy's (the weights that generated), from the training forward so
    #    the first ratio is 1
    with timer("reference"):
        refs = batch_logprobs(models.reference, batches, cfg, gather=True)
        batches = [replace(b, ref_logprobs=r) for b, r in zip(batches, refs)]
        if cfg.policy_epochs > 1 or cfg.kl_in == "reward":
            olds = batch_logprobs(models.policy, batches, cfg, gather=False)
            batches = [replace(b, old_logprobs=o) for b, o in zip(batches, olds)]
    # 5'. --kl_in reward: beta x the response's KL estimate leaves its reward, and the advantages are recomputed
    kl_penalty_BK = torch.zeros_like(rewards_BK)
    if cfg.kl_in == "reward":
        with timer("advantages"):
            advantages, kl_penalty_BK = kl_in_reward(batches, rewards_BK, keep_B, cfg)
            batches = with_advantages(batches, advantages[kept_N])
    # 7. update the policy; a non-finite loss or gradient norm stops the run, or skips the optimizer step
    with timer("update"):
        update = policy_update(models.policy, optimizer, scheduler, batches, cfg, world, device, guard=guard, step=step)
    return StepResult(
        samples=samples,
        scores=scores,
        idx_BK=idx_BK,
        rows_BK=rows_BK,
        selection_stats=selection_stats,
        rewards_BK=rewards_BK,
        advantages=advantages,
        batches=batches,
        update=update,
        seconds=dict(timer.seconds),
        keep_B=keep_B,
        kl_penalty_BK=kl_penalty_BK,
    )


# ----------------------------------------------------------------------------------------------------
# Set-up and the loop (stage 8's metrics: rollouts/metrics.py)


def main(cfg: Config) -> dict:
    # set-up: every check that needs no data and no weights (sizes, the models' configs and context lengths), then
    # the process group, run directory and checkpoint to resume from, before any model is built or put on a GPU
    sources = cfg.sources()  # the reward model and/or functions
    gold_reward = load_function(cfg.gold_reward_fn, "--gold_reward_fn") if cfg.gold_reward_fn else None
    gold_parts = load_function(cfg.gold_parts_fn, "--gold_parts_fn") if cfg.gold_parts_fn else None
    model_cfg = check_models(cfg, sources)
    run = start_run(cfg, {"stage": "grpo", "model_config": model_cfg.to_dict(), "lora": cfg.lora_meta()})
    rank, world, device = run.rank, run.world, run.device
    prompts_per_rank, n_micro = per_rank_sizes(cfg, world)
    check_step_fits(cfg, sources, model_cfg, run.dtype, world, device)

    # set-up: data (training prompts sharded per rank, with the reward sources that apply to each row; evaluation
    # sets split over ranks), models, optimizer, resume
    tok = get_tokenizer()
    train_name = f"{cfg.train_data}[{cfg.train_split}]"
    train = PromptDataset(
        load_rows(cfg.train_data, cfg.train_split, PROMPT_COLUMNS), tok, cfg.max_prompt_len, name=train_name
    )
    train_applies = source_applies(cfg.reward_column, cfg.train_data, cfg.train_split, len(train), sources)  # (rows, S)
    loader = ShardedLoader(len(train), prompts_per_rank, rank, world, cfg.seed, collate=lambda idx: idx)
    total_steps = cfg.steps or loader.batches_per_epoch
    val, pref = load_eval_sets(cfg, tok, sources, rank, world, device)
    models = build_models(cfg, sources, run.dtype, device)
    run.say(
        f"grpo: {trainable_summary(models.policy)}; rewards: " + " + ".join(f"{s.weight:g}*{s.name}" for s in sources)
    )
    spec = RewardSpec(sources, cfg.normalize_reward_fns, tok)
    save_reference = cfg.ref_refresh_every > 0 and not cfg.lora_enabled  # with LoRA the model state holds it
    optimizer = build_optimizer(models.policy, cfg.lr, cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, total_steps * cfg.policy_epochs, cfg.min_lr_ratio)
    frozen = {"reference": models.reference} if save_reference else None  # a refreshed reference (full fine-tuning)
    step = resume(run, cfg, models.policy, optimizer, scheduler, loader, total_steps, frozen=frozen)
    run.say(
        f"grpo: {len(train)} prompts, world {world}, {prompts_per_rank} prompts x {cfg.num_samples} samples -> "
        f"{cfg.kept} kept per rank, {n_micro} micro-batches, {total_steps} steps"
    )
    ref_pref = policy_logps(models.reference, pref, device, cfg.prefix_sharing) if pref is not None else None

    def evaluate(step: int) -> dict:
        out = evaluate_summaries(models.policy, models.reward_model, spec, val, cfg, step) if val is not None else {}
        acc = (
            evaluate_policy(models.policy, ref_pref, pref, cfg.beta, device, prefix_sharing=cfg.prefix_sharing)
            if pref
            else {}
        )
        return out | {f"eval/pref_{k}": v for k, v in acc.items()}

    if step == 0 and cfg.eval_every > 0:
        run.logger.log(evaluate(0), 0)
    batches_iter, metrics, stopping = iter(loader), {}, False
    models.policy.train()
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps:
            t_step = time.perf_counter()
            # 0. iterative GRPO: every ref_refresh_every steps the current policy becomes the reference
            if cfg.ref_refresh_every > 0 and step > 0 and step % cfg.ref_refresh_every == 0:
                refresh_reference(models)
                if pref is not None:  # the implicit reward beta * log(pi / pi_ref) is relative to the new reference
                    ref_pref = policy_logps(models.reference, pref, device, cfg.prefix_sharing)
            # 1. sample prompts (this rank's slice of the global batch)
            t_sample = time.perf_counter()
            prompts = prompt_set(train, list(next(batches_iter)), train_applies, device, train_name)
            seconds = {"sample": time.perf_counter() - t_sample}
            # 2.-7. generate, score, select, advantages, reference, update
            result = train_step(models, optimizer, scheduler, prompts, spec, cfg, step + 1, run.guard)
            step += 1

            # 8. log and evaluate
            metrics = step_metrics(result, spec, cfg, per_row_sources=not bool(train_applies.all()))
            if gold_reward is not None or gold_parts is not None:  # a monitored reward, e.g. the synthetic task's
                metrics.update(gold_metrics(gold_reward, gold_parts, tok, prompts, result.samples, cfg.num_samples))
            generated, step_seconds = metrics.pop("perf/generated_tokens"), time.perf_counter() - t_step
            metrics.update(perf_metrics(seconds | result.seconds, step_seconds, generated, world))
            if cfg.eval_due(step, total_steps):
                metrics.update(evaluate(step))
            if cfg.table_every > 0 and step % cfg.table_every == 0:
                run.logger.table(
                    "samples",
                    *sample_table(
                        spec,
                        prompts,
                        result.samples,
                        result.scores,
                        result.rows_BK,
                        result.advantages,
                        cfg.table_prompts,
                    ),
                    step,
                )

            # 9. checkpoint: on schedule, at the end, at a new best evaluation metric, or when a signal came
            stopping = end_of_step(
                run,
                cfg,
                step,
                total_steps,
                metrics,
                models.policy,
                optimizer,
                scheduler,
                loader,
                best_metric=cfg.keep_best_by(val is not None, pref is not None),
                frozen=frozen,
            )
            if stopping:
                break

    # 10. export a Hugging Face-format folder (not after a signal: the run is not finished)
    finish(
        run,
        models.policy,
        step,
        metrics,
        stopping,
        lambda sd: save_export(models.policy, sd, model_cfg, run.dir / "hf"),
    )
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

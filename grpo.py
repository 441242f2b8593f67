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
    5. advantages         --advantage's estimator over the K selected (GRPO's group normalization by default,
                          float64 statistics), then whitened over the whole batch across ranks
    6. reference          log-probs of the selected responses under the frozen reference policy (with LoRA: the
                          policy with its adapters off); with mu > 1 also the sampling policy's; with --kl_in reward
                          beta x the KL estimate leaves each reward and the advantages are computed again
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
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch

from data.synthetic import gold_reward as synthetic_gold_reward
from data.tldr import ShardedLoader
from data.tokenizer import get_tokenizer
from evaluation.frontier import Frontier, FrontierConfig
from evaluation.preference import evaluate_policy, policy_logps, preference_metric_names
from evaluation.summaries import (
    SampleTableConfig,
    evaluate_summaries,
    load_eval_sets,
    sample_table,
    summary_metric_names,
)
from model.lora import LoRAConfig, trainable_summary
from model.sampler import SampleOutput
from model.weights import save_export
from rlhf.policy_gradient import ADVANTAGES, informative_groups, penalize_missing_end, select, sequence_kl
from rlhf.rewards import RewardSource, combine_sources, load_function, normalize_sources, parse_rewards
from rollouts.batches import (
    MicroBatch,
    build_training_batches,
    kept_advantages,
    pad_micro_batches,
    per_rank_sizes,
    with_advantages,
)
from rollouts.metrics import StepResult, gold_metrics, step_metrics
from rollouts.models import Models, build_models, check_models, check_step_fits, refresh_reference
from rollouts.options import (
    ObjectiveConfig,
    OffloadConfig,
    SamplingConfig,
    SelectionConfig,
    require_non_negative,
    require_positive,
)
from rollouts.prompts import PromptSet, prompt_set, training_prompts
from rollouts.sampling import RewardSpec, Scores, rollout, source_values, warn_constant_sources
from rollouts.update import batch_logprobs, policy_update
from utils.config import (
    ConfigError,
    DataConfig,
    DecodeConfig,
    OptimConfig,
    RunConfig,
    option,
    parse_config,
    require_nonempty,
)
from utils.dist import all_reduce_sum, rank_and_world, stream
from utils.guard import NonFiniteGuard, check_rewards, exit_on_error
from utils.logging import StageTimer, perf_metrics
from utils.optim import build_optimizer, build_scheduler
from utils.run import check_best_metric, end_of_step, finish, log_row, resume, start_run

TASK_REWARDS = {"gold_reward": synthetic_gold_reward}  # --rewards gold_reward: the embedded task's gold reward


@dataclass
class Config(
    RunConfig,
    OptimConfig,
    DataConfig,
    LoRAConfig,
    DecodeConfig,
    SamplingConfig,
    SelectionConfig,
    ObjectiveConfig,
    OffloadConfig,
    FrontierConfig,
    SampleTableConfig,
):
    """utils/config.py's option groups, GRPO's (rollouts/options.py: sampling, selection, objective, offload), the
    frontier's (evaluation/frontier.py) and the sample tables' (evaluation/summaries.py), with the script's own options
    below."""

    # --- models
    model: str = option("runs/sft/hf", model="policy")
    """Starting policy, also the frozen reference (with LoRA: the policy's own base weights, adapters off): a
    Hugging Face-format folder (sft.py's hf/), a hub name, or with --random_init a preset (tiny, small, ...)."""
    random_init: bool = False
    """Random GPT-2 initialisation of the preset named by --model (tests and smoke runs)."""
    reward_model: str = option("runs/rm/hf", model="reward_model")
    """Reward model: reward_model.py's hf/ folder (its gain/bias come from reward_normalization.json), or with
    --reward_random_init a preset. Loaded only when --rewards names reward_model."""
    reward_random_init: bool = False
    """Random reward model of the preset named by --reward_model, gain 1 and bias 0 (tests and smoke runs)."""
    # --- data
    val_rows: int = 256
    pref_data: str = "trl-lib/tldr-preference"
    """Preference pairs for the implicit-reward accuracy (evaluation/preference.py); empty string to skip."""
    pref_split: str = "validation"
    """Split of --pref_data."""
    pref_rows: int = 512
    """Preference pairs used (the first N); 0 for all."""
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
    # --- batch sizes and optimisation
    prompts_per_step: int = 256
    """Global prompts per step, over all ranks (x num_kept sequences in the update)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the policy and reference on each rank."""
    score_micro_batch_size: int = 128
    """Sequences per reward-model forward on each rank."""
    group_by_length: bool = True
    """Each rank's prompt groups ordered by prompt length, longest first, before they are cut into micro-batches (the
    update's, the reference's and the reward model's, evaluation too): each prompt's samples stay together, less
    padding computed, the same gradient and scores up to float summation order. false: the groups in loader order."""
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
    save_every: int = 50
    best_metric: str = "eval/reward"
    """Evaluation metric whose best value keeps its checkpoint (named in checkpoints/best.json, never pruned);
    a new best is saved when it appears. Empty disables. The default needs the summary evaluation (--val_data);
    without it, eval/pref_accuracy (or nothing, without --pref_data either)."""
    best_mode: Literal["min", "max"] = "max"
    out_dir: str = "runs/grpo"
    run_name: str = "grpo"

    def keep_best_by(self, summaries: bool, preferences: bool) -> str:
        """--best_metric; its default eval/reward needs the summary evaluation, else eval/pref_accuracy or none."""
        if self.best_metric != "eval/reward" or summaries:
            return self.best_metric
        return "eval/pref_accuracy" if preferences else ""

    def sources(self) -> list[RewardSource]:
        """The reward sources of --rewards (imports their functions: a typo fails here)."""
        return parse_rewards(self.rewards, self.reward_length_target, TASK_REWARDS)

    def validate(self) -> None:
        require_nonempty(self, "rewards")
        if any(s.fn is None for s in self.sources()):
            require_nonempty(self, "reward_model")
        self.validate_shared()  # --model, data, run, optimisation and LoRA options
        self.validate_sampling()
        self.validate_selection()
        self.validate_objective()
        self.validate_frontier()
        require_non_negative(self, "pref_rows")
        require_positive(
            self, "prompts_per_step", "micro_batch_size", "score_micro_batch_size", "pref_max_response_len"
        )
        require_positive(self, "table_prompts", "reward_length_target")
        if self.kept < (need := ADVANTAGES.facts.get(self.advantage, {}).get("min_kept", 1)):
            raise ConfigError(
                f"--advantage {self.advantage} needs at least {need} kept samples per prompt, got {self.kept}"
            )


# ----------------------------------------------------------------------------------------------------
# Stages 2-7


def score_rewards(
    spec: RewardSpec, reward_model, prompts: PromptSet, samples: SampleOutput, cfg: Config, step: int
) -> Scores:
    """Stage 3 of step `step` (1-based). Reward model: raw score -> minus the penalty (raw units) without an end
    token -> RM gain/bias; a reward model returning NaN, or one score for every sample of every rank, stops the run
    here. Functions: their values, whitened over the global batch; a function that raises or returns a non-number
    stops the run naming itself and the row. The reward is the weighted sum (rlhf/rewards.py)."""
    scores = source_values(spec, reward_model, prompts, samples, cfg.num_samples, cfg)
    if scores.raw is not None:
        check_rewards(scores.raw, "grpo", step, prompts.ids.device)
        penalized = penalize_missing_end(scores.raw, samples.has_end, cfg.missing_end_penalty)
        scores.values[:, spec.rm_column] = reward_model.normalize(penalized).double()
    warn_constant_sources(spec, scores.values, scores.applies, step)
    x = normalize_sources(scores.values, scores.applies, spec.normalize_S, all_reduce_sum)  # (N, S)
    scores.total = combine_sources(x, spec.weights_S).float()  # (N,)
    return scores


def kl_in_reward(batches: list[MicroBatch], rewards_BK: torch.Tensor, keep_B: torch.Tensor, cfg: Config):
    """--kl_in reward: beta x each kept response's KL estimate (--kl_estimator, summed over its tokens, from the
    micro-batches' sampling-policy and reference log-probs) leaves its reward, and the advantages are recomputed.
    Returns the new advantages (B*K,) and the penalty (B, K) (0 for dropped groups)."""
    kl_N = rewards_BK.new_zeros(int(keep_B.sum()) * cfg.kept)  # (kept rows,) in the order of rows_N
    for b in batches:
        if not b.filler:  # each micro-batch's rows back at their places (--group_by_length reorders them)
            kl_N[b.kept_index] = sequence_kl(b.old_logprobs, b.ref_logprobs, b.response_mask, cfg.kl_estimator).float()
    kl_penalty_BK = torch.zeros_like(rewards_BK)
    kl_penalty_BK[keep_B] = cfg.beta * kl_N.view(-1, cfg.kept)
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
    # 5. advantages: --advantage over the *selected* samples, then whitened over the global batch (all ranks)
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
            cfg.group_by_length,  # micro-batches of prompts of similar length
        )
        if cfg.min_group_std > 0:  # as many micro-batches on every rank, whatever each kept
            filler = build_training_batches(
                prompts.ids, prompts.mask, samples, rows_BK.flatten()[:1], advantages[:1], G, 1, cfg.prefix_sharing
            )[0]
            batches = pad_micro_batches(batches, filler, device)
    # 6. reference log-probs (frozen, parameters gathered once; with LoRA the policy with adapters off); with mu > 1
    #    or the KL in the reward also the sampling policy's (the weights that generated), from the training forward so
    #    the first ratio is 1. With --kl_in reward, beta x each response's KL estimate then leaves its reward and the
    #    advantages are recomputed (they need both log-probs)
    kl_penalty_BK = torch.zeros_like(rewards_BK)
    with timer("reference"):
        refs = batch_logprobs(models.reference, batches, cfg, gather=True)
        batches = [replace(b, ref_logprobs=r) for b, r in zip(batches, refs, strict=True)]
        if cfg.policy_epochs > 1 or cfg.kl_in == "reward":
            olds = batch_logprobs(models.policy, batches, cfg, gather=False)
            batches = [replace(b, old_logprobs=o) for b, o in zip(batches, olds, strict=True)]
        if cfg.kl_in == "reward":
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


def evaluate(
    models: Models, spec: RewardSpec, val, pref, ref_pref, cfg: Config, step: int, device, *, frontier=None
) -> dict:
    """Stage 8's evaluation (a collective): the policy's summaries of this rank's --val_data prompts (`val`) and the
    implicit reward's accuracy on its --pref_data pairs (`pref`, against the reference's log-probs `ref_pref`); with
    --frontier_prompts (`frontier`) the KL to the policy the run started from (a frozen copy of it when
    --ref_refresh_every refreshes the reference) and rewards of temperature-1 samples."""
    out = evaluate_summaries(models.policy, models.reward_model, spec, val, cfg, step) if val is not None else {}
    out |= frontier.evaluate(models.policy, models.starting_policy, step) if frontier is not None else {}
    if not pref:
        return out
    acc = evaluate_policy(models.policy, ref_pref, pref, cfg.beta, device, prefix_sharing=cfg.prefix_sharing)
    return out | {f"eval/pref_{k}": v for k, v in acc.items()}


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
    train, train_applies, train_name = training_prompts(cfg, tok, sources)  # applies (rows, S)
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
    # what end_of_step saves beside the policy: the best evaluation's checkpoint, a refreshed reference
    keep = {"best_metric": cfg.keep_best_by(val is not None, pref is not None), "frozen": frozen}
    run.say(
        f"grpo: {len(train)} prompts, world {world}, {prompts_per_rank} prompts x {cfg.num_samples} samples -> "
        f"{cfg.kept} kept per rank, {n_micro} micro-batches, {total_steps} steps"
    )
    ref_pref = policy_logps(models.reference, pref, device, cfg.prefix_sharing) if pref is not None else None
    # --frontier_prompts: KL to the reference and rewards of temperature-1 samples (eval/kl, ...); else None
    frontier = Frontier.build(cfg, tok, run, cfg.max_new_tokens, models.reward_model, gold_reward)
    names = (summary_metric_names(spec, val) if val is not None else set()) | (
        frontier.metric_names() if frontier else set()
    )
    check_best_metric(cfg, names | (preference_metric_names("eval/pref_") if pref else set()), keep["best_metric"])
    if step == 0 and cfg.eval_every > 0:
        evaluated = evaluate(models, spec, val, pref, ref_pref, cfg, 0, device, frontier=frontier)
        log_row(run, evaluated, 0)
    batches_iter, metrics, stopping = iter(loader), {}, False
    models.policy.train()
    with run.stop:  # SIGTERM / SIGINT: finish the step, save, exit 0
        while step < total_steps and not stopping:
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
                metrics.update(evaluate(models, spec, val, pref, ref_pref, cfg, step, device, frontier=frontier))
            if cfg.table_every > 0 and step % cfg.table_every == 0:
                run.logger.table("samples", *sample_table(spec, prompts, result, cfg.table_prompts), step)

            # 9. checkpoint: on schedule, at the end, at a new best evaluation metric, or when a signal came
            stopping = end_of_step(
                run, cfg, step, total_steps, metrics, models.policy, optimizer, scheduler, loader, **keep
            )

    # 10. export a Hugging Face-format folder (not after a signal: the run is not finished)
    export = partial(save_export, models.policy, cfg=model_cfg, folder=run.dir / "hf")  # the Hugging Face folder
    finish(run, models.policy, step, metrics, stopping, export)
    return metrics


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

"""GRPO's step: stages 2-7 of grpo.py's numbered loop on one rank's prompts (DeepSeekMath, arXiv 2402.03300,
section 4), collective over ranks. train_step is the one function grpo.py's main(), the benchmark (bench/) and the
tests call; its pieces are this package's other modules (sampling.py, batches.py, update.py, metrics.py) and the
math in rlhf/. `cfg` is grpo.py's Config.

    2. generate           G = num_samples responses per prompt; the prompt's KV cache is shared by its group
    3. score              every reward source (--rewards) on the samples it applies to: the reward model (penalty
                          for no end token in raw RM units, then gain/bias) and functions of the text (whitened
                          over the global batch); their weighted sum is the reward (rlhf/rewards.py)
    4. select             K = num_kept of G per prompt (RSO rejection sampling at temperature beta_rs, ...); with
                          --min_group_std the groups whose kept rewards tie are dropped (DAPO's dynamic sampling)
    5. advantages         --advantage's estimator over the K selected (GRPO's group normalization by default,
                          float64 statistics; pool_normalized's from all G scored), then whitened over the whole
                          batch across ranks
    6. reference          log-probs of the selected responses under the frozen reference policy (with LoRA: the
                          policy with its adapters off); with mu > 1 also the sampling policy's; with --kl_in reward
                          beta x the KL estimate leaves each reward and the advantages are computed again
    7. update             clipped ratio (per token, or per sequence: --importance_level) x the rollout correction
                          + beta * KL estimate (--kl_estimator) - entropy_coef * entropy, response tokens only, loss /
                          global normaliser; mu = --policy_epochs optimizer steps per batch of rollouts
"""

from dataclasses import replace

import torch

from model.sampler import SampleOutput
from rlhf.advantages import informative_groups
from rlhf.policy_gradient import penalize_missing_end, sequence_kl
from rlhf.rewards import combine_sources, normalize_sources
from rlhf.selection import select
from rollouts.batches import MicroBatch, build_training_batches, kept_advantages, pad_micro_batches, with_advantages
from rollouts.metrics import StepResult
from rollouts.models import Models
from rollouts.prompts import PromptSet
from rollouts.sampling import RewardSpec, Scores, rollout, source_values, warn_constant_sources
from rollouts.update import batch_logprobs, policy_update
from utils.dist import all_reduce_sum, rank_and_world, stream
from utils.guard import NonFiniteGuard, check_rewards
from utils.logging import StageTimer


def score_rewards(spec: RewardSpec, reward_model, prompts: PromptSet, samples: SampleOutput, cfg, step: int) -> Scores:
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


def kl_in_reward(batches: list[MicroBatch], rewards_BK: torch.Tensor, keep_B: torch.Tensor, cfg):
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
    cfg,
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
        advantages = kept_advantages(rewards_BK, keep_B, cfg, scores.total.view(-1, G))  # (B*K,)
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

"""What one GRPO step produced on a rank (StepResult) and the step's global metrics (collectives): the update's
(update_metrics), rewards, selection, samples and every reward source (step_metrics), and a monitored gold reward and
its parts (gold_metrics)."""

from dataclasses import dataclass

import torch

from data.tldr import decode_responses
from model.sampler import SampleOutput
from rlhf.rewards import source_stats
from rlhf.selection import selection_diagnostics
from rollouts.batches import MicroBatch
from rollouts.prompts import PromptSet
from rollouts.sampling import RewardSpec, Scores
from utils.dist import all_reduce_max, all_reduce_sum, global_mean_std
from utils.guard import all_ranks_agree
from utils.metrics import metric


@dataclass
class StepResult:
    """What one GRPO step produced on this rank (rollouts/step.py train_step's names)."""

    samples: SampleOutput  # G samples per prompt, rows b*G .. b*G+G-1 of prompt b
    scores: Scores  # every reward source's values and the training reward
    idx_BK: torch.Tensor  # (B, K) kept columns of each prompt's group
    rows_BK: torch.Tensor  # (B, K) kept rows of the samples
    selection_stats: dict  # per prompt (B,): candidates visited and rounds (rlhf/selection.py select)
    rewards_BK: torch.Tensor  # (B, K) the kept samples' rewards
    advantages: torch.Tensor  # (B*K,), 0 in the groups --min_group_std dropped
    batches: list[MicroBatch]  # the update's micro-batches
    update: dict  # the update's global metrics
    seconds: dict  # each stage's seconds
    keep_B: torch.Tensor  # (B,) the groups trained on (all but those --min_group_std dropped)
    kl_penalty_BK: torch.Tensor  # (B, K) beta x KL taken from each kept reward with --kl_in reward, else 0


metric("reward/gold_mean", "max", "mean of --gold_reward_fn over the step's samples (monitored, not trained on)")
metric("reward/gold_std", "max", "standard deviation of --gold_reward_fn over the step's samples")
metric("gold/{part}", "max", "mean of one part of --gold_parts_fn over the step's samples")
# the parts of the embedded task's gold reward (data.synthetic:gold_parts)
metric("gold/items_correct", "max", "distinct key items of the post a summary names")
metric("gold/items_invented", "min", "distinct vocabulary words a summary names that are not in the post")
metric("gold/words", "max", "words of a summary before the end token")
metric("gold/ended", "max", "share of the summaries that hold the end token")


def gold_metrics(gold_reward, gold_parts, tok, prompts: PromptSet, samples: SampleOutput, group: int) -> dict:
    """Over all ranks and every sample of the step: mean and std of a monitored reward function (--gold_reward_fn),
    and the mean of each part of it (--gold_parts_fn); either function may be None."""
    texts = decode_responses(tok, samples.response_ids, samples.response_mask, samples.has_end)
    pairs = [(prompts.texts[n // group], t) for n, t in enumerate(texts)]
    out = {}
    with all_ranks_agree("--gold_reward_fn / --gold_parts_fn", prompts.ids.device):  # may raise on one rank's rows only
        gold = [float(gold_reward(prompt, text)) for prompt, text in pairs] if gold_reward is not None else None
        parts = [gold_parts(prompt, text) for prompt, text in pairs] if gold_parts is not None else None
    if gold is not None:
        out["reward/gold_mean"], out["reward/gold_std"] = global_mean_std(torch.tensor(gold, device=prompts.ids.device))
    if parts is not None:
        names = sorted(parts[0])  # the same order on every rank, so the all-reduced columns line up
        sums = torch.tensor(
            [[float(p[k]) for k in names] + [1.0] for p in parts], dtype=torch.float64, device=prompts.ids.device
        ).sum(0)  # (parts + 1,): each part's sum, then the count
        sums = all_reduce_sum(sums)
        out.update({f"gold/{k}": float(v) for k, v in zip(names, (sums[:-1] / sums[-1]).tolist(), strict=True)})
    return out


metric("reward/mean", "max", "mean training reward of every sample of the step", headline=("grpo",))
metric("reward/std", "max", "standard deviation of the training reward over every sample")
metric("reward/selected_mean", "max", "mean training reward of the kept samples (the selection's)")
metric("reward/selected_std", "max", "standard deviation of the kept samples' training rewards")
metric("reward/raw_mean", "max", "mean raw reward-model score of the samples (before the gain and bias)")
metric("reward/raw_std", "max", "standard deviation of the raw reward-model scores")
metric("reward/kl_penalty_mean", "min", "with --kl_in reward: mean beta x KL taken from each trained sample's reward")
metric("reward/{source}_mean", "max", "one reward source's mean on the samples it applies to, before whitening")
metric("reward/{source}_std", "max", "that source's standard deviation on those samples")
metric("reward/{source}_fraction", "max", "share of the samples that source applies to (a reward column's tasks)")
metric("rs/acceptance_rate", "max", "kept samples over candidates visited by the selection")
metric("rs/rounds_mean", None, "the selection's mean rounds per prompt")
metric("rs/rounds_max", None, "the selection's most rounds of a prompt")
# what the selection kept against its pool (rlhf/selection.py selection_diagnostics): no best, a description
metric("rs/kept_mean_shift", None, "mean over groups of (kept mean - pool mean) reward, in pool standard deviations")
metric("rs/kept_std_ratio", None, "kept within-group reward std against the pool's: sqrt(mean of s2_K / s2_G)")
metric("rs/pool_group_std", None, "the pool's within-group reward std: sqrt(mean over groups of s2_G)")
metric("rs/kept_ess", None, "Kish's effective sample size of |r - kept mean| in the groups that did not tie")
metric("rs/tied_group_fraction", None, "share of groups whose kept rewards are all exactly equal")
metric("sample/end_fraction", "max", "share of the samples that end with the end token")
metric("sample/response_length", "min", "mean response tokens of the samples")
metric("sample/selected_response_length", "min", "mean response tokens of the kept samples")
metric("sample/dropped_group_fraction", "min", "with --min_group_std: share of groups not trained on (tied rewards)")
metric("perf/generate_tokens_per_second", "max", "generated tokens per second of sampling (all ranks)")
metric("perf/update_tokens_per_second", "max", "tokens per second of the update, every epoch (all ranks)")


def step_metrics(r: StepResult, spec: RewardSpec, cfg, per_row_sources: bool) -> dict:
    """The step's global metrics (collectives): the update's, rewards, selection, samples, every source."""
    device, G, K, rows_N = r.rewards_BK.device, cfg.num_samples, cfg.kept, r.rows_BK.flatten()
    reward_mean, reward_std = global_mean_std(r.scores.total)
    kept_mean, kept_std = global_mean_std(r.rewards_BK)
    n_prompts, visited, rounds, ended, generated, kept_len, train_tokens = all_reduce_sum(
        torch.stack(
            [
                torch.tensor(float(r.idx_BK.shape[0]), dtype=torch.float64, device=device),
                r.selection_stats["visited"].double().sum(),
                r.selection_stats["rounds"].double().sum(),
                r.samples.has_end.double().sum(),
                r.samples.response_mask.double().sum(),
                r.samples.response_mask[rows_N].double().sum(),
                sum(
                    (b.attention_mask.sum() for b in r.batches if not b.filler), torch.zeros((), device=device)
                ).double(),
            ]
        )
    ).tolist()
    n_samples = n_prompts * G
    kept = selection_diagnostics(r.scores.total.view(-1, G), r.rewards_BK, all_reduce_sum)
    metrics = {
        **r.update,
        "reward/mean": reward_mean,
        "reward/std": reward_std,
        "reward/selected_mean": kept_mean,
        "reward/selected_std": kept_std,
        "rs/acceptance_rate": n_prompts * K / visited,
        "rs/rounds_mean": rounds / n_prompts,
        "rs/rounds_max": all_reduce_max(float(r.selection_stats["rounds"].max()), device),
        "rs/kept_mean_shift": float(kept["mean_shift"]),
        "rs/kept_std_ratio": float(kept["std_ratio"]),
        "rs/pool_group_std": float(kept["pool_std"]),
        "rs/kept_ess": float(kept["ess"]),
        "rs/tied_group_fraction": float(kept["tied_fraction"]),
        "sample/end_fraction": ended / n_samples,
        "sample/response_length": generated / n_samples,
        "sample/selected_response_length": kept_len / (n_prompts * K),
        "perf/generate_tokens_per_second": generated / r.seconds["generate"],
        "perf/update_tokens_per_second": train_tokens * cfg.policy_epochs / r.seconds["update"],
        "perf/generated_tokens": generated,
    }
    if cfg.min_group_std > 0:  # dynamic sampling: the share of groups whose kept rewards tied, not trained on
        metrics["sample/dropped_group_fraction"] = 1.0 - float(all_reduce_sum(r.keep_B.double().sum())) / n_prompts
    if cfg.kl_in == "reward":  # beta x the summed KL estimate taken from each trained sample's reward
        penalty = r.kl_penalty_BK[r.keep_B].double()
        count, total = all_reduce_sum(torch.stack([penalty.new_tensor(float(penalty.numel())), penalty.sum()])).tolist()
        metrics["reward/kl_penalty_mean"] = total / max(count, 1.0)
    if r.scores.raw is not None:
        metrics["reward/raw_mean"], metrics["reward/raw_std"] = global_mean_std(r.scores.raw)
    # every source on the samples it applies to, before whitening (the reward model's: penalty, gain/bias)
    count_S, mean_S, std_S = source_stats(r.scores.values, r.scores.applies, all_reduce_sum)
    for i, source in enumerate(spec.sources):
        metrics[f"reward/{source.name}_mean"], metrics[f"reward/{source.name}_std"] = float(mean_S[i]), float(std_S[i])
        if per_row_sources:
            metrics[f"reward/{source.name}_fraction"] = float(count_S[i]) / n_samples
    return metrics


metric("train/kl", "min", "mean per-token KL estimate to the reference over the update", headline=("grpo",))
metric("train/clip_fraction", "max", "share of response tokens whose ratio the clip cut")
metric("train/ratio_deviation", "min", "mean |ratio - 1| of the response tokens")
metric("train/logprob_gap_to_sampler", "min", "mean |training-forward log-prob - sampler log-prob| per token")
metric("train/outside_top_k_p_fraction", "min", "share of tokens outside the sampler's top-k / top-p set")
metric("train/mismatch/outside_band_fraction", "min", "share of tokens whose sampler ratio is outside [0.9, 1.1]")
metric("train/mismatch/mean_abs_log_gap", "min", "mean |log-prob gap| between trainer and sampler")
metric("train/mismatch/max_abs_log_gap", "min", "largest |log-prob gap| between trainer and sampler")
metric("train/rollout_correction_fraction", "max", "share of tokens --rollout_correction truncated or masked")
metric("train/entropy", "max", "mean token entropy of the policy on the kept samples")
metric("train/epoch_{n}/clip_fraction", "max", "with --policy_epochs > 1: that epoch's clip fraction")
metric("train/epoch_{n}/ratio_deviation", "min", "with --policy_epochs > 1: that epoch's mean |ratio - 1|")
metric("train/epoch_{n}/kl", "min", "with --policy_epochs > 1: that epoch's mean KL estimate")


def update_metrics(
    epochs: list[dict[str, float]], gap_max: float, normaliser: float, steps: list[dict], cfg, log_entropy: bool
) -> dict:
    """The update's global metrics from each epoch's global sums (micro-batches and ranks), the largest |log gap| to
    the sampler, the loss normaliser and each optimizer step's own metrics (grad norm, lr, skipped); `cfg`:
    grpo.Config."""
    mu = len(epochs)
    total = {k: sum(e[k] for e in epochs) for k in epochs[0]}
    tokens, mismatch_tokens = total["tokens"], max(total["mismatch_tokens"], 1.0)
    metrics = {
        "train/loss": total["loss"] / normaliser / mu,
        "train/kl": total["kl"] / tokens,
        "train/clip_fraction": total["clipped"] / tokens,
        "train/ratio_deviation": total["ratio_deviation"] / tokens,
        "train/logprob_gap_to_sampler": total["sampler_gap"] / tokens,
        "train/outside_top_k_p_fraction": total["outside_support"] / tokens,
        "train/grad_norm": sum(s["train/grad_norm"] for s in steps) / mu,
        "train/lr": steps[-1]["train/lr"],
        "train/skipped": sum(s["train/skipped"] for s in steps) / mu,
        # sampler / trainer mismatch at the sampling weights (token ratio exp(train - sampler) outside [0.9, 1.1])
        "train/mismatch/outside_band_fraction": total["mismatch_outside"] / mismatch_tokens,
        "train/mismatch/mean_abs_log_gap": total["mismatch_gap"] / mismatch_tokens,
        "train/mismatch/max_abs_log_gap": gap_max,
    }
    if cfg.rollout_correction != "none":  # response tokens whose weight was truncated (tis) or masked (mis)
        metrics["train/rollout_correction_fraction"] = total["corrected"] / tokens
    if log_entropy:
        metrics["train/entropy"] = total["entropy"] / tokens
    if mu > 1:  # how far each update moved from the sampling policy: epoch 1 is exactly 0
        for epoch, e in enumerate(epochs, start=1):
            for name, key in (("clip_fraction", "clipped"), ("ratio_deviation", "ratio_deviation"), ("kl", "kl")):
                metrics[f"train/epoch_{epoch}/{name}"] = e[key] / e["tokens"]
    return metrics

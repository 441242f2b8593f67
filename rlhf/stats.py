"""Statistics of pairwise preference scores: accuracy with ties, bootstrap confidence intervals, the split by
response length, and the gain/bias that standardises rewards. Pure functions of tensors (no distributed code)."""

import math

import torch


def pair_outcomes(score_chosen: torch.Tensor, score_rejected: torch.Tensor) -> torch.Tensor:
    """Per pair (B,) float64: 1 when the chosen response scores higher, 0 when lower, 1/2 on an exact tie.

    A tie counts as half a correct answer: it is what a coin flip between the two scores would get on
    average, so a scorer that cannot tell the responses apart (e.g. a policy equal to its reference, whose
    implicit rewards are all exactly 0) gets accuracy 0.5, not 0 or 1."""
    c, r = score_chosen.double(), score_rejected.double()
    return (c > r).double() + 0.5 * (c == r).double()


def bootstrap_ci(
    values: torch.Tensor, n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (N,): resample N values with replacement
    n_resamples times and take the (1-c)/2 and (1+c)/2 quantiles of the resampled means. A fixed seed makes
    the interval reproducible. NaNs for an empty input."""
    n = values.numel()
    if n == 0:
        return math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_resamples, n), generator=g)  # (S, N)
    means = values.double().flatten()[idx].mean(1)  # (S,)
    alpha = (1.0 - confidence) / 2
    lo, hi = torch.quantile(means, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)).tolist()
    return lo, hi


def preference_summary(
    score_chosen: torch.Tensor,
    score_rejected: torch.Tensor,
    chosen_longer: torch.Tensor,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Accuracy of scores (N,) on N preference pairs, overall and split by whether the chosen response is the
    longer one (`chosen_longer` (N,) bool; equal lengths count as not longer), each with a bootstrap interval.

    Also the mean scores and the mean Bradley-Terry loss -log sigmoid(s_chosen - s_rejected): for implicit
    rewards s = beta log(pi/pi_ref) that is the DPO loss without label smoothing."""
    c, r = score_chosen.double().cpu(), score_rejected.double().cpu()
    longer = chosen_longer.bool().cpu()
    outcomes = pair_outcomes(c, r)  # (N,)
    out: dict[str, float] = {"n_pairs": int(c.numel()), "n_ties": int((c == r).sum())}
    groups = {"": torch.ones_like(longer), "chosen_longer_": longer, "chosen_not_longer_": ~longer}
    for name, keep in groups.items():
        values = outcomes[keep]
        lo, hi = bootstrap_ci(values, n_resamples, confidence, seed)
        out[f"{name}accuracy"] = float(values.mean()) if values.numel() else math.nan
        out[f"{name}accuracy_ci_low"] = lo
        out[f"{name}accuracy_ci_high"] = hi
        if name:
            out[f"n_{name.rstrip('_')}"] = int(values.numel())
    out["chosen_score_mean"] = float(c.mean())
    out["rejected_score_mean"] = float(r.mean())
    out["margin_mean"] = float((c - r).mean())
    out["bt_loss"] = float(-torch.nn.functional.logsigmoid(c - r).mean())
    return out


def win_rate(
    policy_scores: torch.Tensor,
    reference_scores: torch.Tensor,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Share of prompts (N,) whose policy summary a judge (the reward model) scores above the reference summary
    written for the same prompt (the human TL;DR), an exact tie counting half (pair_outcomes), with a percentile
    bootstrap interval over the prompts (bootstrap_ci). NaNs for no prompts."""
    outcomes = pair_outcomes(policy_scores, reference_scores)  # (N,)
    lo, hi = bootstrap_ci(outcomes, n_resamples, confidence, seed)
    rate = float(outcomes.mean()) if outcomes.numel() else math.nan
    return {"win_rate": rate, "win_rate_ci_low": lo, "win_rate_ci_high": hi}


def standardizing_gain_bias(count: float, total: float, total_sq: float) -> tuple[float, float]:
    """(gain, bias) with gain * r + bias of mean 0 and (population) std 1 over rewards given by their count,
    sum and sum of squares (sums that can be all-reduced over ranks)."""
    if count < 2:
        raise ValueError(f"need at least 2 rewards to fit a gain and bias, got {count}")
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    std = math.sqrt(var)
    if std < 1e-8:
        raise ValueError(f"rewards have (near) zero spread (std {std:.3g}); cannot standardise them")
    return 1.0 / std, -mean / std


# ----------------------------------------------------------------------------------------------------
# The reward-KL frontier (evaluation/frontier.py): means of per-sample values over P held-out prompts x G samples,
# the KL to the reference, and best-of-n from the reference.


def mean_and_se(values_PG: torch.Tensor) -> tuple[float, float]:
    """Mean of values (P, G) (G samples of each of P prompts) and its standard error, in float64.

    With G >= 2 the error is that of sampling on these prompts (stratified by prompt): the prompts are fixed, the
    samples of prompt p independent draws with sample variance s_p^2, so Var(mean) = sum_p s_p^2 / (G P^2). Two
    policies measured on the same prompts differ by this noise, not by how prompts differ. With G = 1 (one value per
    prompt, e.g. best-of-n's kept sample) it is the error over prompts, std / sqrt(P), which also counts how prompts
    differ (the larger of the two). NaN error when it cannot be estimated (one value)."""
    v = values_PG.double()
    if v.dim() != 2 or v.numel() == 0:
        raise ValueError(f"values must be (prompts, samples) and non-empty, got shape {tuple(v.shape)}")
    P, G = v.shape
    mean = float(v.mean())
    if G >= 2:
        se = math.sqrt(float(v.var(dim=1, correction=1).sum()) / G) / P
    elif P >= 2:
        se = float(v[:, 0].std(correction=1)) / math.sqrt(P)
    else:
        se = math.nan
    return mean, se


def kl_estimate(logp_policy_PG: torch.Tensor, logp_reference_PG: torch.Tensor) -> tuple[float, float]:
    """KL(pi || pi_ref) on held-out prompts from samples y ~ pi (P prompts x G samples): the mean over samples of
    log pi(y|x) - log pi_ref(y|x), each the sum over the response's tokens (an unbiased estimate of the sequence-level
    KL, E_pi[log pi / pi_ref]), with its standard error (mean_and_se)."""
    if logp_policy_PG.shape != logp_reference_PG.shape:
        raise ValueError(
            f"log-probs under the policy {tuple(logp_policy_PG.shape)} and the reference "
            f"{tuple(logp_reference_PG.shape)} must have the same shape"
        )
    return mean_and_se(logp_policy_PG.double() - logp_reference_PG.double())


def best_of_n_index(proxy_PG: torch.Tensor, n: int) -> torch.Tensor:
    """Column (P,) of the sample the proxy ranks first among the first n of each prompt's G samples (nested subsets:
    best-of-n for every n from one set of samples); a tie goes to the earlier sample."""
    if not 1 <= n <= proxy_PG.shape[1]:
        raise ValueError(f"best-of-n needs 1 <= n <= {proxy_PG.shape[1]} samples per prompt, got n = {n}")
    first_n = proxy_PG[:, :n].double()  # (P, n)
    is_max = first_n == first_n.max(dim=1, keepdim=True).values  # (P, n)
    return is_max.long().argmax(dim=1)  # the first column holding the maximum


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || pi_ref) = log n - (n - 1) / n, the formula of Stiennon et al. 2020 (appendix G.3) and Gao et
    al. 2022 (arXiv 2210.10760, eq. 1). Exact only when no two samples tie under the proxy; in general an upper bound
    on the true KL (Beirami et al. 2024, arXiv 2401.01879), so best-of-n sits at or left of where it is drawn."""
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1, got {n}")
    return math.log(n) - (n - 1) / n

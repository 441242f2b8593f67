"""Selection of K of G scored samples per prompt, grpo.py's step 4 (rlhf/policy_gradient.py gives the order of the
steps), as pure functions: the rules (--selection: SELECTIONS, RSO's rejection sampling among them), what a selection
kept against its pool (selection_diagnostics), and how its kept samples line up with a monitored gold reward
(gold_alignment, kept_slope).

Shapes: B prompts, G samples per prompt, K selected.
"""

from collections.abc import Callable

import torch

from rlhf.registry import Registry


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a single process: the tensor itself (the default `reduce_sum`)."""
    return t


# ----------------------------------------------------------------------------------------------------
# Selection of K of G samples per prompt (--selection: SELECTIONS). Each takes (rewards (B, G), K, the RSO
# temperature beta, a torch.Generator), using what it needs, and returns (indices (B, K) long, sorted ascending,
# stats) where indices are columns of the (B, G) reward matrix and stats holds per-prompt (B,) tensors: "visited"
# (candidates examined; acceptance rate = K / visited) and "rounds" (passes over the candidates), so callers can
# reduce them over ranks. Random numbers are fp32 from the given generator
# (bf16's 8-bit mantissa would make the acceptance probabilities coarse). A registration declaring keeps_all keeps
# every sample (K = G whatever --num_kept says).

SELECTIONS = Registry("selection")


def _one_pass(rewards_BG: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stats of a selection that looks at every candidate once."""
    B, G = rewards_BG.shape
    device = rewards_BG.device
    return {"visited": torch.full((B,), float(G), device=device), "rounds": torch.ones(B, device=device)}


@SELECTIONS.register("all", help="every sample (K = G)", keeps_all=True)
def select_all(
    rewards_BG: torch.Tensor, k: int = 0, beta: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """Keep every sample (K = G; `k` is not read)."""
    B, G = rewards_BG.shape
    idx = torch.arange(G, device=rewards_BG.device).expand(B, G).clone()
    return idx, _one_pass(rewards_BG)


@SELECTIONS.register("top", help="the K best (RSO's limit beta_rs -> 0)")
def select_top(
    rewards_BG: torch.Tensor, k: int, beta: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """The K highest-rewarded samples of each prompt (K <= G): RSO's target pi_sft(y|x) exp(r / beta) as beta -> 0,
    without its random visiting order. Ties at the K-th place go to the lower column (a stable descending sort keeps
    equal rewards in column order), so the result is a function of the rewards alone; the samples of a group are
    exchangeable, so which of two tied samples is kept biases nothing."""
    B, G = rewards_BG.shape
    if not 0 < k <= G:
        raise ValueError(f"top selection needs K in (0, G={G}], got {k}")
    order = torch.argsort(rewards_BG.float(), dim=1, descending=True, stable=True)  # (B, G) best first
    return order[:, :k].sort(dim=1).values, _one_pass(rewards_BG)


@SELECTIONS.register("top_bottom", help="the K/2 best and K/2 worst")
def select_top_bottom(
    rewards_BG: torch.Tensor, k: int, beta: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """The K/2 highest- and K/2 lowest-rewarded samples of each prompt (K even, K <= G)."""
    B, G = rewards_BG.shape
    if k % 2 or not 0 < k <= G:
        raise ValueError(f"top-bottom selection needs an even K in (0, G={G}], got {k}")
    order = torch.argsort(rewards_BG.float(), dim=1, descending=True, stable=True)  # (B, G)
    idx = torch.cat([order[:, : k // 2], order[:, G - k // 2 :]], dim=1)  # (B, K)
    return idx.sort(dim=1).values, _one_pass(rewards_BG)


@SELECTIONS.register("uniform", help="K at random")
def select_uniform(
    rewards_BG: torch.Tensor, k: int, beta: float = 0.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """K samples of each prompt uniformly at random, without replacement."""
    B, G = rewards_BG.shape
    if not 0 < k <= G:
        raise ValueError(f"uniform selection needs K in (0, G={G}], got {k}")
    keys = torch.rand(B, G, generator=generator, device=rewards_BG.device, dtype=torch.float32)
    idx = keys.argsort(dim=1)[:, :k]  # (B, K): a uniformly random K-subset
    return idx.sort(dim=1).values, _one_pass(rewards_BG)


@SELECTIONS.register("rso", help="RSO rejection sampling at temperature --beta_rs (arXiv 2309.06657)")
def select_rso(
    rewards_BG: torch.Tensor, k: int, beta: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """Statistical rejection sampling (RSO, Liu et al. 2023, arXiv 2309.06657, Algorithm 1), batched over prompts.

    Targets pi*(y|x) ~ pi_sft(y|x) exp(r(x, y) / beta) from samples of pi_sft. Each round, with r_max the
    highest reward among the candidates *not yet accepted* (Algorithm 1 recomputes it every round), visit the
    remaining candidates in a random order (without replacement) and accept each with probability
    exp((r - r_max) / beta), stopping as soon as K are accepted. The round's maximum is always accepted, so at
    most K rounds are needed. beta -> 0 keeps the top K; beta -> inf keeps a uniformly random K.

    Algorithm 1 visits candidates in list order; samples of one prompt are exchangeable so that is the same
    distribution, but the random order also makes the result uniform over *indices* when beta -> inf.

    Stats per prompt: candidates visited (one uniform draw each) and rounds used."""
    B, G = rewards_BG.shape
    if not 0 < k <= G:
        raise ValueError(f"rejection sampling needs K in (0, G={G}], got {k}")
    if not beta > 0:
        raise ValueError(f"rejection-sampling temperature beta must be > 0, got {beta}")
    device = rewards_BG.device
    r = rewards_BG.float()  # (B, G)
    accepted = torch.zeros(B, G, dtype=torch.bool, device=device)
    visited = torch.zeros(B, dtype=torch.float32, device=device)
    rounds = torch.zeros(B, dtype=torch.float32, device=device)
    col = torch.arange(G, device=device)
    for _ in range(k):  # every round accepts >= 1 per unfinished prompt
        need = k - accepted.sum(1)  # (B,)
        if not bool((need > 0).any()):
            break
        remaining = ~accepted & (need > 0)[:, None]  # (B, G)
        r_max = r.masked_fill(~remaining, float("-inf")).amax(1, keepdim=True)  # (B, 1)
        # exp((r - r_max) / beta) with the round's maximum at exactly 1 (no 0/0 for tiny beta)
        p_accept = torch.where(r == r_max, 1.0, torch.exp((r - r_max) / beta))  # (B, G)
        u = torch.rand(B, G, generator=generator, device=device, dtype=torch.float32)
        order_keys = torch.rand(B, G, generator=generator, device=device, dtype=torch.float32)
        hit = remaining & (u < p_accept)  # (B, G) accepted if visited
        # visit order: ascending order_keys among the remaining; find each hit's rank among the hits
        visit_order = order_keys.masked_fill(~remaining, float("inf")).argsort(1)  # (B, G)
        hit_sorted = hit.gather(1, visit_order)  # (B, G) hits in visiting order
        hit_rank_sorted = hit_sorted.long().cumsum(1)  # (B, G) number of hits so far
        keep_sorted = hit_sorted & (hit_rank_sorted <= need[:, None])
        # candidates visited: all remaining, or up to and including the need-th hit when the round fills K
        fills = hit_sorted.sum(1) >= need  # (B,)
        stop_at = torch.where(keep_sorted, col, -1).amax(1)  # (B,) position of the last kept hit
        n_visited = torch.where(fills, stop_at + 1, remaining.sum(1))
        visited += torch.where(need > 0, n_visited, 0).float()
        rounds += (need > 0).float()
        keep = torch.zeros_like(accepted).scatter(1, visit_order, keep_sorted)  # (B, G)
        accepted |= keep
    idx = torch.argsort((~accepted).to(torch.uint8), dim=1, stable=True)[:, :k]  # (B, K) accepted columns
    return idx, {"visited": visited, "rounds": rounds}


def select(
    rewards_BG: torch.Tensor, method: str, k: int, beta_rs: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict]:
    """Columns (B, K) of the kept samples of each prompt's group by `method` (a name in SELECTIONS), and per-prompt
    stats: candidates visited and rounds."""
    return SELECTIONS[method](rewards_BG, k, beta_rs, generator)


def selection_diagnostics(
    pool_BG: torch.Tensor, kept_BK: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor] = no_reduce
) -> dict[str, torch.Tensor]:
    """What a selection kept, against the pool it kept it from, over the global batch: the rewards of all G scored
    samples of B groups (B, G) and of the K kept (B, K). Per group, in float64, with the sample (Bessel-corrected)
    variances s2_G of the pool and s2_K of the kept (s2_K = 0 when K = 1):

        mean_shift     mean over groups of (mean_K r - mean_G r) / sqrt(s2_G), 0 for a group whose pool tied: how far
                       the kept mean lies above the pool's, in the pool's standard deviations (RSO on normal rewards
                       of std sigma and a large pool: sigma / beta_rs; uniform selection: 0 in expectation)
        std_ratio      sqrt(mean over groups of s2_K / s2_G), a tied pool's group counting 1: the kept within-group
                       spread against the pool's (exactly 1 when every sample is kept; under uniform selection its
                       square is 1 in expectation, s2_K being unbiased for s2_G when sampling without replacement)
        pool_std       sqrt(mean over groups of s2_G): the pool's within-group spread, in reward units
        ess            mean, over the groups whose kept rewards are not all equal, of Kish's effective sample size of
                       the weights w_i = |r_i - mean_K r| of the K kept, (sum_i w_i)^2 / sum_i w_i^2: how many kept
                       samples carry a group-centred advantage's gradient, between 2 (two samples apart, the rest at
                       the mean) and K (every kept sample equally far from the kept mean); 0 when every group tied
        tied_fraction  share of groups whose K kept rewards are all exactly equal (no group-centred signal)

    Each statistic is a sum over groups divided by a count, both summed over ranks by `reduce_sum` in one call, so two
    ranks give the values one process gives on the concatenated batch (a mean of the ranks' means would not, when they
    hold different numbers of groups). Returns fp64 scalars."""
    pool, kept = pool_BG.double(), kept_BK.double()  # (B, G), (B, K)
    B, K = kept.shape
    pool_var = pool.var(1) if pool.shape[1] > 1 else pool.new_zeros(B)  # (B,) s2_G
    deviation = kept - kept.mean(1, keepdim=True)  # (B, K): exactly 0 for a tie (float64 sum of fp32 rewards)
    sq_dev = (deviation * deviation).sum(1)  # (B,)
    kept_var = sq_dev / (K - 1) if K > 1 else pool.new_zeros(B)  # (B,) s2_K
    spread = pool_var > 0  # (B,) the pool did not tie (a tied pool leaves a tied kept set)
    shift = torch.where(spread, (kept.mean(1) - pool.mean(1)) / pool_var.sqrt(), 0.0)  # (B,)
    var_ratio = torch.where(spread, kept_var / pool_var, 1.0)  # (B,)
    tied = kept.amax(1) == kept.amin(1)  # (B,)
    ess = torch.where(tied, 0.0, deviation.abs().sum(1) ** 2 / sq_dev)  # (B,)
    sums = torch.stack(
        [pool.new_tensor(float(B)), shift.sum(), var_ratio.sum(), pool_var.sum(), tied.sum().double(), ess.sum()]
    )
    groups, shift, var_ratio, pool_var, tied, ess = reduce_sum(sums).unbind()
    return {
        "mean_shift": shift / groups,
        "std_ratio": (var_ratio / groups).sqrt(),
        "pool_std": (pool_var / groups).sqrt(),
        "ess": ess / (groups - tied).clamp(min=1.0),
        "tied_fraction": tied / groups,
    }


def gold_alignment(
    gold_pool_BG: torch.Tensor, reward_BK: torch.Tensor, gold_BK: torch.Tensor, advantage_BK: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How a selection's kept samples and their advantages line up with a monitored gold reward that training never
    sees (evaluation/selection_signal.py): per group (B,) float64, from the gold of all G scored samples (B, G) and,
    for the K kept, the training reward, the gold and the advantage the update gives each (B, K). With m_G, s2_G the
    pool's gold mean and sample variance in the group, s_pool = sqrt(mean over groups of s2_G) and
    rms = sqrt(mean over every kept sample of A^2):

        gold_shift     (mean_K gold - m_G) / sqrt(s2_G): how far the kept gold mean lies above the pool's, in the
                       pool's gold standard deviations (NaN for a group whose pool's gold tied)
        gold_var_ratio s2_K / s2_G of the gold (NaN where the pool's gold tied)
        corr           Pearson correlation of reward and gold over the K kept (NaN where either is constant): how
                       well the reward the update ranks by tells gold apart among the samples it trains on
        signal         mean over the K kept of A (gold - m_G), over rms * s_pool: the update's advantage-weighted
                       gold, scale-free; rms and s_pool are the batch's, so a batch's groups share them (errors over
                       batches, not groups). With advantages centred in the group (sum_k A = 0) m_G drops out and it
                       is the kept samples' covariance of advantage and gold; --global_norm's whitening leaves them
                       uncentred (a tied kept group gets the batch's constant), and then m_G counts

    What the signal assumes: every kept sample an outcome of its own and of equal weight. One step that moves each kept
    sample's log-probability by eta * A_k (the rest renormalized) changes the policy's mean gold, to first order, by
    eta * sum_k pi(y_k) A_k (g_k - E g): each sample weighted by its probability. The signal weighs the kept samples
    equally (m_G standing for E g), which is that change, up to a factor, only when the kept samples' score functions
    are orthogonal and of equal norm. It fails for kept samples the policy rarely draws (their weight is far below the
    others'; `top` and `top_bottom` keep such samples: selection_signal's log-prob shift), for kept samples that repeat
    (a tied kept group is often one summary drawn more than once: one outcome, not K) and for samples whose score
    functions overlap (a gradient step moves every sample's log-probability, not only the kept ones'). It is a
    reading of what the advantages point at, not a prediction of the gold a step gains; and selecting on any reward
    shrinks the kept set's gold range, so the signal falls with the tilt even where the reward is gold itself
    (selection_signal's --reward gold is that null).

    The means over groups (NaN left out) describe the batch; each group's value is one post's."""
    pool, r, g, a = (t.double() for t in (gold_pool_BG, reward_BK, gold_BK, advantage_BK))
    B, K = r.shape
    pool_mean, pool_var = pool.mean(1), pool.var(1)  # (B,)
    nan = torch.full_like(pool_mean, float("nan"))
    spread = pool_var > 0
    shift = torch.where(spread, (g.mean(1) - pool_mean) / pool_var.sqrt(), nan)
    var_ratio = torch.where(spread, g.var(1) / pool_var, nan) if K > 1 else nan
    dr, dg = r - r.mean(1, keepdim=True), g - g.mean(1, keepdim=True)  # (B, K)
    denom = ((dr * dr).sum(1) * (dg * dg).sum(1)).sqrt()
    corr = torch.where(denom > 0, (dr * dg).sum(1) / denom, nan)
    scale = K * (a * a).mean().sqrt() * pool_var.mean().sqrt()
    signal = (a * (g - pool_mean[:, None])).sum(1) / scale if float(scale) > 0 else nan
    return {"gold_shift": shift, "gold_var_ratio": var_ratio, "corr": corr, "signal": signal}


def kept_slope(
    reward_pool_BG: torch.Tensor, gold_pool_BG: torch.Tensor, reward_BK: torch.Tensor, gold_BK: torch.Tensor
) -> torch.Tensor:
    """The slope of gold on the training reward among the kept samples, pooled within groups over the batch, each value
    in its pool's standard deviations: with dr, dg the kept rewards and gold less their kept means, over the pool's
    sample standard deviations of reward and gold,

        slope = sum over groups and kept samples of dr dg / sum of dr^2        fp64 scalar, NaN where no term is left

    leaving out the groups whose pool's reward or gold tied. Selection on the reward restricts the kept range of the
    reward, which lowers the kept correlation of reward and gold (gold_alignment's corr) but not the slope of gold on
    the reward: where gold = rho * reward + independent noise in every pool (a reward of one quality everywhere, rho
    the pool's correlation) the slope is rho for every selection, 1 when the reward is gold, and a selection whose
    slope falls below uniform's keeps samples where the reward tells gold apart worse than over the whole pool (the
    top end of the reward model, for `top`). Pooled rather than a mean of each group's own slope, which divides by
    the kept reward spread of K samples and has no bounded variance where that spread is near 0."""
    r, g, r_pool, g_pool = (t.double() for t in (reward_BK, gold_BK, reward_pool_BG, gold_pool_BG))
    s_r, s_g = r_pool.std(1, keepdim=True), g_pool.std(1, keepdim=True)  # (B, 1)
    spread = ((s_r > 0) & (s_g > 0)).squeeze(1)  # (B,)
    dr = (r - r.mean(1, keepdim=True))[spread] / s_r[spread]  # (B', K)
    dg = (g - g.mean(1, keepdim=True))[spread] / s_g[spread]  # (B', K)
    squares = (dr * dr).sum()
    return (dr * dg).sum() / squares if float(squares) > 0 else squares.new_tensor(float("nan"))

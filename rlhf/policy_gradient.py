"""The policy-gradient math of grpo.py as pure functions: selection of K of G samples, advantages (GRPO's, Dr. GRPO's,
RLOO's, REINFORCE++'s), the per-token loss and its aggregation.

Order of reward processing in grpo.py, per prompt with G samples:

    1. raw score      r_raw = RM(prompt + response), read at the last real token (or summed over the response)
    2. penalty        r_pen = r_raw - missing_end_penalty * (1 - has_end)             raw RM units
    3. normalize      r     = gain * r_pen + bias                                      RM's fitted gain/bias
    4. selection      K of the G samples, from r (RSO / top / top-bottom / uniform / all)
    5. advantage      by --advantage (ADVANTAGES) over the K *selected* samples, e.g. GRPO's
                      A = (r - mean_K(r)) / (std_K(r) + eps); Dr. GRPO's r - mean_K(r); RLOO's leave-one-out;
                      pool_normalized's (r - mean_G(r)) / (std_G(r) + eps), statistics of all G scored samples
    6. global norm    A = (A - mean(A)) / (std(A) + eps)        over every selected sample on every rank

The penalty is applied in raw units before the gain/bias, so penalised and unpenalised rewards share one scale
(a constant written over already-normalised rewards would mix two scales). GRPO's group normalization and global
normalization are invariant to the gain and bias (up to eps); the centred estimators (dr_grpo, rloo) keep the gain
as their scale unless global normalization follows. The penalty in normalised units is gain * missing_end_penalty.

Each choice of the algorithm (selection rule, advantage estimator, KL estimator, rollout correction, loss
aggregation) is a function registered by name where it is defined (rlhf/registry.py); the option names it.

Shapes: B prompts, G samples per prompt, K selected, N = B * K sequences, T response tokens.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.registry import Registry


def _no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a single process: the tensor itself."""
    return t


# ----------------------------------------------------------------------------------------------------
# Rewards


def penalize_missing_end(raw_rewards_N: torch.Tensor, has_end_N: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract `penalty` (raw reward-model units) from the raw score of every response without an end token."""
    return raw_rewards_N.float() - penalty * (~has_end_N.bool()).float()


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
    pool_BG: torch.Tensor, kept_BK: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor] = _no_reduce
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


# ----------------------------------------------------------------------------------------------------
# Advantages (--advantage: ADVANTAGES). Each estimator takes the rewards (B, K) of the K kept samples of B groups and
# `reduce_sum`, which sums a tensor over ranks (the estimators that use batch statistics read the global batch
# through it), and returns advantages (B, K) fp32. What it sees is what selection kept and dynamic sampling did not
# drop: the statistics of a group are those of its K kept samples, a batch's those of every kept group of every
# rank. --global_norm then whitens the result over that same global batch, whichever estimator made it. A
# registration declaring min_kept needs at least that many kept samples per group; one declaring pool also takes
# `pool_BG`, the rewards (B, G) of all G scored samples of the same groups, and reads its group statistics there.

ADVANTAGES = Registry("advantage estimator")

# Group statistics are computed in float64 and the advantages returned in fp32. In fp32 the mean of K identical
# rewards is often a few ulp off the reward itself (the partial sums round), so a group that scored all alike would
# get a small advantage of one sign on every sample instead of 0 (divided by std + eps ~ 1e-4 it reaches 1e-3 to
# 1e-2) and shift every other group through the global mean. The rewards are fp32: K * r is exact in float64 for any
# K < 2**29, so the float64 mean of identical rewards is the reward itself and their advantages are exactly 0.


@ADVANTAGES.register("grpo", help="GRPO's (r - mean) / (std + eps) within each group (arXiv 2402.03300)", min_kept=2)
def group_normalize(rewards_BK: torch.Tensor, reduce_sum=None, eps: float = 1e-4) -> torch.Tensor:
    """GRPO outcome advantage (DeepSeekMath, arXiv 2402.03300, section 4.1.2): (r - mean) / (std + eps) within each
    prompt's group (B, K), statistics in float64, result fp32. std is the sample std (Bessel-corrected), as in TRL."""
    r = rewards_BK.double()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).float()


@ADVANTAGES.register("dr_grpo", help="Dr. GRPO's r - mean within each group, no std (arXiv 2503.20783)")
def group_center(rewards_BK: torch.Tensor, reduce_sum=None) -> torch.Tensor:
    """Dr. GRPO advantage (Liu et al. 2025, arXiv 2503.20783): r - mean within each group (mean in float64, result
    fp32), no std division, which would up-weight prompts whose samples all score alike (too easy or too hard)."""
    r = rewards_BK.double()
    return (r - r.mean(1, keepdim=True)).float()


@ADVANTAGES.register("rloo", help="RLOO's r minus the mean of the group's other K - 1 (arXiv 2402.14740)", min_kept=2)
def leave_one_out(rewards_BK: torch.Tensor, reduce_sum=None) -> torch.Tensor:
    """RLOO advantage (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024,
    arXiv 2402.14740, section 3.3): each sample's reward minus the mean reward of the other K - 1 samples of its
    group, r_i - (sum_j r_j - r_i) / (K - 1) = K / (K - 1) (r_i - mean). The baseline does not depend on the sample
    it is subtracted from, so for K samples drawn independently from the policy (--selection all or uniform) the
    gradient stays unbiased; no std division. Statistics in float64, result fp32; K >= 2."""
    r = rewards_BK.double()
    K = r.shape[1]
    return (r - (r.sum(1, keepdim=True) - r) / (K - 1)).float()


@ADVANTAGES.register(
    "pool_normalized", help="GRPO's (r - mean) / (std + eps) with the mean and std of all G scored samples", pool=True
)
def pool_normalize(
    rewards_BK: torch.Tensor, reduce_sum=None, pool_BG: torch.Tensor | None = None, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's advantage with the group statistics of the whole scored pool: (r - mean_G) / (std_G + eps), the mean
    and sample std (Bessel-corrected) over all G scored samples of the group (B, G), applied to its K kept (B, K).
    The pool is scored before selection, so its statistics cost nothing, and they do not depend on which samples
    selection kept: a kept set of the pool's favourites gets mostly positive advantages, where the kept set's own
    statistics would centre them (about half negative). With --global_norm the batch's mean advantage is then
    subtracted, one baseline for every group. When selection keeps all G, the kept are the pool in its order and
    this is `grpo` bit for bit. Statistics in float64, result fp32; needs G >= 2, any K >= 1."""
    if pool_BG is None:
        raise ValueError("pool_normalized needs the rewards of every scored sample of each group (pool_BG)")
    r, pool = rewards_BK.double(), pool_BG.double()
    return ((r - pool.mean(1, keepdim=True)) / (pool.std(1, keepdim=True) + eps)).float()


def informative_groups(rewards_BK: torch.Tensor, min_std: float) -> torch.Tensor:
    """DAPO's dynamic sampling filter (arXiv 2503.14476, eq. 11), as a threshold: True (B,) for the groups whose kept
    rewards have a sample std (float64) of at least `min_std`. A group that scored all alike has advantage 0 and only
    dilutes the batch; continuous reward-model rewards rarely tie exactly, hence a threshold rather than equality.
    min_std = 0 keeps every group."""
    if min_std <= 0:
        return torch.ones(rewards_BK.shape[0], dtype=torch.bool, device=rewards_BK.device)
    return rewards_BK.double().std(1) >= min_std


def global_normalize(
    advantages: torch.Tensor,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = _no_reduce,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten advantages over the whole batch: (A - mean) / (std + eps), population std.

    `reduce_sum` sums a tensor over ranks (utils.dist.all_reduce_sum); count, sum and sum of squares are
    reduced together in fp64, so the statistics are those of the concatenated global batch, not the local shard."""
    a = advantages.double()
    count = torch.tensor(float(a.numel()), dtype=torch.float64, device=a.device)
    stats = reduce_sum(torch.stack([count, a.sum(), (a * a).sum()]))
    count, total, total_sq = stats[0], stats[1], stats[2]
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0.0)
    return ((a - mean) / (var.sqrt() + eps)).to(advantages.dtype)


@ADVANTAGES.register("reinforce_pp", help="REINFORCE++'s r whitened over the global batch, no group (arXiv 2501.03262)")
def batch_whitened_reward(
    rewards_BK: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor] = _no_reduce
) -> torch.Tensor:
    """REINFORCE++ advantage (Hu et al. 2025, arXiv 2501.03262, section 3): A = r(x, y) - beta sum_{i>=t} KL(i),
    normalised over the global batch, (A - mean_batch A) / std_batch A; no group baseline, so it needs no group of
    samples per prompt (K >= 1). Here the reward is the response's outcome reward: with --kl_in reward it already
    holds minus beta x the response's summed KL estimate (the paper's A at its first token; the paper subtracts each
    token's remaining KL), with --kl_in loss the KL is a loss term instead. The batch is every kept sample of every
    rank (`reduce_sum`); population std, eps 1e-8 (global_normalize). The paper's other variant, REINFORCE++ w/
    baseline (group mean subtracted, then the same global normalisation), is --advantage dr_grpo --global_norm true."""
    return global_normalize(rewards_BK.float(), reduce_sum)


def advantages(
    rewards_BK: torch.Tensor,
    estimator: str,
    global_norm: bool,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = _no_reduce,
    pool_BG: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages (B*K,) of the kept samples by `estimator` (a name in ADVANTAGES), then, with global_norm, whitened
    over the whole batch across ranks (`reduce_sum` sums over ranks). `pool_BG` (B, G), the rewards of every scored
    sample of the same groups, goes to the estimators registered with pool=True."""
    estimate = ADVANTAGES[estimator]
    pool = {"pool_BG": pool_BG} if ADVANTAGES.facts[estimator].get("pool") else {}
    a = estimate(rewards_BK, reduce_sum, **pool).flatten()  # (B*K,)
    return global_normalize(a, reduce_sum) if global_norm else a


# ----------------------------------------------------------------------------------------------------
# Per-token loss
#
# With top-k / top-p the processed log-prob of a token outside the kept set is -inf: the reference may not keep a
# token the policy sampled, and after an update (mu > 1) or from bf16 noise at the edge of the set, neither may the
# policy. -inf - (-inf) is NaN, so log-probs are floored at LOGPROB_FLOOR (no gradient flows through a floored
# value), log-ratios are clamped to [-20, 20] before exp and the k3 KL to at most 10 per token, as verl does
# ("low_var_kl"). Without top-k / top-p none of these bounds is reached in practice.

LOGPROB_FLOOR = -1e4
LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


# KL estimators (Schulman, "Approximating KL divergence", 2020) of KL(pi || pi_ref) per token, with samples from pi
# and log r = ref - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. k1 and k3 are unbiased in value; what
# the update uses is their gradient (arXiv 2512.21852 compares them). Differentiated as a loss term, on-policy:
#   k1:  E[grad k1] = E[grad logp] = 0: no pull towards the reference at all
#   k2:  E[grad k2] = E[(logp - ref) grad logp] = grad KL(pi || pi_ref): unbiased
#   k3:  E[grad k3] = -sum_y pi_ref(y) grad logp(y) = grad KL(pi_ref || pi): the *forward* KL's gradient (biased)
# and in the reward (detached, through the policy gradient), k1 gives E[k1 grad logp] = grad KL(pi || pi_ref).
# Weighting k1 or k3 by the ratio rho = pi / pi_old (pi_old detached; value 1 on-policy) makes the loss term an
# importance-sampled estimate of KL(pi || pi_ref) whose gradient is unbiased: E_old[grad(rho k)] = grad E_pi[k].
# tests/test_grpo_options.py checks each of these exactly on a toy categorical policy. Each estimator takes
# (logp, ref_logp) of any shape; log-ratios are clamped to +-LOG_RATIO_CLAMP and the estimate to +-KL_CLAMP.
KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", help="-log r (can be negative)")
def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref per token, clamped to +-KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (-log_ratio).clamp(-KL_CLAMP, KL_CLAMP)


@KL_ESTIMATORS.register("k2", help="(log r)^2 / 2")
def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref)^2 / 2 per token, >= 0; clamped at KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (0.5 * log_ratio * log_ratio).clamp(max=KL_CLAMP)


@KL_ESTIMATORS.register("k3", help="r - 1 - log r, DeepSeekMath's")
def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token (DeepSeekMath eq. 4):
    exp(ref - logp) - (ref - logp) - 1, >= 0, unbiased for samples from pi; clamped at KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(max=KL_CLAMP)


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (any shape) by `estimator` (a name in KL_ESTIMATORS)."""
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL estimate of each whole response (N,): the sum over its tokens (`mask`) of `estimator`'s per-token
    estimate, log-probs floored at LOGPROB_FLOOR as in the loss; times beta, the penalty that --kl_in reward
    subtracts from the response's reward (InstructGPT-style, there with k1 per token)."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero).clamp(min=LOGPROB_FLOOR)
    ref_logp = torch.where(mask, ref_logp, zero).clamp(min=LOGPROB_FLOOR)
    return torch.where(mask, token_kl(logp, ref_logp, estimator), zero).sum(1)


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip objective, negated to a loss (DeepSeekMath eq. 3; DAPO's decoupled eps_low / eps_high):
    -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - old_logp), per token (N, T).
    `advantages` is (N, T) or (N, 1). Also returns where the clipped branch is active (its gradient is 0)."""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    is_clipped = clipped < unclipped  # the min picks the constant branch
    return -torch.minimum(unclipped, clipped), is_clipped


def sequence_clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages_N: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's sequence-level clipped objective (arXiv 2507.18071, eqs. 5-7), negated to a loss (N,):
    -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) with s = exp(mean over the response's tokens of
    (logp - old_logp)), one ratio per sequence, clipped per sequence. logp and old_logp (N, T) must be 0 (finite)
    where `mask` is False. Returns the loss, whether each sequence is clipped, and s (N,)."""
    m = mask.float()
    log_s = ((logp - old_logp) * m).sum(1) / m.sum(1).clamp(min=1.0)  # (N,) length-normalised log-ratio
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = s * advantages_N
    clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages_N
    return -torch.minimum(unclipped, clipped), clipped < unclipped, s


def spread_sequence_loss(loss_N: torch.Tensor, weights_NT: torch.Tensor) -> torch.Tensor:
    """A per-sequence loss (N,) as a per-token one (N, T) that the aggregation's token weights w turn back into
    exactly loss_i: loss_i / sum_t w_it on each weighted token, so sum_t w_it * out_it = loss_i. Every sequence then
    counts once, with weight 1 / Z, under every --loss_type. (Broadcasting loss_i to every token instead makes
    sum_t w_it * loss_i = |o_i| * loss_i under the token-sum aggregations: a long response would weigh more.)"""
    seq_weight = weights_NT.sum(1, keepdim=True)  # (N, 1)
    return torch.where(weights_NT > 0, loss_N[:, None] / seq_weight.clamp(min=1e-12), 0.0)


# Rollout corrections (--rollout_correction: ROLLOUT_CORRECTIONS): each takes the sampler / trainer probability ratios
# rho and the cap, and returns (the weights, where they differ from rho: beyond the cap), both rho's shape.
ROLLOUT_CORRECTIONS = Registry("rollout correction")


@ROLLOUT_CORRECTIONS.register("none", help="no correction")
def no_correction(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight 1 everywhere."""
    return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)


@ROLLOUT_CORRECTIONS.register("tis", help="truncated importance sampling, min(rho, cap)")
def truncated_importance(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w = min(rho, cap) (Yao et al. 2025, "off-policy RL" note)."""
    return rho.clamp(max=cap), rho > cap


@ROLLOUT_CORRECTIONS.register("mis", help="masked importance sampling, rho or 0 beyond the cap")
def masked_importance(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w = rho if rho <= cap else 0: tokens / sequences beyond the cap drop out."""
    beyond = rho > cap
    return torch.where(beyond, 0.0, rho), beyond


MISMATCH_BAND = (0.9, 1.1)  # a token whose trainer / sampler probability ratio lies outside counts as mismatched


def rollout_correction(
    train_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    method: str,
    cap: float,
    level: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights (detached) that correct the policy loss for the sampler / trainer mismatch: the tokens were
    drawn from the sampler's distribution (its own log-probs, e.g. a KV-cache or bf16 inference path), the loss is
    that of the trainer's (the training forward at the same weights); rho = exp(train_logp - sampler_logp).

        tis  truncated importance sampling: w = min(rho, cap)              (Yao et al. 2025, "off-policy RL" note)
        mis  masked importance sampling:    w = rho if rho <= cap else 0   (tokens / sequences beyond the cap drop)

    `level` "token": one rho per token, weights (N, T); "sequence": rho = exp(mean over the response of the log
    gap), GSPO's length-normalised ratio, one weight per sequence (N, 1). Returns the weights (1 where masked and
    for method "none") and where they differ from rho (N, T) (truncated or masked; False for "none")."""
    weigh = ROLLOUT_CORRECTIONS[method]
    m = mask & torch.isfinite(train_logp) & torch.isfinite(sampler_logp)
    gap = torch.where(m, train_logp - sampler_logp, 0.0).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
    if level == "sequence":
        gap = (gap.sum(1) / m.sum(1).clamp(min=1)).unsqueeze(1)  # (N, 1)
    elif level != "token":
        raise ValueError(f"unknown importance level {level!r}; expected token or sequence")
    w, beyond = weigh(torch.exp(gap), cap)
    return w, beyond.expand_as(mask) & mask


def mismatch_stats(train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sampler / trainer mismatch of one micro-batch, over its response tokens where both log-probs are finite, as
    fp64 scalars: `tokens`, `outside_band` (tokens whose exp(train_logp - sampler_logp) lies outside MISMATCH_BAND),
    `abs_log_gap` (sum of |log gap|), all summed over ranks, and `max_abs_log_gap`, reduced by max. The mean alone
    hides a tail of mismatched tokens, hence the share outside the band and the max. No host read: a micro-batch
    with no such token has a max of 0 (the gap is 0 wherever it is not counted)."""
    m = mask & torch.isfinite(train_logp) & torch.isfinite(sampler_logp)
    gap = torch.where(m, train_logp.double() - sampler_logp.double(), 0.0)
    lo, hi = math.log(MISMATCH_BAND[0]), math.log(MISMATCH_BAND[1])
    outside = m & ((gap < lo) | (gap > hi))
    return {
        "tokens": m.sum().double(),
        "outside_band": outside.sum().double(),
        "abs_log_gap": gap.abs().sum(),
        "max_abs_log_gap": gap.abs().max(),
    }


def floor_logprobs(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logp` with masked positions replaced by 0 and the rest floored at LOGPROB_FLOOR: padding can be -inf (outside
    a top-k set), and -inf * 0 would be NaN in the value and in the gradient; a floored value passes no gradient."""
    return torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).clamp(min=LOGPROB_FLOOR)


@dataclass(frozen=True)
class Objective:
    """The per-token GRPO loss as three terms, with the options bound once per run (OpenRLHF's PolicyLoss; verl's
    compute_policy_loss + agg_loss): each term takes tensors only.

        policy   clipped ratio x advantage (one ratio per token, or GSPO's per sequence: `importance_level`), times
                 the rollout correction's weights (`rollout_correction`, `rollout_correction_cap`)
        kl       beta x the KL estimate (`kl_estimator`, times pi / pi_old with `kl_ratio`); beta = 0 when the KL
                 is in the reward instead
        entropy  entropy_coef x the token entropy, subtracted (a bonus; a penalty when negative)

    `token_loss` composes them into the loss (N, T), 0 on masked tokens; the aggregation's token weights turn it
    into a scalar (AGGREGATIONS)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    importance_level: str = "token"
    rollout_correction: str = "none"
    rollout_correction_cap: float = 3.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio: bool = False
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.importance_level not in ("token", "sequence"):
            raise ValueError(f"unknown importance level {self.importance_level!r}; expected token or sequence")
        KL_ESTIMATORS.check(self.kl_estimator)
        ROLLOUT_CORRECTIONS.check(self.rollout_correction)

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss has an entropy term (the log-prob pass must then return a differentiable entropy)."""
        return self.entropy_coef != 0

    def correction(self, train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor):
        """(rollout-correction weights (N, T) or (N, 1), detached, or None without a correction; where they differ
        from the ratio (N, T)): see rollout_correction."""
        w, corrected = rollout_correction(
            train_logp, sampler_logp, mask, self.rollout_correction, self.rollout_correction_cap, self.importance_level
        )
        return (None if self.rollout_correction == "none" else w), corrected

    def policy_term(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages_N: torch.Tensor,
        mask: torch.Tensor,
        weights_NT: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clipped surrogate loss (N, T), where it is clipped (N, T), the ratio (N, T), detached) from floored
        log-probs (floor_logprobs). At sequence level GSPO's loss is spread over the tokens with the aggregation's
        token weights `weights_NT`, so each sequence counts once whatever its length, and each token carries its
        sequence's ratio and clipping. Times the rollout `correction` weights when given."""
        if self.importance_level == "token":
            adv_N1 = advantages_N[:, None]
            surrogate, is_clipped = clipped_surrogate(logp, old_logp, adv_N1, self.eps_low, self.eps_high)
            ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
        else:
            if weights_NT is None:
                raise ValueError("the sequence-level importance ratio needs the aggregation's token weights")
            loss_N, clipped_N, s_N = sequence_clipped_surrogate(
                logp, old_logp, advantages_N, mask, self.eps_low, self.eps_high
            )
            surrogate = spread_sequence_loss(loss_N, weights_NT)
            is_clipped, ratio = clipped_N[:, None].expand_as(mask), s_N[:, None].detach().expand_as(logp)
        if correction is not None:
            surrogate = surrogate * correction
        return surrogate, is_clipped, ratio

    def kl_term(
        self, logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta x the KL estimate (N, T), times pi / pi_old with kl_ratio (pi_old detached); the estimate (N, T))
        from floored log-probs."""
        kl = token_kl(logp, ref_logp, self.kl_estimator)
        if self.kl_ratio:
            kl_weighted = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * kl
        else:
            kl_weighted = kl
        return self.beta * kl_weighted, kl

    def entropy_term(self, entropy_NT: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """entropy_coef x H per response token (0 on masked tokens), subtracted from the loss: PPO's entropy bonus
        (Schulman et al. 2017, eq. 9), which keeps the policy from collapsing onto a few tokens. `entropy_NT` must
        carry the gradient (rlhf/logprobs.py with with_entropy=True)."""
        return self.entropy_coef * torch.where(mask, entropy_NT, 0.0)

    def token_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages_N: torch.Tensor,
        mask: torch.Tensor,
        *,
        weights_NT: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        entropy_NT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss (N, T), 0 on masked tokens: policy term + KL term, minus the entropy term when
        entropy_coef != 0 (then `entropy_NT` is required). Response tokens outside a top-k / top-p set are floored
        (see above). Also returns per-token `kl`, `clipped` and `ratio_deviation` |rho - 1| (N, T), detached and
        masked, for logging (rho is exactly 1 in the first of mu > 1 updates)."""
        logp, old_logp, ref_logp = (floor_logprobs(x, mask) for x in (logp, old_logp, ref_logp))
        policy_NT, is_clipped, ratio = self.policy_term(logp, old_logp, advantages_N, mask, weights_NT, correction)
        kl_NT, kl = self.kl_term(logp, old_logp, ref_logp)
        loss = torch.where(mask, policy_NT + kl_NT, torch.zeros((), dtype=logp.dtype, device=logp.device))
        if self.needs_entropy:
            loss = loss - self.entropy_term(entropy_NT, mask)
        return loss, {
            "kl": (kl * mask).detach(),
            "clipped": (is_clipped & mask),
            "ratio_deviation": ((ratio - 1.0).abs() * mask),
        }


# ----------------------------------------------------------------------------------------------------
# Aggregation: every variant is sum_{i,t} w_it * loss_it / Z, with token weights w that depend on the mask only
# and a normaliser Z that is a sum over sequences. So Z can be summed over micro-batches and ranks before any
# backward pass, and the gradient does not depend on how the batch is split. Each returns (w (N, T), Z part).
# A row without response tokens (the filler micro-batches that keep ranks in step when --min_group_std dropped
# groups) has w = 0 and adds nothing to Z. --loss_type names one of AGGREGATIONS.

AGGREGATIONS = Registry("loss aggregation")


@AGGREGATIONS.register("grpo", help="per-sequence mean, then mean over sequences")
def grpo_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`grpo` (DeepSeekMath eq. 3): mean over each sequence's tokens, then mean over sequences:
    w_it = 1 / |o_i|, Z = number of sequences."""
    m = mask.float()
    return m / m.sum(1, keepdim=True).clamp(min=1.0), mask.any(1).sum().float()


@AGGREGATIONS.register("dapo", help="mean over all tokens, as bnpo")
@AGGREGATIONS.register("bnpo", help="mean over all tokens")
def token_mean_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`bnpo` / `dapo` (DAPO, arXiv 2503.14476, eq. 12): mean over every response token of the global batch,
    so long sequences count per token: w_it = 1, Z = number of tokens."""
    m = mask.float()
    return m, m.sum()


@AGGREGATIONS.register("dr_grpo", help="sum / (sequences x max_new_tokens)")
def dr_grpo_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`dr_grpo` (Dr. GRPO, arXiv 2503.20783): no per-sequence 1/|o_i|; a constant normaliser
    Z = number of sequences x max_new_tokens, w_it = 1."""
    return mask.float(), mask.any(1).sum().float() * max_new_tokens


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) at each position (B, T), fp32; -inf logits (masked tokens) count 0. The
    plain whole-tensor form; the update uses rlhf/logprobs.py's chunked one (tests/test_logprobs.py: equal)."""
    logp = logits_BTV.float().log_softmax(-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)

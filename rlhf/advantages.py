"""Advantages of the kept samples, grpo.py's steps 5 and 6 (rlhf/policy_gradient.py gives the order of the steps),
as pure functions: the estimators (--advantage: ADVANTAGES: GRPO's, Dr. GRPO's, RLOO's, REINFORCE++'s, the pool's
statistics) over each group's K kept samples, then, with --global_norm, the whitening over the global batch.

Shapes: B prompts, G samples per prompt, K kept.
"""

from collections.abc import Callable

import torch

from rlhf.registry import Registry
from rlhf.selection import no_reduce

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


def kept_and_pool(name: str, rewards_BK: torch.Tensor, pool_BG: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The kept rewards (B, K) and the pool's (B, G) in float64, for the estimators registered with pool=True (`name`
    is the estimator's, for the error when the pool is missing)."""
    if pool_BG is None:
        raise ValueError(f"{name} needs the rewards of every scored sample of each group (pool_BG)")
    return rewards_BK.double(), pool_BG.double()


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
    r, pool = kept_and_pool("pool_normalized", rewards_BK, pool_BG)
    return ((r - pool.mean(1, keepdim=True)) / (pool.std(1, keepdim=True) + eps)).float()


# The two halves of pool_normalized, which changes GRPO's centre and scale at once: each takes one statistic from the
# pool and the other from the kept set, so an experiment can tell which of the two a change of estimator moves.


@ADVANTAGES.register(
    "pool_centered",
    help="(r - mean) / (std + eps), the mean of all G scored samples, the std of the K kept",
    pool=True,
    min_kept=2,
)
def pool_center(
    rewards_BK: torch.Tensor, reduce_sum=None, pool_BG: torch.Tensor | None = None, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's advantage with the pool's centre and the kept set's scale: (r - mean_G) / (std_K + eps), the mean over
    all G scored samples of the group (B, G), the sample std (Bessel-corrected) over its K kept (B, K). Against
    `grpo` it moves the centre only, against `pool_normalized` the scale only. When selection keeps all G it is
    `grpo` bit for bit. Statistics in float64, result fp32; K >= 2."""
    r, pool = kept_and_pool("pool_centered", rewards_BK, pool_BG)
    return ((r - pool.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).float()


@ADVANTAGES.register(
    "pool_scaled", help="(r - mean) / (std + eps), the mean of the K kept, the std of all G scored samples", pool=True
)
def pool_scale(
    rewards_BK: torch.Tensor, reduce_sum=None, pool_BG: torch.Tensor | None = None, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's advantage with the kept set's centre and the pool's scale: (r - mean_K) / (std_G + eps), the mean over
    the group's K kept (B, K), the sample std (Bessel-corrected) over all G scored samples (B, G). Against `grpo` it
    moves the scale only, against `pool_normalized` the centre only. When selection keeps all G it is `grpo` bit for
    bit. Statistics in float64, result fp32; needs G >= 2, any K >= 1 (one kept sample gets 0)."""
    r, pool = kept_and_pool("pool_scaled", rewards_BK, pool_BG)
    return ((r - r.mean(1, keepdim=True)) / (pool.std(1, keepdim=True) + eps)).float()


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
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = no_reduce,
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
    rewards_BK: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor] = no_reduce
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
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = no_reduce,
    pool_BG: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages (B*K,) of the kept samples by `estimator` (a name in ADVANTAGES), then, with global_norm, whitened
    over the whole batch across ranks (`reduce_sum` sums over ranks). `pool_BG` (B, G), the rewards of every scored
    sample of the same groups, goes to the estimators registered with pool=True."""
    estimate = ADVANTAGES[estimator]
    pool = {"pool_BG": pool_BG} if ADVANTAGES.facts[estimator].get("pool") else {}
    a = estimate(rewards_BK, reduce_sum, **pool).flatten()  # (B*K,)
    return global_normalize(a, reduce_sum) if global_norm else a

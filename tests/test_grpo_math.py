"""rlhf/selection.py, advantages.py and policy_gradient.py: selection, advantages, the per-token loss and the
aggregation variants, against values worked by hand, an independent loop implementation of RSO Algorithm 1, and
invariances."""

import math
import random

import pytest
import torch

from rlhf.advantages import (
    ADVANTAGES,
    advantages,
    batch_whitened_reward,
    global_normalize,
    group_center,
    group_normalize,
    leave_one_out,
    pool_center,
    pool_normalize,
    pool_scale,
)
from rlhf.policy_gradient import (
    AGGREGATIONS,
    Objective,
    clipped_surrogate,
    dr_grpo_weights,
    grpo_weights,
    k3_kl,
    penalize_missing_end,
    token_entropy,
    token_mean_weights,
)
from rlhf.selection import (
    gold_alignment,
    select_all,
    select_rso,
    select_top,
    select_top_bottom,
    select_uniform,
    selection_diagnostics,
)


def aggregate(loss, mask, name, max_new_tokens=6):
    w, z = AGGREGATIONS[name](mask, max_new_tokens)
    return (w * loss).sum() / z


def ragged_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


# ----------------------------------------------------------------------------------------------------
# Rewards and selection


def test_penalty_is_subtracted_in_raw_units():
    raw = torch.tensor([1.5, -0.5, 2.0])
    has_end = torch.tensor([True, False, False])
    assert torch.equal(penalize_missing_end(raw, has_end, 1.0), torch.tensor([1.5, -1.5, 1.0]))


def test_rso_with_tiny_beta_keeps_the_top_k():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(50, 16, generator=g)
    idx, stats = select_rso(rewards, 4, beta=1e-6, generator=g)
    top = rewards.topk(4, dim=1).indices.sort(dim=1).values
    assert torch.equal(idx, top)
    # one acceptance (the remaining maximum) per round: rounds 1-3 visit all 16 + 15 + 14 remaining candidates,
    # round 4 stops at its maximum, somewhere among the last 13
    assert (stats["rounds"] == 4).all()
    assert ((stats["visited"] > 45) & (stats["visited"] <= 45 + 13)).all()
    assert stats["visited"].float().std() > 0  # where round 4 meets the maximum varies


def test_top_keeps_the_k_best_ties_to_the_lower_column_and_is_rsos_tiny_beta_limit():
    rewards = torch.tensor([[0.5, 2.0, -1.0, 2.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    idx, stats = select_top(rewards, 3)
    # row 0: 3.0 (column 4), then three tied at 2.0 (columns 1, 3, 5) for two places: columns 1 and 3
    # row 1: all tied: the first three columns
    assert idx.tolist() == [[1, 3, 4], [0, 1, 2]]
    assert stats["visited"].tolist() == [6.0, 6.0] and stats["rounds"].tolist() == [1.0, 1.0]  # acceptance K / G
    assert select_top(rewards, 6)[0].tolist() == select_all(rewards)[0].tolist()
    with pytest.raises(ValueError):
        select_top(rewards, 7)
    g = torch.Generator().manual_seed(0)
    distinct = torch.randn(50, 16, generator=g)  # no ties: RSO at a tiny temperature keeps the same K
    assert torch.equal(select_top(distinct, 4)[0], select_rso(distinct, 4, beta=1e-6, generator=g)[0])


def test_selection_diagnostics_by_hand_and_summed_over_ranks():
    """Three groups of G = 5 scored samples, K = 3 kept (rlhf/selection.py selection_diagnostics):
    group 0: pool 0..4 (mean 2, s2 2.5), kept 2, 3, 4 (mean 3, s2 1): shift 1 / sqrt(2.5), variance ratio 0.4,
             |deviations| 1, 0, 1: ESS 2^2 / 2 = 2
    group 1: pool 0, 0, 0, 0, 5 (mean 1, s2 5), kept 0, 0, 5 (mean 5/3, s2 25/3): shift (2/3) / sqrt(5), ratio 5/3,
             |deviations| 5/3, 5/3, 10/3: ESS (20/3)^2 / (150/9) = 8/3
    group 2: pool all 2 (tied): shift 0, ratio counted 1, pool variance 0, kept tied (not in the ESS mean)."""
    pool = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0, 5.0], [2.0] * 5])
    kept = torch.tensor([[2.0, 3.0, 4.0], [0.0, 0.0, 5.0], [2.0] * 3])
    want = {
        "mean_shift": (1 / math.sqrt(2.5) + (2 / 3) / math.sqrt(5)) / 3,
        "std_ratio": math.sqrt((0.4 + 5 / 3 + 1) / 3),
        "pool_std": math.sqrt((2.5 + 5 + 0) / 3),
        "ess": (2 + 8 / 3) / 2,
        "tied_fraction": 1 / 3,
    }
    got = selection_diagnostics(pool, kept)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(float(got[k]) - v) < 1e-12, (k, float(got[k]), v)
    # two ranks, groups 0-1 on rank 0 and group 2 on rank 1: each rank's sums plus the other's give the global values
    # (averaging the ranks' own values would not: rank 1 alone has ESS 0 and shift 0)
    other = {}

    def keep_sums(t):
        other["sums"] = t
        return t

    alone = selection_diagnostics(pool[2:], kept[2:], keep_sums)
    assert float(alone["ess"]) == 0 and float(alone["tied_fraction"]) == 1
    summed = selection_diagnostics(pool[:2], kept[:2], lambda t: t + other["sums"])
    for k, v in want.items():
        assert abs(float(summed[k]) - v) < 1e-12, k
    # every sample kept: no shift, the spread of the pool
    full = selection_diagnostics(pool, pool)
    assert float(full["mean_shift"]) == 0 and abs(float(full["std_ratio"]) - 1) < 1e-12


def test_selection_diagnostics_of_each_selection_on_normal_rewards():
    """docs/grpo.md's table: 8 of 64 standard normal rewards, 4,000 groups. RSO's exponential tilt of a normal moves
    its mean by sigma^2 / beta_rs and keeps its variance, until the pool's top is reached; uniform selection keeps the
    pool's mean and (in expectation of the variance) spread; top_bottom keeps the extremes, all about equally far from
    their mean."""
    from rlhf.selection import select

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(4000, 64, generator=g)
    want = {  # selection, beta_rs: mean shift, std ratio, ESS (to 0.05)
        ("uniform", 0.0): (0.0, 1.0, 5.49),
        ("rso", 8.0): (0.125, 1.0, 5.51),
        ("rso", 2.0): (0.5, 1.0, 5.51),
        ("rso", 0.5): (1.34, 0.75, 5.45),
        ("top", 0.0): (1.62, 0.44, 5.55),
        ("top_bottom", 0.0): (0.0, 2.09, 7.77),
    }
    for (name, beta), (shift, ratio, ess) in want.items():
        idx, _ = select(pool, name, 8, beta, g)
        got = selection_diagnostics(pool, pool.gather(1, idx))
        assert abs(float(got["mean_shift"]) - shift) < 0.05, (name, beta, float(got["mean_shift"]))
        assert abs(float(got["std_ratio"]) - ratio) < 0.05, (name, beta, float(got["std_ratio"]))
        assert abs(float(got["ess"]) - ess) < 0.05, (name, beta, float(got["ess"]))
        assert float(got["tied_fraction"]) == 0 and abs(float(got["pool_std"]) - 1) < 0.01


def test_gold_alignment_by_hand():
    """Two groups of G = 4 scored samples, K = 2 kept (rlhf/selection.py gold_alignment):
    group 0: pool gold 0..3 (mean 1.5, s2 5/3), kept gold 2, 3 (s2 1/2), rewards 1, 2, advantages -1, +1:
             gold shift 1 / sqrt(5/3), variance ratio 0.3, corr +1;
    group 1: pool gold all 1 (tied), kept rewards 0, 4 with advantages +1, -1: shift, ratio and corr undefined.
    rms of the advantages 1, s_pool = sqrt((5/3 + 0) / 2): signal of group 0 (-0.5 + 1.5) / (2 s_pool), of group 1
    0 (its gold equals the pool mean)."""
    pool = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0] * 4])
    reward = torch.tensor([[1.0, 2.0], [0.0, 4.0]])
    gold = torch.tensor([[2.0, 3.0], [1.0, 1.0]])
    adv = torch.tensor([[-1.0, 1.0], [1.0, -1.0]])
    got = gold_alignment(pool, reward, gold, adv)
    s_pool = math.sqrt(5 / 6)
    want = {
        "gold_shift": (1 / math.sqrt(5 / 3), math.nan),
        "gold_var_ratio": (0.3, math.nan),
        "corr": (1.0, math.nan),
        "signal": (1 / (2 * s_pool), 0.0),
    }
    assert got.keys() == want.keys()
    for name, values in want.items():
        for v, w in zip(got[name].tolist(), values, strict=True):
            assert (math.isnan(v) and math.isnan(w)) or abs(v - w) < 1e-12, (name, got[name], values)
    # the signal scales with neither the advantages' nor the gold's units
    twice = gold_alignment(3 * pool, reward, 3 * gold, 5 * adv)
    assert torch.allclose(twice["signal"], got["signal"], rtol=1e-12)


def test_gold_alignment_reads_the_pool_mean_and_the_batch_rms_by_hand():
    """Advantages not centred within a group, and groups of different rms and pool spread (issue 63: the test above
    passes whether the signal subtracts the pool's mean or the kept one, and whether rms and s_pool are the batch's or
    each group's). G = 4, K = 2:
    group 0: pool gold 0..3 (mean 3/2, s2 5/3), kept gold 2, 3 with advantages +1, +1 (not centred): the step raises
             both, and both lie above the pool's mean: sum A (gold - m_G) = 1/2 + 3/2 = 2 (0 about the kept mean);
    group 1: pool gold 0, 0, 4, 4 (mean 2, s2 16/3), kept gold 4, 0 with advantages +3, -1: 3 * 2 + (-1)(-2) = 8.
    rms over the batch sqrt((1 + 1 + 9 + 1) / 4) = sqrt 3 (each group's own: 1 and sqrt 5); s_pool = sqrt((5/3 + 16/3)
    / 2) = sqrt(7/2) (each group's own: sqrt(5/3), sqrt(16/3)): signals 2 / (2 sqrt 3 sqrt(7/2)), 8 / (the same)."""
    pool = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 4.0, 4.0]])
    reward = torch.tensor([[1.0, 2.0], [5.0, 0.0]])
    gold = torch.tensor([[2.0, 3.0], [4.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [3.0, -1.0]])
    got = gold_alignment(pool, reward, gold, adv)["signal"].tolist()
    scale = 2 * math.sqrt(3) * math.sqrt(7 / 2)
    assert got == pytest.approx([2 / scale, 8 / scale], rel=1e-12, abs=0), got


def test_kept_slope_by_hand_and_on_normal_pools():
    """rlhf/selection.py kept_slope: the slope of gold on the training reward among the kept samples, each
    standardized by its pool's spread, pooled within groups over the batch. By hand, G = 4, K = 2:
    group 0: reward pool 0..3 (s_r = sqrt(5/3)), gold pool twice it (s_g = 2 s_r); kept rewards 1, 2 with gold 2, 6:
             standardized deviations -+1/2 / s_r and -+1 / s_r: cross 1 / s_r^2 = 3/5, squares 1/2 / s_r^2 = 3/10;
    group 1: both pools 0, 0, 4, 4 (s = 4 / sqrt 3); kept rewards 4, 0 with gold 0, 4 (reversed): deviations +-2 / s
             and -+2 / s: cross -8 / s^2 = -3/2, squares 3/2;
    group 2: a pool whose reward tied: left out. Pooled (3/5 - 3/2) / (3/10 + 3/2) = -1/2 (the mean of the groups'
    own slopes, 2 and -1, would be 1/2).
    On normal pools with gold = rho reward + noise (correlation rho everywhere), selecting on the reward leaves the
    slope at rho for every selection (regression on the variable selected on is not range-restricted), while the
    correlation among the top 8 of 64 falls to about a third of it."""
    from rlhf.selection import kept_slope, select

    reward_pool = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 4.0, 4.0], [1.0] * 4])
    gold_pool = torch.tensor([[0.0, 2.0, 4.0, 6.0], [0.0, 0.0, 4.0, 4.0], [0.0, 1.0, 2.0, 3.0]])
    reward = torch.tensor([[1.0, 2.0], [4.0, 0.0], [1.0, 1.0]])
    gold = torch.tensor([[2.0, 6.0], [0.0, 4.0], [0.0, 3.0]])
    assert float(kept_slope(reward_pool, gold_pool, reward, gold)) == pytest.approx(-0.5, rel=1e-12)
    assert math.isnan(float(kept_slope(reward_pool[2:], gold_pool[2:], reward[2:], gold[2:])))

    g = torch.Generator().manual_seed(0)
    rho = 0.5
    reward_pool = torch.randn(4000, 64, generator=g, dtype=torch.float64)
    gold_pool = rho * reward_pool + math.sqrt(1 - rho**2) * torch.randn(4000, 64, generator=g, dtype=torch.float64)
    for name, beta in (("uniform", 0.0), ("rso", 0.5), ("top", 0.0), ("top_bottom", 0.0)):
        idx, _ = select(reward_pool, name, 8, beta, g)
        r_K, g_K = reward_pool.gather(1, idx), gold_pool.gather(1, idx)
        assert abs(float(kept_slope(reward_pool, gold_pool, r_K, g_K)) - rho) < 0.04, name
        if name == "top":
            corr = gold_alignment(gold_pool, r_K, g_K, torch.zeros_like(r_K))["corr"].nanmean()
            assert float(corr) < rho / 2, float(corr)


def test_gold_alignment_of_selections_on_normal_rewards():
    """Gold = reward + independent noise of the same spread (correlation 1/sqrt 2 over the pool), 8 of 64 kept,
    group-normalized advantages. Uniform selection keeps the pool's correlation; RSO at beta_rs 2 tilts a normal
    without changing its shape, so the signal stays uniform's (0.640 against 0.647 on this draw); the pool's top end
    bends the tilt at beta_rs 0.5 and cuts it off for the top 8, which shrink the spread, the correlation and the
    signal (range restriction); keeping the extremes raises all three; gold independent of the reward: signal 0."""
    from rlhf.selection import select

    g = torch.Generator().manual_seed(0)
    reward = torch.randn(4000, 64, generator=g)
    gold = reward + torch.randn(4000, 64, generator=g)
    got = {}
    for name, beta in (("uniform", 0.0), ("rso", 2.0), ("rso", 0.5), ("top", 0.0), ("top_bottom", 0.0)):
        idx, _ = select(reward, name, 8, beta, g)
        r_K = reward.gather(1, idx)
        stats = gold_alignment(gold, r_K, gold.gather(1, idx), group_normalize(r_K))
        got[name, beta] = {k: float(v.nanmean()) for k, v in stats.items()}
    assert abs(got["uniform", 0.0]["corr"] - 1 / math.sqrt(2)) < 0.03
    assert abs(got["uniform", 0.0]["gold_shift"]) < 0.02
    order = [got[k]["signal"] for k in (("top_bottom", 0.0), ("uniform", 0.0), ("rso", 0.5), ("top", 0.0))]
    assert order == sorted(order, reverse=True), order
    assert abs(got["rso", 2.0]["signal"] - got["uniform", 0.0]["signal"]) < 0.03, got
    assert got["top", 0.0]["corr"] < got["uniform", 0.0]["corr"] - 0.1 < got["top_bottom", 0.0]["corr"] - 0.2
    idx, _ = select(reward, "uniform", 8, 0.0, g)
    r_K = reward.gather(1, idx)
    noise = torch.randn(4000, 64, generator=g)
    independent = gold_alignment(noise, r_K, noise.gather(1, idx), group_normalize(r_K))
    assert abs(float(independent["signal"].mean())) < 0.02


def test_rso_with_huge_beta_is_uniform_over_indices():
    g = torch.Generator().manual_seed(1)
    B, G, K = 4000, 8, 2
    rewards = torch.arange(G, dtype=torch.float32).expand(B, G)  # same order in every row: bias would show
    idx, stats = select_rso(rewards, K, beta=1e9, generator=g)
    assert (stats["rounds"] == 1).all() and (stats["visited"] == K).all()  # every visit accepted
    counts = torch.zeros(G).index_add_(0, idx.flatten(), torch.ones(B * K))
    expected = B * K / G  # 1000 per index; binomial sd ~ 29
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, counts  # chi-square with 7 d.o.f.: p = 0.001
    assert (idx[:, 0] != idx[:, 1]).all()  # without replacement


def rso_loop(rewards, k, beta, rng):
    """Algorithm 1 of arXiv 2309.06657 as written in the paper (dict of candidates, one uniform per visit)."""
    candidates = dict(enumerate(rewards))
    order = list(candidates)
    rng.shuffle(order)  # exchangeable samples: a random list order is the paper's setting
    candidates = {c: candidates[c] for c in order}
    accepted = []
    while len(accepted) < k:
        max_reward = max(candidates.values())
        to_remove = []
        for c, r in candidates.items():
            if rng.random() >= math.exp((r - max_reward) / beta):
                continue
            accepted.append(c)
            to_remove.append(c)
            if len(accepted) == k:
                break
        for c in to_remove:
            candidates.pop(c)
    return accepted


def test_rso_matches_the_paper_algorithm_in_distribution():
    rewards = [0.0, 0.3, -1.0, 1.2, 0.8, -0.4]
    K, beta, trials = 3, 1.0, 6000
    rng = random.Random(0)
    loop_counts = torch.zeros(len(rewards))
    for _ in range(trials):
        for c in rso_loop(rewards, K, beta, rng):
            loop_counts[c] += 1
    g = torch.Generator().manual_seed(0)
    idx, _ = select_rso(torch.tensor(rewards).expand(trials, -1), K, beta, generator=g)
    ours = torch.zeros(len(rewards)).index_add_(0, idx.flatten(), torch.ones(trials * K))
    p_loop, p_ours = loop_counts / trials, ours / trials  # inclusion probabilities
    assert (p_loop - p_ours).abs().max() < 0.035, (p_loop, p_ours)  # ~5 sd of a difference of two estimates
    # the best is in unless K fill before it is visited; the worst rarely
    assert p_ours[3] > 0.9 and p_ours[2] < 0.25


def test_top_bottom_uniform_and_all():
    rewards = torch.tensor([[0.5, -2.0, 3.0, 1.0, 0.0, -1.0]])
    idx, _ = select_top_bottom(rewards, 4)
    # columns by reward: 2 (3.0), 3 (1.0), 0 (0.5), 4 (0.0), 5 (-1.0), 1 (-2.0)
    assert idx.tolist() == [[1, 2, 3, 5]]
    idx, _ = select_top_bottom(rewards, 2)
    assert idx.tolist() == [[1, 2]]
    with pytest.raises(ValueError):
        select_top_bottom(rewards, 3)
    assert select_all(rewards)[0].tolist() == [[0, 1, 2, 3, 4, 5]]
    g = torch.Generator().manual_seed(0)
    B = 3000
    idx, _ = select_uniform(torch.zeros(B, 6), 3, generator=g)
    assert all(len(set(row)) == 3 for row in idx.tolist())
    freq = torch.zeros(6).index_add_(0, idx.flatten(), torch.ones(B * 3)) / B
    assert (freq - 0.5).abs().max() < 0.04


# ----------------------------------------------------------------------------------------------------
# Advantages


def test_group_normalization_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
    std = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # Bessel-corrected: 1.2910
    a = group_normalize(r, eps=0.0 + 1e-4)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-4)
    assert torch.allclose(a[0], expected, atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))  # identical rewards carry no signal
    assert torch.equal(group_center(r), torch.tensor([[-1.5, -0.5, 0.5, 1.5], [0.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("K", [8, 16, 64])
def test_a_group_that_scored_all_alike_gets_exactly_zero_advantage(K):
    """2,000 groups of K identical fp32 rewards: every advantage is exactly 0. Statistics in fp32 (what the same
    formula gives without float64) leave hundreds of those groups a few ulp off, which divided by std + eps becomes
    an advantage of one sign on every sample of the group."""
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(2000, 1, generator=g) * 3).expand(2000, K).contiguous()  # (groups, K) fp32, rows all alike
    assert torch.equal(group_normalize(r), torch.zeros(2000, K))
    assert torch.equal(group_center(r), torch.zeros(2000, K))
    fp32 = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    assert int((fp32 != 0).any(1).sum()) > 100  # the fp32 statistics this replaces
    assert group_normalize(r).dtype == torch.float32


def test_rloo_is_the_leave_one_out_baseline_by_hand():
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740): A_i = r_i - (1 / (K - 1)) sum_{j != i} r_j."""
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]])  # sum 12: the others' means 11/3, 10/3, 3, 2
    want = torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(leave_one_out(r), want, atol=1e-6)
    assert torch.equal(leave_one_out(r)[1], torch.zeros(4))  # exactly 0 for a tie (float64 statistics)
    assert torch.allclose(leave_one_out(r), group_center(r) * 4 / 3, atol=1e-6)  # K / (K - 1) (r - mean)
    assert torch.equal(ADVANTAGES["rloo"](r, None), leave_one_out(r))


def test_pool_normalized_by_hand_and_with_global_normalization():
    """(r - mean_G) / (std_G + 1e-4), statistics of all G scored samples: two groups of pool 0, 2, 4, 6 (mean 3,
    sample variance 20 / 3, std s = 2.582), kept 4, 6 and 0, 6: z = (1, 3, -3, 3) / s. With global normalization the
    batch mean of z (1 / s) is subtracted and its population std (sqrt(6) / s) divides: (0, 2, -4, 2) / sqrt(6).
    GRPO's statistics of the kept pairs give +-1 / sqrt(2) in each group, +-1 after global normalization."""
    pool = torch.tensor([[0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0]])
    kept = torch.tensor([[4.0, 6.0], [0.0, 6.0]])
    s = math.sqrt(20 / 3) + 1e-4
    assert torch.allclose(pool_normalize(kept, pool_BG=pool), torch.tensor([[1.0, 3.0], [-3.0, 3.0]]) / s, atol=1e-6)
    got = advantages(kept, "pool_normalized", True, pool_BG=pool)
    assert torch.allclose(got, torch.tensor([0.0, 2.0, -4.0, 2.0]) / math.sqrt(6), atol=1e-4)
    assert torch.allclose(advantages(kept, "grpo", True), torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-4)
    # every sample kept: the kept set is the pool, and the advantage is GRPO's bit for bit
    r = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pool_normalize(r, pool_BG=r), group_normalize(r))
    with pytest.raises(ValueError, match="pool_BG"):
        advantages(kept, "pool_normalized", False)


def test_pool_centered_and_pool_scaled_by_hand():
    """The two halves of pool_normalized on its case: pool 0, 2, 4, 6 (mean 3, sample std s = sqrt(20 / 3)), kept 4, 6
    (mean 5, sample std sqrt(2)) and 0, 6 (mean 3, sample std sqrt(18)). pool_centered, (r - 3) / (std_K + 1e-4):
    (1, 3) / sqrt(2) and (-3, 3) / sqrt(18); pool_scaled, (r - mean_K) / (s + 1e-4): (-1, 1) / s and (-3, 3) / s.
    Each is grpo when every sample is kept; pool_centered times (std_K + eps) / (std_G + eps) is pool_normalized."""
    pool = torch.tensor([[0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0]])
    kept = torch.tensor([[4.0, 6.0], [0.0, 6.0]])
    s = math.sqrt(20 / 3) + 1e-4
    centered = torch.tensor([[1.0 / (math.sqrt(2) + 1e-4), 3.0 / (math.sqrt(2) + 1e-4)], [-3.0, 3.0]])
    centered[1] /= math.sqrt(18) + 1e-4
    assert torch.allclose(pool_center(kept, pool_BG=pool), centered, atol=1e-6)
    assert torch.allclose(pool_scale(kept, pool_BG=pool), torch.tensor([[-1.0, 1.0], [-3.0, 3.0]]) / s, atol=1e-6)
    for name, estimator in (("pool_centered", pool_center), ("pool_scaled", pool_scale)):
        assert torch.equal(advantages(kept, name, False, pool_BG=pool), estimator(kept, pool_BG=pool).flatten())
    rescale = (kept.double().std(1, keepdim=True) + 1e-4) / (pool.double().std(1, keepdim=True) + 1e-4)
    assert torch.allclose(
        pool_center(kept, pool_BG=pool) * rescale.float(), pool_normalize(kept, pool_BG=pool), atol=1e-6
    )
    r = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pool_center(r, pool_BG=r), group_normalize(r))
    assert torch.equal(pool_scale(r, pool_BG=r), group_normalize(r))
    for name in ("pool_centered", "pool_scaled"):
        with pytest.raises(ValueError, match="pool_BG"):
            advantages(kept, name, False)


def test_rloo_gradient_is_unbiased_for_independent_samples():
    """The leave-one-out baseline does not depend on the sample it is subtracted from, so with K = 2 independent
    samples of a categorical policy E[(1/K) sum_i A_i grad log pi(y_i)] is exactly grad E[r] (enumerating every
    pair); GRPO's std-normalized advantage of the same pairs is not an estimate of it (it is +-1/sqrt(2) whatever the
    gap, the std is taken within the pair)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    reward = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    logp = theta.log_softmax(0)
    (true_grad,) = torch.autograd.grad((logp.exp() * reward).sum(), theta, retain_graph=True)
    estimates = {"rloo": torch.zeros(3, dtype=torch.float64), "grpo": torch.zeros(3, dtype=torch.float64)}
    for y1 in range(3):
        for y2 in range(3):
            r_BK = reward[[y1, y2]][None]  # (1, 2)
            p = float((logp[y1] + logp[y2]).detach().exp())  # probability of the pair
            for name in estimates:
                a = ADVANTAGES[name](r_BK, None)[0].double()
                (grad,) = torch.autograd.grad((a[0] * logp[y1] + a[1] * logp[y2]) / 2, theta, retain_graph=True)
                estimates[name] += p * grad
    assert torch.allclose(estimates["rloo"], true_grad, atol=1e-12)
    assert not torch.allclose(estimates["grpo"], true_grad, atol=1e-2)


def test_reinforce_pp_whitens_the_reward_over_the_global_batch_by_hand():
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): A = (r - mean_batch r) / std_batch r over every sample of the
    global batch, no group baseline. Two ranks of one group each: rank 0 holds [1, 2], rank 1 [3, 6]; batch mean 3,
    population variance (4 + 1 + 0 + 9) / 4 = 3.5."""
    rank0, rank1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 6.0]])

    def reduce_with(other):  # what all_reduce_sum returns on this rank: its stats plus the other rank's
        o = other.double()
        return lambda t: t + torch.stack([torch.tensor(float(o.numel()), dtype=torch.float64), o.sum(), (o * o).sum()])

    a0 = batch_whitened_reward(rank0, reduce_with(rank1))
    a1 = batch_whitened_reward(rank1, reduce_with(rank0))
    assert torch.allclose(a0, (rank0 - 3.0) / math.sqrt(3.5), atol=1e-6)
    assert torch.allclose(a1, (rank1 - 3.0) / math.sqrt(3.5), atol=1e-6)
    # no group baseline: the same rewards grouped otherwise get the same advantages, and one sample per prompt works
    both = torch.cat([rank0, rank1])  # (2, 2)
    assert torch.allclose(batch_whitened_reward(both.view(4, 1)).view(2, 2), batch_whitened_reward(both), atol=1e-6)
    assert torch.allclose(advantages(both, "reinforce_pp", False), torch.cat([a0, a1]).flatten(), atol=1e-6)
    # the paper's variant with a baseline (group mean subtracted, then the batch normalisation): dr_grpo + global norm
    centred = torch.tensor([-0.5, 0.5, -1.5, 1.5])  # population std sqrt(1.25)
    assert torch.allclose(advantages(both, "dr_grpo", True), centred / math.sqrt(1.25), atol=1e-6)


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_every_advantage_estimator_sees_only_the_kept_groups(name):
    """rollouts/batches.py kept_advantages: the groups dynamic sampling dropped get 0 and take no part in any
    estimator's statistics (a batch's or the global normalization's): the kept groups' advantages are those of the
    kept groups alone, whatever the dropped groups' rewards."""
    from types import SimpleNamespace

    from rollouts.batches import kept_advantages

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 6, generator=g)  # G = 6 scored, the first K = 4 kept
    rewards = pool[:, :4].clone()
    keep = torch.tensor([True, False, True])
    for global_norm in (False, True):
        cfg = SimpleNamespace(advantage=name, global_norm=global_norm)
        got = kept_advantages(rewards, keep, cfg, pool).view(3, 4)
        assert torch.equal(got[1], torch.zeros(4))
        alone = advantages(rewards[keep], name, global_norm, pool_BG=pool[keep]).view(2, 4)
        assert torch.equal(got[keep], alone)
        rewards[1], pool[1] = 100.0, 100.0  # the dropped group's rewards change nothing
        assert torch.equal(kept_advantages(rewards, keep, cfg, pool).view(3, 4), got)


def test_global_normalization_by_hand():
    a = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5
    out = global_normalize(a, eps=0.0)
    assert torch.allclose(out, (a - 3.0) / math.sqrt(3.5), atol=1e-6)
    # a reduce_sum that doubles the statistics (as two identical ranks would) changes nothing
    assert torch.allclose(global_normalize(a, reduce_sum=lambda t: 2 * t, eps=0.0), out, atol=1e-6)


def test_after_std_group_normalization_global_normalization_is_one_constant_factor():
    """Groups normalized to mean 0 and sample std 1 pool to mean 0 and population variance (K - 1) / K, so global
    whitening multiplies every advantage by sqrt(K / (K - 1)) unless a group is degenerate (all rewards equal: its
    advantages are 0, which shrinks the pooled std). What the ablation of --global_norm can show depends on this."""
    K = 8
    rewards = torch.randn(5, K, generator=torch.Generator().manual_seed(0))
    local, pooled = advantages(rewards, "grpo", False), advantages(rewards, "grpo", True)
    assert torch.allclose(pooled, local * math.sqrt(K / (K - 1)), atol=1e-3)  # eps 1e-4 in the group std
    rewards[0] = 1.0  # one degenerate group of five: the others are scaled up by a further sqrt(5 / 4)
    local, pooled = advantages(rewards, "grpo", False), advantages(rewards, "grpo", True)
    assert torch.allclose(pooled[K:], local[K:] * math.sqrt(K / (K - 1) * 5 / 4), atol=1e-3)
    # Dr. GRPO's centring keeps each group's own scale; there global whitening sets the scale of the whole batch
    centred = advantages(rewards, "dr_grpo", True)
    assert centred.double().std(unbiased=False) == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------------------------------
# Per-token loss


def test_k3_kl_by_hand_and_its_expectation_is_the_exact_kl():
    assert float(k3_kl(torch.tensor(-1.0), torch.tensor(-1.0))) == 0.0
    x = 0.7  # ref - logp
    assert float(k3_kl(torch.tensor(0.0), torch.tensor(x))) == pytest.approx(math.exp(x) - x - 1)
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(10, generator=g).log_softmax(0)
    ref = torch.randn(10, generator=g).log_softmax(0)
    expected_k3 = (logp.exp() * k3_kl(logp, ref)).sum()  # E_{y ~ pi}[k3]
    kl = (logp.exp() * (logp - ref)).sum()
    assert float(expected_k3) == pytest.approx(float(kl), rel=1e-5)


def test_loss_at_ratio_one_is_the_kl_in_value_and_the_policy_gradient_in_gradient():
    """trl PR #2565: with old = logp.detach() the ratio is 1, so the surrogate's value is -A (summing to 0 over
    zero-mean advantages) while its gradient is -A * grad logp, the REINFORCE gradient."""
    g = torch.Generator().manual_seed(0)
    N, T, beta = 6, 5, 0.1
    mask = ragged_mask([5, 2, 3, 1, 4, 5], T)
    logp = (-torch.rand(N, T, generator=g) * 3).requires_grad_()
    ref = -torch.rand(N, T, generator=g) * 3
    adv = global_normalize(torch.randn(N, generator=g))  # mean exactly ~0 over sequences
    for name in AGGREGATIONS:
        loss, _ = Objective(beta=beta).token_loss(logp, logp.detach(), ref, adv, mask)
        total = aggregate(loss, mask, name)
        kl_term = aggregate(beta * k3_kl(logp, ref) * mask, mask, name)
        pg_term = aggregate(-adv[:, None] * logp * mask, mask, name)
        (grad,) = torch.autograd.grad(total, logp)
        (expected,) = torch.autograd.grad(pg_term + kl_term, logp)
        assert torch.allclose(grad, expected, atol=1e-7), name
        if name == "grpo":  # per-sequence means: the advantage part of the value is -mean(A) = 0
            assert float(total.detach()) == pytest.approx(float(kl_term.detach()), abs=1e-6)
    # without a KL term the value is zero and the gradient is pure policy gradient
    loss, _ = Objective(beta=0.0).token_loss(logp, logp.detach(), ref, adv, mask)
    assert abs(float(aggregate(loss, mask, "grpo").detach())) < 1e-6


def test_clipping_zeroes_the_gradient_outside_the_range_only():
    eps_low, eps_high = 0.2, 0.28
    ratios = torch.tensor([0.7, 0.9, 1.0, 1.25, 1.35, 0.7, 0.9, 1.25, 1.35])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    logp = ratios.log().clone().requires_grad_()
    old = torch.zeros(9)
    loss, is_clipped = clipped_surrogate(logp, old, adv, eps_low, eps_high)
    loss.sum().backward()
    # A > 0 clips above 1 + eps_high (1.35); A < 0 clips below 1 - eps_low (0.7). 1.25 is inside with eps_high 0.28
    clipped = torch.tensor([False, False, False, False, True, True, False, False, False])
    assert torch.equal(is_clipped, clipped)
    assert torch.equal(logp.grad == 0, clipped)
    assert torch.allclose(logp.grad[~clipped], -(ratios * adv)[~clipped])  # d(-rho A)/dlogp = -rho A
    assert torch.allclose(loss[clipped], -torch.tensor([1.28, -0.8]))  # the clipped value, constant


def test_masked_tokens_get_no_gradient_even_with_infinite_logprobs():
    mask = ragged_mask([3, 1], 4)
    logp = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")], [-1.5, float("-inf"), -3.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0, -0.7, -2.0], [-1.0, -1.0, float("-inf"), -1.0]])
    loss, stats = Objective(beta=0.1).token_loss(logp, logp.detach(), ref, torch.tensor([1.0, -1.0]), mask)
    total = aggregate(loss, mask, "bnpo")
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all() and (logp.grad[mask] != 0).all()
    assert (stats["kl"][~mask] == 0).all()


def test_tokens_outside_a_top_k_set_give_a_bounded_loss_and_finite_gradient():
    """-inf log-probs of *response* tokens (outside the reference's or the updated policy's top-k / top-p set)."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    inf = float("-inf")
    logp = torch.tensor([[-1.0, inf, -2.0, inf]], requires_grad=True)
    old = torch.tensor([[-1.0, -0.5, inf, inf]])
    ref = torch.tensor([[inf, -1.0, -2.0, inf]])
    loss, stats = Objective(beta=0.1).token_loss(logp, old, ref, torch.tensor([1.0]), mask)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert stats["kl"].max() <= 10.0 and stats["kl"][0, 3] == 0.0  # excluded by both: no divergence
    assert logp.grad[0, 1] == 0 and logp.grad[0, 3] == 0  # floored: no gradient through -inf


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = ragged_mask([3, 1], 3)
    assert float(aggregate(loss, mask, "grpo")) == pytest.approx(((1 + 2 + 3) / 3 + 4 / 1) / 2)  # 3.0
    assert float(aggregate(loss, mask, "bnpo")) == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert float(aggregate(loss, mask, "dapo")) == pytest.approx(2.5)
    assert float(aggregate(loss, mask, "dr_grpo", max_new_tokens=5)) == pytest.approx(10 / (2 * 5))
    assert AGGREGATIONS["grpo"] is grpo_weights and AGGREGATIONS["dr_grpo"] is dr_grpo_weights
    assert AGGREGATIONS["bnpo"] is token_mean_weights


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregations_do_not_depend_on_the_micro_batch_split(name):
    g = torch.Generator().manual_seed(0)
    N, T = 8, 7
    mask = ragged_mask([7, 1, 3, 5, 2, 7, 4, 6], T)
    logp = (-torch.rand(N, T, generator=g) * 2).requires_grad_()
    ref = -torch.rand(N, T, generator=g) * 2
    old = logp.detach() + 0.1 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, generator=g)

    def split_loss(sizes):
        # the normaliser is summed over all micro-batches first, then each micro-batch adds sum(w * loss) / Z
        parts = torch.split(torch.arange(N), sizes)
        z = sum(AGGREGATIONS[name](mask[p], T)[1] for p in parts)
        total = 0.0
        for p in parts:
            loss, _ = Objective(eps_high=0.28, beta=0.05).token_loss(logp[p], old[p], ref[p], adv[p], mask[p])
            total = total + (AGGREGATIONS[name](mask[p], T)[0] * loss).sum() / z
        (grad,) = torch.autograd.grad(total, logp)
        return total.detach(), grad

    full_value, full_grad = split_loss([8])
    for sizes in ([4, 4], [1, 3, 2, 2], [1] * 8):
        value, grad = split_loss(sizes)
        assert torch.allclose(value, full_value, atol=1e-6), sizes
        assert torch.allclose(grad, full_grad, atol=1e-7), sizes


def test_token_entropy():
    V = 16
    assert torch.allclose(token_entropy(torch.zeros(2, 3, V)), torch.full((2, 3), math.log(V)))
    logits = torch.zeros(1, 1, V)
    logits[..., 4:] = float("-inf")  # a top-k mask: 4 tokens left
    assert float(token_entropy(logits)) == pytest.approx(math.log(4))

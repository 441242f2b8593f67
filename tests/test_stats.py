"""rlhf.stats' decisions over a verdict's family (issue 62): the t distribution's CDF, Holm's step-down, the dose trend
with seeds as blocks and the equivalence test, each against a hand computation or a brute-force one."""

import itertools
import math
import random

import pytest
import torch

from rlhf.stats import (
    DIFFERENT,
    EQUAL,
    SMALL,
    UNDECIDED,
    difference_interval,
    dose_trend,
    family_decisions,
    holm,
    incomplete_beta,
    sign_flip_p,
    t_cdf,
    t_quantile,
    t_test_p,
    tost,
)


def t_density(u: float, df: float) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(u * u / df))


def two_sided_p_by_integration(t: float, df: float, intervals: int = 20_000) -> float:
    """1 - 2 x the integral of the t density from 0 to |t|, by Simpson's rule (pure Python)."""
    h = abs(t) / intervals
    total = t_density(0.0, df) + t_density(abs(t), df)
    total += sum((4 if k % 2 else 2) * t_density(k * h, df) for k in range(1, intervals))
    return 1.0 - 2.0 * total * h / 3


def test_incomplete_beta_against_closed_forms_on_both_sides_of_the_switch():
    for x in (0.01, 0.2, 0.5, 0.8, 0.99):
        assert incomplete_beta(x, 1.0, 1.0) == pytest.approx(x, rel=1e-12)
        assert incomplete_beta(x, 3.0, 1.0) == pytest.approx(x**3, rel=1e-12)
        assert incomplete_beta(x, 1.0, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-12)
        assert incomplete_beta(x, 2.0, 2.0) == pytest.approx(3 * x**2 - 2 * x**3, rel=1e-12)
    assert incomplete_beta(0.0, 2.0, 3.0) == 0.0 and incomplete_beta(1.0, 2.0, 3.0) == 1.0


def test_t_cdf_against_closed_forms_and_the_tables():
    for t in (-7.0, -1.0, 0.0, 0.3, 2.0, 12.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    assert t_test_p(2.0, 1.0, 5) == pytest.approx(0.1019, abs=1e-4)  # tables: two-sided p of t = 2 on 5 df
    assert t_test_p(-2.0, 1.0, 5) == t_test_p(2.0, 1.0, 5)
    assert t_test_p(2.2281, 1.0, 10) == pytest.approx(0.05, abs=1e-5)  # t_.975 on 10 df
    assert t_test_p(1.959964, 1.0, math.inf) == pytest.approx(0.05, abs=1e-6)
    assert t_test_p(3.26, 1.0, 3.3) == pytest.approx(0.041, abs=1e-3)  # issue 62's top - uniform: p ~ 0.04
    assert t_test_p(0.0, 0.0, 4) == 1.0 and t_test_p(0.1, 0.0, 4) == 0.0


@pytest.mark.parametrize("df", [0.8, 3.3, 5.0, 12.5, 300.0])
def test_t_p_against_a_numerical_integration_of_the_density(df):
    for t in (0.4, 2.0, 3.26, 6.0):
        assert t_test_p(t, 1.0, df) == pytest.approx(two_sided_p_by_integration(t, df), abs=1e-9)


def test_p_below_five_percent_exactly_when_the_95_interval_excludes_zero():
    for df in (1.7, 3.3, 9.0):
        edge = t_quantile(0.975, df)  # the interval's half-width in units of se
        assert t_test_p(edge, 1.0, df) == pytest.approx(0.05, abs=1e-8)
        assert t_test_p(edge * 1.001, 1.0, df) < 0.05 < t_test_p(edge * 0.999, 1.0, df)


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    # 0.001 x 3, 0.6 x 2 = 1.2 capped at 1, 0.7 x 1 under the running max 1
    assert holm([0.001, 0.6, 0.7]) == pytest.approx([0.003, 1.0, 1.0], abs=1e-15)
    assert holm([0.2]) == [0.2] and holm([]) == []


def test_holm_is_the_closed_test_of_bonferronis_intersections():
    """Brute force: hypothesis i is rejected at alpha when every intersection of hypotheses that contains it is
    rejected by Bonferroni (|I| min_{j in I} p_j <= alpha), so its adjusted p is the max over those I."""
    rng = random.Random(0)
    for _ in range(200):
        m = rng.randint(1, 6)
        p = [rng.choice([rng.random() * 0.1, rng.random(), 0.02]) for _ in range(m)]  # ties included
        brute = []
        for i in range(m):
            worst = 0.0
            for size in range(1, m + 1):
                for subset in itertools.combinations(range(m), size):
                    if i in subset:
                        worst = max(worst, min(1.0, size * min(p[j] for j in subset)))
            brute.append(worst)
        assert holm(p) == pytest.approx(brute, abs=1e-15), p


def test_one_contrast_among_seven_is_not_distinguishable_after_holm():
    # issue 62: top - uniform at t = 3.26 on 3.3 df (p ~ 0.04) is one of the dose's seven contrasts
    rows = [(3.26 * 0.02, 0.02, 3.3)] + [(0.01, 0.02, 3.3)] * 6
    alone = family_decisions(rows[:1])[0]
    assert alone["p"] == pytest.approx(0.041, abs=1e-3) and alone["distinguishable"]
    family = family_decisions(rows)
    assert family[0]["p_adjusted"] == pytest.approx(7 * alone["p"], rel=1e-12)
    assert not family[0]["distinguishable"] and {r["family"] for r in family} == {"all"}


def test_primary_rows_are_adjusted_among_themselves_and_the_rest_apart():
    rows = [(0.10, 0.03, 3.3), (0.05, 0.02, 5.0), (0.08, 0.03, 4.0), (0.0, 0.04, 3.0), (0.2, 0.05, 2.0)]
    p = [t_test_p(*r) for r in rows]
    out = family_decisions(rows, primary=[2, 0])
    assert [out[i]["p_adjusted"] for i in (0, 2)] == pytest.approx(holm([p[0], p[2]]), rel=1e-12)
    assert [out[i]["p_adjusted"] for i in (1, 3, 4)] == pytest.approx(holm([p[1], p[3], p[4]]), rel=1e-12)
    assert [r["family"] for r in out] == ["primary", "exploratory", "primary", "exploratory", "exploratory"]
    assert [r["distinguishable"] for r in out] == [r["p_adjusted"] < 0.05 for r in out]
    with pytest.raises(ValueError, match="must index"):
        family_decisions(rows, primary=[5])


def test_a_family_of_one_decides_as_the_interval_with_seeds_does():
    g = torch.Generator().manual_seed(0)
    for shift in (0.0, 0.03, 0.06, 0.12):
        d_SP = (
            shift
            + 0.1 * torch.randn(3, 40, generator=g, dtype=torch.float64)
            + 0.05 * torch.randn(3, 1, generator=g, dtype=torch.float64)
        )
        interval = difference_interval(d_SP)
        (row,) = family_decisions([(interval["mean"], interval["se"], interval["df"])])
        assert row["distinguishable"] == interval["distinguishable"]
        assert row["t"] == pytest.approx(interval["mean"] / interval["se"])


def test_tost_is_the_90_interval_inside_the_margin_at_the_boundary():
    df, margin = 5.0, 0.05
    t95 = t_quantile(0.95, df)
    se = margin / t95  # the 90% interval of an estimate of 0 is exactly [-margin, +margin]
    edge = tost(0.0, se, df, margin)
    assert edge["p"] == pytest.approx(0.05, abs=1e-8) and edge["ci_high"] == pytest.approx(margin, rel=1e-12)
    assert tost(0.0, 0.99 * se, df, margin)["equal"] and not tost(0.0, 1.01 * se, df, margin)["equal"]
    # the 95% interval of the same estimate is wider than the margin: TOST at 5% is the 90% interval, not the 95%
    assert t_quantile(0.975, df) * 0.99 * se > margin
    # an estimate off 0: the interval's upper end decides, p is the upper test's
    half = 0.99 * margin  # at se = 0.99 margin / t95
    inside = tost(margin - half - 0.0005, 0.99 * se, df, margin)  # [-0.0495, +0.0495]: clear of both edges
    outside = tost(margin - half + 0.001, 0.99 * se, df, margin)
    assert inside["equal"] and not outside["equal"]
    assert outside["p"] == outside["p_upper"] > 0.05 > outside["p_lower"]
    # each one-sided p by hand: P(T >= (est + margin) / se) and P(T <= (est - margin) / se)
    r = tost(0.01, 0.02, df, margin)
    assert r["p_lower"] == pytest.approx(1 - t_cdf(3.0, df), rel=1e-12)
    assert r["p_upper"] == pytest.approx(t_cdf(-2.0, df), rel=1e-12)
    # no error: equal strictly inside the margin
    assert tost(0.049, 0.0, df)["equal"] and not tost(0.05, 0.0, df)["equal"] and not tost(-0.05, 0.0, df)["equal"]


def test_tost_decides_as_the_90_interval_over_a_grid():
    decided = []
    for df in (2.0, 30.0):
        t95 = t_quantile(0.95, df)
        for estimate in (-0.03, 0.0, 0.02, 0.045):
            for se in (0.003, 0.01, 0.04):
                half = t95 * se
                decided.append(tost(estimate, se, df)["equal"])
                assert decided[-1] == (-0.05 < estimate - half and estimate + half < 0.05), (df, estimate, se)
    assert 0 < sum(decided) < len(decided)


def test_decision_words_by_hand():
    rows = [
        (0.0, 0.01, 10.0),  # 90% interval +-0.018 inside +-0.05, t = 0: equal
        (0.2, 0.03, 10.0),  # t = 6.7, interval far outside the margin: different
        (0.02, 0.004, 10.0),  # t = 5, 90% interval [0.013, 0.027]: a difference, and smaller than the margin
        (0.02, 0.04, 3.0),  # t = 0.5, 90% interval [-0.07, 0.11]: neither
    ]
    out = family_decisions(rows)
    assert [r["decision"] for r in out] == [EQUAL, DIFFERENT, SMALL, UNDECIDED]


def brute_force_trend(differences: list[list[float]], doses: list[float]) -> tuple[list[float], float, float]:
    """Per-seed slopes by explicit sums, their mean and its standard error over seeds."""
    D = len(doses)
    x_mean = sum(doses) / D
    slopes = []
    for seed in differences:
        y_mean = sum(seed) / D
        sxy = sum((doses[d] - x_mean) * (seed[d] - y_mean) for d in range(D))
        sxx = sum((doses[d] - x_mean) ** 2 for d in range(D))
        slopes.append(sxy / sxx)
    S = len(slopes)
    mean = sum(slopes) / S
    sd = math.sqrt(sum((b - mean) ** 2 for b in slopes) / (S - 1))
    return slopes, mean, sd / math.sqrt(S)


def test_dose_trend_by_hand_with_seeds_as_blocks():
    # three seeds with slopes 1, 2, 3 on doses 0, 1, 2, each at its own level (10, -5, 100): the levels drop out
    doses = [0.0, 1.0, 2.0]
    levels = torch.tensor([[10.0], [-5.0], [100.0]], dtype=torch.float64)
    y = levels + torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64) * torch.tensor(doses, dtype=torch.float64)
    r = dose_trend(y, doses, sign_flip=True)
    t = 2 * math.sqrt(3)  # mean 2, sample std 1, se 1 / sqrt(3)
    assert r["slopes"] == pytest.approx([1.0, 2.0, 3.0], abs=1e-12)
    assert (r["slope"], r["se"], r["t"], r["df"]) == pytest.approx((2.0, 1 / math.sqrt(3), t, 2), rel=1e-12)
    assert r["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)  # df 2: P(|T| > t) = 1 - t / sqrt(2 + t^2)
    half = 4.302653 / math.sqrt(3)  # t_.975 on 2 df, from the tables
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((2 - half, 2 + half), abs=1e-5)
    # sign flips of 1, 2, 3: sums 6, 4, 2, 0, 0, -2, -4, -6; |sum| >= 6 in 2 of 8
    assert r["p_sign_flip"] == 0.25
    # a common trend added to every seed moves the slope, not its error
    shifted = dose_trend(y + 0.5 * torch.tensor(doses, dtype=torch.float64), doses)
    assert (shifted["slope"], shifted["se"]) == pytest.approx((2.5, r["se"]), rel=1e-12)


def test_dose_trend_against_brute_force():
    rng = random.Random(1)
    for S, D in ((2, 2), (3, 4), (4, 5), (6, 3)):
        doses = sorted(math.log(rng.choice([0.01, 0.03, 0.1, 0.3, 1.0, 3.0]) * (1 + k)) for k in range(D))
        differences = [[rng.gauss(0.05 * d, 0.03) + rng.gauss(0, 0.1) for d in range(D)] for _ in range(S)]
        r = dose_trend(torch.tensor(differences, dtype=torch.float64), doses, confidence=0.9, sign_flip=True)
        slopes, mean, se = brute_force_trend(differences, doses)
        assert r["slopes"] == pytest.approx(slopes, rel=1e-10, abs=1e-12)
        assert (r["slope"], r["se"], r["df"]) == pytest.approx((mean, se, S - 1), rel=1e-10)
        assert r["p"] == pytest.approx(two_sided_p_by_integration(mean / se, S - 1), abs=1e-8)
        half = t_quantile(0.95, S - 1) * se
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((mean - half, mean + half), rel=1e-10)
        flips = [
            abs(sum(s * b for s, b in zip(signs, slopes, strict=True)))
            for signs in itertools.product((1, -1), repeat=S)
        ]
        as_extreme = sum(f >= abs(sum(slopes)) - 1e-12 for f in flips)
        assert r["p_sign_flip"] == as_extreme / 2**S


def test_sign_flip_p_by_hand():
    assert sign_flip_p(torch.tensor([1.0, 2.0, 3.0, 4.0])) == 2 / 16  # only all-plus and all-minus reach |10|
    assert sign_flip_p(torch.tensor([-1.0, 1.0])) == 1.0  # every arrangement's |sum| >= 0
    # |3 +- 1 +- 1| over the 8 arrangements: 5, 3, 3, 1 and their negatives; >= 3 in 6
    assert sign_flip_p(torch.tensor([3.0, -1.0, 1.0])) == 6 / 8


def test_dose_trend_rejects_what_it_cannot_read():
    y = torch.tensor([[0.0, 0.1, float("nan")], [0.0, 0.2, 0.3]])
    with pytest.raises(ValueError, match="NaN"):
        dose_trend(y, [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        dose_trend(torch.zeros(2, 3), [0.0, 1.0, math.inf])
    with pytest.raises(ValueError, match="at least 2 seeds"):
        dose_trend(torch.zeros(1, 3), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="not all be equal"):
        dose_trend(torch.zeros(2, 2), [1.0, 1.0])
    with pytest.raises(ValueError, match="3 doses"):
        dose_trend(torch.zeros(2, 2), [0.0, 1.0, 2.0])

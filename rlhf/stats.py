"""Statistics as pure functions of tensors (no distributed code): pairwise preference scores (accuracy with ties,
bootstrap confidence intervals, the split by response length, the gain/bias that standardises rewards), comparisons
over posts (paired differences, bootstrap intervals, variance components over seeds and posts, sizes), the t
distribution, and the decisions over a verdict's family of contrasts (Holm's step-down, two one-sided tests within a
margin, a dose read as one trend with seeds as blocks). The reward-KL frontier's estimators are rlhf/frontier.py's."""

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
# Comparisons over posts: paired differences, bootstrap intervals, variance components over seeds and posts, sizes


def mean_and_se(values_PG: torch.Tensor) -> tuple[float, float]:
    """Mean of values (P, G) (G samples of each of P prompts) and its standard error over the prompts, in float64:
    the sample std of the P per-prompt means / sqrt(P).

    The prompt is the unit of every error on the frontier: a policy's point, best-of-n's (one value per prompt), and
    the paired difference of two policies on the same prompts (paired_difference) are all means over prompts, so their
    errors are of one kind and a difference's error is that of its per-prompt differences, never a combination of
    two points' errors. The per-prompt mean holds the sampling noise of the G samples, so the error counts both how
    prompts differ and how samples of one prompt differ. NaN error with one prompt."""
    v = values_PG.double()
    if v.dim() != 2 or v.numel() == 0:
        raise ValueError(f"values must be (prompts, samples) and non-empty, got shape {tuple(v.shape)}")
    return mean_and_se_over_posts(v.mean(1))


def mean_and_se_over_posts(values_P: torch.Tensor) -> tuple[float, float]:
    """Mean of one value per prompt (P,) and its standard error over the prompts, std / sqrt(P) (NaN for one)."""
    v = values_P.double().flatten()
    if v.numel() == 0:
        raise ValueError("no values: need at least one prompt")
    P = v.numel()
    return float(v.mean()), (float(v.std(correction=1)) / math.sqrt(P) if P >= 2 else math.nan)


def bootstrap_resamples(statistic, n: int, n_resamples: int = 2000, seed: int = 0) -> torch.Tensor:
    """`statistic` on n_resamples resamples (S, K): each a function of the indices (n,) of n units (posts) drawn with
    replacement that returns K numbers (a float or a tensor), NaN where it is undefined on that resample."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_resamples, n), generator=g)  # (S, n)
    return torch.stack([torch.as_tensor(statistic(i), dtype=torch.float64).flatten() for i in idx])


def crossed_bootstrap_resamples(
    statistic, rows: int, cols: int, n_resamples: int = 1000, seed: int = 0
) -> torch.Tensor:
    """`statistic` on n_resamples resamples (S, K) of a crossed design, `rows` units (seeds) x `cols` units (posts,
    the same posts in every seed): each resample draws the rows and the columns with replacement, independently, and
    calls statistic(row_idx (rows,), col_idx (cols,)), returning K numbers (NaN where undefined). This is Owen's
    pigeonhole bootstrap (2007, Ann. Appl. Stat. 1(1)): no bootstrap is exact for crossed random effects (McCullagh
    2000), and this one counts both the seeds' and the posts' spread, erring on the wide side (Owen: mildly
    conservative). Drawing the columns first and from the same generator as bootstrap_resamples, one row gives
    bootstrap_resamples' resamples."""
    g = torch.Generator().manual_seed(seed)
    col_idx = torch.randint(0, cols, (n_resamples, cols), generator=g)  # (S, cols)
    row_idx = torch.randint(0, rows, (n_resamples, rows), generator=g)  # (S, rows)
    return torch.stack(
        [torch.as_tensor(statistic(r, c), dtype=torch.float64).flatten() for r, c in zip(row_idx, col_idx, strict=True)]
    )


def bootstrap_interval(
    statistic, n: int, n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> torch.Tensor:
    """Percentile bootstrap interval (2, K) of `statistic` (bootstrap_resamples): the (1-c)/2 and (1+c)/2 quantiles
    over the resamples where it is defined (NaN resamples dropped: report their share with bootstrap_undefined; NaN
    when none is). Use it when the statistic is more than a mean (a KL matched in each resample, a fit)."""
    return percentile_interval(bootstrap_resamples(statistic, n, n_resamples, seed), confidence)


def percentile_interval(stats_SK: torch.Tensor, confidence: float = 0.95) -> torch.Tensor:
    """The (1-c)/2 and (1+c)/2 quantiles (2, K) of resampled statistics (S, K), ignoring NaN resamples."""
    alpha = (1.0 - confidence) / 2
    return torch.nanquantile(stats_SK, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64), dim=0)


def bootstrap_undefined(stats_SK: torch.Tensor) -> float:
    """The share of resamples (S, K) on which a statistic is undefined (any of its K numbers NaN)."""
    return float(stats_SK.isnan().any(1).double().mean())


def paired_difference(
    a_P: torch.Tensor, b_P: torch.Tensor, n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """A minus B measured on the same P posts (one value per post each): the mean of the per-post differences, its
    standard error over posts (their std / sqrt(P)) and a percentile bootstrap interval over posts (bootstrap_ci).
    The error of a difference on the same posts is this, not a combination of A's and B's own errors: what the posts
    share cancels."""
    d = a_P.double().flatten() - b_P.double().flatten()
    mean, se = mean_and_se_over_posts(d)
    lo, hi = bootstrap_ci(d, n_resamples, confidence, seed)
    return {"difference": mean, "se": se, "ci_low": lo, "ci_high": hi, "posts": d.numel()}


def sqrt_kl_interpolation(kls: list[float], at: float) -> tuple[int, int, float] | None:
    """Where KL `at` falls on a path of points with KLs `kls` (best-of-n's n = 1, 2, 4, ...; a run's evaluations),
    interpolating linearly in sqrt(KL) (the axis on which Gao et al. 2022 find gold smooth): (i, j, w) with the value
    at `at` = (1 - w) v_i + w v_j, on the first segment that reaches it. A KL below the first point's (an estimate
    below 0 near the reference) is the first point; None beyond the largest KL on the path (no extrapolation)."""
    roots = [math.sqrt(max(k, 0.0)) for k in kls]
    x = math.sqrt(max(at, 0.0))
    if x <= roots[0]:
        return 0, 0, 0.0
    for i in range(len(roots) - 1):
        lo, hi = sorted((roots[i], roots[i + 1]))
        if lo <= x <= hi and hi > lo:
            w = (x - roots[i]) / (roots[i + 1] - roots[i])
            return i, i + 1, w
    return None


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df degrees of freedom (df > 0, not necessarily whole), by bisection on
    t_cdf; the normal's for df > 1e4."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p = {p}, df = {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if df > 1e4:
        return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def variance_components(values_SP: torch.Tensor) -> dict[str, float]:
    """A quantity measured for S seeds (runs) on the same P posts (S, P), e.g. gold per post of one method, or the
    per-post difference of two methods within each seed: its mean and how much of the mean's error comes from seeds
    and from posts, by the two-way crossed random-effects model without replication,

        v_sp = mu + a_s + b_p + e_sp,   Var(mean) = var_seed / S + var_post / P + var_residual / (S P),

    each component from the mean squares (MS_seed = P x the variance of the seeds' means, MS_post = S x that of the
    posts' means, MS_res of what is left), clipped at 0: var_seed = (MS_seed - MS_res) / P, var_post =
    (MS_post - MS_res) / S, var_residual = MS_res (the seed-by-post interaction and the sampling noise of each
    per-post value). Seeds are the unit of the between-run part; the posts are paired within each seed.

    Var(mean) x S P is estimated as B + max(MS_post - MS_res, 0), B = max(MS_seed, MS_res) the between-seed part
    (E[MS_seed] = P var_seed + var_residual: never less than the residual's share). B keeps the seeds' S - 1 degrees
    of freedom even when the seed component is clipped at 0: that it is 0 rests on S - 1 of them, so two seeds that
    agree by chance do not give the interval of posts alone; `seed_floor` says B is the residual's floor (the seeds'
    means vary less than their posts' noise: with few seeds, a spread the interval may understate). The standard
    error's degrees of freedom are Satterthwaite's (for a t interval: difference_interval). One seed: no seed
    component (NaN), the error over posts alone (df P - 1)."""
    v = values_SP.double()
    if v.dim() != 2 or v.shape[1] < 2:
        raise ValueError(f"values must be (seeds, posts) with at least 2 posts, got shape {tuple(v.shape)}")
    S, P = v.shape
    mean = float(v.mean())
    if S == 1:
        _, se = mean_and_se_over_posts(v[0])
        var_post = float(v[0].var(correction=1))
        return {
            "mean": mean,
            "se": se,
            "df": P - 1,
            "var_seed": math.nan,
            "var_post": var_post,
            "var_residual": 0.0,
            "seed_floor": False,
        }
    seed_means, post_means = v.mean(1), v.mean(0)
    ms_seed = P * float(seed_means.var(correction=1))
    ms_post = S * float(post_means.var(correction=1))
    resid = v - seed_means[:, None] - post_means[None, :] + v.mean()
    ms_res = float((resid**2).sum()) / ((S - 1) * (P - 1))
    var_seed, var_post = (ms_seed - ms_res) / P, (ms_post - ms_res) / S
    total, df = satterthwaite(mean_square_terms(ms_seed, ms_post, ms_res, S, P))
    var = total / (S * P)
    return {
        "mean": mean,
        "se": math.sqrt(max(var, 0.0)),
        "df": df,
        "var_seed": max(var_seed, 0.0),
        "var_post": max(var_post, 0.0),
        "var_residual": ms_res,
        "seed_floor": ms_seed <= ms_res,
    }


def mean_square_terms(ms_seed: float, ms_post: float, ms_res: float, S: int, P: int) -> list[tuple[float, int, float]]:
    """Var(mean) x S P as a sum of mean squares, each (mean square, its df, its coefficient) (variance_components):
    the between-seed part max(MS_seed, MS_res) at the seeds' S - 1 df, plus MS_post - MS_res when the post component
    is above 0."""
    has_post = float(ms_post - ms_res > 0)
    return [
        (max(ms_seed, ms_res), S - 1, 1.0),
        (ms_post, P - 1, has_post),
        (ms_res, (S - 1) * (P - 1), -has_post),
    ]


def satterthwaite(terms: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(sum of c ms, its degrees of freedom) of a combination of mean squares (ms, df, c), by Satterthwaite 1946:
    (sum c ms)^2 / sum (c ms)^2 / df (inf when every term is 0)."""
    total = sum(c * ms for ms, _, c in terms)
    parts = sum((c * ms) ** 2 / d for ms, d, c in terms if c != 0)
    return total, (total**2 / parts if parts > 0 else math.inf)


def difference_interval(values_SP: torch.Tensor, confidence: float = 0.95) -> dict[str, float]:
    """variance_components of per-post differences (S seeds, P posts) and the t interval mean +- t_df se that
    includes the seed-to-seed spread; "distinguishable" when it excludes 0."""
    out = variance_components(values_SP)
    half = t_quantile((1 + confidence) / 2, out["df"]) * out["se"]
    out |= {"ci_low": out["mean"] - half, "ci_high": out["mean"] + half}
    return out | {"distinguishable": not (out["ci_low"] <= 0.0 <= out["ci_high"])}


def detectable_difference(se: float, df: float, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true difference a two-sided test at `confidence` finds with probability `power`, for an estimate
    of standard error `se` with df degrees of freedom: (t_{(1+c)/2} + t_{power}) x se."""
    return (t_quantile((1 + confidence) / 2, df) + t_quantile(power, df)) * se


def units_needed(sd: float, delta: float, confidence: float = 0.95, power: float = 0.8, at_most: int = 10**6) -> int:
    """How many independent units of standard deviation `sd` (posts, or seeds) make `delta` detectable: the smallest
    n >= 2 with detectable_difference(sd / sqrt(n), n - 1) <= delta (at_most when none up to it)."""
    if not sd >= 0:
        raise ValueError(f"units_needed needs sd >= 0, got {sd}")
    n = smallest_detecting(lambda n: (sd / math.sqrt(n), n - 1), delta, confidence, power, at_most)
    return at_most if n is None else n


def smallest_detecting(error_of, delta: float, confidence: float, power: float, at_most: int) -> int | None:
    """The smallest count n in [2, at_most] with detectable_difference(*error_of(n)) <= delta, error_of(n) the standard
    error and its degrees of freedom at n, or None when even at_most does not reach it. A doubling then a bisection,
    which assumes the detectable difference falls as n grows (the error shrinks with n; planned_error's degrees of
    freedom can fall with posts, toward the seeds' S - 1)."""
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")

    def enough(n: int) -> bool:
        return detectable_difference(*error_of(n), confidence, power) <= delta

    if not enough(at_most):
        return None
    lo, hi = 1, 2
    while not enough(hi):
        lo, hi = hi, min(2 * hi, at_most)
    while hi - lo > 1:  # enough(hi), not enough(lo) (or lo = 1)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def planned_error(components: dict, seeds: int, posts: int) -> tuple[float, float]:
    """The standard error and degrees of freedom difference_interval would give on `seeds` x `posts` whose mean squares
    are their expectations under variance_components' `components` (E[MS_seed] = P var_seed + var_residual,
    E[MS_post] = S var_post + var_residual, E[MS_res] = var_residual): sqrt(var_seed / S + var_post / P +
    var_residual / (S P)) at Satterthwaite's degrees of freedom of those mean squares (mean_square_terms: the seeds'
    S - 1 alone when the post component is 0), P - 1 for one seed. At the measured seeds and posts it gives back the
    measured se and df. A component that one seed cannot estimate (NaN) counts as 0."""
    v_seed, v_post, v_res = (0.0 if math.isnan(components[k]) else components[k] for k in VARIANCES)
    S, P = seeds, posts
    se = math.sqrt(v_seed / S + v_post / P + v_res / (S * P))
    if S == 1:
        return se, P - 1
    _, df = satterthwaite(mean_square_terms(P * v_seed + v_res, S * v_post + v_res, v_res, S, P))
    return se, df


def seeds_needed(
    components: dict, posts: int, delta: float, confidence: float = 0.95, power: float = 0.8, at_most: int = 1000
) -> int | None:
    """Seeds (runs per method) that make a difference `delta` detectable on `posts` posts, from variance_components
    of a difference (S, P): the smallest S with detectable_difference of planned_error(components, S, posts) (the
    interval's own error and degrees of freedom at S seeds) <= delta. None when no number of seeds reaches it:
    var_post / P does not shrink with seeds (the same posts in every run), so more posts are needed first."""
    return smallest_detecting(lambda S: planned_error(components, S, posts), delta, confidence, power, at_most)


def posts_needed(
    components: dict, seeds: int, delta: float, confidence: float = 0.95, power: float = 0.8, at_most: int = 10**6
) -> int | None:
    """Posts that make a difference `delta` detectable with `seeds` seeds, from variance_components of a difference:
    the smallest P with detectable_difference of planned_error(components, seeds, P) (the interval's own error and
    degrees of freedom at P posts: with the post component at 0 the seeds' S - 1 however many posts) <= delta. None
    when no number of posts reaches it (var_seed / S alone is too large: more seeds first)."""
    return smallest_detecting(lambda P: planned_error(components, seeds, P), delta, confidence, power, at_most)


VARIANCES = ("var_seed", "var_post", "var_residual")
"""variance_components' three components, in the order planned_error reads them."""


# ----------------------------------------------------------------------------------------------------
# The t distribution: its cdf from the regularized incomplete beta function, the t statistic and its two-sided p


def incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (a, b > 0, 0 <= x <= 1), by its continued fraction evaluated
    with the modified Lentz method (Numerical Recipes 3rd ed., 6.4). The fraction converges fast for
    x < (a + 1) / (a + b + 2); above it, I_x(a, b) = 1 - I_{1-x}(b, a). Relative accuracy ~1e-14."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"incomplete_beta needs a, b > 0 and 0 <= x <= 1, got x = {x}, a = {a}, b = {b}")
    if x == 0.0 or x == 1.0:
        return x
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(1.0 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even step d_2m
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # the odd step d_2m+1
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return math.exp(log_front) * h / a
    raise RuntimeError(f"incomplete_beta's continued fraction did not converge at x = {x}, a = {a}, b = {b}")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df > 0 degrees of freedom (not necessarily whole; inf: the normal's), by
    P(|T| > |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2) (incomplete_beta)."""
    if not df > 0:
        raise ValueError(f"t_cdf needs df > 0, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / (df + t * t), df / 2, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_statistic(estimate: float, se: float) -> float:
    """estimate / se; +-inf for se = 0 and an estimate off 0, 0 for both 0."""
    if se > 0:
        return estimate / se
    return math.copysign(math.inf, estimate) if estimate != 0 else 0.0


def t_test_p(estimate: float, se: float, df: float) -> float:
    """Two-sided p-value of the t statistic estimate / se on df degrees of freedom (the with-seeds t of
    difference_interval: H0 a true difference of 0; p < 1 - c exactly when its c interval excludes 0). se = 0 gives 0
    for an estimate off 0 and 1 at 0."""
    if not se >= 0 or math.isnan(estimate):
        raise ValueError(f"t_test_p needs se >= 0 and an estimate, got estimate = {estimate}, se = {se}")
    return 2.0 * t_cdf(-abs(t_statistic(estimate, se)), df)


# ----------------------------------------------------------------------------------------------------
# Decisions over a verdict's family of contrasts (issue 62): p-values of the with-seeds t, Holm's step-down, a dose
# read as one trend with seeds as blocks, and "level" only through two one-sided tests


def holm(p_values: list[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the input's order: with the m p-values sorted p_(1) <= ... <=
    p_(m), adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j)). Rejecting where adjusted p < alpha keeps
    the chance of any false rejection in the family at most alpha, under any dependence between the tests. The
    running max makes them monotone in p (a smaller p never gets a larger adjusted p); equal to the closed test of
    Bonferroni's intersections, max over families I containing i of min(1, |I| min_{j in I} p_j)."""
    if any(not 0.0 <= p <= 1.0 for p in p_values):
        raise ValueError(f"p-values must be in [0, 1], got {p_values}")
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def tost(estimate: float, se: float, df: float, margin: float = 0.05, alpha: float = 0.05) -> dict:
    """Equivalence within +-margin by two one-sided t tests (Schuirmann 1987), each at level alpha: H0- true
    difference <= -margin (p_lower = P(T >= (estimate + margin) / se)) and H0+ >= +margin (p_upper = P(T <=
    (estimate - margin) / se)), T Student's t on df. Shown equal when both reject: p = max(p_lower, p_upper) < alpha,
    exactly when the 1 - 2 alpha interval (the 90% one at alpha 5%: ci_low, ci_high) lies strictly inside (-margin,
    +margin). A row's own test, not adjusted over the family (each "equal" is one claim at level alpha). se = 0: equal
    when |estimate| < margin."""
    if not margin > 0 or not 0 < alpha < 0.5 or not se >= 0:
        raise ValueError(f"tost needs margin > 0, 0 < alpha < 0.5 and se >= 0, got {margin}, {alpha}, {se}")
    if se == 0:
        p_lower, p_upper = float(estimate <= -margin), float(estimate >= margin)
        half = 0.0
    else:
        p_lower = 1.0 - t_cdf((estimate + margin) / se, df)
        p_upper = t_cdf((estimate - margin) / se, df)
        half = t_quantile(1.0 - alpha, df) * se
    p = max(p_lower, p_upper)
    return {
        "p_lower": p_lower,
        "p_upper": p_upper,
        "p": p,
        "ci_low": estimate - half,
        "ci_high": estimate + half,
        "equal": p < alpha,
    }


EQUAL, DIFFERENT, SMALL, UNDECIDED = "equal", "different", "different, within the margin", "undecided"
"""decision's words: shown equal within the margin (tost); shown different from 0 (family-wise adjusted p < alpha);
both (a difference shown, and shown smaller than the margin); neither."""


def decision(equal: bool, distinguishable: bool) -> str:
    """The word for a row: EQUAL when only the equivalence test (tost) shows it within the margin, DIFFERENT when only
    the adjusted test shows it off 0, SMALL when both do, UNDECIDED when neither: the data allow a difference of the
    margin's size and also none."""
    if equal:
        return SMALL if distinguishable else EQUAL
    return DIFFERENT if distinguishable else UNDECIDED


def family_decisions(
    rows: list[tuple[float, float, float]],
    alpha: float = 0.05,
    primary: list[int] | None = None,
    margin: float = 0.05,
) -> list[dict]:
    """Family-wise decisions over a verdict's contrasts, rows (estimate, se, df) (a verdict row's difference, se and df
    with seeds), in their order: the t statistic, its two-sided p (t_test_p), the Holm-adjusted p (holm) over its
    family, "distinguishable" when adjusted p < alpha, the equivalence test within +-margin (tost at alpha: p_equal and
    its 1 - 2 alpha interval) and the decision's word (decision).

    The family is every row, or with `primary` (indices of rows) two families adjusted apart: the primary rows among
    themselves, the rest among themselves, reported as "exploratory" (their adjusted p does not count the primary
    ones: a claim from them is a lead for a new experiment, not a result)."""
    everyone = set(range(len(rows)))
    first = everyone if primary is None else set(primary)
    if not first <= everyone:
        raise ValueError(f"primary indices {sorted(first)} must index the {len(rows)} rows")
    families = [("all", sorted(everyone))] if primary is None else [("primary", sorted(first))]
    if primary is not None:
        families.append(("exploratory", sorted(everyone - first)))
    out = []
    for estimate, se, df in rows:
        eq = tost(estimate, se, df, margin, alpha)
        out.append(
            {
                "t": t_statistic(estimate, se),
                "p": t_test_p(estimate, se, df),
                "p_equal": eq["p"],
                "ci_equal": (eq["ci_low"], eq["ci_high"]),
                "equal": eq["equal"],
            }
        )
    for family, members in families:
        for i, p_adjusted in zip(members, holm([out[i]["p"] for i in members]), strict=True):
            distinguishable = p_adjusted < alpha
            out[i] |= {
                "family": family,
                "p_adjusted": p_adjusted,
                "distinguishable": distinguishable,
                "decision": decision(out[i]["equal"], distinguishable),
            }
    return out


def seed_slopes(differences_SD: torch.Tensor, doses: list[float]) -> torch.Tensor:
    """Each seed's least-squares slope (S,) of its differences (S seeds, D doses) on the doses:
    sum_d (x_d - mean x)(y_sd - mean_d y_sd) / sum_d (x_d - mean x)^2. Each seed's own intercept is fitted, so what a
    seed shares at every dose (its level) drops out: seeds are blocks."""
    y = differences_SD.double()
    x = torch.as_tensor(doses, dtype=torch.float64)
    if y.dim() != 2 or y.shape[1] != x.numel():
        raise ValueError(f"differences must be (seeds, doses) with {x.numel()} doses, got shape {tuple(y.shape)}")
    if not bool(torch.isfinite(y).all()) or not bool(torch.isfinite(x).all()):
        raise ValueError(
            "differences and doses must be finite: a seed missing a dose (NaN) has no slope comparable to the others'; "
            "drop that seed or that dose; give an infinite dose (uniform, beta_rs -> inf) a finite one, e.g. its rank"
        )
    xc = x - x.mean()
    if float((xc * xc).sum()) == 0.0:
        raise ValueError(f"the doses must not all be equal, got {doses}")
    return ((y - y.mean(1, keepdim=True)) * xc).sum(1) / (xc * xc).sum()


def sign_flip_p(values: torch.Tensor) -> float:
    """Exact two-sided p of the sign-flip (randomisation) test that values (S,) are symmetric about 0: the share of the
    2^S arrangements of their signs whose |sum| is at least the observed |sum| (the observed one among them, so p >=
    2 / 2^S). Assumes independent values each symmetric about 0 under H0; no normality. At most 20 values."""
    v = values.double().flatten()
    S = v.numel()
    if not 1 <= S <= 20:
        raise ValueError(f"sign_flip_p enumerates 2^S arrangements: needs 1 <= S <= 20, got {S}")
    observed = abs(float(v.sum()))
    tolerance = 1e-12 * float(v.abs().sum())  # the same sum added in another order
    bits = (torch.arange(2**S)[:, None] >> torch.arange(S)) & 1  # (2^S, S)
    sums = ((1 - 2 * bits).double() * v).sum(1).abs()  # (2^S,)
    return float((sums >= observed - tolerance).double().mean())


def dose_trend(
    differences_SD: torch.Tensor, doses: list[float], confidence: float = 0.95, sign_flip: bool = False
) -> dict:
    """One trend over a dose with seeds as blocks: each seed's matched differences at D doses (S, D) (e.g. each seed's
    mean per-post difference of an arm against uniform, at doses log beta_rs or the dose's rank) give the seed's
    least-squares slope (seed_slopes); the trend is their mean over seeds, with the standard error of that mean (their
    sample std / sqrt(S)), t = slope / se on S - 1 degrees of freedom, the t interval at `confidence` and the
    two-sided p (t_test_p). Seeds are the unit: the doses of one seed share its run-to-run luck, so the S D points are
    not independent, and the pooled regression's error would be wrong. With sign_flip, also the exact sign-flip p over
    the seeds' slopes (sign_flip_p), valid without normality (its smallest value is 2 / 2^S: 0.125 with 4 seeds).
    Assumes independent seeds; the slope summarises a linear trend in the dose as given. Needs S >= 2, no NaN."""
    slopes = seed_slopes(differences_SD, doses)  # (S,)
    S = slopes.numel()
    if S < 2:
        raise ValueError(f"a trend over seeds needs at least 2 seeds, got {S}")
    slope, se = float(slopes.mean()), float(slopes.std(correction=1)) / math.sqrt(S)
    half = t_quantile((1 + confidence) / 2, S - 1) * se
    out = {
        "slope": slope,
        "se": se,
        "t": t_statistic(slope, se),
        "df": S - 1,
        "ci_low": slope - half,
        "ci_high": slope + half,
        "p": t_test_p(slope, se, S - 1),
        "slopes": slopes.tolist(),
        "seeds": S,
    }
    if sign_flip:
        out["p_sign_flip"] = sign_flip_p(slopes)
    return out

"""Comparisons on the reward-KL frontier, over posts: every method and best-of-n are measured on the same posts, the
post the unit of every error. `frontier_points` reads a run's evaluations back (metrics.jsonl, and the per-post values
of frontier_posts.jsonl); `verdict_rows` compares methods, and a method with best-of-n, at matched KL by per-post
differences on the same posts, with intervals over posts and with the seeds' spread, and `verdict_table` writes them;
`fit_curves` fits Gao et al.'s two forms (Gao, Schulman and Hilton 2022, arXiv 2210.10760). The statistics are
rlhf/stats.py's and rlhf/frontier.py's; the frontier's own table and picture are evaluation/frontier.py's.
"""

import math
from pathlib import Path

import torch

from evaluation.frontier_declarations import LOGGED, METRICS, POSTS_TABLE
from rlhf.frontier import gao_fit
from rlhf.stats import (
    UNDECIDED,
    bootstrap_resamples,
    bootstrap_undefined,
    crossed_bootstrap_resamples,
    detectable_difference,
    difference_interval,
    family_decisions,
    mean_and_se_over_posts,
    percentile_interval,
    posts_needed,
    seeds_needed,
    sqrt_kl_interpolation,
    variance_components,
)
from utils.logging import read_rows

# ----------------------------------------------------------------------------------------------------
# Reading runs


def frontier_points(run_dir: Path) -> list[dict]:
    """Every evaluation of a run that measured the frontier (eval/kl in metrics.jsonl), in step order: the step and
    each eval/ frontier metric without its prefix (win_rate_sampled read back as win_rate), and in "posts" its
    per-post values (frontier_posts.jsonl, when the run wrote it: {name: [one value per post]}). A line cut short by
    a kill is skipped (utils.logging.read_rows); a standard error the log lacks (NaN, of one prompt: the logger writes
    finite values only) is NaN."""
    tables = {}
    for row in read_rows(Path(run_dir) / f"{POSTS_TABLE}.jsonl"):
        columns = row["columns"]
        tables[row["step"]] = {c: [r[i] for r in row["rows"]] for i, c in enumerate(columns) if c != "post"}
    points = []
    for row in read_rows(Path(run_dir) / "metrics.jsonl"):
        if "eval/kl" not in row:
            continue
        point = {"step": row["step"]}
        for name in METRICS:
            if LOGGED[name] in row:
                point[name], point[name + "_se"] = row[LOGGED[name]], row.get(LOGGED[name + "_se"], math.nan)
        if row["step"] in tables:
            point["posts"] = tables[row["step"]]
        points.append(point)
    return points


# ----------------------------------------------------------------------------------------------------
# Comparisons over posts: every method and best-of-n measured on the same posts, the post the unit of every error


BEST_OF_N = "best-of-n"
"""The name of best-of-n from the reference as the second member of a pair (verdict_rows)."""


def path_at_kl(points: list[dict], kl: float, key: str, idx: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-post values (P,) of `key` at KL `kl` along a path of points that carry per-post values (best-of-n's n,
    or a run's evaluations), interpolated linearly in sqrt(KL) between its two neighbouring points
    (rlhf.stats.sqrt_kl_interpolation), each point's KL its mean over the posts `idx` (all when None: a bootstrap
    passes a resample); None beyond the path's largest KL."""
    kls = []
    for p in points:
        v = torch.as_tensor(p["posts"]["kl"], dtype=torch.float64)
        kls.append(float(v[idx].mean()) if idx is not None else float(v.mean()))
    where = sqrt_kl_interpolation(kls, kl)
    if where is None:
        return None
    i, j, w = where
    v_i, v_j = (torch.as_tensor(points[k]["posts"][key], dtype=torch.float64) for k in (i, j))
    out = (1 - w) * v_i + w * v_j
    return out[idx] if idx is not None else out


def matched_difference(
    a: list[dict], b: list[dict], key: str, b_is_best_of_n: bool, idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, float] | None:
    """Per-post difference (P,) A minus B of `key` at matched KL, and that KL, for one seed (posts `idx`, all when
    None). A and B are paths of points with per-post values (a run's evaluations, in step order; best-of-n's curve).
    Against best-of-n: at A's last evaluation's KL, best-of-n interpolated to it. Between two runs: at the smaller of
    their last evaluations' KLs, the run that went further interpolated back along its evaluations to it. None when
    best-of-n does not reach A's KL."""

    def mean_kl(point):
        v = torch.as_tensor(point["posts"]["kl"], dtype=torch.float64)
        return float(v[idx].mean()) if idx is not None else float(v.mean())

    def last(points):
        v = torch.as_tensor(points[-1]["posts"][key], dtype=torch.float64)
        return v[idx] if idx is not None else v

    k_a = mean_kl(a[-1])
    if b_is_best_of_n:
        at = path_at_kl(b, k_a, key, idx)
        return None if at is None else (last(a) - at, k_a)
    k_b = mean_kl(b[-1])
    if k_a <= k_b:
        at = path_at_kl(b, k_a, key, idx)
        return None if at is None else (last(a) - at, k_a)
    at = path_at_kl(a, k_b, key, idx)
    return None if at is None else (at - last(b), k_b)


def verdict_rows(
    methods: dict[str, list[list[dict]]],
    curve: list[dict],
    pairs: list[tuple[str, str]],
    key: str = "gold",
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    delta: float = 0.05,
    common: float | None = None,
) -> list[dict]:
    """One row per pair (A, B) of method names (B may be BEST_OF_N): A minus B in `key` at matched KL
    (matched_difference), every run of a method measured on the same posts with per-post values (frontier_points'
    "posts", best_of_n's). Seed s of A is paired with seed s of B (the first min(S_A, S_B) seeds; best-of-n is one
    curve for every seed), giving a (seeds, posts) matrix of per-post differences. Each row:

    - difference, kl: the mean difference and the mean matched KL;
    - se_posts, ci_posts_low/high: its standard error over posts (of the seeds' mean per-post difference) and a
      percentile bootstrap interval over posts that redoes the KL matching in every resample (seeds held fixed);
      ci_posts_unmatched: the share of resamples where best-of-n does not reach A's KL (dropped from the interval:
      the interval is conditional on a match; above (1 - confidence) / 2 the table says so);
    - se, df, ci_low, ci_high, var_seed, var_post, var_residual: the t interval that includes the seed-to-seed spread
      (rlhf.stats.difference_interval: seeds the unit of the between-run part, posts paired within each seed);
      with one seed the posts' alone; seed_floor: the seeds' means agreed within their posts' noise, so the seeds'
      part is its floor (the table says so: with few seeds the interval may be too narrow);
    - excludes_0: the interval (with seeds when there are two or more) excludes 0, unadjusted (decide_rows adds the
      family-wise decision, "distinguishable");
    - seed_kls, seed_differences, seed_variances: per seed its matched KL, its mean per-post difference and that
      difference's variance over posts (what a dose's trend over seeds needs: evaluation/verdict_report.py);
    - with `common` (a KL: common_kl) and B an arm: kl_common, difference_common, se_common, df_common,
      ci_common_low/high and seed_differences_common, the pair read at that KL on both arms' paths (read_at_kl),
      beside its own matched KL; common_note instead when a path does not reach it;
    - detectable: the smallest true difference these seeds and posts detect (rlhf.stats.detectable_difference at 80%
      power); posts_needed: how many posts make `delta` detectable with these seeds, seeds_needed: how many seeds
      with these posts (rlhf.stats.posts_needed, seeds_needed: from the measured components, each count judged at the
      interval's own degrees of freedom there; None when the other count must grow first; seeds_needed NaN with one
      seed, which cannot measure the seeds' spread);
    - seeds, posts; "note" instead of the numbers when best-of-n does not reach A's KL (or two runs' paths share no
      KL)."""

    def as_tensors(points: list[dict]) -> list[dict]:  # per-post lists as tensors once, not in every resample
        return [
            p | {"posts": {k: torch.as_tensor(v, dtype=torch.float64) for k, v in p["posts"].items()}} for p in points
        ]

    curve = as_tensors(curve)
    methods = {name: [as_tensors(points) for points in seeds] for name, seeds in methods.items()}
    rows = []
    for a_name, b_name in pairs:
        vs_bon = b_name == BEST_OF_N
        a_seeds = methods[a_name]
        b_seeds = [curve] * len(a_seeds) if vs_bon else methods[b_name]
        S = min(len(a_seeds), len(b_seeds))
        row = {"pair": f"{a_name} - {b_name}", "a": a_name, "b": b_name, "seeds": S}
        matched = [matched_difference(a_seeds[s], b_seeds[s], key, vs_bon) for s in range(S)]
        if any(m is None for m in matched):
            note = (
                "beyond best-of-n's largest n: a larger --frontier_best_of" if vs_bon else "no common KL on the paths"
            )
            rows.append(row | {"note": note})
            continue
        d_SP = torch.stack([d for d, _ in matched])  # (S, P)
        P = d_SP.shape[1]

        def statistic(idx, a_seeds=a_seeds, b_seeds=b_seeds, vs_bon=vs_bon, S=S):
            out = [matched_difference(a_seeds[s], b_seeds[s], key, vs_bon, idx) for s in range(S)]
            return math.nan if any(m is None for m in out) else sum(float(d.mean()) for d, _ in out) / S

        resampled = bootstrap_resamples(statistic, P, n_resamples, seed)
        lo, hi = percentile_interval(resampled, confidence)[:, 0].tolist()
        mean_d, se_posts = mean_and_se_over_posts(d_SP.mean(0))
        interval = difference_interval(d_SP, confidence)
        row |= {
            "kl": sum(k for _, k in matched) / S,
            "difference": mean_d,
            "se_posts": se_posts,
            "ci_posts_low": lo,
            "ci_posts_high": hi,
            "ci_posts_unmatched": bootstrap_undefined(resampled),
            **{k: interval[k] for k in ("se", "df", "ci_low", "ci_high", "var_seed", "var_post", "var_residual")},
            "seed_floor": interval["seed_floor"],
            "excludes_0": interval["distinguishable"],
            "detectable": detectable_difference(interval["se"], interval["df"], confidence),
            "posts_needed": posts_needed(interval, S, delta, confidence),
            "seeds_needed": seeds_needed(interval, P, delta, confidence) if S > 1 else math.nan,
            "posts": P,
            "seed_kls": [k for _, k in matched],
            "seed_differences": d_SP.mean(1).tolist(),
            "seed_variances": d_SP.var(1, correction=1).tolist() if P > 1 else [math.nan] * S,
        }
        if common is not None and not vs_bon:
            row |= read_at_kl(a_seeds[:S], b_seeds[:S], common, key, confidence)
        rows.append(row)
    return rows


def final_kl(points: list[dict]) -> float:
    """A path's last evaluation's KL, its mean over posts."""
    return float(torch.as_tensor(points[-1]["posts"]["kl"], dtype=torch.float64).mean())


def common_kl(methods: dict[str, list[list[dict]]], arms) -> float | None:
    """The smallest final KL (final_kl) over every seed of the `arms`: a KL every one of their paths reaches, at which
    their rows can be read side by side (a dose read at one KL, not each row at its own); None without runs."""
    kls = [final_kl(points) for arm in arms for points in methods.get(arm, []) if points]
    return min(kls) if kls else None


def difference_at_kl(a: list[dict], b: list[dict], kl: float, key: str) -> torch.Tensor | None:
    """Per-post difference (P,) A minus B of `key` with both paths read at KL `kl` (path_at_kl); None when one does
    not reach it."""
    at_a, at_b = path_at_kl(a, kl, key), path_at_kl(b, kl, key)
    return None if at_a is None or at_b is None else at_a - at_b


def read_at_kl(a_seeds: list[list[dict]], b_seeds: list[list[dict]], kl: float, key: str, confidence: float) -> dict:
    """verdict_rows' columns of a pair read at the common KL `kl`, seed s of A against seed s of B."""
    d = [difference_at_kl(a, b, kl, key) for a, b in zip(a_seeds, b_seeds, strict=True)]
    if any(x is None for x in d):
        return {"kl_common": kl, "common_note": "a path does not reach the common KL"}
    d_SP = torch.stack(d)  # (S, P)
    interval = difference_interval(d_SP, confidence)
    return {
        "kl_common": kl,
        "difference_common": float(d_SP.mean()),
        "se_common": interval["se"],
        "df_common": interval["df"],
        "ci_common_low": interval["ci_low"],
        "ci_common_high": interval["ci_high"],
        "seed_differences_common": d_SP.mean(1).tolist(),
    }


MARGIN = 0.05
"""A verdict's default equivalence margin in gold (rlhf.stats.tost): a row shown within +-MARGIN is "equal"."""


def decide_rows(
    rows: list[dict], primary: list[tuple[str, str]] | None = None, margin: float = MARGIN, confidence: float = 0.95
) -> list[dict]:
    """verdict_rows' rows with their family-wise decisions (rlhf.stats.family_decisions at alpha 1 - confidence, on
    each row's difference, se and df with seeds): t, p, p_adjusted (Holm over its family), distinguishable (adjusted
    p < alpha: what "distinguishable" means), p_equal and ci_equal (the equivalence test within +-margin and its
    1 - 2 alpha interval), equal, decision (rlhf.stats.decision's word), family and margin. Two families, adjusted
    apart: the pairs between arms ("pairs"; with `primary`, the pairs named there "primary" and the rest
    "exploratory") and the arms against best-of-n ("best-of-n": a question of its own, whether a method beats
    selection from the reference at its KL). Rows with a note stay as they are; new dicts, the rows given unchanged."""
    out = [dict(r) for r in rows]
    chosen = {tuple(p) for p in primary} if primary is not None else None
    unread = [i for i, r in enumerate(out) if "note" not in r and not math.isfinite(r["se"] + r["difference"])]
    for i in unread:  # no error to test with (one post, one seed): nothing shown either way
        nan = math.nan
        out[i] |= {"t": nan, "p": nan, "p_adjusted": nan, "p_equal": nan, "ci_equal": (nan, nan), "equal": False}
        out[i] |= {"distinguishable": False, "decision": UNDECIDED, "family": "none", "margin": margin}
    decided = [i for i, r in enumerate(out) if "note" not in r and i not in unread]
    pairs = [i for i in decided if out[i]["b"] != BEST_OF_N]
    families = [("pairs", pairs), (BEST_OF_N, [i for i in decided if i not in pairs])]
    for name, members in families:
        first = None
        if name == "pairs" and chosen is not None:
            first = [k for k, i in enumerate(members) if (out[i]["a"], out[i]["b"]) in chosen]
        estimates = [(out[i]["difference"], out[i]["se"], out[i]["df"]) for i in members]
        for i, d in zip(members, family_decisions(estimates, 1 - confidence, first, margin), strict=True):
            out[i] |= d | {"family": name if d["family"] == "all" else d["family"], "margin": margin}
    return out


def verdict_table(rows: list[dict], key: str = "gold", confidence: float = 0.95) -> str:
    """Markdown of verdict_rows' rows with their decisions (decide_rows; rows without them are decided here with every
    default): each pair at its own matched KL (the KL each row is read at), its interval with seeds, raw and
    Holm-adjusted p (its family beside it), the equivalence test's 90% interval against the margin and the decision;
    beside them the pair read at the common KL (pairs between arms, when verdict_rows read it); then the errors over
    posts, the smallest difference detected and the posts or seeds needed for 0.05."""
    if not any("decision" in r for r in rows):
        rows = decide_rows(rows, confidence=confidence)
    margin = next((r["margin"] for r in rows if "margin" in r), MARGIN)
    equal = f"{1 - 2 * (1 - confidence):.0%} interval (within ±{margin:g}: equal)"
    text = (
        f"| pair ({key}, A - B) | KL read at | difference | 95% interval with seeds (t) | p | p adjusted (Holm, "
        f"family) | {equal} | decision | at the common KL | se over posts | 95% interval over posts (bootstrap) "
        "| se with seeds | detectable | posts, seeds for 0.05 |\n" + "|---" * 14 + "|"
    )
    for r in rows:
        if "note" in r:
            text += f"\n| {r['pair']} | {r['note']} |" + " |" * 12
            continue
        posts = "more seeds first" if r["posts_needed"] is None else str(r["posts_needed"])
        seeds = r["seeds_needed"]
        seeds = "" if isinstance(seeds, float) else ", more posts first" if seeds is None else f", {seeds}"
        floor = "; seeds agree: their spread at its floor" if r.get("seed_floor") else ""
        unmatched = r.get("ci_posts_unmatched", 0.0)
        unmatched = f" ({unmatched:.0%} of resamples unmatched)" if unmatched > (1 - confidence) / 2 else ""
        common = r.get("common_note", "")
        if "difference_common" in r:
            low, high = r["ci_common_low"], r["ci_common_high"]
            common = f"{r['difference_common']:+.3f} [{low:+.3f}, {high:+.3f}] at KL {r['kl_common']:.3f}"
        text += (
            f"\n| {r['pair']} | {r['kl']:.3f} (matched) | {r['difference']:+.3f} | "
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['p']:.3g} | {r['p_adjusted']:.3g} ({r['family']}) | "
            f"[{r['ci_equal'][0]:+.3f}, {r['ci_equal'][1]:+.3f}] | {r['decision']} | {common} | "
            f"{r['se_posts']:.3f} | [{r['ci_posts_low']:+.3f}, {r['ci_posts_high']:+.3f}]{unmatched} | "
            f"{r['se']:.3f} (df {r['df']:.1f}{floor}) | {r['detectable']:.3f} | {posts}{seeds} |"
        )
    return text


def point_components(seeds: list[list[dict]], key: str = "gold") -> dict[str, float]:
    """A method's last evaluation over its seeds, per post (seeds, posts): its mean and the variance components of
    that mean (rlhf.stats.variance_components: between seeds, between posts, residual), with its standard error."""
    return variance_components(torch.tensor([points[-1]["posts"][key] for points in seeds], dtype=torch.float64))


def fit_curves(
    curve: list[dict],
    methods: dict[str, list[list[dict]]],
    key: str = "gold",
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict]:
    """Gao et al. 2022's forms (rlhf.frontier.gao_fit) through the points, gold gained over the reference (best-of-1 on
    the same posts) against d = sqrt(KL): best-of-n by R_bon(d) = d (alpha - beta d) through its n, each method by
    R_RL(d) = d (alpha - beta log d) through every evaluation of every seed. alpha, beta and their percentile bootstrap
    intervals over seeds and posts (rlhf.stats.crossed_bootstrap_resamples: each resample draws the method's seeds
    and the posts with replacement, independently, and refits through the drawn seeds' points, every point's means
    recomputed on the drawn posts; so seeds that disagree widen the interval, which a resample of posts alone with the
    seeds fixed leaves out; best-of-n is one curve: posts alone; NaN with n_resamples 0).
    name (BEST_OF_N for best-of-n) -> {form, alpha, beta, alpha_ci, beta_ci, baseline (best-of-1's mean), d_max}."""
    baseline = torch.tensor(curve[0]["posts"][key], dtype=torch.float64)  # (P,) best-of-1: the reference's value
    P = baseline.numel()
    paths = {BEST_OF_N: ("bon", [curve])} | {name: ("rl", seeds) for name, seeds in methods.items()}
    out = {}
    for name, (form, seeds) in paths.items():
        seeds = [points for points in seeds if points]
        kls = [torch.tensor([p["posts"]["kl"] for p in points], dtype=torch.float64) for points in seeds]  # (M_s, P)
        ys = [torch.tensor([p["posts"][key] for p in points], dtype=torch.float64) for points in seeds]

        def fit(seed_idx, post_idx, kls=kls, ys=ys, form=form):
            kl_MP = torch.cat([kls[s] for s in seed_idx.tolist()])  # the drawn seeds' points (M, P)
            y_MP = torch.cat([ys[s] for s in seed_idx.tolist()])
            d = kl_MP[:, post_idx].mean(1).clamp(min=0).sqrt()
            gain = y_MP[:, post_idx].mean(1) - baseline[post_idx].mean()
            try:
                return torch.tensor(gao_fit(d, gain, form), dtype=torch.float64)
            except ValueError:
                return torch.tensor([math.nan, math.nan], dtype=torch.float64)

        alpha, beta = fit(torch.arange(len(seeds)), torch.arange(P)).tolist()
        if n_resamples > 0:  # (2, 2): rows low and high, columns alpha and beta
            ci = percentile_interval(crossed_bootstrap_resamples(fit, len(seeds), P, n_resamples, seed), confidence)
        else:
            ci = torch.full((2, 2), math.nan, dtype=torch.float64)
        d_max = float(torch.cat(kls).mean(1).clamp(min=0).sqrt().max())
        out[name] = {
            "form": form,
            "alpha": alpha,
            "beta": beta,
            "alpha_ci": ci[:, 0].tolist(),
            "beta_ci": ci[:, 1].tolist(),
            "baseline": float(baseline.mean()),
            "d_max": d_max,
        }
    return out

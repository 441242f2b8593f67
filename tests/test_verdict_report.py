"""A verdict's decisions and report (evaluation/matched.py decide_rows, read_at_kl; evaluation/verdict_report.py):
the pairs read at the common KL against paths interpolated by hand, the families adjusted apart (Holm's step-down
written out), the words of the equivalence test, and a dose's trend with seeds as blocks against each seed's slope
fitted by numpy and a sign-flip p counted over every arrangement."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.matched import BEST_OF_N, common_kl, decide_rows, verdict_rows
from evaluation.verdict_report import dose_trends, read_record, report
from rlhf.stats import DIFFERENT, EQUAL, UNDECIDED, difference_interval, t_quantile

ROOT = Path(__file__).resolve().parents[1]


def path(final_kl: float, start: list[float], end: list[float]) -> list[dict]:
    """A run's two evaluations: at KL 0 (every post) and at `final_kl`, with per-post gold."""
    return [
        {"step": 0, "kl": 0.0, "gold": sum(start) / 3, "posts": {"kl": [0.0] * 3, "gold": start}},
        {"step": 2, "kl": final_kl, "gold": sum(end) / 3, "posts": {"kl": [final_kl] * 3, "gold": end}},
    ]


def test_pairs_are_read_at_the_smallest_final_kl_of_every_arm_beside_their_matched_kl():
    """A ends at KL 0.25 and 0.36, B at 1.0 and 0.49: the common KL is 0.25, A's first seed's end; every other path
    read back to it linearly in sqrt(KL) (weight sqrt(0.25) / sqrt(k) of the way from KL 0), per post and seed."""
    start = [1.0, 2.0, 3.0]
    a = [path(0.25, start, [2.0, 3.5, 3.5]), path(0.36, start, [2.6, 2.9, 4.4])]
    b = [path(1.0, start, [1.0, 4.0, 5.0]), path(0.49, start, [3.1, 2.0, 4.0])]
    curve = [path(4.0, start, [5.0] * 3)[0] | {"n": 1}, path(4.0, start, [5.0] * 3)[1] | {"n": 2}]
    common = common_kl({"A": a, "B": b, "C": [path(0.01, start, start)]}, ["A", "B"])  # C is in no pair
    assert common == 0.25

    def at(end, k):
        w = 0.5 / math.sqrt(k)
        return [(1 - w) * s + w * e for s, e in zip(start, end, strict=True)]

    d = [
        [x - y for x, y in zip([2.0, 3.5, 3.5], at([1.0, 4.0, 5.0], 1.0), strict=True)],
        [x - y for x, y in zip(at([2.6, 2.9, 4.4], 0.36), at([3.1, 2.0, 4.0], 0.49), strict=True)],
    ]
    pair, bon = verdict_rows({"A": a, "B": b}, curve, [("A", "B"), ("A", BEST_OF_N)], n_resamples=10, common=common)
    assert pair["kl_common"] == 0.25 and pair["kl"] == pytest.approx(0.305)  # each seed matched at its smaller KL
    assert pair["seed_differences_common"] == pytest.approx([sum(x) / 3 for x in d])
    assert pair["difference_common"] == pytest.approx(sum(map(sum, d)) / 6)
    want = difference_interval(torch.tensor(d, dtype=torch.float64))
    assert (pair["ci_common_low"], pair["ci_common_high"]) == pytest.approx((want["ci_low"], want["ci_high"]))
    assert "kl_common" not in bon  # against best-of-n: read at its own KL only


def row(pair: str, difference: float, se: float) -> dict:
    a, b = pair.split(" - ")
    return {"pair": pair, "a": a, "b": b, "difference": difference, "se": se, "df": math.inf}


def test_families_are_adjusted_apart_and_primary_pairs_among_themselves():
    """Four pairs and two arms against best-of-n, normal p (df infinite) by hand. Without primary: the pairs one family
    of four (Holm: sorted p times 4, 3, 2, 1 with a running max), best-of-n's rows another of two. With two primary
    pairs: those two adjusted as a family of two, the other two as the exploratory family of two."""
    rows = [
        row("A - B", 0.26, 0.1),
        row("A - C", 0.22, 0.1),
        row("B - C", 0.01, 0.01),
        row("A - D", 0.05, 0.1),
        row(f"A - {BEST_OF_N}", 0.25, 0.1),
        row(f"B - {BEST_OF_N}", 0.3, 0.1),
        {"pair": f"C - {BEST_OF_N}", "a": "C", "b": BEST_OF_N, "note": "beyond best-of-n's largest n"},
    ]
    p = [math.erfc(abs(r["difference"] / r["se"]) / math.sqrt(2)) for r in rows[:6]]
    decided = decide_rows(rows)
    assert [r["family"] for r in decided[:6]] == ["pairs"] * 4 + [BEST_OF_N] * 2 and "family" not in decided[6]
    order = sorted(range(4), key=lambda i: p[i])
    running, want = 0.0, [0.0] * 4
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (4 - rank) * p[i]))
        want[i] = running
    assert [r["p_adjusted"] for r in decided[:4]] == pytest.approx(want)
    assert [r["p_adjusted"] for r in decided[4:6]] == pytest.approx([max(2 * p[5], p[4]), 2 * p[5]])
    assert [r["distinguishable"] for r in decided[:4]] == [w < 0.05 for w in want]
    assert decided[0]["p"] < 0.05 and not decided[1]["distinguishable"] and decided[1]["p"] < 0.05  # raw, not adjusted
    # B - C: 0.01 +- 0.01, its 90% interval inside +-0.05: equal; A - D: neither shown: undecided
    low, high = 0.01 - t_quantile(0.95, math.inf) * 0.01, 0.01 + t_quantile(0.95, math.inf) * 0.01
    assert decided[2]["ci_equal"] == pytest.approx((low, high)) and decided[2]["decision"] == EQUAL
    assert decided[3]["decision"] == UNDECIDED and decided[5]["decision"] == DIFFERENT
    assert decide_rows(rows, margin=0.005)[2]["decision"] != EQUAL  # the margin is the file's
    primary = decide_rows(rows, primary=[("A", "C"), ("A", "D")])
    assert [r["family"] for r in primary[:4]] == ["exploratory", "primary", "exploratory", "primary"]
    assert primary[1]["p_adjusted"] == pytest.approx(2 * p[1]) and primary[3]["p_adjusted"] == pytest.approx(
        max(2 * p[1], p[3])
    )
    assert p[0] < p[2]  # the exploratory two: A - B the smaller p, x2; B - C its own p or A - B's adjusted one
    assert [primary[0]["p_adjusted"], primary[2]["p_adjusted"]] == pytest.approx([2 * p[0], max(2 * p[0], p[2])])
    assert rows[0].keys() == row("A - B", 0.26, 0.1).keys()  # the rows given are not changed
    lone = decide_rows(rows[:2] + [row("A - E", 0.3, math.nan)])  # no error to test with: undecided, in no family
    assert lone[2]["decision"] == UNDECIDED and lone[2]["family"] == "none"
    assert lone[1]["p_adjusted"] == pytest.approx(max(2 * p[0], p[1]))  # a family of the other two


def dose_row(arm: str, matched: list[float], common: list[float]) -> dict:
    return {"a": arm, "b": "uniform", "kl_common": 0.3, "seed_differences": matched, "seed_differences_common": common}


def test_a_dose_is_one_trend_over_its_ranks_with_seeds_as_blocks():
    """Three doses (top, rso at beta_rs 0.5 and 4: ranks 0, 1, 2) and four seeds: the trend is the mean of each seed's
    own least-squares slope (numpy's polyfit per seed), its t on 3 df; the sign-flip p counts the 16 arrangements of
    the slopes' signs; read at the matched KLs and at the common KL from their own per-seed differences."""
    matched = np.array([[-0.30, -0.10, 0.00], [-0.20, -0.15, 0.05], [-0.35, -0.05, -0.02], [-0.10, -0.12, 0.01]])
    common = matched * 0.5 + 0.01
    points = [
        (0.0, dose_row("top", *(matched[:, 0].tolist(), common[:, 0].tolist()))),
        (0.5, dose_row("rso_0.5", *(matched[:, 1].tolist(), common[:, 1].tolist()))),
        (4.0, dose_row("rso_4", *(matched[:, 2].tolist(), common[:, 2].tolist()))),
    ]
    trends = dose_trends(points)
    assert trends["ranks"] == [0, 1, 2] and trends["arms"] == ["top", "rso_0.5", "rso_4"]
    for name, values in (("matched", matched), ("common", common)):
        slopes = np.array([np.polyfit([0, 1, 2], seed, 1)[0] for seed in values])
        t = trends[name]
        assert t["slopes"] == pytest.approx(slopes.tolist()) and t["slope"] == pytest.approx(slopes.mean())
        se = slopes.std(ddof=1) / 2
        assert t["se"] == pytest.approx(se) and t["df"] == 3
        half = t_quantile(0.975, 3) * se
        assert (t["ci_low"], t["ci_high"]) == pytest.approx((slopes.mean() - half, slopes.mean() + half))
        flips = [
            abs(sum(s * x for s, x in zip(signs, slopes, strict=True)))
            for signs in itertools.product((1, -1), repeat=4)
        ]
        assert t["p_sign_flip"] == pytest.approx(np.mean([f >= abs(slopes.sum()) - 1e-12 for f in flips]))
    one_seed = [(x, r | {"seed_differences": r["seed_differences"][:1]}) for x, r in points]
    assert dose_trends(one_seed)["matched"] is None and "two" in dose_trends(one_seed)["why"]


def test_a_trend_the_file_names_is_read_over_its_pairs_in_the_files_order():
    """A verdict's `trends`: the rows of its pairs in the order the file gives (not the rows' order), each seed's slope
    on the ranks 0, 1, 2 (numpy's polyfit), reported with dose_trends' numbers; a trend with a pair not yet read (an arm
    of a verdict cut short) is left out."""
    differences = np.array([[-0.06, -0.05, -0.01], [-0.08, -0.02, 0.00], [-0.03, -0.06, -0.02]])  # seeds x ranks
    names = [("rso_q", "uniform_q"), ("rso", "uniform"), ("rso_4x", "uniform_4x")]
    rows = [
        row(f"{a} - {b}", float(differences[:, k].mean()), 0.02) | EXTRA | dose_row(a, differences[:, k].tolist(), [])
        for k, (a, b) in enumerate(names)
    ]
    for r, (_, b) in zip(rows, names, strict=True):
        r["b"] = b
        del r["seed_differences_common"]
    record = {"key": "gold", "confidence": 0.95, "margin": 0.05, "primary": None, "round": 3, "rounds": 3}
    record |= {"rows": rows[::-1], "options": {}, "tables": "", "trends": [[list(p) for p in names]]}
    text, _ = report(record)
    slopes = [np.polyfit([0, 1, 2], seed, 1)[0] for seed in differences]
    half = t_quantile(0.975, 2) * np.std(slopes, ddof=1) / math.sqrt(3)
    mean = float(np.mean(slopes))
    assert (
        "Trend over the file's order: rso_q - uniform_q rank 0, rso - uniform rank 1, rso_4x - uniform_4x rank 2."
        in text
    )
    assert (
        f"at each row's matched KL: slope {mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}] (95% t interval, 3 "
        "seeds)" in text
    )
    assert "at the common KL: not read" in text
    cut_short = record | {"rows": rows[:2], "trends": [[list(p) for p in names]]}
    assert "Trend over the file's order" not in report(cut_short)[0]


def test_the_report_says_interim_until_the_last_round_and_names_the_families():
    """The same record after round 2 of 3 and after round 3: only the last says final; with primary pairs the text
    names them."""
    rows = [row("A - B", 0.26, 0.1) | EXTRA, row("A - C", 0.1, 0.1) | EXTRA, row(f"A - {BEST_OF_N}", 0.2, 0.1) | EXTRA]
    record = {"key": "gold", "confidence": 0.95, "margin": 0.05, "primary": None, "round": 2, "rounds": 3}
    record |= {"rows": rows, "options": {}, "tables": ""}
    text, decided = report(record)
    assert text.startswith("Interim: after round 2 of 3") and "final table, written after round 3" in text
    assert report(record | {"round": 3})[0].startswith("Final: after the last round of seeds, every arm's 3 seeds.")
    assert [r["family"] for r in decided] == ["pairs", "pairs", BEST_OF_N]
    p = math.erfc(2.6 / math.sqrt(2))  # A - B's raw p; the smaller of the two pairs', so x2 after adjustment
    assert f"| A - B | 0.300 (matched) | +0.260 | [+0.000, +0.500] | {p:.3g} | {2 * p:.3g} (pairs) | " in text
    assert f"| A - {BEST_OF_N} | 0.300 (matched) |" in text and "(best-of-n) |" in text
    assert "the file's primary pairs" in report(record | {"primary": [["A", "B"]]})[0]
    assert report(record | {"primary": [["A", "B"]]})[1][0]["family"] == "primary"


EXTRA = {
    "kl": 0.3,
    "ci_low": 0.0,
    "ci_high": 0.5,
    "se_posts": 0.1,
    "ci_posts_low": 0.0,
    "ci_posts_high": 0.5,
    "detectable": 0.28,
    "posts_needed": None,
    "seeds_needed": math.nan,
}


@pytest.mark.parametrize("folder", sorted(p.name for p in (ROOT / "docs" / "verdicts").iterdir()))
def test_each_committed_record_rebuilds_its_verdict_md(folder):
    """docs/verdicts/<name>/verdict_record.json, read by today's code, gives its verdict.md to the character: the
    committed verdicts stay re-readable without their runs (a change to the report's words rewrites them, said in its
    commit)."""
    path = ROOT / "docs" / "verdicts" / folder
    text, _ = report(read_record(path))
    assert text + "\n" == (path / "verdict.md").read_text()

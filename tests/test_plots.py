"""The verdict's pictures (evaluation/verdict_plots.py) on hand-made inputs: what each draws, read back from its Axes
(the lines' data, the bands' vertices, the forest plot's rows), against means and intervals worked out by hand; and the
command that redraws them from a verdict folder's record alone (evaluation/verdict_report.py), without its runs."""

import json
import math
import shutil
import sys

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from evaluation.matched import BEST_OF_N, decide_rows, verdict_rows  # noqa: E402
from evaluation.plots import main  # noqa: E402
from evaluation.verdict_plots import (  # noqa: E402
    draw_compute,
    draw_dose,
    draw_forest,
    draw_verdict,
    mean_path,
    verdict_runs,
)
from evaluation.verdict_report import RECORD, arm_options, dose_points, report, spent, verdict_record  # noqa: E402

# Student's t 0.975-quantiles from the tables, for 1, 2 and 4 degrees of freedom
T_975 = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105}


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def by_gid(ax, gid: str):
    """The one artist (line, band, bar) of `ax` drawn with this gid."""
    found = [a for a in ax.lines + ax.collections + ax.patches if a.get_gid() == gid]
    assert len(found) == 1, (gid, found)
    return found[0]


def band_ends(band, x: float) -> tuple[float, float]:
    """The lowest and highest y of a fill_between band's outline at x."""
    vertices = band.get_paths()[0].vertices
    at = vertices[np.isclose(vertices[:, 0], x), 1]
    return float(at.min()), float(at.max())


def point(step: int, kl: float, gold: float) -> dict:
    return {"step": step, "kl": kl, "gold": gold}


def test_mean_path_is_the_mean_over_seeds_with_its_t_interval():
    """Three seeds; the third cut short before step 20, so the path stops at step 10 (the mean over every seed)."""
    seeds = [
        [point(0, 0.0, 1.0), point(10, 0.4, 1.0), point(20, 0.9, 2.0)],
        [point(0, 0.0, 1.0), point(10, 0.5, 2.0), point(20, 1.0, 3.0)],
        [point(0, 0.0, 1.0), point(10, 0.9, 4.0)],
    ]
    path = mean_path(seeds, ("kl", "gold"))
    assert path["step"] == [0, 10] and path["seeds"] == 3
    assert path["kl"] == pytest.approx([0.0, 0.6]) and path["gold"] == pytest.approx([1.0, 7 / 3])
    # gold at step 10: 1, 2, 4: sample sd sqrt(7/3), so the half-width is t(0.975, 2) sqrt(7/3) / sqrt(3)
    half = T_975[2] * math.sqrt(7 / 3) / math.sqrt(3)
    assert path["gold_low"][1] == pytest.approx(7 / 3 - half) and path["gold_high"][1] == pytest.approx(7 / 3 + half)
    assert path["gold_low"][0] == path["gold_high"][0] == 1.0  # the seeds agree at step 0
    one = mean_path(seeds[:1], ("kl", "gold"))
    assert one["gold"] == [1.0, 1.0, 2.0] and all(math.isnan(v) for v in one["gold_low"] + one["gold_high"])
    assert mean_path([[], []], ("kl",)) == {"step": [], "seeds": 0, "kl": [], "kl_low": [], "kl_high": []}


def test_verdict_picture_draws_each_arms_mean_path_its_band_and_best_of_n():
    """Arm A: two seeds, its line through the means and its band the t interval over the two seeds (t(0.975, 1));
    arm B: one seed, its line and no band; best-of-n: its points, its band mean ± t(0.975, P - 1) se over P = 5
    posts."""
    curve = [
        {"n": n, "kl": kl, "gold": g, "gold_se": se, "pool": 8, "posts": {"gold": [g] * 5, "kl": [kl] * 5}}
        for n, kl, g, se in ((1, 0.0, 1.0, 0.1), (2, 0.2, 1.5, 0.2), (4, 0.6, 1.7, 0.3))
    ]
    methods = {
        "A": [[point(0, 0.0, 1.0), point(5, 0.2, 1.2)], [point(0, 0.0, 1.0), point(5, 0.4, 1.6)]],
        "B": [[point(0, 0.0, 1.1), point(3, 0.5, 2.0)]],
    }
    fig, ax = plt.subplots()
    draw_verdict(ax, curve, methods)
    a = by_gid(ax, "A")
    assert list(a.get_xdata()) == pytest.approx([0.0, 0.3]) and list(a.get_ydata()) == pytest.approx([1.0, 1.4])
    half = T_975[1] * abs(1.6 - 1.2) / 2  # two seeds: sd |a - b| / sqrt 2, over sqrt 2
    assert band_ends(by_gid(ax, "A band"), 0.3) == pytest.approx((1.4 - half, 1.4 + half))
    b = by_gid(ax, "B")
    assert list(b.get_xdata()) == [0.0, 0.5] and list(b.get_ydata()) == [1.1, 2.0]
    assert not [c for c in ax.collections if c.get_gid() == "B band"]  # one seed: no interval over seeds
    bon = by_gid(ax, BEST_OF_N)
    assert list(bon.get_xdata()) == [0.0, 0.2, 0.6] and list(bon.get_ydata()) == [1.0, 1.5, 1.7]
    assert band_ends(by_gid(ax, f"{BEST_OF_N} band"), 0.6) == pytest.approx(
        (1.7 - T_975[4] * 0.3, 1.7 + T_975[4] * 0.3)
    )
    colours = {line.get_gid(): line.get_color() for line in (a, b, bon)}
    assert len(set(colours.values())) == 3  # one colour per arm
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "best-of-n from the reference (pool of 8)",
        "A (2 seeds)",
        "B (1 seed)",
    ]
    plt.close(fig)


def forest_row(pair: str, difference: float, low: float, high: float, detectable: float) -> dict:
    a, b = pair.split(" - ")
    return {
        "pair": pair,
        "a": a,
        "b": b,
        "difference": difference,
        "ci_low": low,
        "ci_high": high,
        "distinguishable": not low <= 0 <= high,
        "detectable": detectable,
    }


def test_forest_plot_draws_one_row_per_pair_in_order(ax):
    """Two pairs, then two arms against best-of-n (one beyond its largest n: a note): each row at its place from the
    top, its interval's ends and the difference from the row, its detectable difference as a bar around 0, a marker
    filled only where the interval excludes 0, a line at 0."""
    rows = [
        forest_row("A - B", -0.05, -0.08, -0.01, 0.05),
        forest_row("A - C", 0.02, -0.03, 0.07, 0.06),
        forest_row(f"A - {BEST_OF_N}", -0.12, -0.18, -0.06, 0.08),
        {"pair": f"C - {BEST_OF_N}", "a": "C", "b": BEST_OF_N, "note": "beyond best-of-n's largest n"},
    ]
    ys = draw_forest(ax, rows)
    assert ys == [0, 1, 3, 4]  # a gap between the pairs and the rows against best-of-n
    assert ax.yaxis_inverted()  # the first row at the top
    assert list(ax.get_yticks()) == ys and [t.get_text() for t in ax.get_yticklabels()] == [r["pair"] for r in rows]
    for r, y in zip(rows[:3], ys, strict=False):
        line = by_gid(ax, r["pair"])
        assert list(line.get_xdata()) == [r["ci_low"], r["ci_high"]] and list(line.get_ydata()) == [y, y]
        bar = by_gid(ax, r["pair"] + " detectable")
        assert (bar.get_x(), bar.get_width()) == pytest.approx((-r["detectable"], 2 * r["detectable"]))
        (marker,) = [m for m in ax.lines if list(m.get_xdata()) == [r["difference"]] and list(m.get_ydata()) == [y]]
        assert (marker.get_markerfacecolor() != "white") == r["distinguishable"]
    assert not [a for a in ax.lines if a.get_gid() == f"C - {BEST_OF_N}"]
    assert "beyond best-of-n's largest n" in [t.get_text() for t in ax.texts]
    assert list(by_gid(ax, "zero").get_xdata()) == [0, 0]
    assert "-0.050 [-0.080, -0.010]  ±0.050" in [t.get_text() for t in ax.texts]


def test_forest_plot_marks_adjusted_decisions_and_the_equivalence_margin(ax):
    """Decided rows (decide_rows: three pairs in one family, Holm's step-down at 5%): the smallest p x3 stays under
    0.05 (filled); the next two, raw p 0.032 and 0.036, adjusted x2 and by the running max to 0.063 (open); the row
    against best-of-n, its own family, shown inside the margin (a diamond); the margin's band spans +-margin and the
    legend names both."""
    rows = [
        forest_row("A - B", 0.40, 0.20, 0.60, 0.1) | {"se": 0.1, "df": math.inf, "seeds": 2},
        forest_row("A - C", 0.215, 0.02, 0.41, 0.1) | {"se": 0.1, "df": math.inf, "seeds": 2},
        forest_row("A - D", 0.21, 0.01, 0.41, 0.1) | {"se": 0.1, "df": math.inf, "seeds": 2},
        forest_row(f"A - {BEST_OF_N}", 0.001, -0.01, 0.01, 0.01) | {"se": 0.005, "df": math.inf, "seeds": 2},
    ]
    decided = decide_rows(rows, margin=0.05)
    assert [r["distinguishable"] for r in decided] == [True, False, False, False]
    assert [r["family"] for r in decided] == ["pairs"] * 3 + [BEST_OF_N] and decided[3]["equal"]
    p = [math.erfc(d / 0.1 / math.sqrt(2)) for d in (0.40, 0.215, 0.21)]  # two-sided normal p by hand
    assert [r["p"] for r in decided[:3]] == pytest.approx(p)
    assert [r["p_adjusted"] for r in decided[:3]] == pytest.approx([3 * p[0], 2 * p[1], 2 * p[1]])
    assert max(p[1:]) < 0.05 < 2 * p[1]  # raw under 0.05, adjusted over
    ys = draw_forest(ax, decided)
    band = by_gid(ax, "margin")
    assert (band.get_x(), band.get_x() + band.get_width()) == pytest.approx((-0.05, 0.05))
    markers = {m.get_ydata()[0]: m for m in ax.lines if len(m.get_xdata()) == 1 and m.get_marker() in ("o", "D")}
    assert [markers[y].get_markerfacecolor() != "white" for y in ys] == [True, False, False, False]
    assert [markers[y].get_marker() for y in ys] == ["o", "o", "o", "D"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "distinguishable (Holm-adjusted p < 0.05)" in legend
    assert "± the margin 0.05: equal when the 90% interval lies inside" in legend


def metrics_rows(tokens_per_second: float, golds: list[float]) -> list[dict]:
    """A run's metrics.jsonl rows: an evaluation at step 0, then steps of 2 s, an evaluation after every second step.
    GRPO's steps carry reward/mean (their tokens count), DPO's (tokens_per_second 0) do not."""
    rows = [{"step": 0, "eval/gold": golds[0]}]
    for step in range(1, 2 * len(golds) - 1):
        row = {"step": step, "perf/step_seconds": 2.0, "perf/tokens_per_second": tokens_per_second}
        row |= {"reward/mean": 0.0} if tokens_per_second else {}
        rows.append(row | ({"eval/gold": golds[step // 2]} if step % 2 == 0 else {}))
    return rows


def test_compute_picture_draws_one_line_per_arm_through_its_seeds_means():
    grpo = [spent(metrics_rows(100.0, [1.0, 2.0, 3.0])), spent(metrics_rows(300.0, [1.0, 3.0, 4.0]))]
    dpo = [spent(metrics_rows(0.0, [1.0, 1.5]))]
    assert grpo[0][1] == {"step": 2, "tokens": 400.0, "seconds": 4.0, "gold": 2.0}
    fig, axes = plt.subplots(1, 2)
    draw_compute(axes, {"grpo": grpo, "dpo": dpo})
    tokens, seconds = by_gid(axes[0], "grpo"), by_gid(axes[1], "grpo")
    assert list(tokens.get_xdata()) == [0.0, 800.0, 1600.0] and list(tokens.get_ydata()) == [1.0, 2.5, 3.5]
    assert list(seconds.get_xdata()) == [0.0, 4.0, 8.0] and list(seconds.get_ydata()) == [1.0, 2.5, 3.5]
    assert list(by_gid(axes[0], "dpo").get_xdata()) == [0.0, 0.0]
    assert len(axes[0].lines) == len(axes[1].lines) == 2  # one line per arm, not per seed
    assert "dpo (1 seed, samples nothing in training)" in [t.get_text() for t in axes[1].get_legend().get_texts()]
    plt.close(fig)


def write_run(folder, rows: list[dict], config: dict | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"frontier_samples": 2} | (config or {})))


def test_dose_points_keep_the_arms_that_differ_only_in_selection_and_beta_rs_in_order_of_beta_rs(tmp_path, ax):
    """Against uniform: RSO at beta_rs 8 and 0.5, top (x 0) are on the curve; top_bottom (another selection), RSO
    from a pool of 16 (another num_samples) and each arm against best-of-n are not; an arm's seed and folder do not
    count. The picture: each point at its beta_rs (top a factor 4 left of the smallest, uniform at 0 a factor 4 right
    of the largest), its interval, the dashed line through them in order."""
    base = {"selection": "uniform", "beta_rs": 2.0, "num_samples": 64, "lr": 3e-4}
    arms = {
        "uniform": {},
        "rso_8": {"selection": "rso", "beta_rs": 8.0},
        "rso_0.5": {"selection": "rso", "beta_rs": 0.5},
        "top": {"selection": "top"},
        "top_bottom": {"selection": "top_bottom"},
        "rso_16": {"selection": "rso", "num_samples": 16},
    }
    runs = {}
    for arm, changes in arms.items():
        runs[arm] = [tmp_path / arm / f"seed{s}" for s in (0, 1)]
        for s, folder in enumerate(runs[arm]):
            write_run(folder, [], base | changes | {"seed": s, "out_dir": str(folder), "run_name": f"{arm}-{s}"})
    rows = [
        forest_row(f"{a} - uniform", d, d - 0.03, d + 0.03, 0.05)
        for a, d in zip(
            ("rso_8", "rso_0.5", "top", "top_bottom", "rso_16"), (-0.01, -0.06, -0.09, 0.02, -0.02), strict=True
        )
    ] + [forest_row(f"rso_8 - {BEST_OF_N}", -0.1, -0.2, 0.0, 0.08)]
    doses = dose_points(rows, arm_options(runs))
    assert list(doses) == ["uniform"]
    assert [(x, r["a"]) for x, r in doses["uniform"]] == [(0.0, "top"), (0.5, "rso_0.5"), (8.0, "rso_8")]
    draw_dose(ax, doses["uniform"], "uniform")
    assert list(by_gid(ax, "dose").get_xdata()) == [0.125, 0.5, 8.0, 32.0]
    assert list(by_gid(ax, "dose").get_ydata()) == [-0.09, -0.06, -0.01, 0.0]
    assert list(by_gid(ax, "top - uniform").get_ydata()) == pytest.approx([-0.12, -0.06])
    assert list(by_gid(ax, "rso_0.5 - uniform").get_xdata()) == [0.5, 0.5]
    filled = {tuple(m.get_xdata()): m.get_markerfacecolor() != "white" for m in ax.lines if m.get_marker() == "o"}
    assert filled == {(0.125,): True, (0.5,): True, (8.0,): False}  # filled where the interval excludes 0
    assert [t.get_text() for t in ax.get_xticklabels()] == ["top\n(0)", "0.5", "8", "uniform\n(inf)"]
    assert dose_points(rows[:1] + rows[3:], arm_options(runs)) == {}  # one arm along beta_rs: no curve


def post_point(step: int, kl: float, gold: list[float]) -> dict:
    """An evaluation with its per-post values (as frontier_points reads it): every post at KL `kl`."""
    return {"step": step, "kl": kl, "gold": sum(gold) / len(gold), "posts": {"kl": [kl] * len(gold), "gold": gold}}


def test_the_command_redraws_the_verdicts_pictures_and_tables_from_its_record_alone(tmp_path, monkeypatch, capsys):
    """A dose against uniform (rso at beta_rs 1, top), two seeds each, after round 2 of 3: redrawn first from
    verdict.json and the runs (a folder written before the record), then from verdict_record.json alone with the runs
    and verdict.json gone; the record holds no per-post values and rebuilds verdict.md's text (interim, the dose's
    trend) exactly. The trend by hand: each seed's slope on the rank (top 0, rso 1) is its rso - uniform minus its
    top - uniform: seed 0 0.2 - 0.5, seed 1 0.25 - 0.6, mean -0.325."""
    folder = tmp_path / "verdict"
    curve = [post_point(0, 0.0, [1.0, 1.0, 1.0]) | {"n": 1, "pool": 4}, post_point(0, 1.0, [2.0] * 3) | {"n": 2}]
    finals = {
        "uniform": lambda s: [1.0 + 0.1 * s] * 3,
        "rso_1": lambda s: [1.2 + 0.15 * s, 1.1 + 0.15 * s, 1.3 + 0.15 * s],
        "top": lambda s: [1.5 + 0.2 * s, 1.4 + 0.2 * s, 1.6 + 0.2 * s],
    }
    methods = {
        arm: [[post_point(0, 0.0, [1.0] * 3), post_point(2, 0.5, f(s))] for s in (0, 1)] for arm, f in finals.items()
    }
    base = {"selection": "uniform", "beta_rs": 2.0, "num_samples": 64}
    changes = {"uniform": {}, "rso_1": {"selection": "rso", "beta_rs": 1.0}, "top": {"selection": "top"}}
    runs = {arm: [folder / arm / f"seed{s}" for s in (0, 1)] for arm in methods}
    for arm, dirs in runs.items():
        for s, d in enumerate(dirs):
            write_run(d, metrics_rows(100.0, [1.0, finals[arm](s)[0]]), base | changes[arm] | {"seed": s})
    write_run(folder / "top" / "seed2", metrics_rows(100.0, [1.0])[:1])  # the third round, running
    pairs = [("rso_1", "uniform"), ("top", "uniform")] + [(arm, BEST_OF_N) for arm in methods]
    rows = verdict_rows(methods, curve, pairs, n_resamples=20, common=0.5)
    assert [r["seed_differences"] for r in rows[:2]] == [pytest.approx([0.2, 0.25]), pytest.approx([0.5, 0.6])]
    (folder / "verdict.json").write_text(json.dumps({"best_of_n": curve, "methods": methods, "rows": rows}))
    assert verdict_runs(folder, methods)["top"] == runs["top"]  # the seeds verdict.json holds, not the running one
    out = tmp_path / "assets"
    monkeypatch.setattr(sys, "argv", ["plots", "--verdict", str(folder), "--out", str(out / "runs")])
    main()
    names = ("verdict.png", "verdict_forest.png", "verdict_compute.png", "verdict_dose.png")  # named for the folder
    for name in names:
        assert (out / "runs" / name).stat().st_size > 10_000, name
    assert str(out / "runs" / "verdict_forest.png") in capsys.readouterr().out

    record = verdict_record(curve, methods, rows, runs, rounds=3, primary=None, margin=0.05, tables="the frontier")
    text, _ = report(record)
    assert text.startswith("Interim: after round 2 of 3 of seeds") and text.endswith("\n\nthe frontier")
    assert "| rso_1 - uniform | 0.500 (matched) | +0.225 |" in text and "at KL 0.500 |" in text
    assert "rank 0" in text and "at each row's matched KL: slope -0.3250" in text
    assert "at the common KL 0.500: slope -0.3250" in text
    (folder / RECORD).write_text(json.dumps(record))
    shutil.rmtree(folder / "uniform"), shutil.rmtree(folder / "rso_1"), shutil.rmtree(folder / "top")
    (folder / "verdict.json").unlink()
    saved = (folder / RECORD).read_text()
    assert '"posts":{' not in saved.replace(" ", "") and len(saved) < 20_000  # no per-post values
    assert report(json.loads(saved))[0] == text
    monkeypatch.setattr(sys, "argv", ["plots", "--verdict", str(folder), "--out", str(out / "record")])
    main()
    for name in names:
        assert (out / "record" / name).read_bytes() == (out / "runs" / name).read_bytes(), name
    monkeypatch.setattr(sys, "argv", ["plots", "--verdict", str(tmp_path / "none"), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and capsys.readouterr().err.count("\n") == 1

"""The verdict's pictures (demo.py --verdict, verdict.py): each arm's mean path, the forest plot of the verdict's
decided rows with the equivalence margin, gold against the compute spent and the dose along beta_rs; drawn from the
verdict's record (evaluation/verdict_report.py), so `python -m evaluation.plots --verdict DIR` redraws them without
the runs.
"""

import json
import math
import statistics
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from evaluation.matched import BEST_OF_N, MARGIN  # noqa: E402
from evaluation.verdict_report import RECORD, dose_points, read_record, report, verdict_record  # noqa: E402
from rlhf.stats import t_quantile  # noqa: E402


def mean_path(seeds: list[list[dict]], keys: tuple[str, ...], confidence: float = 0.95) -> dict:
    """An arm's path as the mean over its seeds: at each evaluation step that every seed reached and measured every
    one of `keys` (a seed cut short shortens the path), each key's mean over the seeds and the ends of its t interval
    over the seeds, mean ± t_{(1 + confidence)/2, S - 1} sd / sqrt(S) (sd the sample standard deviation of the seeds'
    values: the seed is the unit; NaN ends with one seed). {"step": [...], key: [...], key + "_low": [...],
    key + "_high": [...], "seeds": S}; seeds without points are left out."""
    by_step = [{p["step"]: p for p in points} for points in seeds if points]
    S = len(by_step)
    path = {"step": [], "seeds": S} | {k + end: [] for k in keys for end in ("", "_low", "_high")}
    if not by_step:
        return path
    t = t_quantile((1 + confidence) / 2, S - 1) if S > 1 else math.nan
    for step in sorted(set.intersection(*(set(points) for points in by_step))):
        if not all(k in points[step] for points in by_step for k in keys):
            continue
        path["step"].append(step)
        for k in keys:
            values = [points[step][k] for points in by_step]
            mean = statistics.fmean(values)
            half = t * statistics.stdev(values) / math.sqrt(S) if S > 1 else math.nan
            path[k].append(mean)
            path[k + "_low"].append(mean - half)
            path[k + "_high"].append(mean + half)
    return path


def arm_colours(names) -> dict[str, str]:
    """One colour per arm, in the arms' order (matplotlib's cycle), the same in the three verdict pictures; best-of-n
    black."""
    return {BEST_OF_N: "black"} | {name: f"C{i % 10}" for i, name in enumerate(names)}


def sqrt_kl_axis(ax) -> None:
    """KL on a square-root axis, as Gao et al. 2022 draw it (best-of-128 sits near 3.4 nats, the runs near 1), with
    KL 0 (the reference) at its edge: an estimate below 0 is noise around it."""
    ax.set_xscale("function", functions=(lambda v: np.sqrt(np.clip(v, 0, None)), np.square))
    ax.set_xlim(left=0.0)


def draw_verdict(
    ax, curve: list[dict], methods: dict[str, list[list[dict]]], key: str = "gold", posts: int | None = None
) -> None:
    """Gold (`key`) against KL: best-of-n from the reference (its points' means, n beside each, a band of the 95% t
    interval over posts: mean ± t_{0.975, P - 1} se), and each arm's mean path over its seeds (mean_path: the line
    through the means of KL and gold at each evaluation, a band of the 95% t interval over seeds of gold's mean, and at
    the last evaluation a larger point with the intervals over seeds of both KL and gold as error bars). Every line
    and band has the arm's name as its gid (the band's "<name> band"), one colour per arm (arm_colours). `posts`: how
    many posts best-of-n's points average (their t's df; by default counted from their per-post values)."""
    colours = arm_colours(methods)
    if posts is None:
        posts = len(curve[0].get("posts", {}).get(key, ())) if curve else 0
    t = t_quantile(0.975, posts - 1) if posts > 1 else t_quantile(0.975, 1e5)
    x, y = [p["kl"] for p in curve], [p[key] for p in curve]
    se = [p.get(key + "_se", math.nan) for p in curve]
    label = f"best-of-n from the reference (pool of {curve[0].get('pool', '?')})" if curve else None
    ax.plot(x, y, color="black", marker="s", ms=4, lw=1.8, label=label, gid=BEST_OF_N, zorder=3)
    low, high = [v - t * e for v, e in zip(y, se, strict=True)], [v + t * e for v, e in zip(y, se, strict=True)]
    ax.fill_between(x, low, high, color="black", alpha=0.06, lw=0, gid=f"{BEST_OF_N} band")
    for p in curve:
        ax.annotate(f"n={p['n']}", (p["kl"], p[key]), textcoords="offset points", xytext=(2, 6), fontsize=7)
    for name, seeds in methods.items():
        path = mean_path(seeds, ("kl", key))
        if not path["step"]:
            continue
        c, S = colours[name], path["seeds"]
        label = f"{name} ({S} seed{'s' if S > 1 else ''})"
        ax.plot(path["kl"], path[key], color=c, marker="o", ms=3, lw=1.5, label=label, gid=name, zorder=4)
        if S > 1:
            band = (path[key + "_low"], path[key + "_high"])
            ax.fill_between(path["kl"], *band, color=c, alpha=0.15, lw=0, gid=f"{name} band")
            xerr = [[path["kl"][-1] - path["kl_low"][-1]], [path["kl_high"][-1] - path["kl"][-1]]]
            yerr = [[path[key][-1] - path[key + "_low"][-1]], [path[key + "_high"][-1] - path[key][-1]]]
        else:
            xerr = yerr = None
        ax.errorbar(
            path["kl"][-1:], path[key][-1:], xerr=xerr, yerr=yerr, color=c, marker="o", ms=7, capsize=3, zorder=5
        )
    sqrt_kl_axis(ax)
    ax.set_xlabel("KL(policy || reference), nats per summary (square-root scale)")
    ax.set_ylabel(f"{key} reward, mean over the held-out posts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def draw_forest(ax, rows: list[dict], colours: dict[str, str] | None = None) -> list[float]:
    """The verdict's rows (evaluation.matched decide_rows, in their order from the top: the pairs, then each arm
    against best-of-n below a dotted line): each row's difference A - B at matched KL, filled where it is
    distinguishable after Holm's adjustment in its family, open where not, a diamond where the equivalence test shows
    it within the margin; its raw 95% t interval with seeds (ci_low, ci_high; a line whose gid is the pair), over a
    grey bar from -detectable to +detectable (the smallest true difference its seeds and posts detect at 80% power;
    gid "<pair> detectable"), the numbers and the decision at the right; a shaded band of +-the margin (gid
    "margin", when the rows carry one); a line at 0 (gid "zero"). A row with a note (no matched KL) shows it. Returns
    the rows' y positions (the axis runs downwards)."""
    colours = colours or {}
    margin = next((r["margin"] for r in rows if "margin" in r), None)
    ys, y = [], 0.0
    for i, r in enumerate(rows):
        if i and r["b"] == BEST_OF_N and rows[i - 1]["b"] != BEST_OF_N:
            ax.axhline(y, color="#999", lw=0.8, ls=":")  # the pairs above, each arm against best-of-n below
            y += 1
        ys.append(y)
        y += 1
    ax.axvline(0.0, color="black", lw=1, gid="zero", zorder=1)
    if margin is not None:
        ax.axvspan(-margin, margin, color="#cfe8cf", alpha=0.6, lw=0, zorder=0, gid="margin")
    text = ax.get_yaxis_transform()  # x in axes units, y in data
    for r, y in zip(rows, ys, strict=True):
        if "note" in r:
            ax.text(0.5, y, r["note"], transform=text, ha="center", va="center", fontsize=8, color="#777")
            continue
        c = colours.get(r["a"], "black")
        det = r["detectable"]
        ax.barh(y, 2 * det, left=-det, height=0.6, color="#ddd", lw=0, zorder=0, gid=f"{r['pair']} detectable")
        ax.plot([r["ci_low"], r["ci_high"]], [y, y], color=c, lw=2.2, solid_capstyle="butt", gid=r["pair"], zorder=2)
        face = c if r["distinguishable"] else "white"
        ax.plot([r["difference"]], [y], "D" if r.get("equal") else "o", ms=7, color=c, mfc=face, mew=1.5, zorder=3)
        numbers = f"{r['difference']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]  ±{det:.3f}"
        numbers += f"  {r['decision']}" if "decision" in r else ""
        ax.text(1.01, y, numbers, transform=text, va="center", fontsize=8, family="monospace")
    ax.text(1.01, -0.9, "difference [95% interval]  detectable  decision", transform=text, fontsize=7.5, color="#555")
    ax.set_yticks(ys, [r["pair"] for r in rows])
    ax.set_ylim(max(ys, default=0) + 0.7, -1.2)
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Line2D(
            [], [], marker="o", color="black", mfc="black", ls="-", label="distinguishable (Holm-adjusted p < 0.05)"
        ),
        Line2D([], [], marker="o", color="black", mfc="white", ls="-", label="not after adjustment (line: raw 95%)"),
        Patch(color="#ddd", label="± the smallest difference detected (80% power)"),
    ]
    if margin is not None:
        handles += [
            Patch(color="#cfe8cf", label=f"± the margin {margin:g}: equal when the 90% interval lies inside"),
            Line2D([], [], marker="D", color="black", mfc="white", ls="", label="shown equal within the margin"),
        ]
    ax.legend(handles=handles, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    return ys


def draw_compute(axes, runs: dict[str, list[list[dict]]], key: str = "gold") -> None:
    """Gold (`key`) at every evaluation against the tokens generated in training (axes[0]) and the training seconds
    (axes[1]), each arm one line through the means over its seeds (mean_path of `spent`'s points; gid the arm's name):
    RSO's 8 kept of 64 sampled is 8x the generation of plain GRPO with 8 samples per prompt; DPO generates none."""
    colours = arm_colours(runs)
    for name, seeds in runs.items():
        path = mean_path(seeds, ("tokens", "seconds", key))
        if not path["step"]:
            continue
        S = path["seeds"]
        label = f"{name} ({S} seed{'s' if S > 1 else ''}" + (
            ", samples nothing in training)" if not any(path["tokens"]) else ")"
        )
        for ax, x in zip(axes, ("tokens", "seconds"), strict=True):
            ax.plot(path[x], path[key], color=colours[name], marker="o", ms=3, lw=1.5, label=label, gid=name)
    axes[0].set_xlabel("tokens generated in training (mean over seeds)")
    axes[0].xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k" if x else "0")  # 350000 reads 350k
    axes[1].set_xlabel("training seconds (mean over seeds)")
    for ax in axes:
        ax.set_ylabel(f"{key} reward, mean over the held-out posts")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))


def draw_dose(ax, points: list[tuple[float, dict]], against: str, colours: dict[str, str] | None = None) -> None:
    """Each row's difference A - `against` at matched KL against A's beta_rs (dose_points) on a log axis, with its 95%
    t interval with seeds (filled where distinguishable, Holm-adjusted; a line whose gid is the pair), joined in order
    of beta_rs (gid "dose"); `top` (beta_rs -> 0) drawn a factor 4 left of the smallest beta_rs, and `against` itself
    at 0 a factor 4 right of the largest (beta_rs -> infinity, when it is uniform selection); a line at 0 (gid
    "zero")."""
    colours = colours or {}
    finite = [x for x, _ in points if x > 0] or [1.0]
    low, high = min(finite) / 4, max(finite) * 4
    xs = [x if x > 0 else low for x, _ in points]
    ax.axhline(0.0, color="black", lw=1, gid="zero", zorder=1)
    ax.plot(xs + [high], [r["difference"] for _, r in points] + [0.0], color="#888", lw=1, ls="--", gid="dose")
    for x, (_, r) in zip(xs, points, strict=True):
        c = colours.get(r["a"], "black")
        ax.plot([x, x], [r["ci_low"], r["ci_high"]], color=c, lw=2.2, solid_capstyle="butt", gid=r["pair"])
        ax.plot([x], [r["difference"]], "o", ms=7, color=c, mfc=c if r["distinguishable"] else "white", mew=1.5)
        ax.annotate(r["a"], (x, r["ci_high"]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.plot([high], [0.0], "D", ms=7, color=colours.get(against, "black"), mfc="white", mew=1.5)
    ax.set_xscale("log")
    ticks = sorted(set(xs + [high]))
    labels = [
        "top\n(0)" if t == low and any(x == 0 for x, _ in points) else f"{against}\n(inf)" if t == high else f"{t:g}"
        for t in ticks
    ]
    ax.set_xticks(ticks, labels)
    ax.minorticks_off()
    ax.set_xlim(low / 1.6, high * 1.6)
    ax.set_xlabel("beta_rs (the selection's temperature; log scale)")
    ax.set_ylabel(f"A - {against} at matched KL")
    ax.grid(alpha=0.3)


def forest_picture(
    rows: list[dict], out: Path, heading: str = "", colours: dict[str, str] | None = None, key: str = "gold"
) -> None:
    """The forest plot of verdict rows (draw_forest) as a PNG, under `heading`."""
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.38 * (len(rows) + 1)))
    draw_forest(ax, rows, colours)
    ax.set_xlabel(f"A - B in {key} reward at matched KL (mean over seeds and posts)")
    ax.set_title(
        f"{heading}\neach pair at matched KL: the difference and its raw 95% t interval (with the seeds' spread when "
        "there are two or more); filled: distinguishable after Holm's adjustment in its family",
        fontsize=9,
    )
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


VERDICT_PICTURES = ("", "_forest", "_compute", "_dose")
"""verdict_pictures' files, NAME + each + .png: the frontier, the forest plot, the compute and the dose picture."""


def verdict_picture_files(folder: Path, name: str) -> list[Path]:
    """The pictures of the verdict `name` that verdict_pictures drew in `folder`, in VERDICT_PICTURES' order (the
    dose picture only where it was drawn)."""
    return [p for p in (Path(folder) / f"{name}{kind}.png" for kind in VERDICT_PICTURES) if p.is_file()]


def verdict_pictures(record: dict, rows: list[dict], out: Path, title: str = "", name: str = "verdict") -> list[Path]:
    """The verdict's pictures in the folder `out`, named for the verdict (`name`, its folder), from its record
    (evaluation.verdict_report verdict_record) and its decided rows (verdict_report.report): NAME.png (draw_verdict),
    NAME_forest.png (draw_forest of `rows`), NAME_compute.png (draw_compute of the record's compute) and, when rows
    compare two or more selections along beta_rs against one arm (verdict_report.dose_points), NAME_dose.png
    (draw_dose, one panel per such arm); the key is the record's. `title` heads each, with the posts, samples per
    point and best-of-n's pool. Returns the files."""
    curve, methods, key = record["best_of_n"], record["methods"], record["key"]
    posts, samples = record["posts"], record["samples"]
    where = ", ".join(
        part
        for part in (
            title,
            f"{posts} held-out posts" + (f" x {samples} samples per point" if samples else "") if posts else "",
            f"best-of-n from a pool of {curve[0]['pool']}" if curve and "pool" in curve[0] else "",
        )
        if part
    )
    colours = arm_colours(methods)  # the forest's rows in their arm's colour, as in the other two pictures
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(10, 6))
    draw_verdict(ax, curve, methods, key, posts)
    ax.set_title(
        f"{where}\neach arm: the mean over its seeds at each evaluation, with a band of the 95% t interval over "
        "seeds (2 or more),\nat its last evaluation the 95% t intervals over seeds of KL and gold; best-of-n: its "
        "band the 95% t interval over posts",
        fontsize=9,
    )
    files = [out / f"{name}{kind}.png" for kind in VERDICT_PICTURES]
    fig.savefig(files[0], dpi=130, bbox_inches="tight")
    plt.close(fig)

    forest_picture(rows, files[1], where, colours, key)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    draw_compute(axes, record["compute"], key)
    fig.suptitle(f"{where}\neach arm: the mean over its seeds at each evaluation", fontsize=9)
    fig.savefig(files[2], dpi=130, bbox_inches="tight")
    plt.close(fig)

    doses = dose_points(rows, record["options"])
    if doses:
        fig, axes = plt.subplots(1, len(doses), figsize=(6.5 * len(doses), 4.6), squeeze=False)
        for ax, (against, points) in zip(axes[0], doses.items(), strict=True):
            draw_dose(ax, points, against, colours)
        fig.suptitle(
            f"{where}\neach arm against the arm it is compared with, along beta_rs: the difference in {key} at "
            "matched KL and its 95% t interval with seeds (filled: distinguishable after Holm's adjustment)",
            fontsize=9,
        )
        fig.savefig(files[3], dpi=130, bbox_inches="tight")
        plt.close(fig)
    return files if doses else files[:3]


def verdict_runs(folder: Path, methods: dict[str, list[list[dict]]]) -> dict[str, list[Path]]:
    """The run folders of a verdict folder's arms, as demo.py lays them out (<folder>/<arm>/seed<s>): each arm's
    first len(methods[arm]) seeds by number, those verdict.json holds (a round still running has more folders)."""
    runs = {}
    for name, seeds in methods.items():
        numbered = [(d.name.removeprefix("seed"), d) for d in (Path(folder) / name).glob("seed*")]
        runs[name] = [d for _, d in sorted((int(s), d) for s, d in numbered if s.isdigit())][: len(seeds)]
    return runs


def replot_verdict(folder: Path, out: Path, title: str = "") -> list[Path]:
    """The verdict's pictures (verdict_pictures, named for the folder) redrawn without training from a verdict
    folder's record alone (verdict_report.RECORD: written after each complete round of seeds, so a verdict cut short
    draws its complete rounds); a folder written before the record, from its verdict.json and its runs (verdict_runs:
    the compute from their metrics, the options from their config.json)."""
    folder = Path(folder)
    if (folder / RECORD).is_file() or not (folder / "verdict.json").is_file():
        record = read_record(folder)
    else:
        saved = json.loads((folder / "verdict.json").read_text())
        runs = verdict_runs(folder, saved["methods"])
        key = "gold" if saved["best_of_n"] and "gold" in saved["best_of_n"][0] else "proxy"
        rounds = min((len(seeds) for seeds in saved["methods"].values()), default=0)
        rows = saved.get("rows", [])
        record = verdict_record(
            saved["best_of_n"], saved["methods"], rows, runs, rounds=rounds, primary=None, margin=MARGIN, key=key
        )
    _, rows = report(record)
    return verdict_pictures(record, rows, out, title or str(folder), folder.resolve().name)

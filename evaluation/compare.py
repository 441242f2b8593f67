"""Compare runs: group the runs that differ only in seed, tabulate chosen metrics over seeds, draw their curves.

    python -m evaluation.compare runs/ablation/ablation/*/seed* --metrics reward/gold_mean train/kl --out compare.png
    python -m evaluation.compare runs/a runs/b --metrics eval/pref_accuracy --x train/kl

A run is a run directory holding metrics.jsonl and config.json (both written by utils/logging.Logger). Runs whose
configs are equal apart from the options in IGNORED (the seed, the run's name and folder, logging) form one group;
each group is named by the options that differ between groups. For every metric the table gives, over the seeds of
a group, the mean and the spread (sample standard deviation; 0 with one seed) of its value at the end of the run
(the mean of its last --last logged values) and at its best (max, or min for the metrics named in --minimize). The
picture draws each metric against the step and, with --x, against another metric (train/kl: the reward-KL
frontier), the mean over a group's seeds at each step, smoothed by a centred moving average so that the path of
training reads in step order.
"""

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Options that do not change what a run computes, or that every run has its own value of.
IGNORED = frozenset({
    "seed", "out_dir", "run_name", "resume", "resume_from", "wandb_mode", "wandb_project", "wandb_group",
    "wandb_tags", "eval_every", "save_every", "keep_last", "table_every", "table_prompts", "device",
})


@dataclass
class RunMetrics:
    dir: Path
    config: dict
    rows: list[dict]

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every line that logged `key`, in step order (a value logged twice at a step: the last)."""
        by_step = {int(r["step"]): float(r[key]) for r in self.rows if key in r}
        return sorted(by_step.items())


def load_run(run_dir: str | Path) -> RunMetrics:
    run_dir = Path(run_dir)
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.json"
    for path in (metrics, config):
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir}: no {path.name}; expected a run directory written by a training script")
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    return RunMetrics(run_dir, json.loads(config.read_text()), rows)


def group_runs(runs: list[RunMetrics], ignored: frozenset[str] = IGNORED) -> list[tuple[dict, list[RunMetrics]]]:
    """Runs grouped by their configs apart from `ignored`, in the order of their first run; each group's label holds
    the options whose values differ between groups (empty when there is one group)."""
    keys = sorted({k for r in runs for k in r.config} - ignored)
    groups: dict[str, list[RunMetrics]] = {}
    for run in runs:
        groups.setdefault(json.dumps([run.config.get(k) for k in keys]), []).append(run)
    firsts = [members[0].config for members in groups.values()]
    differing = [k for k in keys if len({json.dumps(c.get(k)) for c in firsts}) > 1]
    return [({k: members[0].config.get(k) for k in differing}, members) for members in groups.values()]


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(members: list[RunMetrics], metric: str, minimize: bool, last: int = 1) -> dict | None:
    """Over the runs of a group: mean and spread of the metric's final value (the mean of its `last` logged values in
    each run) and of its best value; None when no run logged it."""
    series = [s for s in (r.series(metric) for r in members) if s]
    if not series:
        return None
    pick = min if minimize else max
    final = mean_spread([statistics.fmean(v for _, v in s[-last:]) for s in series])
    best = mean_spread([pick(v for _, v in s) for s in series])
    return {"final": final, "best": best, "seeds": len(series)}


def label(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "all runs"


def table(groups: list[tuple[dict, list[RunMetrics]]], metrics: list[str], minimize: set[str], last: int = 1) -> str:
    """A markdown table: one row per group (the options that differ, the number of seeds), per metric its final
    (mean of the last `last` logged values) and best value as mean ± spread over seeds."""
    head = ["group", "seeds"] + [f"{m} ({when})" for m in metrics for when in ("final", "best")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for options, members in groups:
        cells = [label(options), str(len(members))]
        for m in metrics:
            s = summarize(members, m, m in minimize, last)
            cells += ["n/a", "n/a"] if s is None else [f"{s[w][0]:.3f} ± {s[w][1]:.3f}" for w in ("final", "best")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_curve(members: list[RunMetrics], metric: str) -> list[tuple[int, float]]:
    """(step, mean over the group's runs) at the steps every run that logged the metric logged it."""
    series = [dict(s) for s in (r.series(metric) for r in members) if s]
    if not series:
        return []
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return [(step, statistics.fmean(s[step] for s in series)) for step in steps]


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average: the mean of the values up to window // 2 places either side (window 1 returns the
    values; the window shrinks at the ends)."""
    half = window // 2
    return [statistics.fmean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def plot(
    groups: list[tuple[dict, list[RunMetrics]]], metrics: list[str], out: Path, x: str = "", smooth: int = 1
) -> None:
    """One row per metric: against the step, and with `x` against that metric (joined in step order, smoothed, the
    first step marked with a circle and the last with a square)."""
    cols = 2 if x else 1
    fig, axes = plt.subplots(len(metrics), cols, figsize=(5.5 * cols, 3.4 * len(metrics)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, metric in enumerate(metrics):
        for g, (options, members) in enumerate(groups):
            color, name = colors[g % len(colors)], f"{label(options)} ({len(members)})"
            curve = mean_curve(members, metric)
            if not curve:
                continue
            steps, values = zip(*curve)
            axes[row][0].plot(steps, moving_average(list(values), smooth), color=color, label=name)
            if x:
                along = dict(mean_curve(members, x))
                pts = [(along[s], v) for s, v in curve if s in along]
                if not pts:
                    continue
                xs, ys = moving_average([p[0] for p in pts], smooth), moving_average([p[1] for p in pts], smooth)
                axes[row][1].plot(xs, ys, "-", color=color, lw=1.2)
                axes[row][1].plot(xs[0], ys[0], "o", color=color, ms=5)
                axes[row][1].plot(xs[-1], ys[-1], "s", color=color, ms=5)
        axes[row][0].set_xlabel("step")
        axes[row][0].set_ylabel(metric)
        if x:
            axes[row][1].set_xlabel(f"{x} (o first step, ■ last)")
            axes[row][1].set_ylabel(metric)
    axes[0][0].legend(fontsize=7)
    if smooth > 1:
        fig.suptitle(f"mean over seeds, moving average of {smooth} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl and config.json)")
    p.add_argument("--metrics", nargs="+", default=["reward/gold_mean", "reward/mean", "train/kl"],
                   help="metrics to tabulate and draw")
    p.add_argument("--minimize", nargs="*", default=["train/kl"], help="metrics whose best value is the lowest")
    p.add_argument("--last", type=int, default=1,
                   help="the final value of a metric: the mean of its last N logged values")
    p.add_argument("--x", default="train/kl", help="also draw every metric against this one; empty: only against step")
    p.add_argument("--smooth", type=int, default=5,
                   help="moving average of the curves over this many logged steps (window // 2 either side)")
    p.add_argument("--out", default="compare.png", help="PNG of the curves; empty: no picture")
    args = p.parse_args(argv)
    if args.smooth < 1 or args.last < 1:
        p.error(f"--smooth and --last must be >= 1, got {args.smooth} and {args.last}")
    groups = group_runs([load_run(d) for d in args.runs])
    text = table(groups, args.metrics, set(args.minimize), args.last)
    print(text)
    if args.out:
        plot(groups, args.metrics, Path(args.out), args.x, args.smooth)
        print(f"\nwrote {args.out}")
    return text


if __name__ == "__main__":
    main()

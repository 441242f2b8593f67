"""Compare runs: group the runs that differ only in seed, tabulate chosen metrics over seeds, draw their curves.

    python -m evaluation.compare runs/ablation/ablation/*/seed* --metrics reward/gold_mean train/kl
    python -m evaluation.compare runs/a runs/b --metrics eval/pref_accuracy --x train/kl --out cmp.png

A run is a run directory holding metrics.jsonl and config.json (both written by utils/logging.Logger). Runs whose
configs are equal apart from the options in IGNORED (the seed, the run's name and folder, logging and saving cadences,
changes of those on resume: what the options declare) form one group;
each group is named by the options that differ between groups (those every group has; runs of different stages,
which share few options, are named by their folders). For every metric the table gives, over the seeds of a group,
the mean and the spread (sample standard deviation; 0 with one seed) of its value at the end of the run (the mean of
its last --last logged values; an evaluation metric's last evaluation) and at its best: the minimum of a metric whose
declaration says lower is better (losses, KL, lengths: the run's metrics_declared.json, utils/metrics.py), else the
maximum; --minimize and --maximize override. The picture
draws each metric against the step and against another metric (--x; by default eval/kl, the KL of the policy's
temperature-1 samples that --frontier_prompts measures at every evaluation, else train/kl: the reward-KL frontier),
the mean over a group's seeds at each step. Evaluation metrics (val/, eval/: logged every --eval_every steps) are drawn
as their points, each at its value, never smoothed; per-step metrics are smoothed by a centred moving average of
--smooth logged steps, which the panel's title says. The picture goes next to the runs (their common folder) or
where --out says, and into the runs' common folder as TensorBoard events (`tensorboard --logdir` over it shows the
picture and the table beside the runs' curves; --tensorboard false: not) and, with --wandb_mode, into a wandb run of
its own in the runs' wandb group. A missing folder, or a metric no run logged, ends the command with one line (exit
code 2) naming it, and for a metric, the metrics that exist. A line of metrics.jsonl that is not a whole JSON row (a
run still writing) is skipped with one warning line.
"""

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import evaluation.frontier_declarations  # noqa: E402
import evaluation.samples  # noqa: E402
import evaluation.summaries  # noqa: E402
import model.lora  # noqa: E402
import rollouts.metrics  # noqa: E402, F401 (its metrics' declarations, for a run logged without its own)
import rollouts.options  # noqa: E402
import utils.config  # noqa: E402
import utils.optim  # noqa: E402, F401
from utils.config import declared, option_groups, parse_bool  # noqa: E402
from utils.logging import markdown_rows, publish_picture, read_declarations  # noqa: E402
from utils.metrics import EVALUATION_PREFIXES, metric_direction  # noqa: E402
from utils.rundir import RESUME_CHANGES  # noqa: E402

DEFAULT_METRICS = (
    "eval/gold",
    "eval/reward",
    "eval/win_rate",
    "eval/pref_accuracy",
    "val/accuracy",
    "val/loss",
    "reward/mean",
    "train/loss",
    "train/kl",
)
"""Without --metrics: the first three of these that the runs logged."""


class CompareError(ValueError):
    """A bad input to the command: one line, exit code 2."""

    exit_code = 2


# Options that do not change what a run computes, or that every run has its own value of: the options a run may change
# on resume without asking (declared free beside each option: utils.config.option) but --steps, where and how it was
# started (declared recorded=False), the seed and the device. Read from the option groups of the packages (a package
# does not import the scripts; tests/test_compare.py checks that every script's declared options are covered).
OPTION_GROUPS = option_groups(
    utils.config, rollouts.options, model.lora, evaluation.samples, evaluation.summaries,
    evaluation.frontier_declarations,
)  # fmt: skip
IGNORED = frozenset(
    {name for group in OPTION_GROUPS for fact in ("free", "recorded") for name in declared(group, fact)} - {"steps"}
) | {"seed", "device"}


@dataclass
class RunMetrics:
    dir: Path
    config: dict
    rows: list[dict]
    declared: dict = field(default_factory=dict)  # its metrics' declarations (utils.metrics.DECLARED_FILE)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every line that logged `key`, in step order (a value logged twice at a step: the last)."""
        by_step = {int(r["step"]): float(r[key]) for r in self.rows if key in r}
        return sorted(by_step.items())


def load_run(run_dir: str | Path) -> RunMetrics:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CompareError(f"{run_dir}: no such folder; expected a run directory written by a training script")
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.json"
    for path in (metrics, config):
        if not path.is_file():
            raise CompareError(f"{run_dir}: no {path.name}; expected a run directory written by a training script")
    rows = []
    for number, line in enumerate(metrics.read_bytes().decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short: the run is still writing, or was killed mid-line
            print(
                f"warning: {metrics}: line {number} is not a whole JSON row ({line[:60]!r}); skipped", file=sys.stderr
            )
    try:
        return RunMetrics(run_dir, json.loads(config.read_text()), rows, read_declarations(run_dir))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompareError(f"{config}: cannot be read ({type(e).__name__}: {e}); expected the run's options") from None


def result_options(config: dict, ignored: frozenset[str]) -> dict:
    """The options of a run's record that can change its result: all but `ignored`, and its option_changes (made on
    resume) less the changes of ignored options, when any is left."""
    options = {k: v for k, v in config.items() if k not in ignored and k != RESUME_CHANGES}
    changes = []
    for change in config.get(RESUME_CHANGES, []):
        kept = {k: v for k, v in change.get("options", {}).items() if k not in ignored}
        changes += [{"step": change.get("step"), "options": kept}] if kept else []
    return options | ({RESUME_CHANGES: changes} if changes else {})


def group_runs(runs: list[RunMetrics], ignored: frozenset[str] = IGNORED) -> list[tuple[dict, list[RunMetrics]]]:
    """Runs grouped by their configs apart from `ignored` (result_options: a change on resume of an ignored option
    does not split a run from its seeds), in the order of their first run; each group's label holds
    the options whose values differ between groups among those every group has (empty when there is one group). Groups
    that no such option tells apart (runs of different stages) are labelled by their first run's folder."""
    configs = {id(r): result_options(r.config, ignored) for r in runs}
    keys = sorted({k for r in runs for k in configs[id(r)]})
    groups: dict[str, list[RunMetrics]] = {}
    for run in runs:
        groups.setdefault(json.dumps([configs[id(run)].get(k, "<absent>") for k in keys]), []).append(run)
    firsts = [configs[id(members[0])] for members in groups.values()]
    shared = [k for k in keys if all(k in c for c in firsts)]
    differing = [k for k in shared if len({json.dumps(c[k]) for c in firsts}) > 1]
    if any(RESUME_CHANGES in c for c in firsts):  # changes on resume that can change the result tell groups apart
        differing.append(RESUME_CHANGES)
    labels = [{k: first.get(k, []) for k in differing} for first in firsts]
    if len(groups) > 1 and len({json.dumps(x) for x in labels}) < len(labels):
        labels = [{"run": str(members[0].dir)} for members in groups.values()]
    return list(zip(labels, groups.values(), strict=True))


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(members: list[RunMetrics], metric: str, minimize: bool, last: int = 1) -> dict | None:
    """Over the runs of a group: mean and spread of the metric's final value (the mean of its `last` logged values in
    each run; an evaluation metric's last evaluation, never a mean over evaluations along training) and of its best
    value; None when no run logged it."""
    series = [s for s in (r.series(metric) for r in members) if s]
    if not series:
        return None
    pick = min if minimize else max
    last = 1 if is_evaluation(metric) else last
    final = mean_spread([statistics.fmean(v for _, v in s[-last:]) for s in series])
    best = mean_spread([pick(v for _, v in s) for s in series])
    return {"final": final, "best": best, "seeds": len(series)}


# what each GRPO arm's selection kept against its pool (rollouts/metrics.py; docs/grpo.md, Selection diagnostics),
# with the update's gradient norm and KL: the table a verdict adds below its contrasts (step_means_table)
SELECTION_METRICS = (
    "rs/kept_mean_shift",
    "rs/kept_std_ratio",
    "rs/pool_group_std",
    "rs/kept_ess",
    "rs/tied_group_fraction",
    "rs/acceptance_rate",
    "train/grad_norm",
    "train/kl",
)


def step_means_table(
    groups: dict[str, list[Path]], metrics: tuple[str, ...] = SELECTION_METRICS, prefix: str = "rs/"
) -> str:
    """A markdown table: one row per named group of run folders that logged a metric of `metrics` starting with
    `prefix` (by default a GRPO run's selection diagnostics), per metric the mean over each run's logged steps, then
    mean ± spread (sample standard deviation) over the group's runs; n/a where no run of the group logged it. Empty
    when no group qualifies (a verdict of DPO arms alone)."""
    rows = []
    for name, dirs in groups.items():
        runs = [load_run(d) for d in dirs]
        cells = []
        for m in metrics:
            means = [statistics.fmean(v for _, v in s) for s in (r.series(m) for r in runs) if s]
            cells.append("n/a" if not means else "{:.3f} ± {:.3f}".format(*mean_spread(means)))
        if any(c != "n/a" for m, c in zip(metrics, cells, strict=True) if m.startswith(prefix)):
            rows.append("| " + " | ".join([name, str(len(runs))] + cells) + " |")
    if not rows:
        return ""
    head = ["arm", "runs"] + list(metrics)
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + rows)


def label(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "all runs"


def direction(metric: str, runs: list[RunMetrics]) -> str | None:
    """The direction in which `metric` improves (utils.metrics): as the first of `runs` that logged it declares it
    (metrics_declared.json), else as this process declares it (a run logged before runs recorded declarations)."""
    declared = next((r.declared[metric] for r in runs if metric in r.declared), None)
    return declared["direction"] if declared is not None else metric_direction(metric)


def best_is_minimum(metric: str, minimize: set[str], maximize: set[str], runs: list[RunMetrics] = ()) -> bool:
    """Whether `metric`'s best is its minimum: named in --minimize, or not in --maximize and declared lower-is-better
    (direction: losses, KL, lengths, ...)."""
    return metric in minimize or (metric not in maximize and direction(metric, list(runs)) == "min")


def table(
    groups: list[tuple[dict, list[RunMetrics]]],
    metrics: list[str],
    minimize: set[str],
    last: int = 1,
    maximize: frozenset[str] = frozenset(),
) -> str:
    """A markdown table: one row per group (the options that differ, the number of seeds), per metric its final
    (mean of the last `last` logged values) and best value (best_is_minimum) as mean ± spread over seeds."""
    head = ["group", "seeds"] + [f"{m} ({when})" for m in metrics for when in ("final", "best")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for options, members in groups:
        cells = [label(options), str(len(members))]
        for m in metrics:
            s = summarize(members, m, best_is_minimum(m, minimize, maximize, members), last)
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


def is_evaluation(metric: str) -> bool:
    return metric.startswith(EVALUATION_PREFIXES)


def figure(groups: list[tuple[dict, list[RunMetrics]]], metrics: list[str], x: str = "", smooth: int = 1):
    """The picture: one row per metric, against the step and, with `x`, against that metric (joined in step order, the
    first step marked with a circle and the last with a square; `x` itself gets no such panel). An evaluation metric
    is drawn as its points (markers joined by thin lines), each at its mean over seeds, unsmoothed; a per-step
    metric is smoothed over `smooth` logged steps when `smooth` > 1, and its panel's title says so."""
    cols = 2 if x else 1
    fig, axes = plt.subplots(len(metrics), cols, figsize=(5.5 * cols, 3.4 * len(metrics)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, metric in enumerate(metrics):
        points = is_evaluation(metric)
        window = 1 if points else smooth
        style = {"marker": "o", "ms": 4, "lw": 0.8} if points else {}
        for g, (options, members) in enumerate(groups):
            color, name = colors[g % len(colors)], f"{label(options)} ({len(members)})"
            curve = mean_curve(members, metric)
            if not curve:
                continue
            steps, values = zip(*curve, strict=True)
            axes[row][0].plot(steps, moving_average(list(values), window), color=color, label=name, **style)
            if x and metric != x:
                along = dict(mean_curve(members, x))
                pts = [(along[s], v) for s, v in curve if s in along]
                if not pts:
                    continue
                xs = moving_average([p[0] for p in pts], window)
                ys = moving_average([p[1] for p in pts], window)
                axes[row][1].plot(xs, ys, "-", color=color, lw=1.2, **({"marker": "."} if points else {}))
                axes[row][1].plot(xs[0], ys[0], "o", color=color, ms=5)
                axes[row][1].plot(xs[-1], ys[-1], "s", color=color, ms=5)
        axes[row][0].set_xlabel("step")
        axes[row][0].set_ylabel(metric)
        how = (
            "each evaluation, unsmoothed"
            if points
            else (f"moving average of {smooth} logged steps" if smooth > 1 else "every logged step, unsmoothed")
        )
        axes[row][0].set_title(f"{metric}: mean over seeds, {how}", fontsize=8)
        if x:
            if metric == x:
                axes[row][1].axis("off")
            else:
                axes[row][1].set_xlabel(f"{x} (o first step, ■ last)")
                axes[row][1].set_ylabel(metric)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(
    groups: list[tuple[dict, list[RunMetrics]]], metrics: list[str], out: Path, x: str = "", smooth: int = 1
) -> None:
    """figure(), written to the PNG `out`."""
    fig = figure(groups, metrics, x, smooth)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def logged_metrics(runs: list[RunMetrics]) -> list[str]:
    """Every metric some run logged, sorted."""
    return sorted({k for r in runs for row in r.rows for k in row} - {"step"})


def check_metrics(runs: list[RunMetrics], names: list[str], option: str) -> None:
    """CompareError for the first name that no run logged, listing those that exist."""
    known = logged_metrics(runs)
    for name in names:
        if name not in known:
            raise CompareError(f"{option} {name}: no run logged it; the runs logged {', '.join(known)}")


def default_out(run_dirs: list[str]) -> Path:
    """compare.png in the runs' common folder (the folder above a single run)."""
    paths = [str(Path(d).resolve()) for d in run_dirs]
    common = Path(os.path.commonpath(paths))
    return (common.parent if len(paths) == 1 else common) / "compare.png"


def add_publish_arguments(p: argparse.ArgumentParser) -> None:
    """Where the picture is shown besides its PNG (publish): TensorBoard events and a wandb run."""
    p.add_argument(
        "--tensorboard",
        type=parse_bool,
        default=True,
        help="also write the picture and the table as TensorBoard events in the runs' common folder",
    )
    p.add_argument(
        "--wandb_mode",
        default="disabled",
        choices=["auto", "online", "offline", "disabled"],
        help="also log the picture and the table to a wandb run of their own (auto: online with a login)",
    )
    p.add_argument("--wandb_project", default="tldr-rlhf", help="wandb project")
    p.add_argument(
        "--wandb_group",
        default=None,
        help="wandb group of that run; default: the runs' own group when they all share one",
    )


def publish(args: argparse.Namespace, png: Path, tag: str, text: str, runs: list[RunMetrics]) -> None:
    """The picture `png` and its markdown table `text` as TensorBoard events in the runs' common folder (the
    picture's folder without runs: best-of-n alone) and, with --wandb_mode, in a wandb run named `tag` in
    --wandb_group (default: the runs' group when they share one)."""
    groups = {r.config.get("wandb_group", "") for r in runs}
    group = args.wandb_group if args.wandb_group is not None else (groups.pop() if len(groups) == 1 else "")
    if runs:
        folder = Path(os.path.commonpath([str(r.dir.resolve()) for r in runs]))
        folder = folder.parent if len(runs) == 1 else folder
    else:
        folder = png.resolve().parent
    publish_picture(
        png, folder, tag, markdown_rows(text), args.tensorboard, args.wandb_mode, args.wandb_project, group, tag
    )


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl and config.json)")
    p.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        help="metrics to tabulate and draw; default: the first three of "
        + ", ".join(DEFAULT_METRICS)
        + " that the runs logged",
    )
    p.add_argument(
        "--minimize",
        nargs="*",
        default=[],
        help="metrics whose best value is the lowest, beyond those declared so (losses, KL, lengths: the runs' "
        "metrics_declared.json)",
    )
    p.add_argument(
        "--maximize", nargs="*", default=[], help="metrics whose best value is the highest, whatever the name"
    )
    p.add_argument(
        "--last",
        type=int,
        default=1,
        help="the final value of a per-step metric: the mean of its last N logged values (an evaluation metric: "
        "its last evaluation)",
    )
    p.add_argument(
        "--x",
        default=None,
        help="also draw every other metric against this one; default: eval/kl when the runs logged it "
        "(--frontier_prompts), else train/kl when they did; empty: only against the step",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=5,
        help="moving average of per-step metrics over this many logged steps (window // 2 either side); "
        "evaluation metrics (val/, eval/) are never smoothed",
    )
    p.add_argument(
        "--out",
        default=None,
        help="PNG of the curves; default: compare.png in the runs' common folder; empty: no picture",
    )
    add_publish_arguments(p)
    args = p.parse_args(argv)
    if args.smooth < 1 or args.last < 1:
        p.error(f"--smooth and --last must be >= 1, got {args.smooth} and {args.last}")
    runs = [load_run(d) for d in args.runs]
    known = logged_metrics(runs)
    metrics = args.metrics or [m for m in DEFAULT_METRICS if m in known][:3]
    if not metrics:
        raise CompareError(f"none of the default metrics was logged; name some with --metrics: {', '.join(known)}")
    check_metrics(runs, metrics, "--metrics")
    # eval/kl (the policy's own samples at temperature 1, evaluation/measure.py) before train/kl (the training
    # samples): the one evaluation metrics are measured beside, and the one DPO logs
    x = next((k for k in ("eval/kl", "train/kl") if k in known), "") if args.x is None else args.x
    if x:
        check_metrics(runs, [x], "--x")
    groups = group_runs(runs)
    text = table(groups, metrics, set(args.minimize), args.last, frozenset(args.maximize))
    print(text)
    out = default_out(args.runs) if args.out is None else Path(args.out) if args.out else None
    if out is not None:
        plot(groups, metrics, out, x, args.smooth)
        publish(args, out, "compare", text, runs)
        print(f"\nwrote {out}")
    return text


if __name__ == "__main__":
    from utils.guard import exit_on_error

    with exit_on_error():  # a user error (ConfigError, ModelLoadError, ...): one `error:` line and its exit code
        main()

"""The reward-KL frontier's tables, picture and command line: where policies sit on the gold reward (when the task has
one), the proxy reward (the reward model) and the win rate against reference summaries, against their KL to the
reference policy, beside best-of-n from the reference as the baseline (Gao, Schulman and Hilton 2022, arXiv
2210.10760; Rafailov et al. 2023, arXiv 2305.18290, Fig. 2).

A policy's point is measured by evaluation/measure.py (dpo.py and grpo.py call its Frontier.evaluate at every
evaluation when --frontier_prompts > 0), best-of-n's curve by evaluation/best_of_n.py, and the paired comparisons at
matched KL and the fitted curves by evaluation/matched.py; `frontier_table` and `plot_frontier` show them, and
`python -m evaluation.frontier` measures best-of-n and shows any runs beside it. demo.py --frontier_seeds trains the
grids (experiments/embedded.py) and draws the picture (frontier_points, frontier_table, plot_frontier).
"""

import json
import math
from pathlib import Path

import torch

from evaluation.best_of_n import best_of_n
from evaluation.frontier_declarations import check_gold_model
from evaluation.matched import BEST_OF_N, fit_curves, frontier_points, point_components, verdict_rows, verdict_table
from evaluation.measure import load_frontier_prompts
from model.weights import build_reward_model, model_config
from rlhf.frontier import gao_curve
from rlhf.rewards import load_function
from utils.dist import stream

# ----------------------------------------------------------------------------------------------------
# The table and the picture


def spread(values: list[float]) -> str:
    """mean ± sample std over seeds (the mean alone for one seed)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.3f} ± {std:.3f}"


def has_posts(curve: list[dict], methods: dict[str, list[list[dict]]]) -> bool:
    """Whether best-of-n and every seed's every evaluation carry per-post values (runs that wrote frontier_posts)."""
    runs = [p for seeds in methods.values() for points in seeds for p in points]
    return all("posts" in p for p in curve + runs) and bool(runs)


def frontier_table(curve: list[dict], methods: dict[str, list[list[dict]]], rows: list[dict] | None = None) -> str:
    """Markdown: best-of-n's points (value ± standard error over posts; its KL estimated from the pool and the
    formula's bound), each method's last evaluation (mean ± sample std over its seeds, and the largest standard error
    over posts of one seed's value; with per-post values, gold's seed and post standard deviations); then, when every
    point carries per-post values, the paired differences (verdict_rows; `rows`, by default each method minus
    best-of-n at its KL) and the fitted curves."""
    cols = [c for c in ("kl", "gold", "proxy", "win_rate") if c in curve[0]]
    key = "gold" if "gold" in curve[0] else "proxy"
    head = "| policy | seeds | kl | kl bound | " + " | ".join(cols[1:]) + " |\n|---|---|---|" + "---|" * len(cols)
    lines = [head]
    for p in curve:
        kl, *rest = (f"{p[c]:.3f} ± {p[c + '_se']:.3f}" for c in cols)
        name = f"best-of-{p['n']} (reference, pool {p['pool']})"
        lines.append(f"| {name} | | {kl} | {p['kl_bound']:.3f} | " + " | ".join(rest) + " |")
    for name, seeds in methods.items():
        last = [points[-1] for points in seeds if points]
        if not last:
            continue
        cells = []
        for c in cols:
            if c not in last[0]:
                cells.append("")
                continue
            se = max(p[c + "_se"] for p in last)
            cells.append(f"{spread([p[c] for p in last])} (se {se:.3f})")
        lines.append(f"| {name} | {len(last)} | {cells[0]} | | " + " | ".join(cells[1:]) + " |")
    text = "\n".join(lines)
    if "repeats" in curve[0]:
        text += (
            f"\n\nBest-of-n's pool: {curve[0]['pool']} summaries of each post from the reference, "
            f"{100 * curve[0]['repeats']:.1f}% of them repeating an earlier one (one outcome: the KL from the pool is "
            "below the bound as much as the reference repeats itself)"
        )
    if not has_posts(curve, methods):
        return text
    text += f"\n\n{key}: variance components of each method's last evaluation (seeds x posts)\n\n"
    text += "| policy | seeds | mean | se | sd between seeds | sd between posts | sd residual |\n"
    text += "|---|---|---|---|---|---|---|"
    for name, seeds in methods.items():
        c = point_components(seeds, key)
        sds = " | ".join(
            f"{math.sqrt(c[k]):.3f}" if not math.isnan(c[k]) else "" for k in ("var_seed", "var_post", "var_residual")
        )
        text += f"\n| {name} | {len(seeds)} | {c['mean']:.3f} | {c['se']:.3f} | {sds} |"
    rows = rows if rows is not None else verdict_rows(methods, curve, [(name, BEST_OF_N) for name in methods], key)
    text += "\n\n" + verdict_table(rows, key)
    fits = fit_curves(curve, methods, key)
    text += f"\n\nFitted curves (Gao et al. 2022): {key} gained over best-of-1 against d = sqrt(KL), 95% bootstrap "
    text += "intervals over seeds and posts\n\n| policy | form | alpha | beta |\n|---|---|---|---|"
    for name, f in fits.items():
        form = "d (alpha - beta d)" if f["form"] == "bon" else "d (alpha - beta log d)"
        a, b = f["alpha_ci"], f["beta_ci"]
        alpha, beta = f"{f['alpha']:.3f} [{a[0]:.3f}, {a[1]:.3f}]", f"{f['beta']:.3f} [{b[0]:.3f}, {b[1]:.3f}]"
        text += f"\n| {name} | {form} | {alpha} | {beta} |"
    return text


def plot_frontier(curve: list[dict], methods: dict[str, list[list[dict]]], out: Path, title: str = "") -> None:
    """Two panels: y against KL (gold reward, or proxy reward and win rate without a gold reward), and gold against
    proxy; KL on a square-root axis (Gao et al. 2022). Best-of-n is a line at its KL estimated from the pool, with the
    formula's bound log n - (n-1)/n as a faint line; each method's seeds are points joined along training (markers at
    every evaluation, the last one larger), with error bars of one standard error over posts in both directions; one
    colour per method, one line style per seed. With per-post values the fitted curves (fit_curves) are drawn through
    the points on the KL panel (best-of-n's dotted black, each method's dotted in its colour)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_gold = "gold" in curve[0]
    panels = [("kl", "gold"), ("proxy", "gold")] if has_gold else [("kl", "proxy"), ("kl", "win_rate")]
    panels = [(x, y) for x, y in panels if x in curve[0] and y in curve[0]]
    labels = {
        "kl": "KL(pi || pi_ref), nats",
        "gold": "gold reward",
        "proxy": "proxy reward (reward model, normalized)",
        "win_rate": "win rate against the references",
    }
    fits = fit_curves(curve, methods, panels[0][1], n_resamples=0) if has_posts(curve, methods) else {}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (x, y) in zip(axes[0], panels, strict=True):
        if x == "kl":
            ax.plot(
                [p["kl_bound"] for p in curve],
                [p[y] for p in curve],
                color="black",
                lw=1,
                alpha=0.25,
                label="best-of-n at the bound log n - (n-1)/n",
            )
        ax.errorbar(
            [p[x] for p in curve],
            [p[y] for p in curve],
            yerr=[p[y + "_se"] for p in curve],
            color="black",
            marker="s",
            ms=3,
            lw=1.5,
            capsize=2,
            label=f"best-of-n from the reference (pool of {curve[0].get('pool', '?')}; KL from the pool)",
        )
        for p in curve:
            ax.annotate(f"{p['n']}", (p[x], p[y]), textcoords="offset points", xytext=(3, -10), fontsize=7)
        for i, (name, seeds) in enumerate(methods.items()):
            c = colours[i % len(colours)]
            for s, points in enumerate(seeds):
                if not points or y not in points[0]:
                    continue
                ax.errorbar(
                    [p[x] for p in points],
                    [p[y] for p in points],
                    xerr=[p[x + "_se"] for p in points],
                    yerr=[p[y + "_se"] for p in points],
                    color=c,
                    marker="o",
                    ms=3,
                    lw=1,
                    ls=("-", "--", ":", "-.")[s % 4],
                    capsize=1.5,
                    alpha=0.85,
                    label=name if s == 0 else None,
                )
                ax.plot([points[-1][x]], [points[-1][y]], "o", color=c, ms=7)
        if x == "kl" and fits:
            for i, (name, f) in enumerate(fits.items()):
                if math.isnan(f["alpha"]):
                    continue
                d = torch.linspace(0, f["d_max"], 100, dtype=torch.float64)
                r = gao_curve(d, f["alpha"], f["beta"], f["form"]) + f["baseline"]
                c = "black" if name == BEST_OF_N else colours[(i - 1) % len(colours)]
                ax.plot((d**2).tolist(), r.tolist(), color=c, ls=":", lw=1.2, alpha=0.8)
        ax.set_xlabel(labels[x])
        ax.set_ylabel(labels[y])
        if x == "kl":  # a square-root axis, as Gao et al. 2022 draw it: best-of-64 sits near 3 nats, the runs near 0
            ax.set_xscale("function", functions=(lambda v: np.sqrt(np.clip(v, 0, None)), np.square))
            ax.set_xlim(left=0.0)  # KL 0 (the reference) at the edge; an estimate below 0 is noise around it
            ax.set_xlabel(labels[x] + " (square-root scale)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# The command line: any runs that measured the frontier, and best-of-n from their reference


def main(argv: list[str] | None = None) -> str:
    """python -m evaluation.frontier RUN_DIR ... --reference DIR --reward_model DIR --data SOURCE: the table and the
    picture of runs that logged eval/kl (--frontier_prompts), grouped as evaluation/compare.py groups them (runs that
    differ only in seed are one method), with best-of-n from --reference on the first --prompts prompts of --data (the
    runs' --frontier_data); with per-post values (frontier_posts.jsonl) also each method minus best-of-n at its KL and
    the fitted curves, and first each --pair A B, A minus B at matched KL (a verdict's pairs). Gold from --gold_fn's
    function or --gold_model's reward model; without either the picture draws proxy reward and win rate against KL;
    without runs, best-of-n alone (e.g. its KL from two pool sizes). The picture and the table also go into the runs'
    common folder as TensorBoard events and, with --wandb_mode, to wandb (evaluation.compare.publish)."""
    import argparse

    from data.tokenizer import get_tokenizer
    from evaluation.compare import CompareError, add_publish_arguments, group_runs, label, load_run, publish
    from model.weights import build_policy

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument(
        "runs", nargs="*", help="run directories (dpo.py / grpo.py --frontier_prompts N); none: best-of-n alone"
    )
    p.add_argument("--reference", required=True, help="the runs' reference policy (their --model): best-of-n from it")
    p.add_argument("--reward_model", required=True, help="the proxy (the runs' --frontier_reward_model)")
    p.add_argument("--data", required=True, help="the prompts (the runs' --frontier_data)")
    p.add_argument("--split", default="validation", help="split of --data")
    p.add_argument("--prompts", type=int, default=100, help="prompts of --data (the runs' --frontier_prompts)")
    p.add_argument("--gold_fn", default="", help='a gold reward "module:function" of (prompt, summary); empty: none')
    p.add_argument(
        "--gold_model",
        default="",
        help="a gold reward model (reward_model.py's hf/ folder; the runs' --frontier_gold_model) whose normalized "
        "score is the gold reward; it only scores; not --reward_model's folder; empty: --gold_fn",
    )
    p.add_argument("--max_new_tokens", type=int, default=53, help="tokens per summary (the runs' length)")
    p.add_argument("--max_prompt_len", type=int, default=448, help="tokens per prompt at most")
    p.add_argument("--best_of", type=int, default=64, help="best-of-n's largest n, a power of 2")
    p.add_argument(
        "--pool",
        type=int,
        default=64,
        help="reference samples per prompt from which best-of-n is estimated (all subsets; >= --best_of): 128 or 256 "
        "keep the KL estimate's bias small at n = 64 (docs/reporting.md)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of best-of-n's samples")
    p.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="two methods compared at matched KL (A - B, verdict_rows; each named as the table names it), before "
        "each method against best-of-n; repeatable; needs per-post values",
    )
    p.add_argument("--out", default="frontier.png", help="the picture; frontier.json beside it holds every point")
    add_publish_arguments(p)
    args = p.parse_args(argv)
    if args.best_of < 1 or args.best_of & (args.best_of - 1):
        p.error(f"--best_of must be a power of 2, got {args.best_of}")
    if args.pool < args.best_of:
        p.error(f"--pool must be at least --best_of ({args.best_of}), got {args.pool}")
    if args.gold_fn and args.gold_model:
        p.error("--gold_fn and --gold_model both give the gold reward; give one of them")
    # each model's kind before anything is read (a policy as --reward_model would score with a random head)
    model_config(args.reference, kind="policy", option="--reference")
    model_config(args.reward_model, kind="reward_model", option="--reward_model")
    if args.gold_model:
        model_config(args.gold_model, kind="reward_model", option="--gold_model")
        check_gold_model(args.gold_model, args.reward_model, "--gold_model", "--reward_model")
    methods, runs = {}, [load_run(d) for d in args.runs]
    for options, members in group_runs(runs):
        seeds = [frontier_points(run.dir) for run in members]
        empty = [str(run.dir) for run, points in zip(members, seeds, strict=True) if not points]
        if empty:
            raise CompareError(f"{empty[0]}: no eval/kl in its metrics.jsonl; train it with --frontier_prompts N")
        methods[label(options)] = seeds
    for pair in args.pair:
        unknown = [name for name in pair if name not in methods]
        if unknown:
            raise CompareError(f"--pair: no method {unknown[0]!r} among the runs; they are {list(methods)}")
    tok = get_tokenizer()
    prompts = load_frontier_prompts(args.data, args.split, args.prompts, tok, args.max_prompt_len, args.max_new_tokens)
    curve = best_of_n(
        build_policy(args.reference).eval(),
        prompts,
        build_reward_model(args.reward_model).eval(),
        tok,
        stream(args.seed, 0, 0, "best-of-n"),
        args.max_new_tokens,
        n_max=args.best_of,
        gold_fn=load_function(args.gold_fn, "--gold_fn") if args.gold_fn else None,
        pool=args.pool,
        gold_model=build_reward_model(args.gold_model).eval() if args.gold_model else None,
    )
    out = Path(args.out)
    title = f"{args.prompts} prompts of {args.data}; error bars 1 standard error over the prompts"
    plot_frontier(curve, methods, out, title)
    out.with_suffix(".json").write_text(json.dumps({"best_of_n": curve, "methods": methods}, indent=1))
    rows = None
    if args.pair and has_posts(curve, methods):
        pairs = [(a, b) for a, b in args.pair] + [(name, BEST_OF_N) for name in methods]
        rows = verdict_rows(methods, curve, pairs, "gold" if "gold" in curve[0] else "proxy")
    text = frontier_table(curve, methods, rows)
    publish(args, out, "frontier", text, runs)
    print(f"{text}\n\nwrote {out} and {out.with_suffix('.json')}")
    return text


if __name__ == "__main__":
    from utils.guard import exit_on_error

    with exit_on_error():  # a user error (ConfigError, ModelLoadError, ...): one `error:` line and its exit code
        main()

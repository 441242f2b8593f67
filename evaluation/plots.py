"""Pictures for the README: the pipeline diagram and the demo's curves, drawn from metrics.jsonl files; the
verdict's pictures (evaluation/verdict_plots.py), redrawn from a verdict folder's record.

python -m evaluation.plots --run runs/demo --out assets
python -m evaluation.plots --verdict runs/demo/verdict --out assets
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from evaluation import verdict_plots  # noqa: E402


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def pipeline_diagram(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.set_xlim(0, 11.3)
    ax.set_ylim(-0.3, 3.2)
    ax.axis("off")
    boxes = {
        "sft": (0.2, 1.2, "SFT\nsft.py\ntrl-lib/tldr"),
        "rm": (3.0, 2.1, "reward model\nreward_model.py\nBradley-Terry, gain/bias"),
        "dpo": (3.0, 0.2, "DPO baseline\ndpo.py\nfrozen SFT reference"),
        "grpo": (6.2, 1.2, "GRPO\ngrpo.py\nG=64 -> K=8 (RSO)\ngroup + global norm"),
        "eval": (9.0, 1.2, "preference\naccuracy\neval_preferences.py"),
    }
    for x, y, text in boxes.values():
        ax.add_patch(FancyBboxPatch((x, y), 2.0, 0.95, boxstyle="round,pad=0.05", fc="#eef3fb", ec="#35589a"))
        ax.text(x + 1.0, y + 0.47, text, ha="center", va="center", fontsize=8.5)
    arrows = [
        ((2.25, 1.7), (3.0, 2.5)),
        ((2.25, 1.6), (3.0, 0.7)),
        ((2.25, 1.65), (6.2, 1.65)),
        ((5.05, 2.5), (6.2, 1.95)),
        ((5.05, 0.7), (9.0, 1.4)),
        ((8.25, 1.65), (9.0, 1.65)),
        ((5.05, 2.55), (9.0, 1.95)),
    ]
    for (x0, y0), (x1, y1) in arrows:
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color="#35589a"))
    ax.text(
        0.2, -0.25, "each stage exports a Hugging Face-format folder that the next one loads", fontsize=8, color="#555"
    )
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def demo_curves(run: Path, out: Path) -> None:
    """GRPO: reward-model (proxy) score, gold reward and key items named of the step's samples, against KL (each
    point coloured by its step, so the path of training reads even where KL goes back and forth) and against the
    step; reward model: accuracy."""
    grpo = read_metrics(run / "grpo" / "metrics.jsonl")
    rm = read_metrics(run / "rm" / "metrics.jsonl")
    fig, (a, s, b) = plt.subplots(1, 3, figsize=(15, 3.9))
    rows = [m for m in grpo if "train/kl" in m]
    series = (
        ("reward/raw_mean", "o", "reward model (proxy)"),
        ("reward/gold_mean", "s", "gold reward"),
        ("gold/items_correct", "^", "key items named"),
    )
    if rows:
        kl, steps = [m["train/kl"] for m in rows], [m["step"] for m in rows]
        points = None
        for key, marker, name in series:
            if any(key in m for m in rows):
                values = [m.get(key, float("nan")) for m in rows]
                a.plot(kl, values, "-", color="#bbb", lw=0.6, zorder=1)
                points = a.scatter(kl, values, c=steps, cmap="viridis", marker=marker, s=18, zorder=2, label=name)
                s.plot(steps, values, marker=marker, ms=3, label=name)
        if points is not None:
            fig.colorbar(points, ax=a, label="step")
            legend = a.legend(fontsize=8)
            for handle in legend.legend_handles:
                handle.set_color("#555")
        a.set_xlabel("KL(policy || reference) per token")
        a.set_ylabel("mean over the step's samples")
        s.set_xlabel("step")
        s.legend(fontsize=8)
    a.set_title("GRPO on the synthetic task, against KL")
    s.set_title("GRPO, against the step")
    acc = [(m["step"], m[k]) for m in rm for k in ("train/accuracy", "val/accuracy") if k in m]
    for key, style in (("train/accuracy", "-"), ("val/accuracy", "o-")):
        pts = [(m["step"], m[key]) for m in rm if key in m]
        if pts:
            b.plot(*zip(*pts, strict=True), style, ms=4, label=key)
    if acc:
        b.axhline(0.5, color="#999", lw=0.8, ls="--")
        b.legend()
    b.set_xlabel("step")
    b.set_ylabel("preference accuracy")
    b.set_title("reward model")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--run", default="runs/demo", help="demo run directory")
    p.add_argument("--out", default="assets", help="folder for the PNGs")
    p.add_argument(
        "--verdict",
        default="",
        help="a verdict folder (demo.py --verdict, verdict.py: runs/demo/verdict): redraw its pictures (NAME.png, "
        "NAME_forest.png, NAME_compute.png and, along beta_rs, NAME_dose.png, NAME the folder's) from its record "
        "(verdict_record.json) alone, without training or the runs (a folder written before the record: from its "
        "verdict.json and its runs), instead of the demo's pictures",
    )
    p.add_argument("--title", default="", help="with --verdict: the pictures' first words; empty: the folder")
    args = p.parse_args()
    out = Path(args.out)
    if args.verdict:
        try:
            files = verdict_plots.replot_verdict(Path(args.verdict), out, args.title)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print("wrote " + ", ".join(map(str, files)))
        return
    out.mkdir(parents=True, exist_ok=True)
    pipeline_diagram(out / "pipeline.png")
    demo_curves(Path(args.run), out / "demo_curves.png")
    print(f"wrote {out / 'pipeline.png'} and {out / 'demo_curves.png'}")


if __name__ == "__main__":
    main()

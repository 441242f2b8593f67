"""The whole pipeline on the embedded synthetic TL;DR task, offline, on a CPU in minutes.

    python demo.py                       # one process
    python demo.py --nproc 2             # every stage under torchrun with 2 processes (gloo on CPU)
    python demo.py --out runs/ablation --ablation_seeds 3 --reuse    # make ablation: GRPO's selection and
                                         # normalization, 3 seeds each, from one SFT policy and reward model
    python demo.py --out runs/demo --frontier_seeds 2 --reuse        # make frontier: DPO and GRPO grids and
                                         # best-of-n on gold reward against KL (evaluation/frontier.py)
    python demo.py --verdict configs/verdict/embedded.toml --out runs/demo --reuse   # make verdict: the arms,
                                         # pairs, seeds, posts and pool a verdict file declares (docs/reporting.md)

Stages: write the synthetic task (data/synthetic.py) -> SFT (sft.py) -> label pairs of the SFT policy's own
samples by the gold reward -> reward model (reward_model.py) -> DPO (dpo.py) -> GRPO (grpo.py), each training
stage a subprocess running the same command a user would, each stage's exported model feeding the next. The
task has a known gold reward, so the table at the end shows what each stage learned: gold reward of sampled
summaries and its parts (key items named and invented, words, ended), reward-model and DPO preference accuracy.
The summary is written to runs/demo/summary.json.

The reward model and DPO train on comparisons of SFT samples, as in summarize-from-feedback (Stiennon et al.
2020), where labellers compared samples of the policies being trained: what separates the tiny SFT policy's
summaries (which key items they name, which they invent, length, filler, ending) is what the reward model must
learn, and comparisons of its own samples teach exactly that. Each labelled summary is also compared with itself with
one key item swapped for an invented one (swap pairs, data.synthetic.label_pairs), and the reward model sums its head
over the response tokens (reward_model.py --pooling sum), so that it checks a summary's items against the post rather
than counting them. The SFT stage is long for a tiny model (2,400 steps) because copying the post's items appears only
after a plateau. docs/results.md has the results and what was tried. (The task's static preference files compare
summaries of a better writer; they serve the tests and users with larger models.)
"""

import argparse
import json
import time
from pathlib import Path

from experiments import embedded
from experiments.embedded import ABLATION, ABLATION_METRICS, PREPARED, Demo, pipeline, proxy_runs
from experiments.runner import ExperimentRun, run_all
from experiments.verdict import (
    check_runs,
    embedded_measurement,
    posts_reading,
    read_verdict,
    run_verdict,
    verdict_posts,
    verdict_runs,
)
from experiments.verdict_best_of_n import kept_best_of_n, reference_best_of_n


def publish(demo: Demo, picture: str, folder: Path, text: str, beside: tuple[Path, ...] = ()) -> None:
    """A grid's picture (and the pictures `beside` it) and table as TensorBoard events in its folder and, with
    --wandb_mode, a wandb run in the group named for the grid (utils.logging.publish_picture)."""
    from utils.logging import markdown_rows, publish_picture

    png, tag = Path(demo.args.assets) / picture, picture.removesuffix(".png")
    publish_picture(
        png, folder, tag, markdown_rows(text), wandb_mode=demo.args.wandb_mode, wandb_group=tag, beside=beside
    )


def ablation(demo: Demo) -> str:
    """The ablation's runs (experiments.embedded.ablation_runs), every one from the same SFT policy and reward model;
    then the comparison table and curves (evaluation/compare.py), published (`publish`). Returns the table."""
    from evaluation.compare import group_runs, load_run, plot, table

    runs = embedded.ablation_runs(demo)
    run_all(runs, demo.args.nproc)
    groups = group_runs([load_run(run.out_dir) for run in runs])
    text = table(groups, ABLATION_METRICS, set(), last=5)
    Path(demo.args.assets).mkdir(parents=True, exist_ok=True)
    metrics = ["reward/gold_mean", "gold/items_correct", "reward/mean"]
    plot(groups, metrics, Path(demo.args.assets) / "ablation.png", "eval/kl", 5)
    (demo.out / "ablation.md").write_text(text + "\n")
    publish(demo, "ablation.png", demo.out / "ablation", text)
    return text


def sft_best_of_n(demo: Demo, posts: Path, n_posts: int, n_max: int, pool: int) -> list[dict]:
    """Best-of-n from the SFT policy against the reward model on the first `n_posts` of `posts` (prompts of 192 tokens
    at most, the demo's stages'), scored by the task's gold reward: one pool of `pool` samples per post, every n up to
    `n_max` (experiments.verdict_best_of_n.reference_best_of_n)."""
    measured = embedded_measurement(demo, posts)
    return reference_best_of_n(measured, n_posts, n_max, pool, ("validation", 192), seed=demo.args.seed)


def frontier(demo: Demo) -> str:
    """Best-of-n from the SFT policy on the frontier's held-out posts, then the frontier's runs
    (experiments.embedded.frontier_runs), each measured at every evaluation on the first --frontier_prompts held-out
    posts (KL to the SFT policy, gold and proxy reward of --frontier_samples temperature-1 samples per post); then
    frontier.md (the table), frontier.json (every point) and assets/frontier.png, rewritten after every run so that a
    run cut short keeps what it measured; at the end the picture and table published (`publish`). Returns the table."""
    from evaluation.frontier import frontier_table, plot_frontier
    from evaluation.matched import frontier_points

    args, root = demo.args, demo.out / "frontier"
    root.mkdir(parents=True, exist_ok=True)
    curve = sft_best_of_n(
        demo, demo.paths["sft_validation"], args.frontier_prompts, args.frontier_best_of, args.frontier_pool
    )
    methods: dict[str, list[list[dict]]] = {}

    def record(run: ExperimentRun | None = None) -> str:
        if run is not None:
            methods.setdefault(run.name, []).append(frontier_points(run.out_dir))
        text = frontier_table(curve, methods)
        (root / "frontier.md").write_text(text + "\n")
        (root / "frontier.json").write_text(json.dumps({"best_of_n": curve, "methods": methods}, indent=1))
        plot_frontier(
            curve,
            methods,
            Path(args.assets) / "frontier.png",
            f"embedded task: {args.frontier_prompts} held-out posts x {args.frontier_samples} samples per point "
            f"(best-of-n: pool of {args.frontier_pool}); error bars 1 standard error over posts; one line per seed",
        )
        return text

    run_all(embedded.frontier_runs(demo), args.nproc, after=record, keep_finished=args.reuse)
    text = record()
    publish(demo, "frontier.png", root, text)
    return text


def summarize(demo: Demo, t0: float) -> None:
    """Stage 7: what each stage learned, as summary.json, a table on the terminal, the pipeline diagram and the demo's
    curves."""
    from evaluation.plots import demo_curves, pipeline_diagram
    from evaluation.probes import eval_kl, gold_of_samples, reward_probes

    out, paths, args = demo.out, demo.paths, demo.args

    # gold reward of sampled summaries on held-out prompts (all 200 SFT validation posts x 8 samples: the standard
    # error of a stage's mean items invented is ~0.01), preference accuracy
    def gold(stage: str) -> dict:
        return gold_of_samples(out / stage / "hf", paths["sft_validation"], 200, 8, 24, args.seed)

    def last(stage: str, key: str) -> float:
        rows = [json.loads(line) for line in open(out / stage / "metrics.jsonl")]
        return [r[key] for r in rows if key in r][-1]

    grpo_rows = [json.loads(line) for line in open(out / "grpo" / "metrics.jsonl")]
    tail = [r for r in grpo_rows if "train/kl" in r][-5:]  # the last five steps
    golds = {stage: gold(stage) for stage in ("sft", "dpo", "grpo")}
    # where DPO and GRPO are compared: the sequence KL of each policy's own temperature-1 samples to the SFT policy
    kls = {
        stage: eval_kl(out / stage / "hf", out / "sft" / "hf", paths["sft_validation"], args.seed)
        for stage in ("dpo", "grpo")
    }
    summary = {
        "rm_accuracy": last("rm", "val/accuracy"),
        **reward_probes(out, demo.pairs["validation"], paths["sft_validation"], args.seed),
        "dpo_accuracy": last("dpo", "val/accuracy"),
        **{f"{stage}_{name}": value for stage, parts in golds.items() for name, value in parts.items()},
        "dpo_kl": kls["dpo"],
        "grpo_kl": kls["grpo"],
        "grpo_train_kl": sum(r["train/kl"] for r in tail) / len(tail),  # per token, kept training samples
        "grpo_proxy_reward": sum(r["reward/mean"] for r in tail) / len(tail),
        "grpo_pref_accuracy": last("grpo", "eval/pref_accuracy"),
        "seconds": time.time() - t0,
    }
    assets = Path(args.assets)
    assets.mkdir(parents=True, exist_ok=True)
    pipeline_diagram(assets / "pipeline.png")
    demo_curves(out, assets / "demo_curves.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n| metric | value |\n|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v:.4f} |")
    print(f"\nwrote {out / 'summary.json'}, {assets / 'pipeline.png'}, {assets / 'demo_curves.png'}")


def add_frontier_arguments(p: argparse.ArgumentParser) -> None:
    """The reward-KL frontier's options (make frontier)."""
    p.add_argument(
        "--frontier_seeds",
        type=int,
        default=0,
        help="with N > 0: instead of DPO and GRPO, the reward-KL frontier (make frontier): the grids of "
        "--frontier_dpo_betas and --frontier_grpo_betas, N seeds each, and best-of-n, from one SFT policy and reward "
        "model (docs/results.md)",
    )
    p.add_argument("--frontier_dpo_betas", type=float, nargs="+", default=[0.1, 0.3], help="DPO betas")
    p.add_argument(
        "--frontier_grpo_betas",
        type=float,
        nargs="+",
        default=[0.4, 0.1],
        help="GRPO KL coefficients (grpo.py --beta) of the RSO runs; the first also with uniform selection",
    )
    p.add_argument(
        "--frontier_grpo_samples",
        type=int,
        default=64,
        help="samples per prompt of the frontier's GRPO runs (grpo.py --num_samples; 8 are kept)",
    )
    p.add_argument(
        "--frontier_dpo_steps",
        type=int,
        default=60,
        help="optimizer steps of the frontier's DPO runs (dpo.py --steps), evaluated and measured every third",
    )
    p.add_argument(
        "--frontier_eval_rows",
        type=int,
        default=64,
        help="rows of the frontier runs' own evaluations (dpo.py and grpo.py --val_rows, grpo.py --pref_rows); 0: "
        "the demo's",
    )
    p.add_argument("--frontier_prompts", type=int, default=100, help="held-out posts each frontier point samples")
    p.add_argument("--frontier_samples", type=int, default=4, help="temperature-1 samples per post of each point")
    p.add_argument("--frontier_best_of", type=int, default=64, help="best-of-n's largest n (a power of 2)")
    p.add_argument(
        "--frontier_pool",
        type=int,
        default=64,
        help="reference samples per post from which best-of-n is estimated (every n-subset; >= --frontier_best_of)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="runs/demo", help="run directory (data/, sft/, rm/, dpo/, grpo/, summary.json)")
    p.add_argument("--nproc", type=int, default=1, help="processes per stage (torchrun when > 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic task and of every stage")
    p.add_argument("--model", default="tiny", help="GPT-2 preset trained from random initialisation")
    p.add_argument(
        "--sft_steps",
        type=int,
        default=2400,
        help="SFT optimizer steps (the tiny policy starts copying the "
        "post's items after a plateau of ~600-800 steps at --sft_lr 6e-3: docs/results.md)",
    )
    p.add_argument("--sft_lr", type=float, default=6e-3, help="SFT peak learning rate")
    p.add_argument(
        "--prompt_loss_weight",
        type=float,
        default=0.0,
        help="SFT's weight of the next-token loss on the post relative to the summary (sft.py --prompt_loss_weight)",
    )
    p.add_argument(
        "--rm_steps",
        type=int,
        default=900,
        help="reward-model optimizer steps at a constant lr 2e-3 (a "
        "summed head learns to check items slowly: swap accuracy 0.72 to 0.85 after 900 steps on three "
        "seeds: docs/results.md)",
    )
    p.add_argument(
        "--rm_pooling",
        default="sum",
        choices=["last", "sum"],
        help="reward_model.py --pooling: the head "
        "summed over the response tokens (sum) or read at the end token (last, which does not learn to "
        "check the items: docs/results.md)",
    )
    p.add_argument(
        "--swap_pairs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add to the training "
        "pairs each labelled summary against itself with a key item swapped for an invented one",
    )
    p.add_argument(
        "--pair_prompts",
        type=int,
        default=2000,
        help="training prompts whose SFT samples (8 each) are labelled into pairs (up to 4 per prompt)",
    )
    p.add_argument(
        "--proxies",
        action="store_true",
        help="also train reward models on a quarter and on four times the labelled pairs (rm_quarter/, rm_4x/ in "
        '--out; experiments.embedded PROXIES), which a verdict\'s grpo arm names as reward_model = "{out}/rm_4x/hf"',
    )
    p.add_argument("--dpo_steps", type=int, default=150, help="DPO optimizer steps")
    p.add_argument("--grpo_steps", type=int, default=30, help="GRPO steps")
    p.add_argument("--assets", default="assets", help="folder for the pipeline diagram and the demo's curves")
    p.add_argument("--wandb_mode", default="auto", help="online, offline, disabled, or auto")
    p.add_argument(
        "--ablation_seeds",
        type=int,
        default=0,
        help="with N > 0: instead of DPO and GRPO, the ablation of "
        "GRPO's selection and global normalization (ABLATION), N seeds each, from one SFT policy and reward model",
    )
    p.add_argument(
        "--ablation_variants",
        nargs="+",
        default=list(ABLATION),
        metavar="NAME",
        help="which variants of ABLATION to run",
    )
    add_frontier_arguments(p)
    p.add_argument(
        "--verdict",
        default="",
        metavar="FILE",
        help="instead of DPO and GRPO, the verdict a TOML file declares (make verdict: "
        "configs/verdict/embedded.toml): its arms, each a grpo.py or dpo.py run from one SFT policy and reward model, "
        "its seeds, and best-of-n, paired over the same held-out posts (docs/reporting.md); checked whole before "
        "anything runs",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse --out's SFT policy, labelled pairs and reward model "
        "(sft/hf, data/policy_pairs, rm/hf), each that exists, instead of training them again (a stage after "
        "one that is redone is redone too); with --frontier_seeds or --verdict, also keep each run that "
        "finished with the same options (experiment_run.json; its inputs are not compared: delete it to redo it) "
        "and, with --verdict, best-of-n drawn from the same models, posts and options (best_of_n.json)",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    from utils.config import ConfigError
    from utils.guard import exit_on_error
    from utils.host import cpu_memory_settings

    with exit_on_error():  # a bad verdict file: one line naming the key, exit 2, before anything is written or run
        spec = read_verdict(args.verdict) if args.verdict else None
        if spec is not None and spec.task is not None:
            raise ConfigError(
                f"{spec.where}: its [task] names its own models and posts: run it with python verdict.py --verdict "
                f"{spec.path} (demo.py runs verdicts on the embedded task)"
            )

    cpu_memory_settings()  # the demo's own sampling and scoring run here, on the CPU (utils/host.py)
    t0 = time.time()
    out = Path(args.out)

    # 1. the synthetic task
    from data.synthetic import write_task

    demo = Demo(out, write_task(out / "data", seed=args.seed), args)
    if spec is not None:  # each arm's options through its script's checks, before any run
        posts = verdict_posts(demo, spec)
        verdict_grid = verdict_runs(demo, spec, posts)
        with exit_on_error():
            reading = posts_reading(spec, check_runs(spec, verdict_grid))

    # 2.-4. SFT, pairs of SFT samples labelled by the gold reward, reward model (or, with --reuse, the ones in --out)
    runs = pipeline(demo)
    run_all(runs[:PREPARED] + (proxy_runs(demo) if args.proxies else []), args.nproc, reuse=args.reuse)
    if spec is not None:  # best-of-n from the SFT policy on the same posts, the arms, the tables and pictures
        measured = embedded_measurement(demo, posts)
        curve = kept_best_of_n(
            measured, spec.posts, spec.best_of, spec.pool, reading, out / spec.name, seed=args.seed, reuse=args.reuse
        )
        assets = Path(args.assets)
        text = run_verdict(spec, verdict_grid, curve, out, assets, nproc=args.nproc, reuse=args.reuse)
        from evaluation.verdict_plots import verdict_picture_files

        beside = tuple(verdict_picture_files(assets, spec.name)[1:])
        publish(demo, f"{spec.name}.png", out / spec.name, text, beside)
        print(f"\n{text}\n\nwrote {out / spec.name} and {assets / spec.name}*.png ({time.time() - t0:.0f} s)")
        return
    if args.frontier_seeds > 0:
        text = frontier(demo)
        print(
            f"\n{text}\n\nwrote {out / 'frontier'} and {Path(args.assets) / 'frontier.png'} ({time.time() - t0:.0f} s)"
        )
        return
    if args.ablation_seeds > 0:
        text = ablation(demo)
        took = f"{time.time() - t0:.0f} s"
        print(f"\n{text}\n\nwrote {out / 'ablation.md'} and {Path(args.assets) / 'ablation.png'} ({took})")
        return

    # 5. DPO from the SFT policy against a frozen copy of it, on the same pairs
    # 6. GRPO from the SFT policy against the reward model; the gold reward is only watched, never trained on
    run_all(runs[PREPARED:], args.nproc)

    # 7. what each stage learned
    summarize(demo, t0)


if __name__ == "__main__":
    main()

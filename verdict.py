"""A verdict on a task of one's own: the arms, pairs, seeds, posts and best-of-n pool of a verdict file whose [task]
table names the stages' option files, the held-out posts, the reference policy, the proxy and the gold reward model
(configs/verdict/tldr.toml: real TL;DR with gold from a larger reward model, Gao, Schulman and Hilton 2022, arXiv
2210.10760). One command runs it, goes on with it and rebuilds its tables from the runs it finds:

    python verdict.py --verdict configs/verdict/tldr.toml --nproc 8 --reuse      # runs/verdict_tldr/<arm>/seed<s>

1. read the file and check it whole: its keys, every arm's options through its script's checks, how the arms read
   the posts, each [task] model a folder of its kind (one line, exit 2, before any run; experiments/verdict.py)
2. best-of-n from the reference on the same posts, ranked by the proxy and scored by the gold model; --reuse keeps
   the one in --out/<name>/best_of_n.json drawn from the same models, posts and options
3. every arm, seed 0 of each first, each a grpo.py or dpo.py run (torchrun with --nproc > 1) measured at every
   evaluation on the posts with gold from the gold model; --reuse keeps each run that finished with the same options
4. after each round of seeds: verdict.md and verdict.json in --out/<name> (each pair and each arm against best-of-n at
   matched KL) and the three pictures in --assets (default --out/<name>)

A verdict on the embedded task (no [task]: the demo's SFT policy, reward model and posts) runs with
`python demo.py --verdict FILE` (make verdict). The models come first: docs/reporting.md, Gold from a reward model.
"""

import argparse
import time
from pathlib import Path

from experiments.verdict import (
    check_runs,
    check_task_models,
    posts_reading,
    read_verdict,
    run_verdict,
    task_measurement,
    task_runs,
)
from experiments.verdict_best_of_n import kept_best_of_n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--verdict", required=True, metavar="FILE", help="the verdict file (TOML) with a [task] table")
    p.add_argument("--out", default="runs", help="folder of the verdict's folder (its name): runs, tables")
    p.add_argument("--assets", default="", help="folder of the three pictures; empty: --out/<name>")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when > 1)")
    p.add_argument("--device", default="", help="best-of-n's device, cpu or cuda; empty: cuda when there is one")
    p.add_argument("--seed", type=int, default=0, help="seed of best-of-n's samples")
    p.add_argument("--wandb_mode", default="auto", help="every run's --wandb_mode: online, offline, disabled, or auto")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep each run that finished with the same options (its experiment_run.json; its inputs, the models "
        "and data, are not compared: delete it to redo it) and best-of-n drawn from the same models, posts and "
        "options (best_of_n.json, which compares them)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    import torch

    from evaluation.verdict_plots import verdict_picture_files
    from utils.config import ConfigError
    from utils.guard import exit_on_error
    from utils.logging import markdown_rows, publish_picture

    args = parse_args(argv)
    t0, out = time.time(), Path(args.out)

    # 1. the file, every arm's options and the task's models, checked before anything is written or run
    with exit_on_error():
        spec = read_verdict(args.verdict)
        if spec.task is None:
            raise ConfigError(
                f"{spec.where}: no [task] table: a verdict on the embedded task runs with python demo.py --verdict "
                f"{spec.path} (the demo's SFT policy, reward model and posts)"
            )
        runs = task_runs(spec, out, args.wandb_mode)
        reading = posts_reading(spec, check_runs(spec, runs))
        check_task_models(spec)

    # 2. best-of-n from the reference on the same posts, gold from the gold model
    measured = task_measurement(spec.task)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    curve = kept_best_of_n(
        measured,
        spec.posts,
        spec.best_of,
        spec.pool,
        reading,
        out / spec.name,
        seed=args.seed,
        device=device,
        reuse=args.reuse,
    )

    # 3.-4. the arms, seed by seed; the tables and pictures after each round of seeds
    root, assets = out / spec.name, Path(args.assets or out / spec.name)
    text = run_verdict(spec, runs, curve, out, assets, nproc=args.nproc, reuse=args.reuse)
    table = markdown_rows(text)  # as TensorBoard events in --out/<name> and, with --wandb_mode, a wandb run
    picture, *beside = verdict_picture_files(assets, spec.name)
    publish_picture(
        picture, root, spec.name, table, wandb_mode=args.wandb_mode, wandb_group=spec.name, beside=tuple(beside)
    )  # fmt: skip
    print(f"\n{text}\n\nwrote {root} and the pictures in {assets} ({time.time() - t0:.0f} s)")
    return text


if __name__ == "__main__":
    main()

"""The embedded task's experiments as data: the pipeline (SFT -> labelled pairs -> reward model -> DPO, GRPO) and the
grids built on its SFT policy and reward model (the ablation, the reward-KL frontier), each a list of `ExperimentRun`s
for `experiments.runner.run_all`. Every run's options are the ones a user would type; demo.py runs them and reports.
A verdict is a file (configs/verdict/) whose arms start from the stages' options here (experiments/verdict.py)."""

import argparse
import json
import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from experiments.runner import ExperimentRun


@dataclass
class Demo:
    """Where the demo's runs read and write (`paths`: data.synthetic.write_task's files) and its command line."""

    out: Path
    paths: dict
    args: argparse.Namespace

    @property
    def pairs(self) -> dict:
        """The labelled pairs of SFT samples the reward model and DPO train on."""
        return {split: self.out / "data" / "policy_pairs" / f"{split}.jsonl" for split in ("train", "validation")}

    @property
    def common(self) -> dict:
        return {"wandb_mode": self.args.wandb_mode, "seed": self.args.seed, "resume": "false"}


# ----------------------------------------------------------------------------------------------------
# The stages' options


def sft_options(demo: Demo) -> dict:
    """sft.py's options: the tiny policy from random initialisation on the task's (post, summary) rows."""
    args = demo.args
    return {
        "model": args.model,
        "random_init": "true",
        "train_data": demo.paths["sft_train"],
        "val_data": demo.paths["sft_validation"],
        "val_rows": 128,
        "steps": args.sft_steps,
        "batch_size": 32,
        "micro_batch_size": 32 // args.nproc,
        "lr": args.sft_lr,
        "warmup_steps": 10,
        "eval_every": 200,
        "save_every": 0,
        "max_prompt_len": 192,
        "max_response_len": 32,
        "prompt_loss_weight": args.prompt_loss_weight,
        "out_dir": demo.out / "sft",
        "run_name": "demo-sft",
        **demo.common,
    }


def reward_model_options(demo: Demo) -> dict:
    """reward_model.py's options: from the SFT policy on the labelled pairs, normalised on its samples."""
    args = demo.args
    return {
        "model": demo.out / "sft" / "hf",
        "train_data": demo.pairs["train"],
        "val_data": demo.pairs["validation"],
        "val_rows": 256,
        "steps": args.rm_steps,
        "batch_size": 32,
        "micro_batch_size": 32 // args.nproc,
        "lr": 2e-3,
        "min_lr_ratio": 1.0,
        "pooling": args.rm_pooling,
        "warmup_steps": 5,
        "eval_every": 50,
        "save_every": 0,
        "max_prompt_len": 192,
        "max_response_len": 32,
        "norm_prompts": 64,
        "norm_samples_per_prompt": 4,
        "out_dir": demo.out / "rm",
        "run_name": "demo-rm",
        **demo.common,
    }


def dpo_options(demo: Demo) -> dict:
    """dpo.py's options: DPO from the SFT policy against a frozen copy of it, on the labelled pairs."""
    return {
        "model": demo.out / "sft" / "hf",
        "train_data": demo.pairs["train"],
        "val_data": demo.pairs["validation"],
        "val_rows": 256,
        "steps": demo.args.dpo_steps,
        "batch_size": 32,
        "micro_batch_size": 32 // demo.args.nproc,
        "lr": 5e-4,
        "beta": 0.1,
        "warmup_steps": 5,
        "eval_every": 50,
        "save_every": 0,
        "max_prompt_len": 192,
        "max_response_len": 32,
        **demo.common,
    }


def grpo_options(demo: Demo) -> dict:
    """grpo.py's options: GRPO from the SFT policy against the reward model (RSO keeps 8 of 16 samples per prompt at
    beta_rs 2, global normalization on: the defaults), with the gold reward and its parts watched (logged), never
    trained on."""
    return {
        "model": demo.out / "sft" / "hf",
        "reward_model": demo.out / "rm" / "hf",
        "train_data": demo.paths["prompts_train"],
        "val_data": demo.paths["sft_validation"],
        "pref_data": demo.pairs["validation"],
        "pref_rows": 256,
        "val_rows": 64,
        "num_samples": 16,
        "num_kept": 8,
        "max_new_tokens": 24,
        "max_prompt_len": 192,
        "prompts_per_step": 16,
        "micro_batch_size": 64,
        "steps": demo.args.grpo_steps,
        "lr": 3e-4,
        "warmup_steps": 3,
        "beta": 0.4,
        "missing_end_penalty": 2.0,
        "eval_every": 10,
        "save_every": 0,
        "table_every": 10,
        "gold_reward_fn": "data.synthetic:gold_reward",
        "gold_parts_fn": "data.synthetic:gold_parts",
        **demo.common,
    }


# ----------------------------------------------------------------------------------------------------
# The pipeline


def pipeline(demo: Demo) -> list[ExperimentRun]:
    """SFT, pairs of its samples labelled by the gold reward (10% label noise), the reward model; then DPO and GRPO
    from the SFT policy. The first three are what every grid starts from (`--reuse` keeps those --out holds)."""
    out = demo.out
    return [
        ExperimentRun("the SFT policy", "sft.py", sft_options(demo), done=out / "sft" / "hf"),
        ExperimentRun("the labelled pairs", call=partial(label_sft_samples, demo), done=demo.pairs["validation"]),
        ExperimentRun("the reward model", "reward_model.py", reward_model_options(demo), done=out / "rm" / "hf"),
        ExperimentRun("DPO", "dpo.py", dpo_options(demo) | {"out_dir": out / "dpo", "run_name": "demo-dpo"}),
        ExperimentRun("GRPO", "grpo.py", grpo_options(demo) | {"out_dir": out / "grpo", "run_name": "demo-grpo"}),
    ]


PREPARED = 3  # pipeline(demo)[:PREPARED]: the SFT policy, the labelled pairs and the reward model


def label_sft_samples(demo: Demo) -> None:
    """Training pairs of the SFT policy's samples on --pair_prompts prompts (with swap pairs, --swap_pairs), then
    validation pairs on the task's 200 preference-validation prompts (sampled pairs only)."""
    args, sft = demo.args, demo.out / "sft" / "hf"
    n_train, n_swaps = label_policy_pairs(
        sft, demo.paths["prompts_train"], args.pair_prompts, demo.pairs["train"], args.seed, args.swap_pairs
    )
    n_val, _ = label_policy_pairs(
        sft, demo.paths["preference_validation"], 200, demo.pairs["validation"], args.seed + 1, False
    )
    print(
        f"labelled {n_train} training pairs ({n_swaps} of them swap pairs) and {n_val} validation pairs of SFT "
        "samples by the gold reward",
        flush=True,
    )


def label_policy_pairs(
    policy_dir: Path, prompts_file: Path, n_prompts: int, out_file: Path, seed: int, swap_pairs: bool
) -> tuple[int, int]:
    """Preference pairs of the policy's own summaries (8 per prompt), labelled by the gold reward with 10% label noise
    (the stand-in for human labellers; data.synthetic.label_pairs), as in summarize-from-feedback where labellers
    compare samples of the SFT policy. Written in the trl-lib/tldr-preference layout (plus a "swap" column); returns
    (pairs, swap pairs among them)."""
    from data.synthetic import label_pairs
    from evaluation.probes import sample_summary_texts

    rng = random.Random(f"demo-pairs/{seed}/{out_file.name}")
    swap_rng = random.Random(f"demo-swaps/{seed}/{out_file.name}") if swap_pairs else None  # the labels do not move
    rows = []
    for prompt, texts in sample_summary_texts(policy_dir, prompts_file, n_prompts, 8, 32, seed):
        rows += label_pairs(prompt, texts, 0.1, rng, swap_rng)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with open(out_file, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows), sum(row["swap"] for row in rows)


# ----------------------------------------------------------------------------------------------------
# Reward models of other qualities (demo.py --proxies): the same labeller, the same options, other amounts of pairs

PROXIES = {"rm_quarter": 0.25, "rm_4x": 4}
"""Each proxy's folder in --out and its share of the demo's labelled training prompts: rm_quarter/ learns from the
pairs of the first quarter of them, rm_4x/ from those pairs and the pairs of three times as many new prompts; the
demo's rm/ (every pair) sits between them."""


def proxy_pairs(demo: Demo, name: str) -> Path:
    return demo.out / "data" / f"policy_pairs_{name.removeprefix('rm_')}" / "train.jsonl"


def proxy_runs(demo: Demo) -> list[ExperimentRun]:
    """The training pairs of each of PROXIES, then its reward model: reward_model.py with the demo's options (the
    same steps, validation pairs and normalization) but its own pairs and folder. A verdict's grpo arm trains on one
    with reward_model = "{out}/rm_4x/hf" (docs/reporting.md)."""
    runs = []
    for name, share in PROXIES.items():
        pairs = proxy_pairs(demo, name)
        runs.append(
            ExperimentRun(f"the pairs of {name}", call=partial(write_proxy_pairs, demo, share, pairs), done=pairs)
        )
    for name in PROXIES:
        options = reward_model_options(demo) | {"train_data": proxy_pairs(demo, name), "out_dir": demo.out / name}
        runs.append(
            ExperimentRun(
                f"the reward model {name}",
                "reward_model.py",
                options | {"run_name": f"demo-{name}"},
                done=demo.out / name / "hf",
            )
        )
    return runs


def write_proxy_pairs(demo: Demo, share: float, out_file: Path) -> None:
    """The demo's labelled training pairs of the first `share` of their prompts (share < 1), or all of them and the
    pairs of (share - 1) x --pair_prompts new prompts (data.synthetic.write_more_prompts, none a post of the task's
    files), labelled as the demo's are (label_policy_pairs: 8 SFT samples each, the gold labeller, 10% label noise,
    swap pairs). Written whole or not at all (the file is the run's `done`)."""
    from utils.rundir import write_text_atomic

    rows = demo.pairs["train"].read_text(encoding="utf-8").splitlines()
    if share < 1:
        prompt = [json.loads(line)["prompt"] for line in rows]  # each row parsed once
        kept = set(list(dict.fromkeys(prompt))[: round(len(set(prompt)) * share)])
        rows = [line for line, p in zip(rows, prompt, strict=True) if p in kept]
    else:
        from data.synthetic import write_more_prompts

        args = demo.args
        taken = {json.loads(line)["prompt"] for path in demo.paths.values() for line in open(path, encoding="utf-8")}
        n_more = round(args.pair_prompts * (share - 1))
        more = write_more_prompts(out_file.parent / "prompts.jsonl", n_more, args.seed, taken)
        labelled = out_file.parent / "more.jsonl"
        label_policy_pairs(demo.out / "sft" / "hf", more, n_more, labelled, args.seed, args.swap_pairs)
        rows += labelled.read_text(encoding="utf-8").splitlines()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_file, "".join(line + "\n" for line in rows))
    print(f"{out_file}: {len(rows)} labelled training pairs", flush=True)


# ----------------------------------------------------------------------------------------------------
# The ablation (make ablation)

# The method's two claims, each variant against the demo's GRPO (RSO keeps 8 of 16 samples per prompt at beta_rs 2,
# global normalization on): uniform and top_bottom keep 8 of 16 as well; all keeps the 16 (it cannot keep fewer).
# After group normalization with the std, global normalization only rescales every advantage by about
# sqrt(K / (K - 1)) (tests/test_grpo_math.py), so it is also switched on and off after Dr. GRPO's centring, where it
# sets the batch's scale.
ABLATION = {
    "rso": {"selection": "rso", "global_norm": "true", "advantage": "grpo"},
    "uniform": {"selection": "uniform", "global_norm": "true", "advantage": "grpo"},
    "top_bottom": {"selection": "top_bottom", "global_norm": "true", "advantage": "grpo"},
    "all": {"selection": "all", "global_norm": "true", "advantage": "grpo"},
    "rso_no_global_norm": {"selection": "rso", "global_norm": "false", "advantage": "grpo"},
    "rso_centred": {"selection": "rso", "global_norm": "true", "advantage": "dr_grpo"},
    "rso_centred_no_global_norm": {"selection": "rso", "global_norm": "false", "advantage": "dr_grpo"},
}


ABLATION_METRICS = [
    "reward/gold_mean",
    "gold/items_correct",
    "gold/items_invented",
    "reward/mean",
    "eval/kl",
    "train/kl",
    "eval/pref_accuracy",
]
"""The ablation's table: the gold reward and proxy of the last five steps' samples; eval/kl, the sequence KL of the
policy's own temperature-1 samples to the SFT policy at the last evaluation (--frontier_prompts: where the variants are
compared); train/kl, the per-token training metric over the kept samples (a tenth of eval/kl or less here)."""


def ablation_measured(demo: Demo) -> dict:
    """eval/kl at every evaluation, the KL where the variants are compared: the held-out posts (--val_data) x
    --frontier_samples."""
    args = demo.args
    return {
        "frontier_prompts": args.frontier_prompts,
        "frontier_samples": args.frontier_samples,
        "frontier_max_new_tokens": 24,
    }


def ablation_runs(demo: Demo) -> list[ExperimentRun]:
    """GRPO once per variant of --ablation_variants (ABLATION) and seed (--ablation_seeds), each with a wandb group
    (its variant) and tags."""
    unknown = sorted(set(demo.args.ablation_variants) - set(ABLATION))
    if unknown:
        raise SystemExit(f"--ablation_variants: unknown {', '.join(unknown)}; expected some of {', '.join(ABLATION)}")
    runs = []
    for name in demo.args.ablation_variants:
        variant = ABLATION[name]
        for seed in range(demo.args.ablation_seeds):
            options = grpo_options(demo) | variant | ablation_measured(demo)
            options |= {"seed": seed, "out_dir": demo.out / "ablation" / name / f"seed{seed}"}
            options |= {"run_name": f"ablation-{name}-{seed}", "wandb_group": f"ablation-{name}"}
            options["wandb_tags"] = ",".join(f"{k}={v}" for k, v in variant.items())
            runs.append(ExperimentRun(name, "grpo.py", options))
    return runs


# ----------------------------------------------------------------------------------------------------
# The reward-KL frontier (make frontier)

# GRPO with the method's defaults (RSO keeps 8 of 64 samples per prompt at beta_rs 2, global normalization on) over a
# grid of its KL coefficient, and with uniform selection at the grid's first coefficient for contrast; DPO over a grid
# of beta; best-of-n from the SFT policy as the baseline (demo.py).
FRONTIER_SELECTIONS = ("rso", "uniform")


def frontier_measured(demo: Demo) -> dict:
    """The options that make a run measure the frontier at every evaluation (dpo.py / grpo.py --frontier_*)."""
    return {
        "frontier_prompts": demo.args.frontier_prompts,
        "frontier_samples": demo.args.frontier_samples,
        "frontier_data": demo.paths["sft_validation"],
        "frontier_reward_model": demo.out / "rm" / "hf",
        "frontier_gold_fn": "data.synthetic:gold_reward",
        "frontier_max_new_tokens": 24,  # the demo's GRPO length, and its gold evaluation's
    }


def frontier_runs(demo: Demo) -> list[ExperimentRun]:
    """The frontier's grids (--frontier_grpo_betas with RSO, the first of them with uniform selection,
    --frontier_dpo_betas; --frontier_seeds seeds each), the first point of the method, of DPO and of the contrast
    first, every seed of a point before the next: a frontier cut short has one point of each method with all its
    seeds. Each run's name is its method's line in the table."""
    args = demo.args
    first_grpo, first_dpo = args.frontier_grpo_betas[0], args.frontier_dpo_betas[0]
    points = [("grpo", FRONTIER_SELECTIONS[0], first_grpo), ("dpo", "", first_dpo)]
    points += [("grpo", selection, first_grpo) for selection in FRONTIER_SELECTIONS[1:]]
    points += [("grpo", FRONTIER_SELECTIONS[0], beta) for beta in args.frontier_grpo_betas[1:]]
    points += [("dpo", "", beta) for beta in args.frontier_dpo_betas[1:]]
    runs = []
    for stage, selection, beta in points:
        if stage == "grpo":
            name = f"GRPO {selection} {args.frontier_grpo_samples}->8, beta {beta:g}"
            folder = f"grpo_{selection}_beta{beta:g}"
            options = grpo_options(demo) | {"num_samples": args.frontier_grpo_samples, "selection": selection}
        else:
            name, folder = f"DPO beta {beta:g}", f"dpo_beta{beta:g}"
            steps = args.frontier_dpo_steps
            options = dpo_options(demo) | {"steps": steps, "eval_every": max(1, steps // 3)}
        if args.frontier_eval_rows:
            options |= {"val_rows": args.frontier_eval_rows}
            options |= {"pref_rows": args.frontier_eval_rows} if stage == "grpo" else {}
        for seed in range(args.frontier_seeds):
            run = options | frontier_measured(demo) | {"beta": beta, "seed": seed}
            run |= {"out_dir": demo.out / "frontier" / folder / f"seed{seed}", "run_name": f"frontier-{folder}-{seed}"}
            run |= {"wandb_group": f"frontier-{folder}", "wandb_tags": f"{stage}={selection or 'dpo'},beta={beta:g}"}
            runs.append(ExperimentRun(name, f"{stage}.py", run))
    return runs

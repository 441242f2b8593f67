"""The whole pipeline on the embedded synthetic TL;DR task, offline, on a CPU in minutes.

    python demo.py                       # one process
    python demo.py --nproc 2             # every stage under torchrun with 2 processes (gloo on CPU)
    python demo.py --out runs/ablation --ablation_seeds 3 --reuse    # make ablation: GRPO's selection and
                                         # normalization, 3 seeds each, from one SFT policy and reward model
    python demo.py --out runs/demo --frontier_seeds 2 --reuse        # make frontier: DPO and GRPO grids and
                                         # best-of-n on gold reward against KL (evaluation/frontier.py)

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
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent


def run_stage(script: str, args: dict, nproc: int) -> None:
    # Every demo stage starts from scratch: its folder under --out is the demo's own, and the scripts refuse
    # --resume false on top of existing checkpoints (they would be overwritten).
    shutil.rmtree(args["out_dir"], ignore_errors=True)
    cmd = (
        [sys.executable, script]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", script]
    )
    for k, v in args.items():
        cmd += [f"--{k}", str(v)]
    print("\n$ " + " ".join(cmd[1:] if nproc == 1 else ["torchrun", *cmd[3:]]), flush=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc))),
    }
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


@torch.no_grad()
def sample_summaries(
    policy_dir: Path, prompts_file: Path, n_prompts: int, samples: int, max_new_tokens: int, seed: int
) -> list[tuple[str, list[str]]]:
    """(prompt, [summary text]) for the first `n_prompts` prompts of a file, `samples` summaries each, sampled at
    temperature 1. A summary ends with "\n" exactly when the policy stopped by itself (EOS counts as "\n")."""
    from data.tldr import PROMPT_COLUMNS, PromptDataset, load_rows, pad_prompts
    from data.tokenizer import get_tokenizer
    from model.sampler import END_ID
    from model.weights import build_policy
    from rollouts.sampling import sample_responses

    tok = get_tokenizer()
    rows = load_rows(str(prompts_file), "train", PROMPT_COLUMNS)[:n_prompts]
    ds = PromptDataset(rows, tok, 256)
    model = build_policy(str(policy_dir))
    ids, mask = pad_prompts(ds.prompts)  # (B, P) left-padded; each call of 32 prompts is cut to its own padding
    out = sample_responses(
        model, ids, mask, samples, max_new_tokens, prompts_per_call=32, generator=torch.Generator().manual_seed(seed)
    )
    texts = []
    for n in range(out.response_ids.shape[0]):
        resp = out.response_ids[n][out.response_mask[n]].tolist()
        if out.has_end[n] and resp[-1] != END_ID:
            resp = resp[:-1] + [END_ID]
        texts.append(tok.decode(resp))
    return [(ds.texts[b], texts[b * samples : (b + 1) * samples]) for b in range(len(ds))]


def gold_of_samples(
    policy_dir: Path, prompts_file: Path, n_prompts: int, samples: int, max_new_tokens: int, seed: int
) -> dict:
    """Means over summaries sampled (temperature 1) from a policy on held-out prompts: the gold reward and each of
    its parts (items_correct, items_invented, words, ended; data.synthetic.gold_parts)."""
    from data.synthetic import gold_parts, gold_reward

    drawn = sample_summaries(policy_dir, prompts_file, n_prompts, samples, max_new_tokens, seed)
    pairs = [(prompt, text) for prompt, texts in drawn for text in texts]
    parts = [gold_parts(prompt, text) for prompt, text in pairs]
    out = {"gold_reward": sum(gold_reward(prompt, text) for prompt, text in pairs) / len(pairs)}
    return out | {name: sum(p[name] for p in parts) / len(parts) for name in parts[0]}


@torch.no_grad()
def score_margins(score, triples: list[tuple[list[int], list[int], list[int]]]) -> torch.Tensor:
    """score(prompt + first) - score(prompt + second) for each (prompt, first, second) of token ids, in batches of 32
    collate_pairs rows; `score` maps such a batch to a score per row."""
    from data.tldr import collate_pairs

    margins = []
    for i in range(0, len(triples), 32):
        batch = collate_pairs(*zip(*triples[i : i + 32], strict=True))
        r = score(batch)
        margins.append(r[: batch["n_pairs"]] - r[batch["n_pairs"] :])
    return torch.cat(margins)


@torch.no_grad()
def swap_accuracy(score, pairs_file: Path, seed: int) -> float:
    """How often `score` (a collate_pairs batch -> a score per row) puts a summary above the same summary with one key
    item swapped for an invented one (data.synthetic.swap_key_item), over the summaries of a labelled-pairs file that
    name a key item: 1 when the scorer checks every item against the post, 0.5 when it cannot tell a key item from an
    invented one (it counts items)."""
    import random

    from data.synthetic import swap_key_item
    from data.tldr import encode_prompt, encode_response
    from data.tokenizer import get_tokenizer

    tok, rng = get_tokenizer(), random.Random(f"demo-swap/{seed}")
    triples = []
    for line in open(pairs_file, encoding="utf-8"):
        row = json.loads(line)
        for text in (row["chosen"], row["rejected"]):
            swapped = swap_key_item(row["prompt"], text, rng)
            if swapped is not None:
                triples.append(
                    (
                        encode_prompt(tok, row["prompt"], 192),
                        encode_response(tok, text, 32),
                        encode_response(tok, swapped, 32),
                    )
                )
    return int((score_margins(score, triples) > 0).sum()) / len(triples)


def reward_probes(out: Path, pairs_file: Path, prompts_file: Path, seed: int) -> dict:
    """swap_accuracy of the reward model (its score), of DPO's implicit reward (log pi_dpo - log pi_sft of the
    summary; beta does not change the order) and of the SFT policy's own log-likelihood of the summary (which
    prefers the item it would copy); and the reward model's appended_item_gains on the first 200 prompts of
    `prompts_file`, in its normalised units (the std of its rewards over SFT samples: what GRPO reads)."""
    from evaluation.preference import response_logprobs, reward_scores
    from model.weights import build_policy, build_reward_model

    rm = build_reward_model(str(out / "rm" / "hf")).eval()
    dpo, sft = build_policy(str(out / "dpo" / "hf")).eval(), build_policy(str(out / "sft" / "hf")).eval()
    gains = appended_item_gains(lambda b: rm.normalize(reward_scores(rm, b, "cpu")), prompts_file, 200, seed)
    return {
        "rm_swap_accuracy": swap_accuracy(lambda b: reward_scores(rm, b, "cpu"), pairs_file, seed),
        "dpo_swap_accuracy": swap_accuracy(
            lambda b: response_logprobs(dpo, b, "cpu") - response_logprobs(sft, b, "cpu"), pairs_file, seed
        ),
        "sft_swap_accuracy": swap_accuracy(lambda b: response_logprobs(sft, b, "cpu"), pairs_file, seed),
        "rm_append_correct": gains["append_correct"],
        "rm_append_invented": gains["append_invented"],
    }


@torch.no_grad()
def appended_item_gains(score, prompts_file: Path, n_prompts: int, seed: int) -> dict:
    """What `score` (a collate_pairs batch -> a score per row) gains by appending the post's feeling to a summary
    naming its person and object, and by appending an invented feeling (data.synthetic.appended_item_summaries; gold
    +1 and -1), means over the first `n_prompts` prompts of a file: (append_correct, append_invented). A scorer that
    checks items gives the first > 0 > the second; one that pays for naming items gives both > 0, and GRPO against
    it gains by naming more items, invented or not."""
    import random

    from data.synthetic import appended_item_summaries
    from data.tldr import PROMPT_COLUMNS, encode_prompt, encode_response, load_rows
    from data.tokenizer import get_tokenizer

    tok, rng = get_tokenizer(), random.Random(f"demo-append/{seed}")
    prompts = [row["prompt"] for row in load_rows(str(prompts_file), "train", PROMPT_COLUMNS)[:n_prompts]]
    quads = [
        (encode_prompt(tok, p, 192), *(encode_response(tok, s, 32) for s in appended_item_summaries(p, rng)))
        for p in prompts
    ]  # (prompt, base, right, invented)
    right = score_margins(score, [(p, r, b) for p, b, r, _ in quads])
    invented = score_margins(score, [(p, i, b) for p, b, _, i in quads])
    return {"append_correct": float(right.double().mean()), "append_invented": float(invented.double().mean())}


def label_policy_pairs(
    policy_dir: Path,
    prompts_file: Path,
    n_prompts: int,
    out_file: Path,
    label_noise: float,
    seed: int,
    swap_pairs: bool = False,
    samples: int = 8,
) -> tuple[int, int]:
    """Preference pairs of the policy's own summaries (`samples` per prompt), labelled by the gold reward (the
    stand-in for human labellers; data.synthetic.label_pairs), as in summarize-from-feedback where labellers compare
    samples of the SFT policy. Written in the trl-lib/tldr-preference layout (plus a "swap" column); returns (pairs,
    swap pairs among them)."""
    import random

    from data.synthetic import label_pairs

    rng = random.Random(f"demo-pairs/{seed}/{out_file.name}")
    swap_rng = random.Random(f"demo-swaps/{seed}/{out_file.name}") if swap_pairs else None  # the labels do not move
    rows = []
    for prompt, texts in sample_summaries(policy_dir, prompts_file, n_prompts, samples, 32, seed):
        rows += label_pairs(prompt, texts, label_noise, rng, swap_rng)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with open(out_file, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows), sum(row["swap"] for row in rows)


def train_sft_and_reward_model(out: Path, paths: dict, pairs: dict, args, common: dict) -> None:
    """Stages 2-4 of the demo: SFT, pairs of SFT samples labelled by the gold reward, the reward model. With --reuse,
    each of the three that --out already holds (sft/hf, data/policy_pairs, rm/hf) is kept instead; a stage after one
    that was redone is redone too."""
    # 2. SFT
    reuse = args.reuse and found("the SFT policy", out / "sft" / "hf")
    if not reuse:
        run_sft(out, paths, args, common)

    # 3. preference pairs of the SFT policy's own summaries, labelled by the gold reward with 10% label noise
    reuse = reuse and found("the labelled pairs", pairs["validation"])  # written after the training pairs
    if not reuse:
        n_train, n_swaps = label_policy_pairs(
            out / "sft" / "hf",
            paths["prompts_train"],
            args.pair_prompts,
            pairs["train"],
            0.1,
            args.seed,
            swap_pairs=args.swap_pairs,
        )
        n_val, _ = label_policy_pairs(
            out / "sft" / "hf", paths["preference_validation"], 200, pairs["validation"], 0.1, args.seed + 1
        )  # validation: the sampled pairs only
        print(
            f"labelled {n_train} training pairs ({n_swaps} of them swap pairs) and {n_val} validation pairs of SFT "
            "samples by the gold reward",
            flush=True,
        )

    # 4. reward model on those pairs, normalised on samples of the SFT policy
    if not (reuse and found("the reward model", out / "rm" / "hf")):
        run_reward_model(out, pairs, args, common)


def found(what: str, path: Path) -> bool:
    """Whether `path` exists; says that it is reused when it does."""
    if path.exists():
        print(f"reusing {what}: {path}", flush=True)
    return path.exists()


def run_sft(out: Path, paths: dict, args, common: dict) -> None:
    run_stage("sft.py", sft_options(out, paths, args) | common, args.nproc)


def sft_options(out: Path, paths: dict, args) -> dict:
    """sft.py's options in the demo: the tiny preset from random weights on the task's SFT rows."""
    return {
        "model": args.model,
        "random_init": "true",
        "train_data": paths["sft_train"],
        "val_data": paths["sft_validation"],
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
        "out_dir": out / "sft",
        "run_name": "demo-sft",
    }


def run_reward_model(out: Path, pairs: dict, args, common: dict) -> None:
    run_stage("reward_model.py", reward_model_options(out, pairs, args) | common, args.nproc)


def reward_model_options(out: Path, pairs: dict, args) -> dict:
    """reward_model.py's options in the demo: from the SFT policy, on the labelled pairs of its own samples, normalised
    on its samples."""
    return {
        "model": out / "sft" / "hf",
        "train_data": pairs["train"],
        "val_data": pairs["validation"],
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
        "out_dir": out / "rm",
        "run_name": "demo-rm",
    }


def dpo_options(out: Path, pairs: dict, args) -> dict:
    """dpo.py's options in the demo: DPO from the SFT policy against a frozen copy of it, on the labelled pairs."""
    return {
        "model": out / "sft" / "hf",
        "train_data": pairs["train"],
        "val_data": pairs["validation"],
        "val_rows": 256,
        "steps": args.dpo_steps,
        "batch_size": 32,
        "micro_batch_size": 32 // args.nproc,
        "lr": 5e-4,
        "beta": 0.1,
        "warmup_steps": 5,
        "eval_every": 50,
        "save_every": 0,
        "max_prompt_len": 192,
        "max_response_len": 32,
        "wandb_mode": args.wandb_mode,
        "seed": args.seed,
        "resume": "false",
    }


def grpo_options(out: Path, paths: dict, pairs: dict, args) -> dict:
    """grpo.py's options in the demo: GRPO from the SFT policy against the reward model, with the gold reward and its
    parts watched (logged), never trained on."""
    return {
        "model": out / "sft" / "hf",
        "reward_model": out / "rm" / "hf",
        "train_data": paths["prompts_train"],
        "val_data": paths["sft_validation"],
        "pref_data": pairs["validation"],
        "pref_rows": 256,
        "val_rows": 64,
        "num_samples": 16,
        "num_kept": 8,
        "max_new_tokens": 24,
        "max_prompt_len": 192,
        "prompts_per_step": 16,
        "micro_batch_size": 64,
        "steps": args.grpo_steps,
        "lr": 3e-4,
        "warmup_steps": 3,
        "beta": 0.4,
        "missing_end_penalty": 2.0,
        "eval_every": 10,
        "save_every": 0,
        "table_every": 10,
        "gold_reward_fn": "data.synthetic:gold_reward",
        "gold_parts_fn": "data.synthetic:gold_parts",
        "wandb_mode": args.wandb_mode,
        "seed": args.seed,
        "resume": "false",
    }


# The method's two claims, each variant against the demo's GRPO (RSO keeps 8 of 16 samples per prompt at beta_rs 2,
# global normalization on): uniform and top_bottom keep 8 of 16 as well; all keeps the 16 (it cannot keep fewer).
# After group normalization with the std, global normalization only rescales every advantage by about
# sqrt(K / (K - 1)) (tests/test_grpo_math.py), so it is also switched on and off after Dr. GRPO's centring, where it
# sets the batch's scale.
ABLATION = {
    "rso": {"selection": "rso", "global_norm": "true", "scale_by_std": "true"},
    "uniform": {"selection": "uniform", "global_norm": "true", "scale_by_std": "true"},
    "top_bottom": {"selection": "top_bottom", "global_norm": "true", "scale_by_std": "true"},
    "all": {"selection": "all", "global_norm": "true", "scale_by_std": "true"},
    "rso_no_global_norm": {"selection": "rso", "global_norm": "false", "scale_by_std": "true"},
    "rso_centred": {"selection": "rso", "global_norm": "true", "scale_by_std": "false"},
    "rso_centred_no_global_norm": {"selection": "rso", "global_norm": "false", "scale_by_std": "false"},
}
ABLATION_METRICS = [
    "reward/gold_mean",
    "gold/items_correct",
    "gold/items_invented",
    "reward/mean",
    "train/kl",
    "eval/pref_accuracy",
]


def ablation(out: Path, paths: dict, pairs: dict, args) -> str:
    """GRPO once per variant of ABLATION and seed (--ablation_seeds), every run from the same SFT policy and reward
    model, each with a wandb group (its variant) and tags; then the comparison table and curves
    (evaluation/compare.py), also as TensorBoard events in --out/ablation and, with --wandb_mode, a wandb run in the
    group "ablation". Returns the table (markdown)."""
    from evaluation.compare import group_runs, load_run, plot, table
    from utils.logging import markdown_rows, publish_picture

    unknown = sorted(set(args.ablation_variants) - set(ABLATION))
    if unknown:
        raise SystemExit(f"--ablation_variants: unknown {', '.join(unknown)}; expected some of {', '.join(ABLATION)}")
    dirs = []
    for name in args.ablation_variants:
        options = ABLATION[name]
        for seed in range(args.ablation_seeds):
            run_dir = out / "ablation" / name / f"seed{seed}"
            tags = ",".join(f"{k}={v}" for k, v in options.items())
            run_stage(
                "grpo.py",
                grpo_options(out, paths, pairs, args)
                | options
                | {
                    "seed": seed,
                    "out_dir": run_dir,
                    "run_name": f"ablation-{name}-{seed}",
                    "wandb_group": f"ablation-{name}",
                    "wandb_tags": tags,
                },
                args.nproc,
            )
            dirs.append(run_dir)
    groups = group_runs([load_run(d) for d in dirs])
    text = table(groups, ABLATION_METRICS, set(), last=5)
    Path(args.assets).mkdir(parents=True, exist_ok=True)
    plot(
        groups,
        ["reward/gold_mean", "gold/items_correct", "reward/mean"],
        Path(args.assets) / "ablation.png",
        "train/kl",
        5,
    )
    (out / "ablation.md").write_text(text + "\n")
    publish_picture(
        Path(args.assets) / "ablation.png",
        out / "ablation",
        "ablation",
        markdown_rows(text),
        wandb_mode=args.wandb_mode,
        wandb_group="ablation",
    )
    return text


# The reward-KL frontier (make frontier): GRPO with the method's defaults (RSO keeps 8 of 64 samples per prompt at
# beta_rs 2, global normalization on) over a grid of its KL coefficient, and with uniform selection at the grid's first
# coefficient for contrast; DPO over a grid of beta; best-of-n from the SFT policy as the baseline.
FRONTIER_SELECTIONS = ("rso", "uniform")


def frontier(out: Path, paths: dict, pairs: dict, args) -> str:
    """Every run of the frontier's grids (--frontier_grpo_betas with RSO, the first of them with uniform selection,
    --frontier_dpo_betas; --frontier_seeds seeds each) from the SFT policy and reward model in --out, each measured
    at every evaluation on the first --frontier_prompts held-out posts (dpo.py / grpo.py --frontier_prompts: KL to
    the SFT policy, gold and proxy reward of --frontier_samples temperature-1 samples per post); best-of-n from the
    SFT policy on the same posts; then frontier.md (the table), frontier.json (every point) and assets/frontier.png,
    rewritten after every run so that a run cut short keeps what it measured; at the end the picture and the table also
    as TensorBoard events in --out/frontier and, with --wandb_mode, a wandb run in the group "frontier". Returns the
    table (markdown)."""
    from data.synthetic import gold_reward
    from data.tokenizer import get_tokenizer
    from evaluation.frontier import best_of_n, frontier_points, frontier_table, load_frontier_prompts, plot_frontier
    from model.weights import build_policy, build_reward_model
    from utils.dist import stream
    from utils.logging import markdown_rows, publish_picture

    root = out / "frontier"
    root.mkdir(parents=True, exist_ok=True)
    measured = {
        "frontier_prompts": args.frontier_prompts,
        "frontier_samples": args.frontier_samples,
        "frontier_data": paths["sft_validation"],
        "frontier_reward_model": out / "rm" / "hf",
        "frontier_gold_fn": "data.synthetic:gold_reward",
        "frontier_max_new_tokens": 24,  # the demo's GRPO length, and its gold evaluation's
    }

    # best-of-n from the SFT policy: one pass of --frontier_best_of samples per post
    t0 = time.time()
    tok = get_tokenizer()
    prompts = load_frontier_prompts(str(paths["sft_validation"]), "validation", args.frontier_prompts, tok, 192, 24)
    curve = best_of_n(
        build_policy(str(out / "sft" / "hf")).eval(),
        prompts,
        build_reward_model(str(out / "rm" / "hf")).eval(),
        tok,
        stream(args.seed, 0, 0, "best-of-n"),
        24,
        n_max=args.frontier_best_of,
        gold_fn=gold_reward,
    )
    print(f"best-of-n from the SFT policy, n up to {args.frontier_best_of}: {time.time() - t0:.0f} s", flush=True)

    methods: dict[str, list[list[dict]]] = {}

    def record() -> str:
        text = frontier_table(curve, methods)
        (root / "frontier.md").write_text(text + "\n")
        (root / "frontier.json").write_text(json.dumps({"best_of_n": curve, "methods": methods}, indent=1))
        plot_frontier(
            curve,
            methods,
            Path(args.assets) / "frontier.png",
            f"embedded task: {args.frontier_prompts} held-out posts x {args.frontier_samples} samples per point "
            f"(best-of-n: x {args.frontier_best_of}); error bars 1 standard error; one line per seed",
        )
        return text

    # the first grid point of the method, of DPO and of the contrast, then the rest of the grids, every seed of a run
    # before the next: a frontier cut short has one point of each method with all its seeds
    first_grpo, first_dpo = args.frontier_grpo_betas[0], args.frontier_dpo_betas[0]
    runs = [("grpo", FRONTIER_SELECTIONS[0], first_grpo), ("dpo", "", first_dpo)]
    runs += [("grpo", selection, first_grpo) for selection in FRONTIER_SELECTIONS[1:]]
    runs += [("grpo", FRONTIER_SELECTIONS[0], beta) for beta in args.frontier_grpo_betas[1:]]
    runs += [("dpo", "", beta) for beta in args.frontier_dpo_betas[1:]]
    for (stage, selection, beta), seed in itertools.product(runs, range(args.frontier_seeds)):
        kept = f"{args.frontier_grpo_samples}->8"
        name = f"GRPO {selection} {kept}, beta {beta:g}" if stage == "grpo" else f"DPO beta {beta:g}"
        run_dir = root / (f"grpo_{selection}_beta{beta:g}" if stage == "grpo" else f"dpo_beta{beta:g}") / f"seed{seed}"
        frontier_run(stage, selection, beta, seed, run_dir, out, paths, pairs, args, measured)
        methods.setdefault(name, []).append(frontier_points(run_dir))
        record()
    text = record()
    publish_picture(
        Path(args.assets) / "frontier.png",
        root,
        "frontier",
        markdown_rows(text),
        wandb_mode=args.wandb_mode,
        wandb_group="frontier",
    )
    return text


def frontier_run(stage, selection, beta, seed, run_dir: Path, out: Path, paths: dict, pairs: dict, args, measured):
    """One run of the frontier's grids: grpo.py (with `selection`) or dpo.py at KL coefficient `beta`, seed `seed`,
    in `run_dir`, measured at every evaluation (`measured`: the --frontier_* options)."""
    if stage == "grpo":
        options = grpo_options(out, paths, pairs, args) | {
            "num_samples": args.frontier_grpo_samples,
            "selection": selection,
        }
    else:
        steps = args.frontier_dpo_steps
        options = dpo_options(out, pairs, args) | {"steps": steps, "eval_every": max(1, steps // 3)}
    if args.frontier_eval_rows:
        options |= {"val_rows": args.frontier_eval_rows} | (
            {"pref_rows": args.frontier_eval_rows} if stage == "grpo" else {}
        )
    tags = f"{stage}={selection or 'dpo'},beta={beta:g}"
    run_stage(
        f"{stage}.py",
        options
        | measured
        | {
            "beta": beta,
            "seed": seed,
            "out_dir": run_dir,
            "run_name": f"frontier-{run_dir.parent.name}-{seed}",
            "wandb_group": f"frontier-{run_dir.parent.name}",
            "wandb_tags": tags,
        },
        args.nproc,
    )


def summarize(out: Path, paths: dict, pairs: dict, args: argparse.Namespace, t0: float) -> None:
    """Stage 7: what each stage learned, as summary.json, a table on the terminal, the pipeline diagram and the demo's
    curves."""

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
    summary = {
        "rm_accuracy": last("rm", "val/accuracy"),
        **reward_probes(out, pairs["validation"], paths["sft_validation"], args.seed),
        "dpo_accuracy": last("dpo", "val/accuracy"),
        **{f"{stage}_{name}": value for stage, parts in golds.items() for name, value in parts.items()},
        "grpo_kl": sum(r["train/kl"] for r in tail) / len(tail),
        "grpo_proxy_reward": sum(r["reward/mean"] for r in tail) / len(tail),
        "grpo_pref_accuracy": last("grpo", "eval/pref_accuracy"),
        "seconds": time.time() - t0,
    }
    from evaluation.plots import demo_curves, pipeline_diagram

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
        "--reuse",
        action="store_true",
        help="reuse --out's SFT policy, labelled pairs and reward model "
        "(sft/hf, data/policy_pairs, rm/hf), each that exists, instead of training them again (a stage after "
        "one that is redone is redone too)",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    from utils.host import cpu_memory_settings

    cpu_memory_settings()  # the demo's own sampling and scoring run here, on the CPU (utils/host.py)
    t0 = time.time()
    out = Path(args.out)
    common = {"wandb_mode": args.wandb_mode, "seed": args.seed, "resume": "false"}

    # 1. the synthetic task
    from data.synthetic import write_task

    paths = write_task(out / "data", seed=args.seed)

    # 2.-4. SFT, pairs of SFT samples labelled by the gold reward, reward model (or, with --reuse, the ones in --out)
    pairs = {
        "train": out / "data" / "policy_pairs" / "train.jsonl",
        "validation": out / "data" / "policy_pairs" / "validation.jsonl",
    }
    train_sft_and_reward_model(out, paths, pairs, args, common)
    if args.frontier_seeds > 0:
        text = frontier(out, paths, pairs, args)
        print(
            f"\n{text}\n\nwrote {out / 'frontier'} and {Path(args.assets) / 'frontier.png'} ({time.time() - t0:.0f} s)"
        )
        return
    if args.ablation_seeds > 0:
        text = ablation(out, paths, pairs, args)
        print(
            f"\n{text}\n\nwrote {out / 'ablation.md'} and {Path(args.assets) / 'ablation.png'} "
            f"({time.time() - t0:.0f} s)"
        )
        return

    # 5. DPO from the SFT policy against a frozen copy of it, on the same pairs
    run_stage("dpo.py", dpo_options(out, pairs, args) | {"out_dir": out / "dpo", "run_name": "demo-dpo"}, args.nproc)

    # 6. GRPO from the SFT policy against the reward model; the gold reward is only watched, never trained on
    run_stage(
        "grpo.py",
        grpo_options(out, paths, pairs, args) | {"out_dir": out / "grpo", "run_name": "demo-grpo"},
        args.nproc,
    )

    # 7. what each stage learned
    summarize(out, paths, pairs, args, t0)


if __name__ == "__main__":
    main()

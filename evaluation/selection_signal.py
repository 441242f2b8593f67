"""What each selection hands the update, measured against a gold reward before any training: a pool of G samples of
each held-out post from a policy at temperature 1, scored by the training reward (the reward model's normalized score
of the raw score minus --missing_end_penalty without an end token, as grpo.py scores) and by the gold reward; then
each selection keeps K of every pool, the advantage estimator turns the kept rewards into advantages (with
--global_norm over batches of --prompts_per_step posts, as a step does), and rlhf.selection.gold_alignment says
how the kept samples and their advantages line up with gold (the training reward's own shift beside it). Random
selections are drawn --draws times on the same pools, from a generator of their own (seeded from --seed and the
selection's name, so a row does not depend on --selections' order), and averaged per post; every selection sees the
same pools, so each row's signal minus uniform's is a paired difference over posts. Each ± is a standard error over
the batches of --prompts_per_step posts, not over posts: a batch's posts share one whitening and the signal's rms.

    python -m evaluation.selection_signal --policy runs/demo/sft/hf --reward_model runs/demo/rm/hf \\
        --data runs/demo/verdict/data/sft/validation.jsonl --gold_fn data.synthetic:gold_reward
    python -m evaluation.selection_signal --policy runs/demo/sft/hf --reward gold \\
        --data runs/demo/verdict/data/sft/validation.jsonl --gold_fn data.synthetic:gold_reward

The gold signal weighs every kept sample as an outcome of its own and of equal weight (gold_alignment's docstring
says where that fails), and it falls with the tilt for any reward, gold included: selecting on a reward shrinks the
kept set's range, so group-centred advantages carry less of any outcome. The second command is that null (--reward
gold: no reward-model error at all); a row says something of the reward model only against its null row. The kept
corr(reward, gold) is range-restricted the same way; the kept slope of gold on the reward (kept_slope) is not, and
reads the reward model's quality where each selection keeps (1 under --reward gold).

docs/results.md ("RSO against uniform selection") reads its table for the verdict's policy and posts."""

import argparse
import json
import math
from pathlib import Path

import torch

from evaluation.measure import load_frontier_prompts, score_samples
from evaluation.samples import sample_summaries
from rlhf.advantages import ADVANTAGES, advantages
from rlhf.policy_gradient import penalize_missing_end
from rlhf.rewards import load_function
from rlhf.selection import SELECTIONS, gold_alignment, kept_slope, select
from utils.config import ConfigError
from utils.dist import stream
from utils.logging import EvalProgress

DEFAULT_SELECTIONS = ("uniform", "rso:8", "rso:2", "rso:0.5", "top", "top_bottom", "all")
COLUMNS = {  # statistic: its heading
    "reward_shift": "reward shift (pool sd)",
    "gold_shift": "gold shift (pool sd)",
    "logp_shift": "log-prob shift (pool sd)",
    "gold_std_ratio": "gold spread, kept / pool",
    "corr": "corr(reward, gold), kept",
    "slope": "slope of gold on reward, kept",
    "signal": "gold signal",
}


def parse_selection(spec: str) -> tuple[str, float]:
    """'rso:2' -> ('rso', 2.0); 'uniform' -> ('uniform', 0.0). The name must be registered (--selection's choices)."""
    name, _, beta = spec.partition(":")
    if name not in SELECTIONS:
        raise ConfigError(f"--selections: unknown selection {name!r} in {spec!r}; registered: {sorted(SELECTIONS)}")
    try:
        value = float(beta) if beta else 0.0
    except ValueError:
        raise ConfigError(f"--selections: {spec!r} needs a number after ':' (RSO's beta_rs), e.g. rso:2") from None
    if name == "rso" and not value > 0:
        raise ConfigError(f"--selections: {spec!r}: RSO needs beta_rs > 0, written rso:BETA (e.g. rso:2)")
    return name, value


def selection_stats(
    reward_PG: torch.Tensor,
    gold_PG: torch.Tensor,
    logp_PG: torch.Tensor,
    selection: str,
    beta_rs: float,
    kept: int,
    estimator: str,
    global_norm: bool,
    batch: int,
    draws: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Per post (P,) float64: each statistic of gold_alignment, reward_shift and logp_shift (the same shift of
    the training reward and of each sample's log-probability under the policy, `logp_PG`: the kept mean above the
    pool's, in pool standard deviations) and slope (kept_slope of the post's batch, the same for each of its posts),
    averaged over `draws` selections of the same pools (NaN where a post's statistic is undefined on every draw; top
    and top_bottom, deterministic, are drawn once). Advantages (and --global_norm's whitening) are computed over
    consecutive batches of `batch` posts, as over a step's batch; gold_alignment's signal divides by that batch's rms
    and gold spread, so a batch's posts are not independent (mean_se's errors are over batches). `generator` draws
    the random selections: one per selection (selection_generator), so a row does not depend on which others ran."""
    P = reward_PG.shape[0]
    keeps_all = SELECTIONS.facts[selection].get("keeps_all", False)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    for _ in range(1 if keeps_all or selection in ("top", "top_bottom") else draws):  # the others are random
        for start in range(0, P, batch):
            r, g, lp = (t[start : start + batch] for t in (reward_PG, gold_PG, logp_PG))
            idx, _ = select(r, selection, kept, beta_rs, generator)
            r_K, g_K = r.gather(1, idx), g.gather(1, idx)
            a = advantages(r_K, estimator, global_norm, pool_BG=r).view_as(r_K)
            values = gold_alignment(g, r_K, g_K, a)
            values["reward_shift"] = gold_alignment(r, r_K, r_K, a)["gold_shift"]  # the same formula on the reward
            values["logp_shift"] = gold_alignment(lp, r_K, lp.gather(1, idx), a)["gold_shift"]  # and the log-prob
            values["slope"] = kept_slope(r, g, r_K, g_K).expand(r.shape[0])  # the batch's, on each of its posts
            for name, v in values.items():
                sums.setdefault(name, torch.zeros(P, dtype=torch.float64))[start : start + batch] += v.nan_to_num()
                counts.setdefault(name, torch.zeros(P, dtype=torch.float64))[start : start + batch] += ~v.isnan()
    return {name: sums[name] / counts[name] for name in sums}  # 0 / 0: NaN where every draw was undefined


def selection_generator(seed: int, spec: str) -> torch.Generator:
    """The generator of one selection's random draws, from the seed and the selection's name as written ('rso:2'):
    each row's draws are its own, whichever selections run beside it and in whatever order."""
    return stream(seed, 0, 0, "selection-signal-draws", spec)


def mean_se(values: torch.Tensor, batch: int) -> tuple[float, float]:
    """Mean over the posts where the value is defined, and its standard error over the batches of `batch` consecutive
    posts (the clusters: a batch's posts share one whitening, rms and gold spread, so posts are not independent):
    sqrt(n / (n - 1) * sum_b (S_b - N_b * mean)^2) / N, S_b and N_b the sum and count of batch b's defined values,
    N = sum_b N_b, n the batches holding one (with equal N_b, the standard deviation of the batch means over sqrt n).
    NaN below two such batches."""
    defined = ~values.isnan()
    sums = torch.stack([v.sum() for v in values.nan_to_num().split(batch)])  # (n_batches,)
    counts = torch.stack([d.sum() for d in defined.split(batch)]).double()  # (n_batches,)
    sums, counts = sums[counts > 0], counts[counts > 0]
    if not len(counts):
        return float("nan"), float("nan")
    mean = float(sums.sum() / counts.sum())
    n = len(counts)
    if n < 2:
        return mean, float("nan")
    return mean, float((n / (n - 1) * ((sums - counts * mean) ** 2).sum()).sqrt() / counts.sum())


def signal_table(
    per_post: dict[str, dict[str, torch.Tensor]], batch: int, baseline: str = "uniform"
) -> tuple[str, list[dict]]:
    """The markdown table of selection_stats' per-post values of each selection (mean over posts ± standard error over
    batches of `batch` posts; the gold spread as sqrt of the mean variance ratio), with each selection's signal minus
    `baseline`'s, paired over posts, when `baseline` is among them."""
    rows = []
    for name, stats in per_post.items():
        row = {"selection": name, "posts": int((~stats["signal"].isnan()).sum())}
        for key in COLUMNS:
            if key == "gold_std_ratio":
                m, se = mean_se(stats["gold_var_ratio"], batch)
                row[key] = (math.sqrt(m), se / (2 * math.sqrt(m)) if m > 0 else float("nan"))  # the delta method
            else:
                row[key] = mean_se(stats[key], batch)
        if baseline in per_post and name != baseline:
            row["signal_minus_baseline"] = mean_se(stats["signal"] - per_post[baseline]["signal"], batch)
        rows.append(row)
    headings = ["selection", *COLUMNS.values()]
    if baseline in per_post:
        headings.append(f"gold signal - {baseline}'s")
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for row in rows:
        cells = [row["selection"], *(f"{row[k][0]:+.3f} ± {row[k][1]:.3f}" for k in COLUMNS)]
        if baseline in per_post:
            diff = row.get("signal_minus_baseline")
            cells.append(f"{diff[0]:+.3f} ± {diff[1]:.3f}" if diff else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> str:
    """python -m evaluation.selection_signal --policy DIR --reward_model DIR --data SOURCE --gold_fn MODULE:FUNCTION:
    the table of what each selection keeps and hands the update, against gold, on one pool per post."""
    from data.tokenizer import get_tokenizer
    from model.weights import build_policy, build_reward_model, model_config

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--policy", required=True, help="the policy the pools are drawn from (an hf/ folder)")
    p.add_argument(
        "--reward_model", help="the training reward's model (grpo.py's --reward_model); needed unless --reward gold"
    )
    p.add_argument("--data", required=True, help="the posts (a file or a hub dataset with a prompt column)")
    p.add_argument("--split", default="validation", help="split of --data")
    p.add_argument("--prompts", type=int, default=400, help="posts of --data (the first distinct ones)")
    p.add_argument("--gold_fn", required=True, help='the gold reward, "module:function" of (prompt, summary)')
    p.add_argument(
        "--reward",
        default="model",
        choices=("model", "gold"),
        help="what the selections rank by and the advantages are made of: the reward model's score as grpo.py scores "
        "it (model), or the gold reward itself (gold: the null, with no reward-model error, so what is left of a "
        "row's signal is what selecting on any reward does, range restriction; RSO's beta_rs is then in gold's raw "
        "units, where a grpo.py run with rewards = gold_reward whitens gold over its batch first: compare rows at "
        "equal reward shift)",
    )
    p.add_argument("--pool", type=int, default=64, help="samples per post (grpo.py's --num_samples, G)")
    p.add_argument("--kept", type=int, default=8, help="samples each selection keeps (--num_kept, K)")
    p.add_argument(
        "--selections",
        nargs="+",
        default=list(DEFAULT_SELECTIONS),
        help="selections to compare: a registered name, RSO as rso:BETA_RS; 'all' keeps the whole pool",
    )
    p.add_argument("--advantage", default="grpo", choices=sorted(ADVANTAGES), help="the advantage estimator")
    p.add_argument("--global_norm", type=int, choices=(0, 1), default=1, help="whiten advantages over each batch")
    p.add_argument(
        "--prompts_per_step",
        type=int,
        default=16,
        help="posts per batch of --global_norm (a step's); the "
        "± is a standard error over these batches, whose posts share one whitening",
    )
    p.add_argument("--draws", type=int, default=16, help="draws of each random selection on the same pools")
    p.add_argument("--missing_end_penalty", type=float, default=2.0, help="raw-score penalty without an end token")
    p.add_argument("--max_new_tokens", type=int, default=24, help="tokens per summary")
    p.add_argument("--max_prompt_len", type=int, default=192, help="tokens per prompt at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples and of the random selections")
    p.add_argument("--out", default="selection_signal.json", help="the table's rows and settings as JSON")
    args = p.parse_args(argv)
    specs = {spec: parse_selection(spec) for spec in args.selections}
    if not 0 < args.kept <= args.pool:
        p.error(f"--kept must be in [1, --pool={args.pool}], got {args.kept}")
    model_config(args.policy, kind="policy", option="--policy")
    if args.reward == "model":
        if args.reward_model is None:
            p.error("--reward_model is required with --reward model (the default); --reward gold needs none")
        model_config(args.reward_model, kind="reward_model", option="--reward_model")
    gold_fn = load_function(args.gold_fn, "--gold_fn")

    tok = get_tokenizer()
    prompts = load_frontier_prompts(args.data, args.split, args.prompts, tok, args.max_prompt_len, args.max_new_tokens)
    policy = build_policy(args.policy).eval()
    reward_model = build_reward_model(args.reward_model).eval() if args.reward == "model" else None
    progress = EvalProgress("pools", len(prompts.prompts), unit="posts", split=False)
    ids, mask, samples = sample_summaries(
        policy,
        prompts.prompts,
        args.pool,
        args.max_new_tokens,
        generator=stream(args.seed, 0, 0, "selection-signal"),
        on_chunk=progress.advance,
    )
    progress.close()
    values = score_samples(prompts, ids, mask, samples, args.pool, tok, reward_model, gold_fn)
    gold = values["gold"]
    if reward_model is None:  # --reward gold: the null
        reward = gold
    else:
        raw = values["proxy_raw"].flatten()
        penalized = penalize_missing_end(raw, samples.has_end.cpu(), args.missing_end_penalty)
        reward = reward_model.normalize(penalized).double().view(-1, args.pool)  # what grpo.py's selection ranks by
    logp = samples.logprobs.double().sum(1).cpu().view(-1, args.pool)  # log pi(y|x) of each sample, as drawn

    per_post = {
        spec: selection_stats(
            reward,
            gold,
            logp,
            name,
            beta,
            args.kept,
            args.advantage,
            bool(args.global_norm),
            args.prompts_per_step,
            args.draws,
            selection_generator(args.seed, spec),
        )
        for spec, (name, beta) in specs.items()
    }
    table, rows = signal_table(per_post, args.prompts_per_step)
    pool_corr = gold_alignment(gold, reward, gold, torch.zeros_like(reward))["corr"]
    header = (
        f"{len(prompts.prompts)} posts of {args.data}, a pool of {args.pool} from {args.policy} at temperature 1, "
        f"{args.kept} kept, reward {args.reward}, --advantage {args.advantage}, global_norm {bool(args.global_norm)}; "
        f"mean over posts ± standard error over batches of {args.prompts_per_step} posts; corr(reward, gold) over the "
        f"whole pool {mean_se(pool_corr, args.prompts_per_step)[0]:+.3f}"
    )
    settings = vars(args) | {"pool_corr": mean_se(pool_corr, args.prompts_per_step)[0]}
    Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    text = f"{header}\n\n{table}"
    print(f"{text}\n\nwrote {args.out}")
    return text


if __name__ == "__main__":
    from utils.guard import exit_on_error

    with exit_on_error():  # a user error (ConfigError, ModelLoadError, ...): one `error:` line and its exit code
        main()

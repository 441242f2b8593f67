"""The reward-KL frontier: where a policy sits on the gold reward (when the task has one), the proxy reward (the reward
model) and the win rate against reference summaries, against its KL to the reference policy; and best-of-n from the
reference as the baseline (Gao, Schulman and Hilton 2022, arXiv 2210.10760; Rafailov et al. 2023, arXiv 2305.18290,
Fig. 2).

`measure` samples `num_samples` summaries of each held-out prompt from the policy at temperature 1 (the policy's own
distribution, whatever temperature it was trained with) and gives

    KL(pi || pi_ref) = E_x E_{y ~ pi(.|x)} [log pi(y|x) - log pi_ref(y|x)]

estimated by the mean over the samples of the log-ratio, each log-prob summed over the response's tokens (the end
token included; a response cut at the token budget counts its tokens up to the cut), with its standard error
(rlhf.stats.kl_estimate), and the mean gold reward, proxy reward (raw and normalized by the reward model's gain and
bias, no missing-end penalty) and win rate of the same samples, each with its standard error.

`best_of_n` samples 64 (`n_max`) summaries of each prompt from the reference once and keeps, for every n in
1, 2, 4, ..., 64, the one the proxy ranks first among the first n (nested subsets: one sampling pass for the whole
curve); its KL is log n - (n - 1)/n (rlhf.stats.best_of_n_kl, an upper bound).

dpo.py and grpo.py call Frontier.evaluate at every evaluation when --frontier_prompts > 0 (eval/kl, ...);
demo.py --frontier trains the grids and draws the picture (frontier_points, frontier_table, plot_frontier).
"""

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from data.tldr import PROMPT_COLUMNS, PromptDataset, decode_responses, load_optional_column, load_rows
from evaluation.samples import sample_summaries
from evaluation.summaries import reference_summaries
from model.sampler import SampleOutput
from model.weights import build_reward_model, freeze, model_config
from rlhf.logprobs import linear_processed_logprobs
from rlhf.rewards import load_function
from rlhf.stats import best_of_n_index, best_of_n_kl, kl_estimate, mean_and_se, pair_outcomes
from rollouts.models import sharded_module
from rollouts.sampling import model_rows, score
from utils.config import ConfigError
from utils.dist import stream
from utils.fsdp import gathered_params, shard_model
from utils.logging import read_rows

METRICS = ("kl", "gold", "proxy", "proxy_raw", "win_rate")
"""What measure() reports, each with its standard error (name + "_se"); gold and win_rate only when they apply."""


@dataclass
class FrontierConfig:
    # --- evaluation and logging
    frontier_prompts: int = 0
    """Held-out prompts (the first N of --frontier_data) on which every evaluation also measures the policy's KL to
    its reference and the reward of its temperature-1 samples (eval/kl, eval/kl_se, eval/gold, eval/proxy,
    eval/win_rate_sampled, ...: docs/reporting.md); 0: not measured."""
    frontier_samples: int = 4
    """Summaries sampled at temperature 1 per prompt for --frontier_prompts."""
    frontier_data: str = ""
    """Prompts for --frontier_prompts (a prompt column; a completion column adds the win rate against it): a hub
    dataset name, a .jsonl/.parquet file or a folder; empty: the stage's --val_data (its distinct prompts)."""
    frontier_reward_model: str = ""
    """The proxy reward model (reward_model.py's hf/ folder) scoring the samples; empty: grpo.py's --reward_model,
    dpo.py's --judge, or none."""
    frontier_gold_fn: str = ""
    """A gold reward "module:function" of (prompt, summary) scoring the samples (the embedded task's:
    data.synthetic:gold_reward); empty: grpo.py's --gold_reward_fn, or none."""
    frontier_max_new_tokens: int = 0
    """Tokens of each sampled summary at most, the end token included; 0: the stage's response length."""

    def frontier_limits(self, policy_cfg, response: str) -> list[tuple]:
        """utils.config.fit_context's limits of the frontier's sampled summaries (--frontier_max_new_tokens, else the
        stage's `response` option) in the policy and --frontier_reward_model; none without --frontier_prompts. Checks
        that --frontier_reward_model is a reward model holding its normalisation (model.weights.model_config): its
        proxy is logged normalized."""
        if self.frontier_prompts <= 0:
            return []
        length = "frontier_max_new_tokens" if self.frontier_max_new_tokens else response
        limits = [(policy_cfg, length, "policy")]
        if self.frontier_reward_model:
            rm_cfg = model_config(self.frontier_reward_model, kind="reward_model", option="--frontier_reward_model")
            limits.append((rm_cfg, length, "frontier reward model"))
        return limits

    def validate_frontier(self) -> None:
        for name in ("frontier_prompts", "frontier_max_new_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.frontier_samples < 1:
            raise ConfigError(f"--frontier_samples must be >= 1, got {self.frontier_samples}")


@dataclass
class FrontierPrompts:
    """Held-out prompts: token ids, texts, and the reference summaries (as sampler output) when the rows have them."""

    prompts: list[list[int]]
    texts: list[str]
    references: SampleOutput | None = None


def load_frontier_prompts(
    source: str, split: str, n: int, tok, max_prompt_len: int, max_new_tokens: int
) -> FrontierPrompts:
    """The first n distinct prompts of `source` (a preference file repeats a prompt for each of its pairs), with
    their `completion` (cut to max_new_tokens) when every one of them has one."""
    rows = load_rows(source, split, PROMPT_COLUMNS)
    completions = load_optional_column(source, split, "completion")
    first: dict[str, int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row["prompt"], i)
        if len(first) == n:
            break
    index = list(first.values())
    dataset = PromptDataset([rows[i] for i in index], tok, max_prompt_len, name=f"{source}[{split}]")
    references = None
    if completions is not None and all(isinstance(completions[i], str) and completions[i].strip() for i in index):
        references = reference_summaries([completions[i] for i in index], tok, max_new_tokens, "cpu")
    return FrontierPrompts(dataset.prompts, dataset.texts, references)


@torch.no_grad()
def sequence_logprobs(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples: SampleOutput, group: int, micro: int = 64
) -> torch.Tensor:
    """log pi(y|x) (N,) fp32 of every sampled response at temperature 1, summed over its tokens (the end token
    included), sample n answering prompt n // group; the LM head runs at the response tokens only, in
    rlhf/logprobs.py's chunked pass. Parameters gathered once (a frozen model, or the policy between updates)."""
    N = samples.response_ids.shape[0]
    out = []
    module = sharded_module(model)  # the policy itself for a LoRA reference (its adapters-off view)
    was_training = module.training
    module.eval()
    with gathered_params(module):
        for s in range(0, N, micro):
            rows = torch.arange(s, min(s + micro, N), device=prompt_ids.device)
            batch = model_rows(
                prompt_ids,
                prompt_mask,
                samples.response_ids[rows],
                samples.response_mask[rows],
                rows // group,
                prefix_sharing=False,
            )
            P, R = batch["prompt_len"], batch["response_ids"].shape[1]
            logp, _ = model(
                batch["input_ids"],
                batch["position_ids"],
                batch["attention_mask"],
                logits_slice=slice(P - 1, P + R - 1),
                head=partial(
                    linear_processed_logprobs, targets_NR=batch["response_ids"], mask_NR=batch["response_mask"]
                ),
            )  # (n, R), 0 at padding
            out.append(logp.float().sum(1))
    module.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def score_samples(
    prompts: FrontierPrompts,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: SampleOutput,
    group: int,
    tok,
    reward_model=None,
    gold_fn=None,
    micro: int = 64,
) -> dict[str, torch.Tensor]:
    """Per-sample values (P, G) of what applies: gold (gold_fn of the prompt and the decoded summary), proxy_raw and
    proxy (the reward model's raw score, and gain * raw + bias), win_rate (1 when the reward model scores the
    summary above the prompt's reference summary, 0 below, 1/2 on a tie)."""
    P = len(prompts.prompts)
    out = {}
    if gold_fn is not None:
        texts = decode_responses(tok, samples.response_ids, samples.response_mask, samples.has_end)
        gold = [float(gold_fn(prompts.texts[n // group], t)) for n, t in enumerate(texts)]
        out["gold"] = torch.tensor(gold, dtype=torch.float64).view(P, group)
    if reward_model is not None:
        raw = score(reward_model, prompt_ids, prompt_mask, samples, group, micro, prefix_sharing=False).double()
        out["proxy_raw"] = raw.cpu().view(P, group)
        out["proxy"] = reward_model.normalize(raw).double().cpu().view(P, group)
        if prompts.references is not None:
            r = prompts.references
            refs = SampleOutput(
                *(t.to(prompt_ids.device) for t in (r.response_ids, r.response_mask, r.logprobs, r.has_end))
            )
            reference_raw = score(reward_model, prompt_ids, prompt_mask, refs, 1, micro, prefix_sharing=False)
            out["win_rate"] = pair_outcomes(out["proxy_raw"], reference_raw.double().cpu()[:, None].expand(P, group))
    return out


@torch.no_grad()
def measure(
    policy,
    reference,
    prompts: FrontierPrompts,
    num_samples: int,
    max_new_tokens: int,
    tok,
    generator: torch.Generator,
    reward_model=None,
    gold_fn=None,
    micro: int = 64,
) -> dict[str, float]:
    """One point on the frontier: `num_samples` summaries of each prompt from the policy at temperature 1; the KL to
    the reference and every value of score_samples, each as a mean with its standard error (rlhf.stats.mean_and_se:
    sampling noise on these prompts). Every rank computes all of it (with the same generator, the same numbers)."""
    ids, mask, samples = sample_summaries(
        policy, prompts.prompts, num_samples, max_new_tokens, temperature=1.0, generator=generator
    )
    P = len(prompts.prompts)
    # log pi(y|x): the sampler's own log-probs of the tokens it drew (temperature 1, no top-k / top-p: the policy's
    # distribution; equal to sequence_logprobs' forward, tests/test_frontier.py), so the policy needs no second pass
    logp = samples.logprobs.double().sum(1).cpu().view(P, num_samples)
    logp_ref = sequence_logprobs(reference, ids, mask, samples, num_samples, micro).cpu().view(P, num_samples)
    kl, kl_se = kl_estimate(logp, logp_ref)
    out = {"kl": kl, "kl_se": kl_se}
    for name, values in score_samples(prompts, ids, mask, samples, num_samples, tok, reward_model, gold_fn).items():
        out[name], out[name + "_se"] = mean_and_se(values)
    out["response_length"] = float(samples.response_mask.double().sum(1).mean())
    return out


class Frontier:
    """--frontier_prompts at every evaluation of a training stage: the prompts, the proxy reward model (sharded like
    the run's models) and the gold function, built once; evaluate() gives the policy's point (a collective under
    FSDP: every rank calls it and computes the same numbers)."""

    EVAL_NAMES = {"win_rate": "win_rate_sampled", "win_rate_se": "win_rate_sampled_se"}
    """Keys renamed in the stage's metrics: grpo.py's eval/win_rate is its greedy summaries'."""

    def __init__(
        self,
        cfg,
        val_data: str,
        val_split: str,
        tok,
        max_prompt_len: int,
        max_new_tokens: int,
        run,
        reward_model=None,
        gold_fn=None,
    ):
        """`reward_model` (built) and `gold_fn` are the stage's own, used when --frontier_reward_model and
        --frontier_gold_fn are empty."""
        self.cfg, self.tok, self.seed, self.device = cfg, tok, cfg.seed, run.device
        self.max_new_tokens = cfg.frontier_max_new_tokens or max_new_tokens
        source = cfg.frontier_data or val_data
        if not source:
            raise ConfigError("--frontier_prompts needs --frontier_data (or the stage's --val_data)")
        self.prompts = load_frontier_prompts(
            source, val_split, cfg.frontier_prompts, tok, max_prompt_len, self.max_new_tokens
        )
        self.reward_model = reward_model
        if cfg.frontier_reward_model:
            # frozen before sharding: shard_model gives a frozen model the hook that empties FSDP2's per-forward records
            self.reward_model = shard_model(freeze(build_reward_model(cfg.frontier_reward_model)), run.dtype)
            self.reward_model.to(run.device)
        self.gold_fn = load_function(cfg.frontier_gold_fn, "--frontier_gold_fn") if cfg.frontier_gold_fn else gold_fn

    @classmethod
    def build(cls, cfg, tok, run, max_new_tokens: int, reward_model=None, gold_fn=None) -> "Frontier | None":
        """The stage's Frontier over its own validation data and prompt length (cfg.val_data, cfg.val_split,
        cfg.max_prompt_len); None without --frontier_prompts."""
        if cfg.frontier_prompts <= 0:
            return None
        args = (cfg.val_data, cfg.val_split, tok, cfg.max_prompt_len, max_new_tokens, run)
        return cls(cfg, *args, reward_model=reward_model, gold_fn=gold_fn)

    def metric_names(self, prefix: str = "eval/") -> set[str]:
        """The metrics evaluate() logs under `prefix`: measure's KL, length and, for each of score_samples' values that
        applies (gold, proxy_raw and proxy, win_rate), its mean and standard error."""
        values = ["gold"] if self.gold_fn is not None else []
        if self.reward_model is not None:
            values += ["proxy_raw", "proxy"] + (["win_rate"] if self.prompts.references is not None else [])
        names = ["kl", "kl_se", "response_length", *values, *(v + "_se" for v in values)]
        renamed = self.EVAL_NAMES | {"response_length": "sampled_length"}
        return {prefix + renamed.get(k, k) for k in names}

    def evaluate(self, policy, reference, step: int, prefix: str = "eval/") -> dict[str, float]:
        generator = stream(self.seed, step, 0, "frontier", device=self.device)  # rank 0's stream on every rank
        out = measure(
            policy,
            reference,
            self.prompts,
            self.cfg.frontier_samples,
            self.max_new_tokens,
            self.tok,
            generator,
            self.reward_model,
            self.gold_fn,
        )
        names = self.EVAL_NAMES | {"response_length": "sampled_length"}
        return {prefix + names.get(k, k): v for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------
# Best-of-n from the reference


@torch.no_grad()
def best_of_n(
    reference,
    prompts: FrontierPrompts,
    reward_model,
    tok,
    generator: torch.Generator,
    max_new_tokens: int,
    n_max: int = 64,
    gold_fn=None,
    micro: int = 64,
) -> list[dict[str, float]]:
    """Best-of-n from the reference for n = 1, 2, 4, ..., n_max: n_max samples of each prompt at temperature 1 (one
    pass), and for each n the sample the proxy (the reward model's raw score) ranks first among the first n kept
    (rlhf.stats.best_of_n_index); its gold, proxy and win rate with standard errors over the prompts
    (mean_and_se of one value per prompt), and kl = log n - (n - 1)/n (an upper bound: rlhf.stats.best_of_n_kl)."""
    if n_max < 1 or n_max & (n_max - 1):
        raise ValueError(f"best-of-n needs n_max a power of 2, got {n_max}")
    ids, mask, samples = sample_summaries(
        reference, prompts.prompts, n_max, max_new_tokens, temperature=1.0, generator=generator
    )
    values = score_samples(prompts, ids, mask, samples, n_max, tok, reward_model, gold_fn, micro)  # each (P, n_max)
    lengths = samples.response_mask.double().sum(1).cpu().view(-1, n_max)
    curve = []
    n = 1
    while n <= n_max:
        kept = best_of_n_index(values["proxy_raw"], n)[:, None]  # (P, 1)
        point = {"n": n, "kl": best_of_n_kl(n), "kl_se": 0.0}
        for name, v in values.items():
            point[name], point[name + "_se"] = mean_and_se(v.gather(1, kept))
        point["response_length"] = float(lengths.gather(1, kept).mean())
        curve.append(point)
        n *= 2
    return curve


# ----------------------------------------------------------------------------------------------------
# Reading runs, the table and the picture


def frontier_points(run_dir: Path) -> list[dict[str, float]]:
    """Every evaluation of a run that measured the frontier (eval/kl in metrics.jsonl), in step order: the step and
    each eval/ frontier metric without its prefix (win_rate_sampled read back as win_rate). A line cut short by a kill
    is skipped (utils.logging.read_rows); a standard error the log lacks (NaN, of one prompt and one sample: the logger
    writes finite values only) is NaN."""
    points = []
    for row in read_rows(Path(run_dir) / "metrics.jsonl"):
        if "eval/kl" not in row:
            continue
        point = {"step": row["step"]}
        for name in METRICS:
            key = Frontier.EVAL_NAMES.get(name, name)
            if f"eval/{key}" in row:
                point[name], point[name + "_se"] = row[f"eval/{key}"], row.get(f"eval/{key}_se", math.nan)
        points.append(point)
    return points


def spread(values: list[float]) -> str:
    """mean ± sample std over seeds (the mean alone for one seed)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.3f} ± {std:.3f}"


def frontier_table(curve: list[dict], methods: dict[str, list[list[dict]]]) -> str:
    """Markdown: best-of-n's points (value ± standard error), then each method's last evaluation (mean ± sample std
    over its seeds, and the largest standard error of one seed's value). `methods`: name -> one list of points per
    seed."""
    cols = [c for c in ("kl", "gold", "proxy", "win_rate") if c in curve[0]]
    head = "| policy | seeds | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols)
    rows = [head]
    for p in curve:
        cells = " | ".join(f"{p[c]:.3f}" + (f" ± {p[c + '_se']:.3f}" if c != "kl" else "") for c in cols)
        rows.append(f"| best-of-{p['n']} (reference) | | {cells} |")
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
        rows.append(f"| {name} | {len(last)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_frontier(curve: list[dict], methods: dict[str, list[list[dict]]], out: Path, title: str = "") -> None:
    """Two panels: y against KL (gold reward, or proxy reward and win rate without a gold reward), and gold against
    proxy; KL on a square-root axis (Gao et al. 2022). Best-of-n is a line (its KL the formula's upper bound); each
    method's seeds are points joined along training (markers at every evaluation, the last one larger), with error
    bars of one standard error in both directions; one colour per method, one line style per seed."""
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
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (x, y) in zip(axes[0], panels, strict=True):
        ax.errorbar(
            [p[x] for p in curve],
            [p[y] for p in curve],
            yerr=[p[y + "_se"] for p in curve],
            color="black",
            marker="s",
            ms=3,
            lw=1.5,
            capsize=2,
            label="best-of-n from the reference (KL: log n - (n-1)/n, an upper bound)",
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
        ax.set_xlabel(labels[x])
        ax.set_ylabel(labels[y])
        if x == "kl":  # a square-root axis, as Gao et al. 2022 draw it: best-of-64 sits at 3.2 nats, the runs near 0
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
    runs' --frontier_data). Without a --gold_fn the picture draws proxy reward and win rate against KL. The picture and
    the table also go into the runs' common folder as TensorBoard events and, with --wandb_mode, to wandb
    (evaluation.compare.publish)."""
    import argparse

    from data.tokenizer import get_tokenizer
    from evaluation.compare import CompareError, add_publish_arguments, group_runs, label, load_run, publish
    from model.weights import build_policy

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (dpo.py / grpo.py --frontier_prompts N)")
    p.add_argument("--reference", required=True, help="the runs' reference policy (their --model): best-of-n from it")
    p.add_argument("--reward_model", required=True, help="the proxy (the runs' --frontier_reward_model)")
    p.add_argument("--data", required=True, help="the prompts (the runs' --frontier_data)")
    p.add_argument("--split", default="validation", help="split of --data")
    p.add_argument("--prompts", type=int, default=100, help="prompts of --data (the runs' --frontier_prompts)")
    p.add_argument("--gold_fn", default="", help='a gold reward "module:function" of (prompt, summary); empty: none')
    p.add_argument("--max_new_tokens", type=int, default=53, help="tokens per summary (the runs' length)")
    p.add_argument("--max_prompt_len", type=int, default=448, help="tokens per prompt at most")
    p.add_argument("--best_of", type=int, default=64, help="best-of-n's largest n, a power of 2")
    p.add_argument("--seed", type=int, default=0, help="seed of best-of-n's samples")
    p.add_argument("--out", default="frontier.png", help="the picture; frontier.json beside it holds every point")
    add_publish_arguments(p)
    args = p.parse_args(argv)
    if args.best_of < 1 or args.best_of & (args.best_of - 1):
        p.error(f"--best_of must be a power of 2, got {args.best_of}")
    # each model's kind before anything is read (a policy as --reward_model would score with a random head)
    model_config(args.reference, kind="policy", option="--reference")
    model_config(args.reward_model, kind="reward_model", option="--reward_model")
    methods, runs = {}, [load_run(d) for d in args.runs]
    for options, members in group_runs(runs):
        seeds = [frontier_points(run.dir) for run in members]
        empty = [str(run.dir) for run, points in zip(members, seeds, strict=True) if not points]
        if empty:
            raise CompareError(f"{empty[0]}: no eval/kl in its metrics.jsonl; train it with --frontier_prompts N")
        methods[label(options)] = seeds
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
    )
    out = Path(args.out)
    plot_frontier(curve, methods, out, f"{args.prompts} prompts of {args.data}; error bars 1 standard error")
    out.with_suffix(".json").write_text(json.dumps({"best_of_n": curve, "methods": methods}, indent=1))
    text = frontier_table(curve, methods)
    publish(args, out, "frontier", text, runs)
    print(f"{text}\n\nwrote {out} and {out.with_suffix('.json')}")
    return text


if __name__ == "__main__":
    import sys

    from evaluation.compare import CompareError
    from model.weights import ModelLoadError

    try:
        main()
    except (CompareError, ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)

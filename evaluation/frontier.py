"""The reward-KL frontier: where a policy sits on the gold reward (when the task has one), the proxy reward (the reward
model) and the win rate against reference summaries, against its KL to the reference policy; and best-of-n from the
reference as the baseline (Gao, Schulman and Hilton 2022, arXiv 2210.10760; Rafailov et al. 2023, arXiv 2305.18290,
Fig. 2).

`measure_posts` samples `num_samples` summaries of each held-out prompt (post) from the policy at temperature 1 (the
policy's own distribution, whatever temperature it was trained with) and gives, per post, the mean of the log-ratio

    KL(pi || pi_ref) = E_x E_{y ~ pi(.|x)} [log pi(y|x) - log pi_ref(y|x)]

(each log-prob summed over the response's tokens, the end token included; a response cut at the token budget counts
its tokens up to the cut), and of the gold reward, proxy reward (raw and normalized by the reward model's gain and
bias, no missing-end penalty) and win rate of the same samples; `measure` gives their means over posts, each with its
standard error over posts (the post is the unit of every error here).

`best_of_n` samples a pool of 64 (`pool`) summaries of each post from the reference once and estimates, for every n
in 1, 2, 4, ..., `n_max`, the expected values of best-of-n over every n-subset of the pool at once, and its KL from
the pool's empirical distribution (repeated summaries one outcome), beside the formula's bound log n - (n - 1)/n
(rlhf.stats: best_of_n_weights, best_of_n_pool_kl, best_of_n_kl).

`verdict_rows` compares methods, and a method with best-of-n, at matched KL by per-post differences on the same
posts, with intervals over posts and with the seeds' spread; `fit_curves` fits Gao et al.'s two forms.

dpo.py and grpo.py call Frontier.evaluate at every evaluation when --frontier_prompts > 0 (eval/kl, ...; per-post
values in the run's frontier_posts.jsonl); demo.py --frontier_seeds trains the grids (experiments/embedded.py) and
draws the picture (frontier_points, frontier_table, plot_frontier).
"""

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from data.tldr import PROMPT_COLUMNS, PromptDataset, decode_responses, load_optional_column, load_rows
from evaluation.frontier_declarations import LOGGED, METRICS, check_gold_model
from evaluation.samples import sample_summaries
from evaluation.summaries import reference_summaries
from model.lora import sharded_module
from model.sampler import SampleOutput
from model.weights import build_reward_model, freeze, model_config
from rlhf.logprobs import linear_processed_logprobs
from rlhf.rewards import load_function
from rlhf.stats import (
    best_of_n_kl,
    best_of_n_pool_kl,
    best_of_n_weights,
    bootstrap_resamples,
    bootstrap_undefined,
    crossed_bootstrap_resamples,
    detectable_difference,
    difference_interval,
    gao_curve,
    gao_fit,
    mean_and_se_over_posts,
    pair_outcomes,
    percentile_interval,
    posts_needed,
    seeds_needed,
    sqrt_kl_interpolation,
    variance_components,
)
from rollouts.sampling import model_rows, score
from utils.config import ConfigError
from utils.dist import stream
from utils.fsdp import gathered_params, shard_model
from utils.logging import read_rows

POSTS_TABLE = "frontier_posts"
"""The table (utils.logging.Logger.table: frontier_posts.jsonl in the run directory) of every evaluation's per-post
values: the unit of the paired comparisons (verdict_rows)."""


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
    *,
    gold_model=None,
) -> dict[str, torch.Tensor]:
    """Per-sample values (P, G) of what applies: gold (gold_fn of the prompt and the decoded summary, or the gold
    reward model's normalized score gain * raw + bias of the same tokens the proxy reads), proxy_raw and proxy (the
    reward model's raw score, and gain * raw + bias), win_rate (1 when the reward model scores the summary above the
    prompt's reference summary, 0 below, 1/2 on a tie)."""
    P = len(prompts.prompts)
    out = {}
    if gold_fn is not None and gold_model is not None:
        raise ValueError("score_samples: gold from a function or from a gold reward model, not both")
    if gold_fn is not None:
        texts = decode_responses(tok, samples.response_ids, samples.response_mask, samples.has_end)
        gold = [float(gold_fn(prompts.texts[n // group], t)) for n, t in enumerate(texts)]
        out["gold"] = torch.tensor(gold, dtype=torch.float64).view(P, group)
    if gold_model is not None:
        raw = score(gold_model, prompt_ids, prompt_mask, samples, group, micro, prefix_sharing=False)
        out["gold"] = gold_model.normalize(raw).double().cpu().view(P, group)
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
def measure_posts(
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
    *,
    gold_model=None,
) -> dict[str, torch.Tensor]:
    """One point on the frontier, per post: `num_samples` summaries of each prompt from the policy at temperature 1;
    for each prompt (P,) float64 the mean over its samples of the log-ratio log pi(y|x) - log pi_ref(y|x) ("kl"), of
    every value of score_samples, and of the response length. Every rank computes all of it (with the same generator,
    the same numbers)."""
    ids, mask, samples = sample_summaries(
        policy, prompts.prompts, num_samples, max_new_tokens, temperature=1.0, generator=generator
    )
    P = len(prompts.prompts)
    # log pi(y|x): the sampler's own log-probs of the tokens it drew (temperature 1, no top-k / top-p: the policy's
    # distribution; equal to sequence_logprobs' forward, tests/test_frontier.py), so the policy needs no second pass
    logp = samples.logprobs.double().sum(1).cpu().view(P, num_samples)
    logp_ref = sequence_logprobs(reference, ids, mask, samples, num_samples, micro).cpu().view(P, num_samples)
    values = {"kl": logp - logp_ref.double()}
    values |= score_samples(prompts, ids, mask, samples, num_samples, tok, reward_model, gold_fn, gold_model=gold_model)
    values["response_length"] = samples.response_mask.double().sum(1).cpu().view(P, num_samples)
    return {name: v.mean(1) for name, v in values.items()}


def summarize_posts(posts: dict[str, torch.Tensor]) -> dict[str, float]:
    """The frontier point of per-post values (measure_posts, best_of_n): each mean over the posts with its standard
    error over the posts (rlhf.stats.mean_and_se_over_posts: the unit of every error on the frontier); the length
    without one."""
    out = {}
    for name, v in posts.items():
        if name == "response_length":
            out[name] = float(v.mean())
        else:
            out[name], out[name + "_se"] = mean_and_se_over_posts(v)
    return out


def measure(*args, **kwargs) -> dict[str, float]:
    """One point on the frontier: summarize_posts of measure_posts (same arguments), the KL to the reference
    (rlhf.stats.kl_estimate's estimate, with its error over posts) and every value of score_samples, each a mean with
    its standard error over the posts."""
    return summarize_posts(measure_posts(*args, **kwargs))


class Frontier:
    """--frontier_prompts at every evaluation of a training stage: the prompts, the proxy reward model (sharded like
    the run's models) and the gold function or gold reward model (--frontier_gold_model, sharded the same way), built
    once; evaluate() gives the policy's point (a collective under FSDP: every rank calls it and computes the same
    numbers)."""

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
        --frontier_gold_fn (and --frontier_gold_model, which replaces any gold function) are empty."""
        self.cfg, self.tok, self.seed, self.device, self.run = cfg, tok, cfg.seed, run.device, run
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
        self.gold_model = None
        if cfg.frontier_gold_model:  # gold instead of any function: it only scores, never trains anything
            self.gold_fn = None
            self.gold_model = shard_model(freeze(build_reward_model(cfg.frontier_gold_model)), run.dtype)
            self.gold_model.to(run.device)

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
        values = ["gold"] if self.gold_fn is not None or self.gold_model is not None else []
        if self.reward_model is not None:
            values += ["proxy_raw", "proxy"] + (["win_rate"] if self.prompts.references is not None else [])
        names = ["kl", "kl_se", "response_length", *values, *(v + "_se" for v in values)]
        return {prefix + LOGGED[k].removeprefix("eval/") for k in names}

    def evaluate(self, policy, reference, step: int, prefix: str = "eval/") -> dict[str, float]:
        """The policy's point against `reference` (the policy the run started from: grpo.py keeps a frozen copy of it
        when --ref_refresh_every refreshes the training reference). Also writes the per-post values to the run's
        frontier_posts.jsonl (rank 0; a table of one row per post: post, kl, gold, ...), from which the paired
        comparisons over posts are computed (frontier_points)."""
        generator = stream(self.seed, step, 0, "frontier", device=self.device)  # rank 0's stream on every rank
        posts = measure_posts(
            policy,
            reference,
            self.prompts,
            self.cfg.frontier_samples,
            self.max_new_tokens,
            self.tok,
            generator,
            self.reward_model,
            self.gold_fn,
            gold_model=self.gold_model,
        )
        logger = getattr(self.run, "logger", None)
        if logger is not None:
            columns = ["post", *posts]
            rows = [[p, *(float(v[p]) for v in posts.values())] for p in range(len(self.prompts.prompts))]
            logger.table(POSTS_TABLE, columns, rows, step)
        return {prefix + LOGGED[k].removeprefix("eval/"): v for k, v in summarize_posts(posts).items()}


# ----------------------------------------------------------------------------------------------------
# Best-of-n from the reference


def first_occurrence(samples: SampleOutput, group: int) -> torch.Tensor:
    """For each of P x `group` sampled summaries (P, group) long: the column of the first sample of its prompt with the
    same tokens (itself when it is the first): a repeated summary is one outcome of the reference."""
    P = samples.response_ids.shape[0] // group
    first = torch.empty(P, group, dtype=torch.long)
    for p in range(P):
        seen: dict[tuple, int] = {}
        for g in range(group):
            n = p * group + g
            key = tuple(samples.response_ids[n][samples.response_mask[n]].tolist()) + (bool(samples.has_end[n]),)
            first[p, g] = seen.setdefault(key, g)
    return first


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
    pool: int = 0,
    *,
    gold_model=None,
) -> list[dict]:
    """Best-of-n from the reference for n = 1, 2, 4, ..., n_max, from one pool of `pool` (default n_max) samples of
    each prompt at temperature 1 ranked by the proxy (the reward model's raw score; a repeated summary keeps its first
    occurrence's score, so that it is one outcome):

    - every value (gold: gold_fn's or gold_model's, proxy, win rate, length) by the all-subsets estimator over the pool
      (rlhf.stats.best_of_n_weights: the expected value of best-of-n over every n-subset, ties broken at random);
    - kl: KL(best-of-n || pi_ref) of the pool's empirical distribution (rlhf.stats.best_of_n_pool_kl: repeats one
      outcome), and kl_bound = log n - (n - 1)/n (rlhf.stats.best_of_n_kl, the formula, an upper bound);

    each a mean over prompts with its standard error over prompts, and in "posts" the per-prompt values (lists) for
    the paired comparisons (verdict_rows). "repeats": the share of the pool's samples that repeat an earlier one."""
    pool = pool or n_max
    if n_max < 1 or n_max & (n_max - 1):
        raise ValueError(f"best-of-n needs n_max a power of 2, got {n_max}")
    if pool < n_max:
        raise ValueError(f"best-of-n's pool ({pool}) must hold at least n_max = {n_max} samples per prompt")
    ids, mask, samples = sample_summaries(
        reference, prompts.prompts, pool, max_new_tokens, temperature=1.0, generator=generator
    )
    values = score_samples(  # each (P, pool)
        prompts, ids, mask, samples, pool, tok, reward_model, gold_fn, micro, gold_model=gold_model
    )
    values["response_length"] = samples.response_mask.double().sum(1).cpu().view(-1, pool)
    first = first_occurrence(samples, pool)  # (P, pool)
    proxy = values["proxy_raw"].gather(1, first)  # a repeat scores as its first occurrence
    repeats = float((first != torch.arange(pool)[None]).double().mean())
    curve = []
    n = 1
    while n <= n_max:
        weights = best_of_n_weights(proxy, n)  # (P, pool)
        posts = {"kl": best_of_n_pool_kl(proxy, n)} | {k: (weights * v).sum(1) for k, v in values.items()}
        point = {"n": n, **summarize_posts(posts), "kl_bound": best_of_n_kl(n), "pool": pool, "repeats": repeats}
        point["posts"] = {k: v.tolist() for k, v in posts.items()}
        curve.append(point)
        n *= 2
    return curve


# ----------------------------------------------------------------------------------------------------
# Reading runs


def frontier_points(run_dir: Path) -> list[dict]:
    """Every evaluation of a run that measured the frontier (eval/kl in metrics.jsonl), in step order: the step and
    each eval/ frontier metric without its prefix (win_rate_sampled read back as win_rate), and in "posts" its
    per-post values (frontier_posts.jsonl, when the run wrote it: {name: [one value per post]}). A line cut short by
    a kill is skipped (utils.logging.read_rows); a standard error the log lacks (NaN, of one prompt: the logger writes
    finite values only) is NaN."""
    tables = {}
    for row in read_rows(Path(run_dir) / f"{POSTS_TABLE}.jsonl"):
        columns = row["columns"]
        tables[row["step"]] = {c: [r[i] for r in row["rows"]] for i, c in enumerate(columns) if c != "post"}
    points = []
    for row in read_rows(Path(run_dir) / "metrics.jsonl"):
        if "eval/kl" not in row:
            continue
        point = {"step": row["step"]}
        for name in METRICS:
            if LOGGED[name] in row:
                point[name], point[name + "_se"] = row[LOGGED[name]], row.get(LOGGED[name + "_se"], math.nan)
        if row["step"] in tables:
            point["posts"] = tables[row["step"]]
        points.append(point)
    return points


# ----------------------------------------------------------------------------------------------------
# Comparisons over posts: every method and best-of-n measured on the same posts, the post the unit of every error


BEST_OF_N = "best-of-n"
"""The name of best-of-n from the reference as the second member of a pair (verdict_rows)."""


def path_at_kl(points: list[dict], kl: float, key: str, idx: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-post values (P,) of `key` at KL `kl` along a path of points that carry per-post values (best-of-n's n,
    or a run's evaluations), interpolated linearly in sqrt(KL) between its two neighbouring points
    (rlhf.stats.sqrt_kl_interpolation), each point's KL its mean over the posts `idx` (all when None: a bootstrap
    passes a resample); None beyond the path's largest KL."""
    kls = []
    for p in points:
        v = torch.as_tensor(p["posts"]["kl"], dtype=torch.float64)
        kls.append(float(v[idx].mean()) if idx is not None else float(v.mean()))
    where = sqrt_kl_interpolation(kls, kl)
    if where is None:
        return None
    i, j, w = where
    v_i, v_j = (torch.as_tensor(points[k]["posts"][key], dtype=torch.float64) for k in (i, j))
    out = (1 - w) * v_i + w * v_j
    return out[idx] if idx is not None else out


def matched_difference(
    a: list[dict], b: list[dict], key: str, b_is_best_of_n: bool, idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, float] | None:
    """Per-post difference (P,) A minus B of `key` at matched KL, and that KL, for one seed (posts `idx`, all when
    None). A and B are paths of points with per-post values (a run's evaluations, in step order; best-of-n's curve).
    Against best-of-n: at A's last evaluation's KL, best-of-n interpolated to it. Between two runs: at the smaller of
    their last evaluations' KLs, the run that went further interpolated back along its evaluations to it. None when
    best-of-n does not reach A's KL."""

    def mean_kl(point):
        v = torch.as_tensor(point["posts"]["kl"], dtype=torch.float64)
        return float(v[idx].mean()) if idx is not None else float(v.mean())

    def last(points):
        v = torch.as_tensor(points[-1]["posts"][key], dtype=torch.float64)
        return v[idx] if idx is not None else v

    k_a = mean_kl(a[-1])
    if b_is_best_of_n:
        at = path_at_kl(b, k_a, key, idx)
        return None if at is None else (last(a) - at, k_a)
    k_b = mean_kl(b[-1])
    if k_a <= k_b:
        at = path_at_kl(b, k_a, key, idx)
        return None if at is None else (last(a) - at, k_a)
    at = path_at_kl(a, k_b, key, idx)
    return None if at is None else (at - last(b), k_b)


def verdict_rows(
    methods: dict[str, list[list[dict]]],
    curve: list[dict],
    pairs: list[tuple[str, str]],
    key: str = "gold",
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    delta: float = 0.05,
) -> list[dict]:
    """One row per pair (A, B) of method names (B may be BEST_OF_N): A minus B in `key` at matched KL
    (matched_difference), every run of a method measured on the same posts with per-post values (frontier_points'
    "posts", best_of_n's). Seed s of A is paired with seed s of B (the first min(S_A, S_B) seeds; best-of-n is one
    curve for every seed), giving a (seeds, posts) matrix of per-post differences. Each row:

    - difference, kl: the mean difference and the mean matched KL;
    - se_posts, ci_posts_low/high: its standard error over posts (of the seeds' mean per-post difference) and a
      percentile bootstrap interval over posts that redoes the KL matching in every resample (seeds held fixed);
      ci_posts_unmatched: the share of resamples where best-of-n does not reach A's KL (dropped from the interval:
      the interval is conditional on a match; above (1 - confidence) / 2 the table says so);
    - se, df, ci_low, ci_high, var_seed, var_post, var_residual: the t interval that includes the seed-to-seed spread
      (rlhf.stats.difference_interval: seeds the unit of the between-run part, posts paired within each seed);
      with one seed the posts' alone; seed_floor: the seeds' means agreed within their posts' noise, so the seeds'
      part is its floor (the table says so: with few seeds the interval may be too narrow);
    - distinguishable: the interval (with seeds when there are two or more) excludes 0;
    - detectable: the smallest true difference these seeds and posts detect (rlhf.stats.detectable_difference at 80%
      power); posts_needed: how many posts make `delta` detectable with these seeds, seeds_needed: how many seeds
      with these posts (rlhf.stats.posts_needed, seeds_needed: from the measured components, each count judged at the
      interval's own degrees of freedom there; None when the other count must grow first; seeds_needed NaN with one
      seed, which cannot measure the seeds' spread);
    - seeds, posts; "note" instead of the numbers when best-of-n does not reach A's KL (or two runs' paths share no
      KL)."""

    def as_tensors(points: list[dict]) -> list[dict]:  # per-post lists as tensors once, not in every resample
        return [
            p | {"posts": {k: torch.as_tensor(v, dtype=torch.float64) for k, v in p["posts"].items()}} for p in points
        ]

    curve = as_tensors(curve)
    methods = {name: [as_tensors(points) for points in seeds] for name, seeds in methods.items()}
    rows = []
    for a_name, b_name in pairs:
        vs_bon = b_name == BEST_OF_N
        a_seeds = methods[a_name]
        b_seeds = [curve] * len(a_seeds) if vs_bon else methods[b_name]
        S = min(len(a_seeds), len(b_seeds))
        row = {"pair": f"{a_name} - {b_name}", "a": a_name, "b": b_name, "seeds": S}
        matched = [matched_difference(a_seeds[s], b_seeds[s], key, vs_bon) for s in range(S)]
        if any(m is None for m in matched):
            note = (
                "beyond best-of-n's largest n: a larger --frontier_best_of" if vs_bon else "no common KL on the paths"
            )
            rows.append(row | {"note": note})
            continue
        d_SP = torch.stack([d for d, _ in matched])  # (S, P)
        P = d_SP.shape[1]

        def statistic(idx, a_seeds=a_seeds, b_seeds=b_seeds, vs_bon=vs_bon, S=S):
            out = [matched_difference(a_seeds[s], b_seeds[s], key, vs_bon, idx) for s in range(S)]
            return math.nan if any(m is None for m in out) else sum(float(d.mean()) for d, _ in out) / S

        resampled = bootstrap_resamples(statistic, P, n_resamples, seed)
        lo, hi = percentile_interval(resampled, confidence)[:, 0].tolist()
        mean_d, se_posts = mean_and_se_over_posts(d_SP.mean(0))
        interval = difference_interval(d_SP, confidence)
        row |= {
            "kl": sum(k for _, k in matched) / S,
            "difference": mean_d,
            "se_posts": se_posts,
            "ci_posts_low": lo,
            "ci_posts_high": hi,
            "ci_posts_unmatched": bootstrap_undefined(resampled),
            **{k: interval[k] for k in ("se", "df", "ci_low", "ci_high", "var_seed", "var_post", "var_residual")},
            "seed_floor": interval["seed_floor"],
            "distinguishable": interval["distinguishable"],
            "detectable": detectable_difference(interval["se"], interval["df"], confidence),
            "posts_needed": posts_needed(interval, S, delta, confidence),
            "seeds_needed": seeds_needed(interval, P, delta, confidence) if S > 1 else math.nan,
            "posts": P,
        }
        rows.append(row)
    return rows


def point_components(seeds: list[list[dict]], key: str = "gold") -> dict[str, float]:
    """A method's last evaluation over its seeds, per post (seeds, posts): its mean and the variance components of
    that mean (rlhf.stats.variance_components: between seeds, between posts, residual), with its standard error."""
    return variance_components(torch.tensor([points[-1]["posts"][key] for points in seeds], dtype=torch.float64))


def fit_curves(
    curve: list[dict],
    methods: dict[str, list[list[dict]]],
    key: str = "gold",
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict]:
    """Gao et al. 2022's forms (rlhf.stats.gao_fit) through the points, gold gained over the reference (best-of-1 on
    the same posts) against d = sqrt(KL): best-of-n by R_bon(d) = d (alpha - beta d) through its n, each method by
    R_RL(d) = d (alpha - beta log d) through every evaluation of every seed. alpha, beta and their percentile bootstrap
    intervals over seeds and posts (rlhf.stats.crossed_bootstrap_resamples: each resample draws the method's seeds
    and the posts with replacement, independently, and refits through the drawn seeds' points, every point's means
    recomputed on the drawn posts; so seeds that disagree widen the interval, which a resample of posts alone with the
    seeds fixed leaves out; best-of-n is one curve: posts alone; NaN with n_resamples 0).
    name (BEST_OF_N for best-of-n) -> {form, alpha, beta, alpha_ci, beta_ci, baseline (best-of-1's mean), d_max}."""
    baseline = torch.tensor(curve[0]["posts"][key], dtype=torch.float64)  # (P,) best-of-1: the reference's value
    P = baseline.numel()
    paths = {BEST_OF_N: ("bon", [curve])} | {name: ("rl", seeds) for name, seeds in methods.items()}
    out = {}
    for name, (form, seeds) in paths.items():
        seeds = [points for points in seeds if points]
        kls = [torch.tensor([p["posts"]["kl"] for p in points], dtype=torch.float64) for points in seeds]  # (M_s, P)
        ys = [torch.tensor([p["posts"][key] for p in points], dtype=torch.float64) for points in seeds]

        def fit(seed_idx, post_idx, kls=kls, ys=ys, form=form):
            kl_MP = torch.cat([kls[s] for s in seed_idx.tolist()])  # the drawn seeds' points (M, P)
            y_MP = torch.cat([ys[s] for s in seed_idx.tolist()])
            d = kl_MP[:, post_idx].mean(1).clamp(min=0).sqrt()
            gain = y_MP[:, post_idx].mean(1) - baseline[post_idx].mean()
            try:
                return torch.tensor(gao_fit(d, gain, form), dtype=torch.float64)
            except ValueError:
                return torch.tensor([math.nan, math.nan], dtype=torch.float64)

        alpha, beta = fit(torch.arange(len(seeds)), torch.arange(P)).tolist()
        if n_resamples > 0:  # (2, 2): rows low and high, columns alpha and beta
            ci = percentile_interval(crossed_bootstrap_resamples(fit, len(seeds), P, n_resamples, seed), confidence)
        else:
            ci = torch.full((2, 2), math.nan, dtype=torch.float64)
        d_max = float(torch.cat(kls).mean(1).clamp(min=0).sqrt().max())
        out[name] = {
            "form": form,
            "alpha": alpha,
            "beta": beta,
            "alpha_ci": ci[:, 0].tolist(),
            "beta_ci": ci[:, 1].tolist(),
            "baseline": float(baseline.mean()),
            "d_max": d_max,
        }
    return out


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


def verdict_table(rows: list[dict], key: str = "gold", confidence: float = 0.95) -> str:
    """Markdown of verdict_rows: each pair's difference at matched KL, its errors and intervals, whether it is
    distinguishable and the smallest difference these seeds and posts detect."""
    text = (
        f"| pair ({key}, A - B at matched KL) | KL | difference | se over posts | 95% interval over posts (bootstrap) "
        "| se with seeds | 95% interval with seeds (t) | distinguishable | detectable | posts, seeds for 0.05 |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if "note" in r:
            text += f"\n| {r['pair']} | {r['note']} | | | | | | | | |"
            continue
        posts = "more seeds first" if r["posts_needed"] is None else str(r["posts_needed"])
        seeds = r["seeds_needed"]
        seeds = "" if isinstance(seeds, float) else ", more posts first" if seeds is None else f", {seeds}"
        floor = "; seeds agree: their spread at its floor" if r.get("seed_floor") else ""
        unmatched = r.get("ci_posts_unmatched", 0.0)
        unmatched = f" ({unmatched:.0%} of resamples unmatched)" if unmatched > (1 - confidence) / 2 else ""
        text += (
            f"\n| {r['pair']} | {r['kl']:.3f} | {r['difference']:+.3f} | {r['se_posts']:.3f} | "
            f"[{r['ci_posts_low']:+.3f}, {r['ci_posts_high']:+.3f}]{unmatched} | "
            f"{r['se']:.3f} (df {r['df']:.1f}{floor}) | "
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {'yes' if r['distinguishable'] else 'no'} | "
            f"{r['detectable']:.3f} | {posts}{seeds} |"
        )
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

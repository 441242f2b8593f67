"""A policy's point on the reward-KL frontier, measured on held-out posts: its KL to the reference policy, and the gold
reward (when the task has one), the proxy reward (the reward model) and the win rate against reference summaries of
its samples (Gao, Schulman and Hilton 2022, arXiv 2210.10760; Rafailov et al. 2023, arXiv 2305.18290, Fig. 2).

`measure_posts` samples `num_samples` summaries of each held-out prompt (post) from the policy at temperature 1 (the
policy's own distribution, whatever temperature it was trained with) and gives, per post, the mean of the log-ratio

    KL(pi || pi_ref) = E_x E_{y ~ pi(.|x)} [log pi(y|x) - log pi_ref(y|x)]

(each log-prob summed over the response's tokens, the end token included; a response cut at the token budget counts
its tokens up to the cut), and of the gold reward, proxy reward (raw and normalized by the reward model's gain and
bias, no missing-end penalty) and win rate of the same samples; `measure` gives their means over posts, each with its
standard error over posts (the post is the unit of every error here).

dpo.py and grpo.py call Frontier.evaluate at every evaluation when --frontier_prompts > 0 (eval/kl, ...; per-post
values in the run's frontier_posts.jsonl). Best-of-n from the reference on the same posts is evaluation/best_of_n.py,
the comparisons at matched KL evaluation/matched.py, the tables, the picture and the command line
evaluation/frontier.py.
"""

from dataclasses import dataclass
from functools import partial

import torch

from data.tldr import PROMPT_COLUMNS, PromptDataset, decode_responses, load_optional_column, load_rows
from evaluation.frontier_declarations import LOGGED, POSTS_TABLE
from evaluation.samples import sample_summaries
from evaluation.summaries import reference_summaries
from model.lora import sharded_module
from model.sampler import SampleOutput
from model.weights import build_reward_model, freeze
from rlhf.logprobs import linear_processed_logprobs
from rlhf.rewards import load_function
from rlhf.stats import mean_and_se_over_posts, pair_outcomes
from rollouts.sampling import model_rows, score
from utils.config import ConfigError
from utils.dist import stream
from utils.fsdp import gathered_params, shard_model


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
    (rlhf.frontier.kl_estimate's estimate, with its error over posts) and every value of score_samples, each a mean with
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
        comparisons over posts are computed (evaluation/matched.py frontier_points)."""
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

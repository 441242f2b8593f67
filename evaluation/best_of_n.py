"""Best-of-n from the reference, the baseline of the reward-KL frontier (Gao, Schulman and Hilton 2022, arXiv
2210.10760): `best_of_n` samples a pool of 64 (`pool`) summaries of each post from the reference once and estimates,
for every n in 1, 2, 4, ..., `n_max`, the expected values of best-of-n over every n-subset of the pool at once, and its
KL from the pool's empirical distribution (repeated summaries one outcome), beside the formula's bound
log n - (n - 1)/n (rlhf.frontier: best_of_n_weights, best_of_n_pool_kl, best_of_n_kl). Its samples are scored as a
policy's are (evaluation/measure.py score_samples), on the same posts, so that the comparisons at matched KL
(evaluation/matched.py) pair them post by post.
"""

import torch

from evaluation.measure import FrontierPrompts, score_samples, summarize_posts
from evaluation.samples import sample_summaries
from model.sampler import SampleOutput
from rlhf.frontier import best_of_n_kl, best_of_n_pool_kl, best_of_n_weights


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
      (rlhf.frontier.best_of_n_weights: the expected value of best-of-n over every n-subset, ties broken at random);
    - kl: KL(best-of-n || pi_ref) of the pool's empirical distribution (rlhf.frontier.best_of_n_pool_kl: repeats one
      outcome), and kl_bound = log n - (n - 1)/n (rlhf.frontier.best_of_n_kl, the formula, an upper bound);

    each a mean over prompts with its standard error over prompts, and in "posts" the per-prompt values (lists) for
    the paired comparisons (evaluation/matched.py verdict_rows). "repeats": the share of the pool's samples that repeat
    an earlier one."""
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

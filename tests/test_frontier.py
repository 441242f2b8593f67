"""The reward-KL frontier's estimators (evaluation/measure.py, best_of_n.py, matched.py, frontier.py; rlhf/frontier.py,
stats.py): the KL estimate against the exact KL of one-token responses, best-of-n's selection and its KL formula on
known rewards, paired comparisons and sizes by hand. The runs end to end: tests/test_frontier_runs.py."""

import itertools
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.synthetic import write_task
from data.tokenizer import get_tokenizer
from evaluation.best_of_n import best_of_n
from evaluation.frontier import frontier_table
from evaluation.matched import BEST_OF_N, frontier_points, verdict_rows, verdict_table
from evaluation.measure import FrontierPrompts, measure, sequence_logprobs
from evaluation.samples import sample_summaries
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.heads import RewardModel
from rlhf.frontier import (
    best_of_n_expected,
    best_of_n_index,
    best_of_n_kl,
    best_of_n_pool_bias,
    best_of_n_pool_kl,
    best_of_n_weights,
    gao_curve,
    gao_fit,
    kl_estimate,
)
from rlhf.stats import (
    detectable_difference,
    difference_interval,
    mean_and_se,
    mean_and_se_over_posts,
    paired_difference,
    posts_needed,
    seeds_needed,
    sqrt_kl_interpolation,
    t_quantile,
    units_needed,
    variance_components,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["POST: my cat ate my homework\n\nTL;DR:", "POST: the landlord kept the deposit\n\nTL;DR:", "TL;DR:"]


def two_policies():
    """Two tiny random GPT-2s (different seeds): a policy and a reference whose next-token distributions differ."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(PRESETS["tiny"]).eval()
    torch.manual_seed(1)
    reference = GPT2LMHeadModel(PRESETS["tiny"]).eval()
    return policy, reference


@torch.no_grad()
def next_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log pi(. | prompt) (V,) from one plain forward of the prompt (no padding, no cache)."""
    ids = torch.tensor([prompt])
    logits = model(ids, torch.arange(len(prompt))[None], None)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return F.log_softmax(logits[0, -1].double(), -1)


def exact_kls(policy, reference, prompts: list[list[int]]) -> torch.Tensor:
    """KL(pi || pi_ref) (P,) of one-token responses: sum over the vocabulary of p (log p - log q)."""
    out = []
    for p in prompts:
        lp, lq = next_token_logprobs(policy, p), next_token_logprobs(reference, p)
        out.append((lp.exp() * (lp - lq)).sum())
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------------
# The statistics, by hand


def test_mean_and_se_by_hand():
    values = torch.tensor([[1.0, 3.0], [2.0, 6.0]])  # per-prompt means 2 and 4
    mean, se = mean_and_se(values)
    assert mean == 3.0
    assert se == pytest.approx(math.sqrt(2.0) / math.sqrt(2))  # std of the prompts' means / sqrt(P)
    mean, se = mean_and_se(torch.tensor([[1.0], [3.0], [5.0]]))  # one value per prompt: the same unit
    assert mean == 3.0 and se == pytest.approx(2.0 / math.sqrt(3))
    assert math.isnan(mean_and_se(torch.tensor([[4.0, 5.0]]))[1])  # one prompt: no error over prompts
    with pytest.raises(ValueError, match="prompts, samples"):
        mean_and_se(torch.zeros(3))


def test_kl_estimate_is_the_mean_log_ratio():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -2.0], [-1.0, -2.0]])  # log-ratios 0.5, 0 | 0.5, -1: per-prompt means 0.25, -0.25
    kl, se = kl_estimate(logp, ref)
    assert kl == pytest.approx(0.0)
    assert se == pytest.approx(math.sqrt(0.125) / math.sqrt(2))
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(logp, ref[:, :1])


# ----------------------------------------------------------------------------------------------------
# The KL estimate against the exact KL of one-token responses


def test_kl_estimate_matches_the_exact_kl_of_one_token_responses():
    """Tokens drawn from the policy's exact next-token distributions after three prompts (the full 50,257-token
    vocabulary): the estimate is within 1e-3 of the exact sum over the vocabulary, and its standard error covers the
    gap."""
    policy, reference = two_policies()
    tok = get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    exact = float(exact_kls(policy, reference, prompts).mean())
    assert exact > 0.01  # the two policies differ: a KL of 0 would make the check empty
    g = torch.Generator().manual_seed(0)
    logp, logq = [], []
    for p in prompts:
        lp, lq = next_token_logprobs(policy, p), next_token_logprobs(reference, p)
        y = torch.multinomial(lp.exp(), 200_000, replacement=True, generator=g)  # (G,) tokens y ~ pi
        logp.append(lp[y])
        logq.append(lq[y])
    ratio = torch.stack(logp) - torch.stack(logq)  # (P, G)
    kl, _ = kl_estimate(torch.stack(logp), torch.stack(logq))
    # the error of sampling on these prompts (the exact KL is of the same prompts): sqrt(sum_p s_p^2 / G) / P
    se = math.sqrt(float(ratio.var(dim=1).sum()) / ratio.shape[1]) / ratio.shape[0]
    assert abs(kl - exact) < 1e-3
    assert abs(kl - exact) <= 3 * se
    assert se < 1e-3 / 2


def test_measure_on_one_token_responses_scores_the_sampled_tokens_exactly():
    """The whole measurement (sampling, the policy's and the reference's log-probs of the samples) on one-token
    responses: each sample's log-probs equal the exact next-token distributions' at the sampled token, and the KL
    estimate falls within 4 standard errors of the exact KL."""
    policy, reference = two_policies()
    tok = get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    G = 300
    ids, mask, samples = sample_summaries(policy, prompts, G, 1, generator=torch.Generator().manual_seed(0))
    assert samples.response_ids.shape == (3 * G, 1)
    tokens = samples.response_ids[:, 0].view(3, G)
    exact_p = torch.stack([next_token_logprobs(policy, p) for p in prompts])  # (P, V)
    exact_q = torch.stack([next_token_logprobs(reference, p) for p in prompts])
    want_p, want_q = exact_p.gather(1, tokens), exact_q.gather(1, tokens)  # (P, G)
    got_p = sequence_logprobs(policy, ids, mask, samples, G).view(3, G).double()
    got_q = sequence_logprobs(reference, ids, mask, samples, G).view(3, G).double()
    assert torch.allclose(got_p, want_p, atol=1e-5)
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(samples.logprobs.sum(1).view(3, G).double(), want_p, atol=1e-5)  # measure's log pi

    out = measure(policy, reference, FrontierPrompts(prompts, PROMPTS), G, 1, tok, torch.Generator().manual_seed(1))
    exact = float(exact_kls(policy, reference, prompts).mean())
    assert abs(out["kl"] - exact) <= 4 * out["kl_se"]
    assert out["response_length"] == 1.0
    same = measure(policy, policy, FrontierPrompts(prompts, PROMPTS), 8, 4, tok, torch.Generator().manual_seed(1))
    assert same["kl"] == pytest.approx(0.0, abs=1e-5)  # a policy against itself (its log-probs from two paths)


# ----------------------------------------------------------------------------------------------------
# Best-of-n on known rewards


def test_best_of_n_keeps_the_first_n_samples_best_by_the_proxy():
    proxy = torch.tensor([[1.0, 3.0, 2.0, 5.0], [4.0, 4.0, 0.0, 1.0], [0.0, -1.0, 7.0, 7.0]])
    assert best_of_n_index(proxy, 1).tolist() == [0, 0, 0]
    assert best_of_n_index(proxy, 2).tolist() == [1, 0, 0]  # a tie goes to the earlier sample
    assert best_of_n_index(proxy, 4).tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="1 <= n <= 4"):
        best_of_n_index(proxy, 5)


def test_best_of_n_kl_formula_and_its_exact_value_without_ties():
    """log n - (n-1)/n by hand, and against the exact KL of best-of-n over m equally likely outcomes with distinct
    rewards (the kept one is the i-th best with probability (i/m)^n - ((i-1)/m)^n): equal as m grows, above it for
    small m (an upper bound, Beirami et al. 2024)."""
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(64) == pytest.approx(math.log(64) - 63 / 64)

    def exact(n: int, m: int) -> float:
        i = torch.arange(1, m + 1, dtype=torch.float64)
        p = (i / m) ** n - ((i - 1) / m) ** n
        return float((p * torch.log(p * m)).sum())

    for n in (2, 4, 16, 64):
        assert exact(n, 100_000) == pytest.approx(best_of_n_kl(n), abs=1e-3)
        assert exact(n, 8) < best_of_n_kl(n)
    with pytest.raises(ValueError):
        best_of_n_kl(0)


def brute_force_best_of_n(proxy: list[float], values: list[float], n: int) -> float:
    """The mean over every n-subset of the pool of the value best-of-n keeps, a tie among the subset's best broken
    at random (the tied members' mean value)."""
    means = []
    for subset in itertools.combinations(range(len(proxy)), n):
        top = max(proxy[i] for i in subset)
        tied = [values[i] for i in subset if proxy[i] == top]
        means.append(sum(tied) / len(tied))
    return sum(means) / len(means)


def test_all_subsets_estimator_is_the_mean_over_every_subset_with_ties():
    """A pool of N = 8 with a three-way and a two-way tie in the proxy (distinct values behind them), and one without
    ties: for every n the estimator equals the brute-force mean over all C(8, n) subsets."""
    pools = [
        ([0.3, 1.0, 1.0, -2.0, 1.0, 0.7, 0.7, 2.5], [1.0, -3.0, 2.0, 0.5, 4.0, 7.0, -1.0, 0.25]),
        ([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        ([1.0] * 8, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]),  # all tied: the pool's mean for every n
    ]
    proxy = torch.tensor([p for p, _ in pools], dtype=torch.float64)
    values = torch.tensor([v for _, v in pools], dtype=torch.float64)
    for n in range(1, 9):
        got = best_of_n_expected(values, proxy, n)
        want = [brute_force_best_of_n(p, v, n) for p, v in pools]
        assert got.tolist() == pytest.approx(want, abs=1e-12), n
        assert best_of_n_weights(proxy, n).sum(1).tolist() == pytest.approx([1.0] * 3, abs=1e-12)
    assert best_of_n_expected(values, proxy, 1).tolist() == pytest.approx(values.mean(1).tolist())
    assert float(best_of_n_expected(values, proxy, 8)[1]) == pytest.approx(1.0)  # n = N: the pool's best, its value
    with pytest.raises(ValueError, match="1 <= n <= 8"):
        best_of_n_weights(proxy, 9)


def exact_best_of_n_kl(q: list[float], reward: list[float], n: int) -> float:
    """KL(best-of-n || q) of a discrete distribution q over outcomes with rewards (ties allowed), by enumerating every
    n-tuple of draws: the kept draw is one of the tuple's best, a tie broken at random."""
    p_bon = [0.0] * len(q)
    for draws in itertools.product(range(len(q)), repeat=n):
        prob = math.prod(q[k] for k in draws)
        top = max(reward[k] for k in draws)
        tied = [k for k in draws if reward[k] == top]
        for k in tied:
            p_bon[k] += prob / len(tied)
    return sum(p * math.log(p / qk) for p, qk in zip(p_bon, q, strict=True) if p > 0)


def test_pool_kl_is_the_exact_kl_of_the_pools_distribution():
    """A pool of 8 holding outcome k m_k times (repeats: one outcome; two distinct outcomes tied in the proxy): the
    estimate is the exact KL of best-of-n under q = m / 8, by enumeration of every n-tuple."""
    counts, reward = [3, 1, 2, 2], [0.5, 1.0, 1.0, 2.0]
    q = [c / 8 for c in counts]
    proxy = torch.tensor([[r for r, c in zip(reward, counts, strict=True) for _ in range(c)]], dtype=torch.float64)
    for n in range(1, 7):
        assert float(best_of_n_pool_kl(proxy, n)[0]) == pytest.approx(exact_best_of_n_kl(q, reward, n), abs=1e-12)
        assert float(best_of_n_pool_kl(proxy, n)[0]) < best_of_n_kl(n) or n == 1  # repeats: below the formula
    # without repeats or ties the same check, and the exact value (i/m)^n - ((i-1)/m)^n per outcome
    distinct = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.3]], dtype=torch.float64)
    for n in (1, 2, 3, 5):
        want = exact_best_of_n_kl([0.2] * 5, distinct[0].tolist(), n)
        assert float(best_of_n_pool_kl(distinct, n)[0]) == pytest.approx(want, abs=1e-12)


def test_pool_kl_approaches_the_formula_as_the_pool_grows_without_repeats():
    for n in (2, 4, 16, 64):
        errors = [
            abs(float(best_of_n_pool_kl(torch.arange(N)[None].double(), n)[0]) - best_of_n_kl(n))
            for N in (64, 1024, 100_000)
        ]
        assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3, (n, errors)
    assert best_of_n_pool_bias(64, 64) == pytest.approx(-0.041, abs=5e-4)  # docs/reporting.md's figures
    assert best_of_n_pool_bias(64, 256) == pytest.approx(-0.003, abs=5e-4)


def test_pool_kl_is_finite_for_a_large_pool_and_unchanged_for_a_small_one():
    """(c/N)^128 underflows to 0 for the lowest samples of a pool above ~340, where 0 log 0 gave NaN: a pool of 1024
    (with and without ties and repeats) gives a finite KL between 0 and the bound log n - (n - 1)/n, close to it
    without repeats; on small pools the value is the direct formula's, sum (F^n - F_-^n) log((F^n - F_-^n) / Q)."""
    g = torch.Generator().manual_seed(0)
    distinct = torch.randn(2, 1024, generator=g, dtype=torch.float64)
    repeats = torch.randint(0, 100, (2, 1024), generator=g).double()  # about 10 copies of each score
    for n in (64, 128, 512):
        kl = best_of_n_pool_kl(torch.cat([distinct, repeats]), n)
        assert torch.isfinite(kl).all() and (kl > 0).all() and (kl <= best_of_n_kl(n) + 1e-9).all(), (n, kl)

    def exact(n: int, m: int) -> float:  # m distinct outcomes, p_i = (i/m)^n - ((i-1)/m)^n in exact fractions
        total = 0.0
        for i in range(1, m + 1):
            p = Fraction(i, m) ** n - Fraction(i - 1, m) ** n
            total += float(p) * (math.log(p.numerator * m) - math.log(p.denominator))
        return total

    want = exact(128, 1024)
    assert best_of_n_kl(128) - 1e-3 < want < best_of_n_kl(128)
    assert best_of_n_pool_kl(distinct, 128).tolist() == pytest.approx([want] * 2, rel=1e-12)
    assert best_of_n_pool_bias(128, 4096) == pytest.approx(exact(128, 4096) - best_of_n_kl(128), rel=1e-9)

    def direct(proxy_PN: torch.Tensor, n: int) -> torch.Tensor:  # the formula as written, fine on a small pool
        N = proxy_PN.shape[1]
        below = (proxy_PN[:, None, :] < proxy_PN[:, :, None]).double().sum(2)  # (P, N) c_lo
        at_or_below = (proxy_PN[:, None, :] <= proxy_PN[:, :, None]).double().sum(2)  # c_hi
        mass = (at_or_below / N) ** n - (below / N) ** n
        block = at_or_below - below
        return (mass / block * torch.log(mass / (block / N))).sum(1)

    small = torch.cat([torch.randn(2, 64, generator=g), torch.randint(0, 9, (2, 64), generator=g)]).double()
    for n in (1, 2, 7, 32, 64):
        assert best_of_n_pool_kl(small, n).tolist() == pytest.approx(direct(small, n).tolist(), rel=1e-12, abs=1e-14)


# ----------------------------------------------------------------------------------------------------
# Paired comparisons over posts, variance components over seeds and posts, sizes, fitted curves


def test_paired_difference_is_the_error_of_the_per_post_differences():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.0, 2.0, 1.0, 5.0])  # differences 1, 0, 2, -1
    out = paired_difference(a, b)
    assert out["difference"] == 0.5
    assert out["se"] == pytest.approx(math.sqrt(5 / 3) / 2)  # sample variance 5/3, over sqrt(4) posts
    assert out["posts"] == 4
    # the interval, on 9 posts of irregular differences (resampled means nearly continuous): the same 2000 resamples
    # drawn here, their means' 2.5% and 97.5% percentiles taken with numpy (linear interpolation)
    d = np.array([0.31, -1.2, 2.05, 0.7, -0.45, 1.6, 0.02, 3.3, -0.9])
    out = paired_difference(torch.tensor(d) + 1.0, torch.ones(9), seed=3)
    idx = torch.randint(0, 9, (2000, 9), generator=torch.Generator().manual_seed(3)).numpy()
    lo, hi = np.percentile(d[idx].mean(1), [2.5, 97.5])
    assert (out["ci_low"], out["ci_high"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    # not the two points' errors combined: what the posts share cancels
    combined = math.hypot(mean_and_se_over_posts(a)[1], mean_and_se_over_posts(b)[1])
    assert combined == pytest.approx(math.sqrt(5 / 3 / 4 + 14 / 3 / 4)) and out["se"] < combined


def test_sqrt_kl_interpolation_by_hand():
    assert sqrt_kl_interpolation([0.0, 1.0, 4.0], 2.25) == (1, 2, 0.5)  # sqrt: 0, 1, 2; at 1.5
    assert sqrt_kl_interpolation([0.0, 1.0, 4.0], 0.25) == (0, 1, 0.5)
    assert sqrt_kl_interpolation([0.0, 1.0, 4.0], -0.1) == (0, 0, 0.0)  # below 0: the first point
    assert sqrt_kl_interpolation([0.0, 1.0, 4.0], 4.01) is None  # no extrapolation


def test_t_quantile_against_the_tables():
    for p, df, want in ((0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 10, 2.2281), (0.8, 33, 0.8526)):
        assert t_quantile(p, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.025, 10) == pytest.approx(-2.2281, abs=1e-4)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-6)


def test_variance_components_by_hand():
    """2 seeds x 3 posts: seeds' means 2 and 5, posts' means 2, 3, 5.5; MS_seed 13.5, MS_post 6.5, MS_res 1.5."""
    v = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 8.0]])
    c = variance_components(v)
    assert c["mean"] == 3.5
    assert c["var_seed"] == pytest.approx(4.0) and c["var_post"] == pytest.approx(2.5)
    assert c["var_residual"] == pytest.approx(1.5)
    assert c["se"] ** 2 == pytest.approx(4.0 / 2 + 2.5 / 3 + 1.5 / 6)  # = (13.5 + 6.5 - 1.5) / 6
    assert c["df"] == pytest.approx(18.5**2 / (13.5**2 + 6.5**2 / 2 + 1.5**2 / 2))
    interval = difference_interval(v)
    half = t_quantile(0.975, c["df"]) * c["se"]
    assert (interval["ci_low"], interval["ci_high"]) == pytest.approx((3.5 - half, 3.5 + half))
    assert not interval["distinguishable"] and not c["seed_floor"]  # df 1.67: the t interval is wide
    # equal seeds: no seed component, the error of the posts' means (MS_post / (S P))
    same = variance_components(torch.tensor([[1.0, 2.0, 6.0], [1.0, 2.0, 6.0]]))
    assert same["var_seed"] == 0.0 and same["se"] ** 2 == pytest.approx(2 * 7.0 / 6)
    one = variance_components(torch.tensor([[1.0, 2.0, 6.0]]))
    assert math.isnan(one["var_seed"]) and one["se"] == pytest.approx(math.sqrt(7.0 / 3)) and one["df"] == 2


def test_a_seed_component_clipped_at_zero_keeps_the_seeds_degrees_of_freedom():
    """Two seeds that agree by chance do not give the interval of posts alone. 2 seeds x 3 posts with equal seeds'
    means and equal posts' means: MS_seed 0, MS_post 0, MS_res 8 (residuals +-2): both components clipped, the error
    is MS_res / (S P) at the seeds' 1 degree of freedom, not the residual's 2."""
    c = variance_components(torch.tensor([[0.0, 4.0, 2.0], [4.0, 0.0, 2.0]]))
    assert c["var_seed"] == 0.0 and c["var_post"] == 0.0 and c["var_residual"] == pytest.approx(8.0)
    assert c["se"] ** 2 == pytest.approx(8.0 / 6) and c["df"] == pytest.approx(1.0) and c["seed_floor"]
    # 2 seeds x 200 posts, seeds' means made equal: the error is the posts' (MS_post / (S P)), its df Satterthwaite's
    # with MS_res at 1 df: 14.6, not the 199 of posts alone
    g = torch.Generator().manual_seed(0)
    v = torch.randn(200, generator=g, dtype=torch.float64) + 0.8 * torch.randn(2, 200, generator=g, dtype=torch.float64)
    v = v - v.mean(1, keepdim=True) + 0.1
    S, P = v.shape
    ms_post = S * float(v.mean(0).var())
    resid = v - v.mean(1, keepdim=True) - v.mean(0, keepdim=True) + v.mean()
    ms_res = float((resid**2).sum()) / ((S - 1) * (P - 1))
    c = variance_components(v)
    assert c["var_seed"] == 0.0 and c["se"] ** 2 == pytest.approx(ms_post / (S * P))
    want_df = ms_post**2 / (ms_res**2 / 1 + ms_post**2 / (P - 1) + ms_res**2 / ((S - 1) * (P - 1)))
    assert c["df"] == pytest.approx(want_df) and c["df"] < 20  # 14.6


def test_sizes_and_the_smallest_detectable_difference_by_hand():
    # (t_.975 + t_.8) se: with many degrees of freedom the normal's 1.95996 + 0.84162
    assert detectable_difference(0.1, 1e6) == pytest.approx(0.280158, abs=1e-5)
    # sd 1, delta 0.5: 34 units ((2.0345 + 0.8526) / sqrt(34) = 0.4951), 33 too few (0.5031)
    assert units_needed(1.0, 0.5) == 34
    assert units_needed(0.0, 0.5) == 2
    # sd 0.7 per post, delta 0.05: about ((1.96 + 0.84) 0.7 / 0.05)^2 = 1,538 posts
    assert units_needed(0.7, 0.05) == pytest.approx(1540, abs=5)
    # from variance components: the seeds' part alone (var_seed 0.01, nothing else) is units_needed(sd 0.1): 10 seeds
    # ((2.262 + 0.883) / sqrt(10) = 0.9946 <= 1; 9: 1.065); the posts' part alone, units_needed(1, 0.5) = 34 posts
    seeds_only = {"var_seed": 0.01, "var_post": 0.0, "var_residual": 0.0}
    assert seeds_needed(seeds_only, 100, 0.1) == units_needed(1.0, 1.0) == 10
    assert posts_needed({"var_seed": 0.0, "var_post": 1.0, "var_residual": 0.0}, 4, 0.5) == 34
    assert posts_needed({"var_seed": math.nan, "var_post": 1.0, "var_residual": 0.0}, 1, 0.5) == 34  # one seed
    # the residual shrinks with seeds x posts (4 seeds of var_residual 4: error 1 / sqrt(P)), but with no post
    # component the interval's df is the seeds' 3 however many posts (difference_interval's): (t_.975,3 + t_.8,3)
    # / sqrt(P) = (3.1824 + 0.9785) / sqrt(P) <= 0.5 from P = 70 (69: 0.5009), not the 34 of df P - 1
    assert posts_needed({"var_seed": 0.0, "var_post": 0.0, "var_residual": 4.0}, 4, 0.5) == 70
    # var_post / P does not shrink with seeds (the same posts in every run): no number of seeds reaches 0.05 on 100
    # posts of var_post 0.5 ((1.96 + 0.84) sqrt(0.005) = 0.198); var_seed / S alone: no number of posts
    assert seeds_needed({"var_seed": 0.01, "var_post": 0.5, "var_residual": 1.0}, 100, 0.05) is None
    assert posts_needed({"var_seed": 0.01, "var_post": 0.5, "var_residual": 1.0}, 2, 0.05) is None


def test_sizes_are_counted_at_the_intervals_own_degrees_of_freedom():
    """6 seeds x 400 posts of differences with no post component (the posts' means made equal): the interval's df is
    the seeds' 5, and it detects a little more than 0.05; so 0.05 needs more than 400 posts, in closed form at df 5:
    var_seed / 6 + var_residual / (6 P) <= (0.05 / (t_.975,5 + t_.8,5))^2. At df P - 1 it would be fewer than 400."""
    g = torch.Generator().manual_seed(1)
    v = 0.03 * torch.randn(6, 1, generator=g, dtype=torch.float64) + torch.randn(
        6, 400, generator=g, dtype=torch.float64
    )
    v = v - v.mean(0, keepdim=True)  # every post's mean 0: MS_post = 0, the post component clipped
    v = -0.04 + v * (0.0146 / variance_components(v)["se"])  # se 0.0146 at df 5: detectable 3.49 x 0.0146 = 0.051
    c = difference_interval(v)
    assert c["var_post"] == 0.0 and c["df"] == pytest.approx(5.0)
    detectable = detectable_difference(c["se"], c["df"])
    assert detectable == pytest.approx(0.051, abs=5e-4)
    t5 = t_quantile(0.975, 5) + t_quantile(0.8, 5)
    want = math.ceil(c["var_residual"] / (6 * (0.05 / t5) ** 2 - c["var_seed"]))
    assert 400 < want < 1000 and posts_needed(c, 6, 0.05) == want
    assert posts_needed(c, 6, round(detectable, 6) + 1e-6) <= 400 < posts_needed(c, 6, round(detectable, 6) - 1e-6)
    # seeds with a post component: Satterthwaite's df of the mean squares at S seeds, (1 + 25 S)^2 / ..., above S - 1,
    # found here by a scan over S (seeds_needed bisects)
    comps = {"var_seed": 0.01, "var_post": 0.25, "var_residual": 0.5}
    P = 100

    def detectable_at(S: int) -> float:
        ms = [(P * 0.01 + 0.5, S - 1, 1.0), (S * 0.25 + 0.5, P - 1, 1.0), (0.5, (S - 1) * (P - 1), -1.0)]
        df = sum(c * m for m, _, c in ms) ** 2 / sum((c * m) ** 2 / d for m, d, c in ms)
        return detectable_difference(math.sqrt(0.01 / S + 0.25 / P + 0.5 / (S * P)), df)

    want = next(S for S in range(2, 100) if detectable_at(S) <= 0.2)
    assert seeds_needed(comps, P, 0.2) == want == 7  # at df S - 1: 10


@pytest.mark.parametrize("form", ["bon", "rl"])
def test_gao_fit_recovers_alpha_and_beta(form):
    d = torch.linspace(0.1, 2.0, 12, dtype=torch.float64)
    exact = gao_curve(d, 1.2, 0.3, form)
    assert gao_fit(d, exact, form) == pytest.approx((1.2, 0.3), abs=1e-10)
    noise = 0.01 * torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert gao_fit(d, exact + noise, form) == pytest.approx((1.2, 0.3), abs=0.05)
    assert float(gao_curve(torch.tensor([0.0]), 1.2, 0.3, form)[0]) == 0.0  # R(0) = 0: no gain at the reference
    with pytest.raises(ValueError, match="distinct d > 0"):
        gao_fit(torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]), form)


def post_point(kl: list[float], gold: list[float], n: int | None = None) -> dict:
    """A frontier point with per-post values (and its means), as frontier_points and best_of_n give them."""
    point = {"kl": sum(kl) / len(kl), "gold": sum(gold) / len(gold), "posts": {"kl": kl, "gold": gold}}
    return point | ({"n": n} if n is not None else {})


def test_verdict_rows_pair_posts_and_match_kl():
    """Best-of-n at KL 0 and 1 (mean over posts), a method at KL 0.25 (sqrt 0.5: best-of-n halfway in sqrt(KL)), and a
    second method at KL 1 whose path passes KL 0.25 at its first evaluation: every difference by hand."""
    curve = [post_point([0.0, 0.0, 0.0], [1.0, 2.0, 3.0], 1), post_point([1.0, 1.0, 1.0], [3.0, 2.0, 5.0], 2)]
    a = [[post_point([0.0] * 3, [1.0, 2.0, 3.0]), post_point([0.25] * 3, [2.5, 2.5, 3.5])]]
    b = [
        [
            post_point([0.0] * 3, [1.0, 2.0, 3.0]),
            post_point([0.25] * 3, [2.0, 2.0, 3.0]),
            post_point([1.0] * 3, [0.0] * 3),
        ]
    ]
    rows = verdict_rows({"A": a, "B": b}, curve, [("A", BEST_OF_N), ("A", "B"), ("B", BEST_OF_N)], n_resamples=200)
    # A - best-of-n at 0.25: best-of-n halfway, per post 2, 2, 4; A 2.5, 2.5, 3.5: differences 0.5, 0.5, -0.5
    assert rows[0]["kl"] == 0.25 and rows[0]["difference"] == pytest.approx(1 / 6)
    assert rows[0]["se_posts"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))
    # A - B at A's KL (the smaller): B's path at 0.25 is its second evaluation: 0.5, 0.5, 0.5
    assert rows[1]["kl"] == 0.25 and rows[1]["difference"] == pytest.approx(0.5) and rows[1]["se_posts"] == 0.0
    # B at KL 1: best-of-n's largest n exactly
    assert rows[2]["difference"] == pytest.approx(-10 / 3)
    assert all(r["seeds"] == 1 and r["posts"] == 3 for r in rows)
    # one seed: posts alone at df P - 1; per-post variance 1/3, so (t_.975,P-1 + t_.8,P-1) sqrt(1 / (3 P)) <= 0.05 from
    # P = 1049 ((1.9623 + 0.8420) / sqrt(3147) = 0.04999; 1048: 0.05001)
    assert math.isnan(rows[0]["seeds_needed"]) and rows[0]["posts_needed"] == 1049
    for P, enough in ((1048, False), (1049, True)):
        t = t_quantile(0.975, P - 1) + t_quantile(0.8, P - 1)
        assert (t * math.sqrt(1 / (3 * P)) <= 0.05) == enough
    beyond = verdict_rows({"B": b}, curve[:1] + [post_point([0.5] * 3, [1.0] * 3, 2)], [("B", BEST_OF_N)])
    assert "beyond best-of-n" in beyond[0]["note"]
    table = verdict_table(rows)
    assert "| A - best-of-n | 0.250 (matched) | +0.167 |" in table and "| A - B | 0.250 (matched) | +0.500 |" in table


def interval_by_hand(d: list[list[float]]) -> dict[str, float]:
    """The two-way crossed model of differences d (S seeds x P posts) from its mean squares, written out: the mean,
    se^2 = (MS_seed + MS_post - MS_res) / (S P), Satterthwaite's df and the 95% t interval (both components above 0)."""
    S, P = len(d), len(d[0])
    m = sum(map(sum, d)) / (S * P)
    seed_m = [sum(row) / P for row in d]
    post_m = [sum(d[s][p] for s in range(S)) / S for p in range(P)]
    ms_seed = P * sum((x - m) ** 2 for x in seed_m) / (S - 1)
    ms_post = S * sum((x - m) ** 2 for x in post_m) / (P - 1)
    ms_res = sum((d[s][p] - seed_m[s] - post_m[p] + m) ** 2 for s in range(S) for p in range(P)) / ((S - 1) * (P - 1))
    assert ms_seed > ms_res and ms_post > ms_res  # neither component clipped: the general case
    total = ms_seed + ms_post - ms_res
    df = total**2 / (ms_seed**2 / (S - 1) + ms_post**2 / (P - 1) + ms_res**2 / ((S - 1) * (P - 1)))
    se = math.sqrt(total / (S * P))
    half = t_quantile(0.975, df) * se
    return {"difference": m, "se": se, "df": df, "ci_low": m - half, "ci_high": m + half}


def test_verdict_rows_pair_three_seeds_by_seed():
    """Three seeds of A (each one evaluation, at KL 0.25, 0.36, 0.16) and four of B (each from KL 0 to 1; the fourth
    unpaired), seed effects that differ and that B shares seed by seed with A: A - B pairs seed s with seed s, at each
    seed's own matched KL (B interpolated back in sqrt(KL): weight sqrt(k_s)), and A - best-of-n matches best-of-n to
    each seed's KL; the difference, its error over posts and its t interval with the seeds' spread against the
    (seeds, posts) table written out by hand."""
    curve = [post_point([0.0] * 4, [1.0, 2.0, 3.0, 4.0], 1), post_point([1.0] * 4, [3.0, 2.0, 5.0, 4.0], 2)]
    kls = [0.25, 0.36, 0.16]
    a_gold = [[2.0, 2.6, 3.9, 4.4], [3.2, 3.1, 4.9, 5.6], [1.5, 1.9, 3.0, 4.3]]
    b_paths = [
        ([1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 3.5, 5.0]),
        ([1.2, 2.1, 3.3, 4.2], [2.8, 3.1, 4.5, 5.6]),
        ([0.9, 1.8, 2.9, 3.9], [1.6, 2.2, 3.0, 4.1]),
        ([0.0] * 4, [9.0] * 4),  # B's fourth seed: A has three, so it is left out
    ]
    a = [[post_point([k] * 4, g)] for k, g in zip(kls, a_gold, strict=True)]
    b = [[post_point([0.0] * 4, g0), post_point([1.0] * 4, g1)] for g0, g1 in b_paths]
    rows = verdict_rows({"A": a, "B": b}, curve, [("A", "B"), ("A", BEST_OF_N)], n_resamples=200)

    def at(g0, g1, k):  # a path from KL 0 to KL 1 at KL k, linear in sqrt(KL)
        return [(1 - math.sqrt(k)) * x + math.sqrt(k) * y for x, y in zip(g0, g1, strict=True)]

    bon = curve[0]["posts"]["gold"], curve[1]["posts"]["gold"]
    d_ab = [[x - y for x, y in zip(a_gold[s], at(*b_paths[s], kls[s]), strict=True)] for s in range(3)]
    d_bon = [[x - y for x, y in zip(a_gold[s], at(*bon, kls[s]), strict=True)] for s in range(3)]
    for row, d in ((rows[0], d_ab), (rows[1], d_bon)):
        want = interval_by_hand(d)
        assert row["seeds"] == 3 and row["posts"] == 4 and row["kl"] == pytest.approx(sum(kls) / 3)
        for k, v in want.items():
            assert row[k] == pytest.approx(v, rel=1e-9), (row["pair"], k)
        assert row["excludes_0"] == (not want["ci_low"] <= 0 <= want["ci_high"])
        # per seed what a dose's trend reads: its matched KL, its mean difference and that difference's variance
        assert row["seed_kls"] == pytest.approx(kls) and row["seed_differences"] == pytest.approx(
            [sum(x) / 4 for x in d]
        )
        assert row["seed_variances"] == pytest.approx([sum((v - sum(x) / 4) ** 2 for v in x) / 3 for x in d])
        post_means = [sum(d[s][p] for s in range(3)) / 3 for p in range(4)]
        mean = sum(post_means) / 4
        assert row["se_posts"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in post_means) / 3 / 4))
    # the pairing matters here: B's seeds in another order would give another interval
    shuffled = [[x - y for x, y in zip(a_gold[s], at(*b_paths[(s + 1) % 3], kls[s]), strict=True)] for s in range(3)]
    assert abs(rows[0]["se"] - interval_by_hand(shuffled)["se"]) > 0.05


def test_verdict_rows_bootstrap_drops_resamples_beyond_best_of_n():
    """A method whose mean KL (0.9) best-of-n reaches (1.0), but one post's KL is 3: resamples holding that post twice
    or more (a share of 1 - (3/4)^4 - 4 (1/4)(3/4)^3 = 0.262 of them) pass best-of-n's largest KL. The interval comes
    from the others, their share is reported and the table says so."""
    curve = [post_point([0.0] * 4, [1.0, 2.0, 3.0, 4.0], 1), post_point([1.0] * 4, [2.0, 3.0, 4.0, 5.0], 2)]
    a = [[post_point([0.2, 0.2, 0.2, 3.0], [2.0, 2.5, 4.0, 4.0])]]
    (row,) = verdict_rows({"A": a}, curve, [("A", BEST_OF_N)], n_resamples=4000)
    assert row["ci_posts_unmatched"] == pytest.approx(0.262, abs=0.02)
    # the interval from the same resamples drawn here: best-of-n's gold is best-of-1's + sqrt(KL) on every post, so a
    # resample's difference is mean(A - best-of-1) - sqrt(mean KL), undefined where the mean KL passes 1
    idx = torch.randint(0, 4, (4000, 4), generator=torch.Generator().manual_seed(0)).numpy()
    kl, gain = np.array([0.2, 0.2, 0.2, 3.0]), np.array([1.0, 0.5, 1.0, 0.0])  # A's KL, A - best-of-1 per post
    mean_kl = kl[idx].mean(1)
    d = gain[idx].mean(1)[mean_kl <= 1] - np.sqrt(mean_kl[mean_kl <= 1])
    assert row["ci_posts_unmatched"] == pytest.approx(float((mean_kl > 1).mean()), abs=1e-12)
    lo, hi = np.percentile(d, [2.5, 97.5])
    assert (row["ci_posts_low"], row["ci_posts_high"]) == (pytest.approx(lo, abs=1e-9), pytest.approx(hi, abs=1e-9))
    assert "% of resamples unmatched)" in verdict_table([row])


def test_frontier_table_fits_gaos_forms_through_points_made_from_them(tmp_path):
    """Best-of-n's points on R_bon and a method's evaluations (two seeds) on R_RL, alpha 1.2 and beta 0.3, each post's
    gold the same gain over its own baseline: the fits give alpha and beta back with degenerate intervals, the table
    holds the points (both KLs), the variance components, each method minus best-of-n at its KL and the fits, and
    the picture draws."""
    from evaluation.frontier import plot_frontier
    from evaluation.matched import fit_curves

    base = [1.0, 2.0, 4.0]  # three posts, each its own reference gold

    def point(kl, form, n=None):
        gain = float(gao_curve(torch.tensor([math.sqrt(kl)], dtype=torch.float64), 1.2, 0.3, form)[0])
        return post_point([kl] * 3, [b + gain for b in base], n)

    curve = [
        point(k, "bon", n) | {"kl_bound": best_of_n_kl(n), "pool": 64}
        for n, k in ((1, 0.0), (2, 0.2), (4, 0.6), (8, 1.1))
    ]
    for p in curve:
        p |= {"kl_se": 0.0, "gold_se": 0.0}
    seeds = [[point(k, "rl") | {"kl_se": 0.0, "gold_se": 0.0} for k in (0.0, 0.3, 0.8)] for _ in range(2)]
    methods = {"GRPO": seeds}
    fits = fit_curves(curve, methods, n_resamples=50)
    for name, form in (("best-of-n", "bon"), ("GRPO", "rl")):
        f = fits[name]
        assert f["form"] == form and (f["alpha"], f["beta"]) == pytest.approx((1.2, 0.3), abs=1e-9)
        assert f["alpha_ci"] == pytest.approx([1.2, 1.2], abs=1e-9) and f["baseline"] == pytest.approx(7 / 3)
    text = frontier_table(curve, methods)
    assert "| policy | seeds | kl | kl bound | gold |" in text
    assert "| best-of-8 (reference, pool 64) | | 1.100 ± 0.000 | 1.204 | " in text
    assert "| GRPO | 2 | 3.437 | 0.882 | 0.000 | 1.528 | 0.000 |" in text  # seeds alike: only posts differ
    assert "| GRPO - best-of-n | 0.800 (matched) |" in text
    assert "| best-of-n | d (alpha - beta d) | 1.200 [1.200, 1.200] | 0.300 [0.300, 0.300] |" in text
    assert "| GRPO | d (alpha - beta log d) | 1.200 [1.200, 1.200] | 0.300 [0.300, 0.300] |" in text
    plot_frontier(curve, methods, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_fit_intervals_count_the_seeds_spread():
    """Three seeds of a method on R_RL with alpha 1.0, 1.2 and 1.4 (beta 0.3), every post the same gain over its own
    baseline: resampling posts with the seeds fixed gives the point [1.2, 1.2] (the fit through all three seeds'
    points is their mean), while the seeds' spread is real. With the seeds resampled too, alpha's interval is the
    spread of the mean of three draws from {1.0, 1.2, 1.4}: inside [1.0, 1.4], at least 0.2 wide; beta stays 0.3
    (every seed has it). Best-of-n, one curve, keeps its interval over posts (degenerate here)."""
    from evaluation.matched import fit_curves

    base = [1.0, 2.0, 4.0]

    def point(kl, form, alpha, n=None):
        gain = float(gao_curve(torch.tensor([math.sqrt(kl)], dtype=torch.float64), alpha, 0.3, form)[0])
        return post_point([kl] * 3, [b + gain for b in base], n)

    curve = [point(k, "bon", 1.2, n) for n, k in ((1, 0.0), (2, 0.2), (4, 0.6), (8, 1.1))]
    seeds = [[point(k, "rl", alpha) for k in (0.0, 0.3, 0.8)] for alpha in (1.0, 1.2, 1.4)]
    fits = fit_curves(curve, {"GRPO": seeds}, n_resamples=400)
    f = fits["GRPO"]
    assert (f["alpha"], f["beta"]) == pytest.approx((1.2, 0.3), abs=1e-9)
    low, high = f["alpha_ci"]
    assert 1.0 - 1e-9 <= low <= 1.1 and 1.3 <= high <= 1.4 + 1e-9, f["alpha_ci"]
    assert f["beta_ci"] == pytest.approx([0.3, 0.3], abs=1e-9)
    assert fits["best-of-n"]["alpha_ci"] == pytest.approx([1.2, 1.2], abs=1e-9)


def test_evaluate_writes_per_post_values_that_frontier_points_reads(tmp_path):
    """Frontier.evaluate at two steps with a run's logger: frontier_posts.jsonl holds each post's values, and
    frontier_points gives them back with the logged means (the mean of the per-post values)."""
    from types import SimpleNamespace

    from evaluation.frontier_declarations import FrontierConfig
    from evaluation.measure import Frontier
    from utils.logging import Logger

    paths = write_task(tmp_path / "data", seed=0)
    policy, reference = two_policies()
    cfg = SimpleNamespace(**vars(FrontierConfig(frontier_prompts=3, frontier_samples=2)), seed=0)
    logger = Logger(tmp_path / "run", {"seed": 0}, "test", "run", "disabled", enabled=True)
    run = SimpleNamespace(dtype=None, device=torch.device("cpu"), logger=logger)
    frontier = Frontier(cfg, str(paths["sft_validation"]), "", get_tokenizer(), 64, 4, run, gold_fn=lambda p, s: len(s))
    for step in (0, 5):
        logger.log(frontier.evaluate(policy, reference, step), step=step)
    logger.finish()
    points = frontier_points(tmp_path / "run")
    assert [p["step"] for p in points] == [0, 5]
    for p in points:
        assert set(p["posts"]) == {"kl", "gold", "response_length"} and len(p["posts"]["kl"]) == 3
        assert p["kl"] == pytest.approx(sum(p["posts"]["kl"]) / 3)
        assert p["gold"] == pytest.approx(sum(p["posts"]["gold"]) / 3)
        assert p["gold_se"] == pytest.approx(mean_and_se_over_posts(torch.tensor(p["posts"]["gold"]))[1])
    assert points[0]["posts"] != points[1]["posts"]  # each evaluation its own samples (the generator keyed by step)


class TableReward(torch.nn.Module):
    """A stand-in reward model for best_of_n: the raw score of a response is a fixed value per response token id
    (looked up in `table`), summed; gain 1 and bias 0."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.gain, self.bias = torch.tensor(1.0), torch.tensor(0.0)

    def forward(self, input_ids, position_ids, mask, prompt_len=None):
        return self.table[input_ids[:, -1]]  # one-token responses: the last column is the response token

    def normalize(self, raw):
        return self.gain * raw + self.bias


def test_best_of_n_curve_on_known_rewards():
    """One-token samples from a peaked policy (summaries repeat), a proxy that scores each token by a known table and a
    gold reward of the text: for every n the curve's proxy and gold are the brute-force means over every n-subset of
    each prompt's pool, its KL the exact KL of best-of-n over the pool's empirical distribution (a repeated token one
    outcome), its bound the formula, and the per-post values average to the point."""
    policy, _ = two_policies()
    with torch.no_grad():  # larger logits (the head is tied to wte): a peaked distribution, so tokens repeat
        policy.transformer.wte.weight.mul_(30)
    tok = get_tokenizer()
    prompts = FrontierPrompts([tok.encode(p) for p in PROMPTS], PROMPTS)
    table = torch.randn(50257, generator=torch.Generator().manual_seed(3))
    gold = lambda prompt, text: float(len(text))  # noqa: E731  (a known function of the text)
    gen = torch.Generator().manual_seed(5)
    curve = best_of_n(policy, prompts, TableReward(table), tok, gen, 1, n_max=8, gold_fn=gold, pool=8)
    assert [p["n"] for p in curve] == [1, 2, 4, 8]
    assert [p["kl_bound"] for p in curve] == [best_of_n_kl(n) for n in (1, 2, 4, 8)]
    _, _, samples = sample_summaries(policy, prompts.prompts, 8, 1, generator=torch.Generator().manual_seed(5))
    tokens = samples.response_ids[:, 0].view(3, 8)
    assert curve[0]["repeats"] > 0.2  # the check covers repeats
    scores = table[tokens].double()
    texts = [tok.decode([t]) for t in tokens.flatten().tolist()]
    golds = torch.tensor([len(t if t != "<|endoftext|>" else "\n") for t in texts], dtype=torch.float64).view(3, 8)
    for point in curve:
        n = point["n"]
        proxy = [brute_force_best_of_n(scores[p].tolist(), scores[p].tolist(), n) for p in range(3)]
        gold_n = [brute_force_best_of_n(scores[p].tolist(), golds[p].tolist(), n) for p in range(3)]
        assert point["posts"]["proxy"] == pytest.approx(proxy) and point["proxy"] == pytest.approx(sum(proxy) / 3)
        assert point["posts"]["gold"] == pytest.approx(gold_n) and point["gold"] == pytest.approx(sum(gold_n) / 3)
        kls = []
        for p in range(3):
            outcomes = sorted(set(tokens[p].tolist()))
            q = [tokens[p].tolist().count(t) / 8 for t in outcomes]
            kls.append(exact_best_of_n_kl(q, [float(table[t]) for t in outcomes], n))
        assert point["posts"]["kl"] == pytest.approx(kls, abs=1e-12) and point["kl"] == pytest.approx(sum(kls) / 3)
        assert point["kl"] <= point["kl_bound"] + 1e-12
    assert curve[-1]["proxy"] >= curve[0]["proxy"]
    with pytest.raises(ValueError, match="pool"):
        best_of_n(policy, prompts, TableReward(table), tok, gen, 1, n_max=8, pool=4)


def test_metric_names_are_the_ones_evaluate_logs(tmp_path):
    # the stages check --best_metric against Frontier.metric_names before their first step, without evaluating
    from types import SimpleNamespace

    from evaluation.frontier_declarations import FrontierConfig
    from evaluation.measure import Frontier

    paths = write_task(tmp_path / "data", seed=0)
    policy, reference = two_policies()
    torch.manual_seed(0)
    reward_model = RewardModel(PRESETS["tiny"]).eval()
    cfg = SimpleNamespace(**vars(FrontierConfig(frontier_prompts=2, frontier_samples=2)), seed=0)
    run = SimpleNamespace(dtype=None, device=torch.device("cpu"))
    for rm, gold in ((None, None), (reward_model, None), (reward_model, lambda prompt, response: 1.0)):
        for source in (paths["sft_validation"], paths["preference_validation"]):  # with and without references
            frontier = Frontier(cfg, str(source), "", get_tokenizer(), 64, 4, run, reward_model=rm, gold_fn=gold)
            assert set(frontier.evaluate(policy, reference, 0)) == frontier.metric_names()

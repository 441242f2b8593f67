"""The reward-KL frontier's estimators (evaluation/frontier.py, evaluation/best_of_n.py) as pure functions of tensors:
means of per-sample values over P held-out prompts x G samples, the KL to the reference, best-of-n from the reference
(its exact KL, its expectation over every subset of a pool, the KL of a pool's best-of-n) and Gao, Schulman and Hilton's
(2022) forms of gold gained against sqrt(KL)."""

import math

import torch

from rlhf.stats import mean_and_se


def kl_estimate(logp_policy_PG: torch.Tensor, logp_reference_PG: torch.Tensor) -> tuple[float, float]:
    """KL(pi || pi_ref) on held-out prompts from samples y ~ pi (P prompts x G samples): the mean over samples of
    log pi(y|x) - log pi_ref(y|x), each the sum over the response's tokens (an unbiased estimate of the sequence-level
    KL, E_pi[log pi / pi_ref]), with its standard error (mean_and_se)."""
    if logp_policy_PG.shape != logp_reference_PG.shape:
        raise ValueError(
            f"log-probs under the policy {tuple(logp_policy_PG.shape)} and the reference "
            f"{tuple(logp_reference_PG.shape)} must have the same shape"
        )
    return mean_and_se(logp_policy_PG.double() - logp_reference_PG.double())


def best_of_n_index(proxy_PG: torch.Tensor, n: int) -> torch.Tensor:
    """Column (P,) of the sample the proxy ranks first among the first n of each prompt's G samples (nested subsets:
    best-of-n for every n from one set of samples); a tie goes to the earlier sample."""
    if not 1 <= n <= proxy_PG.shape[1]:
        raise ValueError(f"best-of-n needs 1 <= n <= {proxy_PG.shape[1]} samples per prompt, got n = {n}")
    first_n = proxy_PG[:, :n].double()  # (P, n)
    is_max = first_n == first_n.max(dim=1, keepdim=True).values  # (P, n)
    return is_max.long().argmax(dim=1)  # the first column holding the maximum


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || pi_ref) = log n - (n - 1) / n, the formula of Stiennon et al. 2020 (appendix G.3) and Gao et
    al. 2022 (arXiv 2210.10760, eq. 1). Exact only when no two samples tie under the proxy; in general an upper bound
    on the true KL (Beirami et al. 2024, arXiv 2401.01879), so best-of-n sits at or left of where it is drawn."""
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def binomial_ratio(c: torch.Tensor, n: int, N: int) -> torch.Tensor:
    """C(c, n) / C(N, n) in float64 for counts c (any shape, 0 <= c <= N): the chance that a random n-subset of N
    items falls within a given c of them; 0 for c < n."""
    c = c.double()
    log_ratio = (
        torch.lgamma(c + 1) - torch.lgamma((c - n + 1).clamp(min=1)) - math.lgamma(N + 1) + math.lgamma(N - n + 1)
    )
    return torch.where(c >= n, log_ratio.exp(), torch.zeros_like(c))


def tie_blocks(proxy_PN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample of each prompt's N samples (P, N): how many samples of its prompt the proxy scores strictly
    below it (c_lo) and at or below it (c_hi); c_hi - c_lo is the size of its block of tied scores."""
    proxy = proxy_PN.double()
    sorted_PN = proxy.sort(dim=1).values
    c_lo = torch.searchsorted(sorted_PN, proxy, right=False)
    c_hi = torch.searchsorted(sorted_PN, proxy, right=True)
    return c_lo, c_hi


def best_of_n_weights(proxy_PN: torch.Tensor, n: int) -> torch.Tensor:
    """Weights (P, N) float64, summing to 1 per prompt, such that sum_i w_i v_i is the expected value v of best-of-n
    over every n-subset of a prompt's pool of N samples at once (unbiased for best-of-n from the sampling policy,
    with far less variance than one subset; the estimator of pass@k, Chen et al. 2021, arXiv 2107.03374).

    Sorted by the proxy without ties, the i-th smallest sample is the best of a random n-subset with probability
    C(i-1, n-1) / C(N, n). With ties, best-of-n breaks a tie at random: for a block of b samples with the same score,
    c_lo of the pool below it and c_hi = c_lo + b at or below, the subset's best lies in the block with probability
    [C(c_hi, n) - C(c_lo, n)] / C(N, n) (all n in the c_hi, not all in the c_lo); given that, every sample of the
    block is equally likely to be the one kept (the subset is a random one and the tie is broken at random), so each
    gets 1/b of it: tied samples share the block's mean value. Without ties C(i, n) - C(i-1, n) = C(i-1, n-1)."""
    P, N = proxy_PN.shape
    if not 1 <= n <= N:
        raise ValueError(f"best-of-n needs 1 <= n <= {N} samples per prompt, got n = {n}")
    c_lo, c_hi = tie_blocks(proxy_PN)
    return (binomial_ratio(c_hi, n, N) - binomial_ratio(c_lo, n, N)) / (c_hi - c_lo).double()


def best_of_n_expected(values_PN: torch.Tensor, proxy_PN: torch.Tensor, n: int) -> torch.Tensor:
    """Expected value (P,) of the sample best-of-n keeps, over every n-subset of each prompt's pool
    (best_of_n_weights)."""
    return (best_of_n_weights(proxy_PN, n) * values_PN.double()).sum(1)


def best_of_n_pool_kl(proxy_PN: torch.Tensor, n: int) -> torch.Tensor:
    """KL(best-of-n || pi_ref) (P,) of each prompt, from its pool of N samples of pi_ref, in nats.

    With F the proxy's empirical CDF over the pool, best-of-n keeps a summary of score r with probability
    F(r)^n - F(r-)^n; a summary drawn m times is one outcome of probability m / N under pi_ref, so repeats must carry
    one score (evaluation.best_of_n gives a repeat its first occurrence's). Distinct summaries that tie share the
    block's probability in proportion to their own (the tie broken at random, as in best_of_n_weights), so the
    log-ratio is the block's, log((F(r)^n - F(r-)^n) / Q_r) with Q_r = F(r) - F(r-), and

        KL = sum over blocks of tied scores (F(r)^n - F(r-)^n) log((F(r)^n - F(r-)^n) / Q_r).

    Exact for the pool's empirical distribution; log n - (n - 1)/n (best_of_n_kl) is its limit for a pool of N
    distinct untied samples as N grows, and an upper bound (Beirami et al. 2024, arXiv 2401.01879). The estimate is
    biased low when n approaches N (no repeats: best_of_n_pool_bias; docs/reporting.md). Computed in log space: finite
    for any pool."""
    P, N = proxy_PN.shape
    if not 1 <= n <= N:
        raise ValueError(f"best-of-n needs 1 <= n <= {N} samples per prompt, got n = {n}")
    c_lo, c_hi = tie_blocks(proxy_PN)
    # best-of-n's probability of the sample's block, in log space: (c_hi/N)^n underflows to 0 for the lowest samples of
    # a large pool (n = 128, N > ~340), and 0 log 0 would be NaN. log(F_hi^n - F_lo^n) = n log F_hi + log(1 - r),
    # r = (c_lo / c_hi)^n, with log(1 - r) = log(-expm1(log r)) (accurate for r near 1; r = 0 when c_lo = 0)
    log_hi = torch.log(c_hi.double() / N)  # c_hi >= 1
    log_r = n * (torch.log(c_lo.double()) - torch.log(c_hi.double()))  # -inf when c_lo = 0
    log_mass = n * log_hi + torch.log(-torch.expm1(log_r))
    block = (c_hi - c_lo).double()  # each block counted once per sample in it
    log_ratio = log_mass - torch.log(block / N)
    return (torch.exp(log_mass) / block * log_ratio).sum(1)  # a mass that underflows adds 0 (its log is finite)


# ----------------------------------------------------------------------------------------------------
# Gao, Schulman and Hilton 2022 (arXiv 2210.10760, eqs. 1-2): gold gained against d = sqrt(KL)


GAO_FORMS = {
    "bon": lambda d: -d * d,  # R_bon(d) = d (alpha - beta d)
    "rl": lambda d: -d * torch.log(torch.where(d > 0, d, torch.ones_like(d))),  # R_RL(d) = d (alpha - beta log d)
}


def gao_fit(d: torch.Tensor, gain: torch.Tensor, form: str) -> tuple[float, float]:
    """(alpha, beta) of R(d) = alpha d + beta g(d), g(d) = -d^2 (form "bon") or -d log d ("rl", 0 at d = 0), by least
    squares through points (d = sqrt(KL), gold gained over the reference); both forms are linear in alpha and beta,
    so it is the 2x2 normal equations. At least 2 points with distinct d > 0."""
    if form not in GAO_FORMS:
        raise ValueError(f"form must be one of {', '.join(GAO_FORMS)}, got {form!r}")
    d, y = d.double().flatten(), gain.double().flatten()
    X = torch.stack([d, GAO_FORMS[form](d)], dim=1)  # (M, 2)
    if int(torch.linalg.matrix_rank(X)) < 2:
        raise ValueError("gao_fit needs at least 2 points with distinct d > 0")
    A, b = X.T @ X, X.T @ y
    alpha, beta = torch.linalg.solve(A, b).tolist()
    return alpha, beta


def gao_curve(d: torch.Tensor, alpha: float, beta: float, form: str) -> torch.Tensor:
    """R(d) of a fitted form (gao_fit) at d."""
    d = d.double()
    return alpha * d + beta * GAO_FORMS[form](d)


def best_of_n_pool_bias(n: int, N: int) -> float:
    """best_of_n_pool_kl's value on a pool of N distinct untied samples minus log n - (n - 1)/n, its limit as the
    pool grows: the bias of the estimate from a pool of N when no summary repeats (<= 0)."""
    return float(best_of_n_pool_kl(torch.arange(N, dtype=torch.float64)[None], n)[0]) - best_of_n_kl(n)

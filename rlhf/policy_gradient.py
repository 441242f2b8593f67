"""The policy-gradient math of grpo.py as pure functions: the missing-end penalty, the per-token loss (KL estimators,
the clipped surrogate, rollout corrections, Objective) and its aggregation. Selection of K of G samples is
rlhf/selection.py's, the advantages rlhf/advantages.py's.

Order of reward processing in grpo.py, per prompt with G samples:

    1. raw score      r_raw = RM(prompt + response), read at the last real token (or summed over the response)
    2. penalty        r_pen = r_raw - missing_end_penalty * (1 - has_end)             raw RM units
    3. normalize      r     = gain * r_pen + bias                                      RM's fitted gain/bias
    4. selection      K of the G samples, from r (RSO / top / top-bottom / uniform / all): rlhf/selection.py
    5. advantage      by --advantage (rlhf/advantages.py ADVANTAGES) over the K *selected* samples, e.g. GRPO's
                      A = (r - mean_K(r)) / (std_K(r) + eps); Dr. GRPO's r - mean_K(r); RLOO's leave-one-out;
                      pool_normalized's (r - mean_G(r)) / (std_G(r) + eps), statistics of all G scored samples
    6. global norm    A = (A - mean(A)) / (std(A) + eps)        over every selected sample on every rank

The penalty is applied in raw units before the gain/bias, so penalised and unpenalised rewards share one scale
(a constant written over already-normalised rewards would mix two scales). GRPO's group normalization and global
normalization are invariant to the gain and bias (up to eps); the centred estimators (dr_grpo, rloo) keep the gain
as their scale unless global normalization follows. The penalty in normalised units is gain * missing_end_penalty.

Each choice of the algorithm (selection rule, advantage estimator, KL estimator, rollout correction, loss
aggregation) is a function registered by name where it is defined (rlhf/registry.py); the option names it.

Shapes: B prompts, G samples per prompt, K selected, N = B * K sequences, T response tokens.
"""

import math
from dataclasses import dataclass

import torch

from rlhf.registry import Registry

# ----------------------------------------------------------------------------------------------------
# Rewards


def penalize_missing_end(raw_rewards_N: torch.Tensor, has_end_N: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract `penalty` (raw reward-model units) from the raw score of every response without an end token."""
    return raw_rewards_N.float() - penalty * (~has_end_N.bool()).float()


# ----------------------------------------------------------------------------------------------------
# Per-token loss
#
# With top-k / top-p the processed log-prob of a token outside the kept set is -inf: the reference may not keep a
# token the policy sampled, and after an update (mu > 1) or from bf16 noise at the edge of the set, neither may the
# policy. -inf - (-inf) is NaN, so log-probs are floored at LOGPROB_FLOOR (no gradient flows through a floored
# value), log-ratios are clamped to [-20, 20] before exp and the k3 KL to at most 10 per token, as verl does
# ("low_var_kl"). Without top-k / top-p none of these bounds is reached in practice.

LOGPROB_FLOOR = -1e4
LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


# KL estimators (Schulman, "Approximating KL divergence", 2020) of KL(pi || pi_ref) per token, with samples from pi
# and log r = ref - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. k1 and k3 are unbiased in value; what
# the update uses is their gradient (arXiv 2512.21852 compares them). Differentiated as a loss term, on-policy:
#   k1:  E[grad k1] = E[grad logp] = 0: no pull towards the reference at all
#   k2:  E[grad k2] = E[(logp - ref) grad logp] = grad KL(pi || pi_ref): unbiased
#   k3:  E[grad k3] = -sum_y pi_ref(y) grad logp(y) = grad KL(pi_ref || pi): the *forward* KL's gradient (biased)
# and in the reward (detached, through the policy gradient), k1 gives E[k1 grad logp] = grad KL(pi || pi_ref).
# Weighting k1 or k3 by the ratio rho = pi / pi_old (pi_old detached; value 1 on-policy) makes the loss term an
# importance-sampled estimate of KL(pi || pi_ref) whose gradient is unbiased: E_old[grad(rho k)] = grad E_pi[k].
# tests/test_grpo_options.py checks each of these exactly on a toy categorical policy. Each estimator takes
# (logp, ref_logp) of any shape; log-ratios are clamped to +-LOG_RATIO_CLAMP and the estimate to +-KL_CLAMP.
KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", help="-log r (can be negative)")
def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref per token, clamped to +-KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (-log_ratio).clamp(-KL_CLAMP, KL_CLAMP)


@KL_ESTIMATORS.register("k2", help="(log r)^2 / 2")
def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - ref)^2 / 2 per token, >= 0; clamped at KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (0.5 * log_ratio * log_ratio).clamp(max=KL_CLAMP)


@KL_ESTIMATORS.register("k3", help="r - 1 - log r, DeepSeekMath's")
def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token (DeepSeekMath eq. 4):
    exp(ref - logp) - (ref - logp) - 1, >= 0, unbiased for samples from pi; clamped at KL_CLAMP."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(max=KL_CLAMP)


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (any shape) by `estimator` (a name in KL_ESTIMATORS)."""
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL estimate of each whole response (N,): the sum over its tokens (`mask`) of `estimator`'s per-token
    estimate, log-probs floored at LOGPROB_FLOOR as in the loss; times beta, the penalty that --kl_in reward
    subtracts from the response's reward (InstructGPT-style, there with k1 per token)."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(mask, logp, zero).clamp(min=LOGPROB_FLOOR)
    ref_logp = torch.where(mask, ref_logp, zero).clamp(min=LOGPROB_FLOOR)
    return torch.where(mask, token_kl(logp, ref_logp, estimator), zero).sum(1)


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip objective, negated to a loss (DeepSeekMath eq. 3; DAPO's decoupled eps_low / eps_high):
    -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - old_logp), per token (N, T).
    `advantages` is (N, T) or (N, 1). Also returns where the clipped branch is active (its gradient is 0)."""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    is_clipped = clipped < unclipped  # the min picks the constant branch
    return -torch.minimum(unclipped, clipped), is_clipped


def sequence_clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages_N: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's sequence-level clipped objective (arXiv 2507.18071, eqs. 5-7), negated to a loss (N,):
    -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) with s = exp(mean over the response's tokens of
    (logp - old_logp)), one ratio per sequence, clipped per sequence. logp and old_logp (N, T) must be 0 (finite)
    where `mask` is False. Returns the loss, whether each sequence is clipped, and s (N,)."""
    m = mask.float()
    log_s = ((logp - old_logp) * m).sum(1) / m.sum(1).clamp(min=1.0)  # (N,) length-normalised log-ratio
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = s * advantages_N
    clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages_N
    return -torch.minimum(unclipped, clipped), clipped < unclipped, s


def spread_sequence_loss(loss_N: torch.Tensor, weights_NT: torch.Tensor) -> torch.Tensor:
    """A per-sequence loss (N,) as a per-token one (N, T) that the aggregation's token weights w turn back into
    exactly loss_i: loss_i / sum_t w_it on each weighted token, so sum_t w_it * out_it = loss_i. Every sequence then
    counts once, with weight 1 / Z, under every --loss_type. (Broadcasting loss_i to every token instead makes
    sum_t w_it * loss_i = |o_i| * loss_i under the token-sum aggregations: a long response would weigh more.)"""
    seq_weight = weights_NT.sum(1, keepdim=True)  # (N, 1)
    return torch.where(weights_NT > 0, loss_N[:, None] / seq_weight.clamp(min=1e-12), 0.0)


# Rollout corrections (--rollout_correction: ROLLOUT_CORRECTIONS): each takes the sampler / trainer probability ratios
# rho and the cap, and returns (the weights, where they differ from rho: beyond the cap), both rho's shape.
ROLLOUT_CORRECTIONS = Registry("rollout correction")


@ROLLOUT_CORRECTIONS.register("none", help="no correction")
def no_correction(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight 1 everywhere."""
    return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)


@ROLLOUT_CORRECTIONS.register("tis", help="truncated importance sampling, min(rho, cap)")
def truncated_importance(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w = min(rho, cap) (Yao et al. 2025, "off-policy RL" note)."""
    return rho.clamp(max=cap), rho > cap


@ROLLOUT_CORRECTIONS.register("mis", help="masked importance sampling, rho or 0 beyond the cap")
def masked_importance(rho: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w = rho if rho <= cap else 0: tokens / sequences beyond the cap drop out."""
    beyond = rho > cap
    return torch.where(beyond, 0.0, rho), beyond


MISMATCH_BAND = (0.9, 1.1)  # a token whose trainer / sampler probability ratio lies outside counts as mismatched


def rollout_correction(
    train_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    method: str,
    cap: float,
    level: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights (detached) that correct the policy loss for the sampler / trainer mismatch: the tokens were
    drawn from the sampler's distribution (its own log-probs, e.g. a KV-cache or bf16 inference path), the loss is
    that of the trainer's (the training forward at the same weights); rho = exp(train_logp - sampler_logp).

        tis  truncated importance sampling: w = min(rho, cap)              (Yao et al. 2025, "off-policy RL" note)
        mis  masked importance sampling:    w = rho if rho <= cap else 0   (tokens / sequences beyond the cap drop)

    `level` "token": one rho per token, weights (N, T); "sequence": rho = exp(mean over the response of the log
    gap), GSPO's length-normalised ratio, one weight per sequence (N, 1). Returns the weights (1 where masked and
    for method "none") and where they differ from rho (N, T) (truncated or masked; False for "none")."""
    weigh = ROLLOUT_CORRECTIONS[method]
    m = mask & torch.isfinite(train_logp) & torch.isfinite(sampler_logp)
    gap = torch.where(m, train_logp - sampler_logp, 0.0).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T)
    if level == "sequence":
        gap = (gap.sum(1) / m.sum(1).clamp(min=1)).unsqueeze(1)  # (N, 1)
    elif level != "token":
        raise ValueError(f"unknown importance level {level!r}; expected token or sequence")
    w, beyond = weigh(torch.exp(gap), cap)
    return w, beyond.expand_as(mask) & mask


def mismatch_stats(train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sampler / trainer mismatch of one micro-batch, over its response tokens where both log-probs are finite, as
    fp64 scalars: `tokens`, `outside_band` (tokens whose exp(train_logp - sampler_logp) lies outside MISMATCH_BAND),
    `abs_log_gap` (sum of |log gap|), all summed over ranks, and `max_abs_log_gap`, reduced by max. The mean alone
    hides a tail of mismatched tokens, hence the share outside the band and the max. No host read: a micro-batch
    with no such token has a max of 0 (the gap is 0 wherever it is not counted)."""
    m = mask & torch.isfinite(train_logp) & torch.isfinite(sampler_logp)
    gap = torch.where(m, train_logp.double() - sampler_logp.double(), 0.0)
    lo, hi = math.log(MISMATCH_BAND[0]), math.log(MISMATCH_BAND[1])
    outside = m & ((gap < lo) | (gap > hi))
    return {
        "tokens": m.sum().double(),
        "outside_band": outside.sum().double(),
        "abs_log_gap": gap.abs().sum(),
        "max_abs_log_gap": gap.abs().max(),
    }


def floor_logprobs(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logp` with masked positions replaced by 0 and the rest floored at LOGPROB_FLOOR: padding can be -inf (outside
    a top-k set), and -inf * 0 would be NaN in the value and in the gradient; a floored value passes no gradient."""
    return torch.where(mask, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).clamp(min=LOGPROB_FLOOR)


@dataclass(frozen=True)
class Objective:
    """The per-token GRPO loss as three terms, with the options bound once per run (OpenRLHF's PolicyLoss; verl's
    compute_policy_loss + agg_loss): each term takes tensors only.

        policy   clipped ratio x advantage (one ratio per token, or GSPO's per sequence: `importance_level`), times
                 the rollout correction's weights (`rollout_correction`, `rollout_correction_cap`)
        kl       beta x the KL estimate (`kl_estimator`, times pi / pi_old with `kl_ratio`); beta = 0 when the KL
                 is in the reward instead
        entropy  entropy_coef x the token entropy, subtracted (a bonus; a penalty when negative)

    `token_loss` composes them into the loss (N, T), 0 on masked tokens; the aggregation's token weights turn it
    into a scalar (AGGREGATIONS)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    importance_level: str = "token"
    rollout_correction: str = "none"
    rollout_correction_cap: float = 3.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio: bool = False
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.importance_level not in ("token", "sequence"):
            raise ValueError(f"unknown importance level {self.importance_level!r}; expected token or sequence")
        KL_ESTIMATORS.check(self.kl_estimator)
        ROLLOUT_CORRECTIONS.check(self.rollout_correction)

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss has an entropy term (the log-prob pass must then return a differentiable entropy)."""
        return self.entropy_coef != 0

    def correction(self, train_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor):
        """(rollout-correction weights (N, T) or (N, 1), detached, or None without a correction; where they differ
        from the ratio (N, T)): see rollout_correction."""
        w, corrected = rollout_correction(
            train_logp, sampler_logp, mask, self.rollout_correction, self.rollout_correction_cap, self.importance_level
        )
        return (None if self.rollout_correction == "none" else w), corrected

    def policy_term(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages_N: torch.Tensor,
        mask: torch.Tensor,
        weights_NT: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clipped surrogate loss (N, T), where it is clipped (N, T), the ratio (N, T), detached) from floored
        log-probs (floor_logprobs). At sequence level GSPO's loss is spread over the tokens with the aggregation's
        token weights `weights_NT`, so each sequence counts once whatever its length, and each token carries its
        sequence's ratio and clipping. Times the rollout `correction` weights when given."""
        if self.importance_level == "token":
            adv_N1 = advantages_N[:, None]
            surrogate, is_clipped = clipped_surrogate(logp, old_logp, adv_N1, self.eps_low, self.eps_high)
            ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
        else:
            if weights_NT is None:
                raise ValueError("the sequence-level importance ratio needs the aggregation's token weights")
            loss_N, clipped_N, s_N = sequence_clipped_surrogate(
                logp, old_logp, advantages_N, mask, self.eps_low, self.eps_high
            )
            surrogate = spread_sequence_loss(loss_N, weights_NT)
            is_clipped, ratio = clipped_N[:, None].expand_as(mask), s_N[:, None].detach().expand_as(logp)
        if correction is not None:
            surrogate = surrogate * correction
        return surrogate, is_clipped, ratio

    def kl_term(
        self, logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta x the KL estimate (N, T), times pi / pi_old with kl_ratio (pi_old detached); the estimate (N, T))
        from floored log-probs."""
        kl = token_kl(logp, ref_logp, self.kl_estimator)
        if self.kl_ratio:
            kl_weighted = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * kl
        else:
            kl_weighted = kl
        return self.beta * kl_weighted, kl

    def entropy_term(self, entropy_NT: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """entropy_coef x H per response token (0 on masked tokens), subtracted from the loss: PPO's entropy bonus
        (Schulman et al. 2017, eq. 9), which keeps the policy from collapsing onto a few tokens. `entropy_NT` must
        carry the gradient (rlhf/logprobs.py with with_entropy=True)."""
        return self.entropy_coef * torch.where(mask, entropy_NT, 0.0)

    def token_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor,
        advantages_N: torch.Tensor,
        mask: torch.Tensor,
        *,
        weights_NT: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        entropy_NT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss (N, T), 0 on masked tokens: policy term + KL term, minus the entropy term when
        entropy_coef != 0 (then `entropy_NT` is required). Response tokens outside a top-k / top-p set are floored
        (see above). Also returns per-token `kl`, `clipped` and `ratio_deviation` |rho - 1| (N, T), detached and
        masked, for logging (rho is exactly 1 in the first of mu > 1 updates)."""
        logp, old_logp, ref_logp = (floor_logprobs(x, mask) for x in (logp, old_logp, ref_logp))
        policy_NT, is_clipped, ratio = self.policy_term(logp, old_logp, advantages_N, mask, weights_NT, correction)
        kl_NT, kl = self.kl_term(logp, old_logp, ref_logp)
        loss = torch.where(mask, policy_NT + kl_NT, torch.zeros((), dtype=logp.dtype, device=logp.device))
        if self.needs_entropy:
            loss = loss - self.entropy_term(entropy_NT, mask)
        return loss, {
            "kl": (kl * mask).detach(),
            "clipped": (is_clipped & mask),
            "ratio_deviation": ((ratio - 1.0).abs() * mask),
        }


# ----------------------------------------------------------------------------------------------------
# Aggregation: every variant is sum_{i,t} w_it * loss_it / Z, with token weights w that depend on the mask only
# and a normaliser Z that is a sum over sequences. So Z can be summed over micro-batches and ranks before any
# backward pass, and the gradient does not depend on how the batch is split. Each returns (w (N, T), Z part).
# A row without response tokens (the filler micro-batches that keep ranks in step when --min_group_std dropped
# groups) has w = 0 and adds nothing to Z. --loss_type names one of AGGREGATIONS.

AGGREGATIONS = Registry("loss aggregation")


@AGGREGATIONS.register("grpo", help="per-sequence mean, then mean over sequences")
def grpo_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`grpo` (DeepSeekMath eq. 3): mean over each sequence's tokens, then mean over sequences:
    w_it = 1 / |o_i|, Z = number of sequences."""
    m = mask.float()
    return m / m.sum(1, keepdim=True).clamp(min=1.0), mask.any(1).sum().float()


@AGGREGATIONS.register("dapo", help="mean over all tokens, as bnpo")
@AGGREGATIONS.register("bnpo", help="mean over all tokens")
def token_mean_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`bnpo` / `dapo` (DAPO, arXiv 2503.14476, eq. 12): mean over every response token of the global batch,
    so long sequences count per token: w_it = 1, Z = number of tokens."""
    m = mask.float()
    return m, m.sum()


@AGGREGATIONS.register("dr_grpo", help="sum / (sequences x max_new_tokens)")
def dr_grpo_weights(mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`dr_grpo` (Dr. GRPO, arXiv 2503.20783): no per-sequence 1/|o_i|; a constant normaliser
    Z = number of sequences x max_new_tokens, w_it = 1."""
    return mask.float(), mask.any(1).sum().float() * max_new_tokens


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) at each position (B, T), fp32; -inf logits (masked tokens) count 0. The
    plain whole-tensor form; the update uses rlhf/logprobs.py's chunked one (tests/test_logprobs.py: equal)."""
    logp = logits_BTV.float().log_softmax(-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)

"""Losses as pure functions. Each returns a *sum* over tokens or pairs together with what it was summed over,
so callers divide by a global count (over ranks and accumulation steps) and gradients do not depend on the
world size or micro-batch size (see utils/dist.py and the tests)."""

import functools

import torch
import torch.nn.functional as F


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position (B, T), in fp32 whatever the logits' dtype (bf16 log-softmax loses bits)."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    # the target's logit minus the logsumexp: no (B, T, V) log-softmax tensor is materialised
    return torch.gather(logits, -1, targets_BT.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sft_loss_sum(logprobs_BT: torch.Tensor, weight_BT: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the target tokens, each weighted (0 for padding), from their log-probs
    (B, T) (rlhf/logprobs.py computes them without the logits): a scalar."""
    return -(logprobs_BT * weight_BT).sum()


# ----------------------------------------------------------------------------------------------------
# Pairwise preference losses. Each returns one loss per pair (B,); the caller sums them and divides by
# the global number of pairs.


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Reward-model loss under the Bradley-Terry model p(y_w > y_l) = sigmoid(r_w - r_l)
    (Stiennon et al. 2020, eq. 1): -log sigmoid(r_chosen - r_rejected), per pair (B,). log 2 at equal rewards."""
    return -F.logsigmoid(r_chosen.float() - r_rejected.float())


def dpo_logits(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
) -> torch.Tensor:
    """h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), per pair (B,); inputs are summed sequence log-probs."""
    return (policy_chosen.float() - ref_chosen.float()) - (policy_rejected.float() - ref_rejected.float())


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * h), per pair (B,).

    label_smoothing eps (conservative DPO, cDPO): the preference label is taken to be flipped with
    probability eps, so the loss is the cross-entropy against the soft label,
    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h). At h = 0 it is log 2 for any eps."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    z = beta * dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm...", eq. 17, tau = beta): (h - 1/(2 beta))^2, per
    pair (B,). A squared loss regresses the log-ratio margin to a finite target instead of pushing it to
    infinity as DPO does on deterministic preferences. h uses summed (not length-averaged) log-probs."""
    h = dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return (h - 1.0 / (2.0 * beta)) ** 2


def preference_loss(cfg):
    """The per-pair loss (policy_chosen, policy_rejected, ref_chosen, ref_rejected) -> (B,) that cfg.loss names
    ("sigmoid": dpo_loss with cfg.beta and cfg.label_smoothing; "ipo": ipo_loss with cfg.beta)."""
    if cfg.loss == "ipo":
        return functools.partial(ipo_loss, beta=cfg.beta)
    return functools.partial(dpo_loss, beta=cfg.beta, label_smoothing=cfg.label_smoothing)

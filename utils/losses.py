"""Losses as pure functions. Each returns a *sum* over tokens or pairs together with what it was summed over,
so callers divide by a global count (over ranks and accumulation steps) and gradients do not depend on the
world size or micro-batch size (see utils/dist.py and the tests)."""

import torch
import torch.nn.functional as F


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position (B, T), in fp32 whatever the logits' dtype (bf16 log-softmax loses bits)."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets_BT.unsqueeze(-1)).squeeze(-1)


def sft_loss_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked target tokens (a scalar)."""
    nll = -token_logprobs(logits_BTV, targets_BT)
    return (nll * mask_BT).sum()

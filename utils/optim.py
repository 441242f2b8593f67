"""Optimizer, learning-rate schedule and the gradient step every stage takes: the accumulation over micro-batches
(accumulate_micro_batches) and the guarded optimizer step (guarded_step)."""

import math

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from utils.dist import all_reduce_sum
from utils.fsdp import set_gradient_sync
from utils.metrics import metric


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, layer norms or the reward gain/bias).

    The fused implementation (one kernel over every parameter, on CPU and CUDA, DTensor shards included): the same
    update as the per-tensor loop up to rounding, and cheaper on a CPU (docs/benchmarks.md)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate: linear warmup from 1/warmup to 1, then cosine decay to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup_steps, total_steps, min_ratio)
    )


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards) and return it before clipping. max_norm <= 0
    only measures.

    Called before every optimizer step, it first frees every FSDP unit's gathered weights: a training model's root
    keeps them from forward to backward (utils/fsdp.py), so after a forward without backward (an evaluation, the
    reference with adapters off) they would outlive the optimizer step, and the next forward would reuse them
    stale instead of gathering the updated shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def build_optimization(model: nn.Module, cfg, total_steps: int):
    """(AdamW, its warmup-cosine schedule) over `model`'s trainable parameters, from an OptimConfig's --lr,
    --weight_decay, --warmup_steps and --min_lr_ratio."""
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    return optimizer, build_scheduler(optimizer, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)


def accumulate_micro_batches(model: nn.Module, micro_batches: list, loss_fn, world: int, normaliser) -> list:
    """Forward and backward over this rank's micro-batches of one optimizer step; returns what `loss_fn` returned
    beside each loss, in order.

    `loss_fn(micro_batch)` returns (this micro-batch's loss summed over its rows or tokens, with its graph; anything
    detached to keep). Each is divided by `normaliser`, the count (or weight) of the *global* batch over all ranks and
    micro-batches, and multiplied by the world size: FSDP averages gradients over ranks, so the reduced gradient is
    that of (the sum of every rank's losses / normaliser), whatever the world size or number of micro-batches. The
    gradient reduce-scatter runs once, after the last micro-batch's backward."""
    kept = []
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        loss, out = loss_fn(batch)
        (loss * world / normaliser).backward()
        kept.append(out)
    return kept


metric(
    "train/loss", "min", "the stage's loss of the step (mean over the batch)", headline=("sft", "reward_model", "dpo")
)
metric("train/grad_norm", "min", "the gradient's global norm before clipping")
metric("train/lr", None, "the learning rate of the step")
metric("train/skipped", "min", "1 when --on_nonfinite skip skipped the step (non-finite loss or norm), else 0")


def guarded_step(model: nn.Module, optimizer, scheduler, guard, step: int, metrics: dict, grad_clip: float) -> dict:
    """Clip the gradient norm, then step the optimizer and the schedule unless `guard` (utils/guard.py; None: no
    check) finds metrics["train/loss"] or the norm non-finite: it raises (--on_nonfinite stop) or the step is skipped
    (skip). Gradients are cleared either way. Adds train/grad_norm, train/lr and train/skipped to `metrics` and
    returns it; `step` is the 1-based number of the step being taken."""
    metrics["train/grad_norm"] = clip_grad_norm(model, grad_clip)
    stepped = guard is None or guard.ok(step, {k: metrics[k] for k in ("train/loss", "train/grad_norm")})
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.update({"train/lr": scheduler.get_last_lr()[0], "train/skipped": float(not stepped)})
    return metrics


def step_throughput(micro_batches: list[dict], seconds: float, world: int, device) -> dict[str, float]:
    """perf/ metrics of one optimizer step of `seconds`: tokens (attention-mask ones, all ranks) per second, in all and
    per device. A collective."""
    tokens = float(sum(b["attention_mask"].sum() for b in micro_batches))
    seen = float(all_reduce_sum(torch.tensor(tokens, device=device)))
    return {
        "perf/step_seconds": seconds,
        "perf/tokens_per_second": seen / seconds,
        "perf/tokens_per_second_per_device": seen / seconds / world,
    }

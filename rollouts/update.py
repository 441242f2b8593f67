"""GRPO's stage 7, the policy update (rollouts/step.py train_step), and the log-probs of stage 6: every response token's
processed log-prob (and entropy) under a model, the per-micro-batch loss composed of rlhf/policy_gradient.py's Objective
terms, and cfg.policy_epochs optimizer steps over a step's micro-batches. `cfg` is grpo.py's Config."""

from contextlib import nullcontext
from functools import partial

import torch

from model.lora import sharded_module
from rlhf.logprobs import linear_processed_logprobs
from rlhf.policy_gradient import AGGREGATIONS, Objective, mismatch_stats
from rollouts.batches import MicroBatch
from rollouts.metrics import update_metrics
from utils.dist import all_reduce_max, all_reduce_named, all_reduce_sum
from utils.fsdp import gathered_params
from utils.guard import NonFiniteGuard
from utils.optim import accumulate_micro_batches, guarded_step


def response_logprobs(model, batch: MicroBatch, cfg, with_entropy: bool = False):
    """(processed log-probs (n, R), entropy (n, R) or None) of the response tokens: temperature, top-k and top-p
    applied as the sampler drew them, in one chunked pass with the LM head inside it (rlhf/logprobs.py), so the
    (n, R, V) logits are never materialised. Predicted at columns P-1 .. P+R-2 of prompt + response rows, or at their
    places in packed rows (each prompt's last token, then the response's own columns); the head runs only at the
    micro-batch's response tokens (`head_positions`, found when it was built: no host read here), 0 log-prob and
    entropy at padding, which every loss and sum masks out."""
    n, R = batch.response_ids.shape
    targets = batch.response_ids
    if batch.layout is not None:  # one packed row: the head runs at its n*R predicting positions
        mask, where = batch.layout, batch.layout.logits_index().view(1, n * R)
        targets = targets.reshape(1, n * R)
    else:
        P = batch.prompt_len
        mask, where = batch.attention_mask, slice(P - 1, P + R - 1)
    head = partial(
        linear_processed_logprobs,
        targets_NR=targets,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        with_entropy=with_entropy,
        positions_K=batch.head_positions,
    )
    logp, entropy = model(batch.input_ids, batch.position_ids, mask, logits_slice=where, head=head)
    return logp.view(n, R), entropy.view(n, R) if entropy is not None else None


@torch.no_grad()
def batch_logprobs(model, batches: list[MicroBatch], cfg, gather: bool) -> list[torch.Tensor]:
    """Processed log-probs (n, R) of each micro-batch's responses under `model` (no gradient). `gather`: keep the
    parameters gathered over all micro-batches (a frozen model, or with LoRA the policy seen with adapters off);
    otherwise FSDP's per-block gathers (the policy, whose training forward this must match)."""
    with gathered_params(sharded_module(model)) if gather else nullcontext():
        return [response_logprobs(model, batch, cfg)[0] for batch in batches]


def diagnostics(logp: torch.Tensor, old: torch.Tensor, batch: MicroBatch) -> tuple[dict, dict]:
    """What the loss does not use, of one micro-batch (no graph), as named fp64 sums and maxima over its response
    tokens: the sampler / trainer mismatch at the sampling weights (`old`: the training forward's log-probs there;
    rlhf/policy_gradient.py mismatch_stats), and the tokens outside the training forward's top-k / top-p set with the
    |log-prob gap| to the sampler on the others."""
    mask = batch.response_mask
    with torch.no_grad():
        mismatch = mismatch_stats(old, batch.sampler_logprobs, mask)
        in_support = mask & torch.isfinite(logp)  # outside: a token the training forward's top-k/top-p set excludes
        gap = torch.where(in_support, (logp.detach() - batch.sampler_logprobs).abs(), 0.0)
        sums = {
            "sampler_gap": gap.sum().double(),
            "outside_support": (mask & ~in_support).sum().double(),
            "mismatch_tokens": mismatch["tokens"],
            "mismatch_outside": mismatch["outside_band"],
            "mismatch_gap": mismatch["abs_log_gap"],
        }
    return sums, {"mismatch_gap_max": mismatch["max_abs_log_gap"]}


def micro_batch_loss(
    policy, batch: MicroBatch, w: torch.Tensor, objective: Objective, cfg, with_entropy: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """sum(w * per-token loss) of one micro-batch (with its graph), its named sums (fp64 scalars, no graph: the loss,
    the terms' statistics, `tokens`, and diagnostics()) and named maxima. The entropy is computed when the objective
    has an entropy term or `with_entropy` (to log it). No host read: it compiles as one graph
    (tests/test_grpo.py)."""
    mask = batch.response_mask
    # the processed log-probs and the entropy of what is sampled (temperature, top-k and top-p applied) in one
    # chunked pass over the vocabulary (rlhf/logprobs.py); the entropy is differentiable, used only as a bonus
    with_entropy = with_entropy or objective.needs_entropy
    logp, entropy = response_logprobs(policy, batch, cfg, with_entropy)  # (n, R) each
    # mu = 1: old = current, detached, so the ratio is 1 in value and d ratio = d logp (trl PR #2565);
    # mu > 1: the sampling policy's log-probs, so the ratio moves away from 1 after the first step
    old = logp.detach() if cfg.policy_epochs == 1 else batch.old_logprobs
    # --rollout_correction reweights the policy term by the training forward's / the sampler's probability ratio
    correction, corrected = objective.correction(old, batch.sampler_logprobs, mask)
    loss_NT, stats = objective.token_loss(
        logp, old, batch.ref_logprobs, batch.advantages, mask, weights_NT=w, correction=correction, entropy_NT=entropy
    )
    loss = (w * loss_NT).sum()
    sums, maxima = diagnostics(logp, old, batch)
    with torch.no_grad():
        sums |= {"loss": loss.detach().double(), "tokens": mask.sum().double(), "corrected": corrected.sum().double()}
        sums |= {name: t.sum().double() for name, t in stats.items()}  # kl, clipped, ratio_deviation
        if with_entropy:
            sums["entropy"] = (entropy.detach() * mask).sum().double()
    return loss, sums, maxima


def policy_update(
    policy,
    optimizer,
    scheduler,
    batches: list[MicroBatch],
    cfg,
    world: int,
    device,
    *,
    guard: NonFiniteGuard | None = None,
    step: int = 1,
) -> dict:
    """cfg.policy_epochs optimizer steps over this rank's micro-batches (optimizer step `step`, 1-based, of the run);
    returns global metrics. `guard` checks each epoch's loss and gradient norm before its optimizer step (stop, or
    skip that optimizer and scheduler step).

    Every aggregation is sum(w * loss) / Z with token weights w from the mask and a normaliser Z summed over
    micro-batches and ranks before any backward (rlhf/policy_gradient.py); utils/optim.py accumulate_micro_batches
    scales each rank's loss so the reduced gradient is that of the global loss, for any world size and micro-batch
    size."""
    objective = cfg.objective()
    weigh = AGGREGATIONS[cfg.loss_type]
    weights = [weigh(b.response_mask, cfg.max_new_tokens) for b in batches]  # (token weights (n, R), Z part)
    normaliser = all_reduce_sum(sum((z for _, z in weights), torch.zeros(())).to(device).double()).float()
    if float(normaliser) == 0:  # --min_group_std dropped every group of every rank: no step, on every rank alike
        return {"train/skipped": 1.0, "train/lr": scheduler.get_last_lr()[0]}
    log_entropy = cfg.entropy_coef != 0 or (cfg.entropy_every > 0 and step % cfg.entropy_every == 0)

    def loss_of(micro: tuple[MicroBatch, torch.Tensor]):
        batch, w = micro
        loss, sums, maxima = micro_batch_loss(policy, batch, w, objective, cfg, log_entropy)
        return loss, (sums, maxima)

    micro_batches = [(b, w) for b, (w, _) in zip(batches, weights, strict=True)]
    epoch_sums, steps, gap_max = [], [], torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(cfg.policy_epochs):
        outputs = accumulate_micro_batches(policy, micro_batches, loss_of, world, normaliser)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = {k: sum((s[k] for s, _ in outputs), zero) for k in outputs[0][0]}  # this epoch's, over micro-batches
        for _, maxima in outputs:
            gap_max = torch.maximum(gap_max, maxima["mismatch_gap_max"])
        steps.append(
            guarded_step(policy, optimizer, scheduler, guard, step, {"train/loss": float(sums["loss"])}, cfg.grad_clip)
        )
        epoch_sums.append(sums)
    epochs = all_reduce_named(epoch_sums)  # mu x {name: global sum}: one collective
    return update_metrics(epochs, all_reduce_max(float(gap_max), device), float(normaliser), steps, cfg, log_entropy)

"""GRPO's training micro-batches from a step's rollouts (stage 5 of grpo.py): the kept samples' advantages, their
packed rows, and the filler micro-batches that keep every rank's FSDP collectives in step."""

import torch

from model.sampler import SampleOutput
from rlhf.grpo import advantages
from rollouts.sampling import model_rows
from utils.config import ConfigError
from utils.dist import all_reduce_max, all_reduce_sum


def per_rank_sizes(cfg, world: int) -> tuple[int, int]:
    """(prompts per rank, training micro-batches per rank), with exact-division checks."""
    if cfg.prompts_per_step % world:
        raise ConfigError(f"--prompts_per_step {cfg.prompts_per_step} must be divisible by the world size {world}")
    prompts = cfg.prompts_per_step // world
    if (prompts * cfg.kept) % cfg.micro_batch_size:
        raise ConfigError(
            f"{prompts} prompts per rank x {cfg.kept} kept samples = {prompts * cfg.kept} sequences must be divisible "
            f"by --micro_batch_size {cfg.micro_batch_size}"
        )
    return prompts, prompts * cfg.kept // cfg.micro_batch_size


def build_training_batches(prompt_ids, prompt_mask, samples: SampleOutput, rows_N: torch.Tensor, advantages_N, group, micro,
                           shared: bool = True):
    """Micro-batches of the selected rows, plus advantages and the sampler's log-probs: packed rows with each prompt
    once for its responses (`shared`), or the prompt + response layout with a copy of the prompt per row."""
    batches = []
    for s in range(0, rows_N.shape[0], micro):
        rows = rows_N[s : s + micro]
        batch = model_rows(prompt_ids, prompt_mask, samples.response_ids[rows], samples.response_mask[rows], rows // group, shared)
        batch["advantages"] = advantages_N[s : s + micro]
        batch["sampler_logprobs"] = samples.logprobs[rows][:, : batch["response_ids"].shape[1]]
        batches.append(batch)
    return batches


def kept_advantages(rewards_BK: torch.Tensor, keep_B: torch.Tensor, cfg) -> torch.Tensor:
    """Advantages (B*K,): those of the kept groups (`keep_B`), globally normalized over the kept groups of every rank
    only; 0 for the groups dynamic sampling dropped (--min_group_std), which are not trained on."""
    adv_BK = torch.zeros(rewards_BK.shape, dtype=torch.float32, device=rewards_BK.device)
    adv_N = advantages(rewards_BK[keep_B], cfg.scale_by_std, cfg.global_norm, all_reduce_sum)  # (kept groups * K,)
    adv_BK[keep_B] = adv_N.view(-1, rewards_BK.shape[1])
    return adv_BK.flatten()


def pad_micro_batches(batches: list[dict], filler: dict, device) -> list[dict]:
    """`batches` followed by filler micro-batches up to the largest count of any rank. Every rank must run as many
    forward / backward passes as the others (each gathers and reduces FSDP shards): with --min_group_std the
    ranks can keep different numbers of groups. A filler is `filler` (a one-response micro-batch, in the layout
    the others use) with an empty response mask: weight 0, nothing added to any normaliser or sum."""
    n_micro = int(all_reduce_max(float(len(batches)), device))
    filler = dict(filler, response_mask=torch.zeros_like(filler["response_mask"]),
                  advantages=torch.zeros_like(filler["advantages"]), filler=True)
    return batches + [dict(filler) for _ in range(n_micro - len(batches))]

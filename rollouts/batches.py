"""GRPO's training micro-batches from a step's rollouts (stage 5 of grpo.py): the kept samples' advantages, their
packed rows, and the filler micro-batches that keep every rank's FSDP collectives in step."""

from dataclasses import dataclass, replace

import torch

from model.gpt2 import SharedPrefix
from model.sampler import SampleOutput
from rlhf.advantages import advantages
from rollouts.sampling import micro_batch_rows, model_rows
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


@dataclass
class MicroBatch:
    """One micro-batch of the update: n kept responses as the rows a policy forward takes (rollouts/sampling.py
    model_rows: packed with each prompt once when `layout` is set, else prompt + response rows of width prompt_len +
    R), and what the loss reads of them. Stage 6 fills in the log-probs (dataclasses.replace)."""

    input_ids: torch.Tensor  # (1, T) packed, or (n, P+R)
    position_ids: torch.Tensor  # as input_ids
    attention_mask: torch.Tensor  # as input_ids, True on the real tokens
    response_ids: torch.Tensor  # (n, R)
    response_mask: torch.Tensor  # (n, R) bool
    head_positions: torch.Tensor  # (K,) long: flat indices of response_mask's True entries, where the LM head runs
    advantages: torch.Tensor  # (n,)
    sampler_logprobs: torch.Tensor  # (n, R): the sampler's own log-probs of the tokens it drew
    kept_index: torch.Tensor  # (n,) long: its rows' places among the step's kept rows (rows_N, in selection order)
    layout: SharedPrefix | None = None  # packed rows: the model's attention layout
    prompt_len: int = 0  # prompt + response rows: the prompt's width P
    ref_logprobs: torch.Tensor | None = None  # (n, R) under the reference (stage 6)
    old_logprobs: torch.Tensor | None = None  # (n, R) under the sampling policy (stage 6, mu > 1 or --kl_in reward)
    filler: bool = False  # a filler that keeps ranks in step (pad_micro_batches): no response token

    @classmethod
    def from_rows(
        cls, rows: dict, advantages: torch.Tensor, sampler_logprobs: torch.Tensor, kept_index: torch.Tensor
    ) -> "MicroBatch":
        """From model_rows' dict; the head's positions are found here, once, not in the update's forward."""
        head_positions = rows["response_mask"].reshape(-1).nonzero().squeeze(1)
        return cls(
            **rows,
            head_positions=head_positions,
            advantages=advantages,
            sampler_logprobs=sampler_logprobs,
            kept_index=kept_index,
        )


def build_training_batches(
    prompt_ids,
    prompt_mask,
    samples: SampleOutput,
    rows_N: torch.Tensor,
    advantages_N,
    group,
    micro,
    prefix_sharing: bool = True,
    by_length: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of the selected rows, with their advantages and the sampler's log-probs: packed rows with each
    prompt once for its responses (`prefix_sharing`), or the prompt + response layout with a copy of the prompt per
    row. In the rows' order, or with `by_length` the groups of the longest prompts first (micro_batch_rows: each
    prompt's rows together, micro-batches of prompts of similar length); each micro-batch keeps its rows' places
    among rows_N (kept_index)."""
    prompt_of_row = rows_N // group  # (N,)
    batches = []
    for index in micro_batch_rows(prompt_of_row, prompt_mask.sum(1) if by_length else None, micro):
        rows = rows_N[index]
        batch = model_rows(
            prompt_ids,
            prompt_mask,
            samples.response_ids[rows],
            samples.response_mask[rows],
            prompt_of_row[index],
            prefix_sharing,
        )
        sampler_logprobs = samples.logprobs[rows][:, : batch["response_ids"].shape[1]]
        batches.append(MicroBatch.from_rows(batch, advantages_N[index], sampler_logprobs, index))
    return batches


def with_advantages(batches: list[MicroBatch], advantages_N: torch.Tensor) -> list[MicroBatch]:
    """The micro-batches with new advantages, `advantages_N` (N,) those of the kept rows rows_N in their order, each
    micro-batch taking its rows' (kept_index); fillers keep theirs."""
    return [b if b.filler else replace(b, advantages=advantages_N[b.kept_index]) for b in batches]


def kept_advantages(
    rewards_BK: torch.Tensor, keep_B: torch.Tensor, cfg, pool_BG: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages (B*K,): those of the kept groups (`keep_B`) by --advantage, its batch statistics and the global
    normalization over the kept groups of every rank only; 0 for the groups dynamic sampling dropped
    (--min_group_std), which are not trained on. `pool_BG` (B, G): every scored sample's reward, for the estimators
    that take their group statistics from the whole pool (--advantage pool_normalized)."""
    adv_BK = torch.zeros(rewards_BK.shape, dtype=torch.float32, device=rewards_BK.device)
    pool = None if pool_BG is None else pool_BG[keep_B]
    adv_N = advantages(rewards_BK[keep_B], cfg.advantage, cfg.global_norm, all_reduce_sum, pool)  # (kept groups * K,)
    adv_BK[keep_B] = adv_N.view(-1, rewards_BK.shape[1])
    return adv_BK.flatten()


def pad_micro_batches(batches: list[MicroBatch], filler: MicroBatch, device) -> list[MicroBatch]:
    """`batches` followed by filler micro-batches up to the largest count of any rank. Every rank must run as many
    forward / backward passes as the others (each gathers and reduces FSDP shards): with --min_group_std the
    ranks can keep different numbers of groups. A filler is `filler` (a one-response micro-batch, in the layout
    the others use) with an empty response mask: weight 0, nothing added to any normaliser or sum."""
    n_micro = int(all_reduce_max(float(len(batches)), device))
    no_response = torch.zeros_like(filler.response_mask)
    filler = replace(
        filler,
        response_mask=no_response,
        head_positions=filler.head_positions[:0],
        advantages=torch.zeros_like(filler.advantages),
        filler=True,
    )
    return batches + [filler] * (n_micro - len(batches))

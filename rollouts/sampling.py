"""Sampling responses from the policy and scoring them with the reward sources: GRPO's stages 2 and 3 and its summary
evaluation. Every function takes the run's `cfg` (grpo.Config) for the sampling and scoring options it reads.

With cfg.prefix_sharing (grpo --prefix_sharing, the default) each prompt is computed and stored once for all the
samples of its group: the sampler keeps one copy of the prompt's keys and values (model/sampler.py), and the reward
model and the training forwards run packed rows (`shared_prompt_rows`) in which each prompt appears once. Off, every
sample carries its own copy of the prompt (the reference implementation the tests compare against)."""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from data.tldr import decode_responses, prompt_response_rows
from model.gpt2 import SharedPrefix
from model.sampler import SampleOutput, generate
from rlhf.rewards import REWARD_MODEL, RewardSource, score_functions
from rollouts.prompts import PromptSet
from utils.dist import all_reduce_sum
from utils.fsdp import gathered_params
from utils.guard import all_ranks_agree
from utils.rundir import warn


@dataclass
class RewardSpec:
    """The reward sources (--rewards) with their weights and which are whitened over the batch; the tokenizer that
    decodes responses for the functions, and where the prompts come from (for error messages)."""

    sources: list[RewardSource]
    normalize_fns: bool
    tok: object
    constant: set[str] = field(default_factory=set)
    """Functions already reported as constant over a step (warn_constant_sources: one warning per run)."""

    @property
    def rm_column(self) -> int | None:
        """Column of the reward model among the sources; None when it is not one of them."""
        return next((i for i, s in enumerate(self.sources) if s.name == REWARD_MODEL), None)

    @property
    def weights_S(self) -> torch.Tensor:
        return torch.tensor([s.weight for s in self.sources], dtype=torch.float64)

    @property
    def normalize_S(self) -> torch.Tensor:
        return torch.tensor([s.fn is not None and self.normalize_fns for s in self.sources])


@torch.no_grad()
def sample_responses(
    policy,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int,
    max_new_tokens: int,
    *,
    prompts_per_call: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    prefix_sharing: bool = True,
    compile: bool = False,
    on_chunk=None,
) -> SampleOutput:
    """The sampling loop every caller shares: `num_samples` responses to each left-padded prompt (B, P), with the
    policy's parameters gathered once for the whole loop (under FSDP every rank calls it, a collective), the prompts
    cut into calls of `prompts_per_call`, each call's prompts trimmed to their own left padding (a chunk of short
    prompts computes no column that is padding in all of them), and the calls' outputs concatenated. Sampling
    options as model.sampler.generate's (temperature 0: the most likely token). The policy is put in eval mode for
    the loop and given back its mode after. `on_chunk(prompts)` runs after each call (progress).

    Returns a SampleOutput of N = B * num_samples rows grouped by prompt (rows b*G .. b*G+G-1 answer prompt b):
    response_ids (N, max_new_tokens) the sampled tokens, response_mask (N, max_new_tokens) True up to and
    including a row's end token, logprobs (N, max_new_tokens) the sampler's processed log-probability of each
    token (0 past the mask), has_end (N,) whether the row stopped by itself."""
    was_training = policy.training
    policy.eval()
    parts = []
    with gathered_params(policy):
        for s in range(0, prompt_ids.shape[0], prompts_per_call):
            ids, mask = prompt_ids[s : s + prompts_per_call], prompt_mask[s : s + prompts_per_call]  # (b, P)
            first = int(mask.any(0).long().argmax())  # this chunk's own left padding only
            parts.append(
                generate(
                    policy,
                    ids[:, first:],
                    mask[:, first:],
                    num_samples,
                    max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    generator=generator,
                    prefix_sharing=prefix_sharing,
                    compile=compile,
                )
            )
            if on_chunk is not None:
                on_chunk(ids.shape[0])
    policy.train(was_training)
    fields = ("response_ids", "response_mask", "logprobs", "has_end")
    return SampleOutput(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))


def rollout(
    policy, prompt_ids, prompt_mask, cfg, num_samples: int, generator, greedy: bool = False, on_chunk=None
) -> SampleOutput:
    """sample_responses with GRPO's sampling options (cfg: --max_new_tokens, --gen_prompts prompts per call,
    --temperature / --top_p / --top_k, --prefix_sharing, --compile); `greedy`: temperature 0. Returns
    (B * num_samples, max_new_tokens) tensors grouped by prompt."""
    return sample_responses(
        policy,
        prompt_ids,
        prompt_mask,
        num_samples,
        cfg.max_new_tokens,
        prompts_per_call=cfg.gen_prompts,
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        generator=generator,
        prefix_sharing=cfg.prefix_sharing,
        compile=cfg.compile,
        on_chunk=on_chunk,
    )


def shared_prompt_rows(prompt_ids, prompt_mask, response_ids, response_mask, prompt_of_row: torch.Tensor) -> dict:
    """The packed layout of n responses (n, R) whose prompts are rows prompt_of_row (n,) of prompt_ids (B, P): each
    distinct prompt once, then the responses (model/gpt2.py's SharedPrefix). Keys as prompt_response_rows' where
    they mean the same: response_ids / response_mask (n, R') and attention_mask (1, T) (True on the real tokens
    the forward computes), plus input_ids / position_ids (1, T) and "layout" (the SharedPrefix, passed to the
    model as its attention mask). Columns that are padding everywhere are dropped first, as there."""
    prompts, group = torch.unique(prompt_of_row, return_inverse=True)  # distinct prompts, each row's among them
    p_ids, p_mask = prompt_ids[prompts], prompt_mask[prompts]
    first = int(p_mask.any(0).long().argmax())  # leading columns that are padding in every prompt
    width = int(response_mask.any(0).sum())  # trailing response columns that are padding in every row
    response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
    input_ids, position_ids, layout = SharedPrefix.pack(
        p_ids[:, first:], p_mask[:, first:], response_ids, response_mask, group
    )
    attention_mask = torch.cat([p_mask[:, first:].reshape(-1), response_mask.reshape(-1)])[None]  # (1, T)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "layout": layout,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def micro_batch_rows(
    prompt_of_row: torch.Tensor, prompt_lengths: torch.Tensor | None, micro: int
) -> list[torch.Tensor]:
    """n rows whose prompts are prompt_of_row (n,) cut into micro-batches of `micro` rows (the last may hold fewer),
    as index tensors into the rows. `prompt_lengths` None: the rows in their own order. Given each prompt's length
    (B,) (its real tokens): the rows of the longest prompts first, a prompt's rows together (a prompt is packed once
    per micro-batch it appears in, so a group split over micro-batches computes its prompt again), prompts of equal
    length in the order of their first rows (a stable sort); each micro-batch's rows then in their own order, so
    grouping changes which rows share a micro-batch and nothing else.

    A micro-batch is as wide as its longest prompt (shared_prompt_rows; prompt_response_rows pads every row to it):
    prompts of similar length together leave little padding to compute. Every loss is a sum over rows divided by
    global counts, and scores are per row, so the grouping moves numbers only by the order of float summation."""
    n = prompt_of_row.shape[0]
    order = torch.arange(n, device=prompt_of_row.device)  # (n,)
    if prompt_lengths is None:
        return [order[s : s + micro] for s in range(0, n, micro)]
    first_row = torch.full_like(prompt_lengths, n, dtype=torch.long).scatter_reduce(
        0, prompt_of_row, order, "amin"
    )  # (B,) each prompt's first row
    order = torch.argsort(first_row[prompt_of_row], stable=True)  # (n,) each prompt's rows together
    order = order[torch.argsort(-prompt_lengths[prompt_of_row[order]], stable=True)]  # longest prompts first
    return [order[s : s + micro].sort().values for s in range(0, n, micro)]


def model_rows(
    prompt_ids, prompt_mask, response_ids, response_mask, prompt_of_row: torch.Tensor, prefix_sharing: bool
) -> dict:
    """The rows a forward over n prompt + response sequences takes: packed with each prompt once (`prefix_sharing`), or
    one row per response with its own copy of the prompt (data.tldr.prompt_response_rows)."""
    if prefix_sharing:
        return shared_prompt_rows(prompt_ids, prompt_mask, response_ids, response_mask, prompt_of_row)
    return prompt_response_rows(prompt_ids[prompt_of_row], prompt_mask[prompt_of_row], response_ids, response_mask)


@torch.no_grad()
def score(
    reward_model,
    prompt_ids,
    prompt_mask,
    samples: SampleOutput,
    group: int,
    micro: int,
    prefix_sharing: bool = True,
    by_length: bool = False,
) -> torch.Tensor:
    """Raw reward-model score (N,) of every prompt + response row, read at the row's last real token (the end token,
    or the last sampled token when the response ran out of tokens) or summed over its response (the model's
    pooling). Row n belongs to prompt n // group. `prefix_sharing`: each micro-batch's prompts are computed once for all
    their responses (packed rows). `by_length`: micro-batches of prompts of similar length (micro_batch_rows); the
    scores still come back in row order."""
    N = samples.response_ids.shape[0]
    prompt_of_row = torch.arange(N, device=prompt_ids.device) // group  # (N,)
    cuts = micro_batch_rows(prompt_of_row, prompt_mask.sum(1) if by_length else None, micro)
    scores = torch.empty(N, device=prompt_ids.device)  # (N,) fp32
    with gathered_params(reward_model):
        for rows in cuts:
            batch = model_rows(
                prompt_ids,
                prompt_mask,
                samples.response_ids[rows],
                samples.response_mask[rows],
                rows // group,
                prefix_sharing,
            )
            mask = batch["layout"] if prefix_sharing else batch["attention_mask"]
            scores[rows] = reward_model(
                batch["input_ids"], batch["position_ids"], mask, prompt_len=batch.get("prompt_len")
            ).float()
    return scores


@dataclass
class Scores:
    """Stage 3's output for N = B * group samples, row n belonging to prompt n // group. values (N, S) fp64: each
    source on the samples it applies to, before any whitening (the reward model's after penalty and gain/bias);
    raw (N,): the reward model's raw scores, or None; applies (N, S); total (N,): the training reward."""

    values: torch.Tensor
    raw: torch.Tensor | None
    applies: torch.Tensor
    total: torch.Tensor | None = None


@torch.no_grad()
def warn_constant_sources(spec: RewardSpec, values_NS: torch.Tensor, applies_NS: torch.Tensor, step: int) -> None:
    """One warning line per run for each reward function that gave one value to every response it applies to in a
    step, over all ranks (a collective): whitened it is 0 everywhere, raw it shifts every advantage alike, so it
    trains nothing (a function that ignores its input, or a task it never or always meets). The reward model is
    checked by utils.guard.check_rewards, which stops the run."""
    v = values_NS.double()
    top = torch.finfo(torch.float64).max
    hi_lo = torch.cat([torch.where(applies_NS, v, -top).amax(0), torch.where(applies_NS, -v, -top).amax(0)])  # (2S,)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hi_lo, op=dist.ReduceOp.MAX)
    count = all_reduce_sum(applies_NS.sum(0).double())  # (S,)
    S = v.shape[1]
    for s, source in enumerate(spec.sources):
        if source.fn is None or source.name in spec.constant or count[s] < 2 or hi_lo[s] != -hi_lo[S + s]:
            continue
        spec.constant.add(source.name)
        warn(
            f"reward source {source.spec} gave every one of its {int(count[s])} responses the same value "
            f"({float(hi_lo[s]):.6g}) at step {step}: it adds nothing to the advantages, so it trains nothing "
            f"(said once per run)"
        )


@torch.no_grad()
def source_values(spec: RewardSpec, reward_model, prompts: PromptSet, samples: SampleOutput, group: int, cfg) -> Scores:
    """Every function on the samples it applies to (0 elsewhere and in the reward-model column) and the reward
    model's raw score of every sample; the caller turns raw scores into the reward-model column."""
    device = prompts.ids.device
    N = samples.response_ids.shape[0]
    applies = prompts.applies.repeat_interleave(group, 0)  # (N, S)
    values = torch.zeros(applies.shape, dtype=torch.float64)
    if any(s.fn is not None for s in spec.sources):
        of = [n // group for n in range(N)]
        texts = decode_responses(spec.tok, samples.response_ids, samples.response_mask, samples.has_end)
        # a function may raise on the rows one rank holds only: every rank stops together, with that rank's message
        with all_ranks_agree("the reward functions", device):
            values = score_functions(
                spec.sources,
                applies,
                [prompts.texts[b] for b in of],
                texts,
                [prompts.rows[b] for b in of],
                prompts.where,
            )
    raw = None
    if reward_model is not None:
        raw = score(
            reward_model,
            prompts.ids,
            prompts.mask,
            samples,
            group,
            cfg.score_micro_batch_size,
            cfg.prefix_sharing,
            cfg.group_by_length,
        )  # (N,)
    return Scores(values.to(device), raw, applies.to(device))

"""The reward of held-out summaries: one greedy (or sampled) summary per validation prompt, scored by every reward
source; GRPO's evaluation next to the implicit-reward preference accuracy (evaluation/preference.py)."""

import torch

from data.tldr import PREF_COLUMNS, PROMPT_COLUMNS, PromptDataset, load_rows
from evaluation.preference import build_eval_set
from rlhf.grpo import penalize_missing_end
from rlhf.rewards import combine_sources, source_stats
from rollouts.prompts import PromptSet, prompt_set, source_applies
from rollouts.sampling import RewardSpec, rollout, source_values
from utils.dist import all_reduce_sum, rank_and_world, stream

@torch.no_grad()
def evaluate_summaries(policy, reward_model, spec: RewardSpec, val: PromptSet, cfg, step: int) -> dict:
    """One greedy (or sampled) summary per validation prompt, scored by every source, over all ranks.

    eval/reward: the weighted sum of the sources' values before any batch whitening (reward model: gain/bias
    normalized, no penalty; functions: raw); eval/reward_penalized: the reward model's with the missing-end penalty;
    eval/reward_<name>: each function's mean over the prompts it applies to."""
    device = val.ids.device
    generator = stream(cfg.seed, step, rank_and_world()[0], "eval", device=device)
    samples = rollout(policy, val.ids, val.mask, cfg, 1, generator, greedy=cfg.eval_greedy)
    scores = source_values(spec, reward_model, val, samples, 1, cfg)
    values, rm = scores.values, spec.rm_column
    counted = torch.ones(values.shape[0], dtype=torch.bool, device=device) if val.counted is None else val.counted  # (n,)
    applies = scores.applies & counted[:, None]  # (n, S): padding prompts count for no source
    penalized = torch.zeros(values.shape[0], device=device)
    if rm is not None:
        values[:, rm] = reward_model.normalize(scores.raw).double()
        penalized = reward_model.normalize(penalize_missing_end(scores.raw, samples.has_end, cfg.missing_end_penalty))
    total = combine_sources(torch.where(applies, values, 0.0), spec.weights_S)  # (n,)
    count_S, mean_S, _ = source_stats(values, applies, all_reduce_sum)
    w = counted.double()  # (n,)
    n, r, rp, end, length = all_reduce_sum(torch.stack([
        w.sum(), (w * total).sum(), (w * penalized.double()).sum(), (w * samples.has_end.double()).sum(),
        (w * samples.response_mask.double().sum(1)).sum(),
    ])).tolist()
    out = {"eval/reward": r / n, "eval/end_fraction": end / n, "eval/response_length": length / n}
    if rm is not None:
        out["eval/reward_penalized"] = rp / n
    for i, source in enumerate(spec.sources):
        if source.fn is not None and count_S[i] > 0:
            out[f"eval/reward_{source.name}"] = float(mean_S[i])
    return out

def sample_table(spec: RewardSpec, prompts: PromptSet, samples, scores, rows_BK: torch.Tensor, advantages: torch.Tensor,
                 n_prompts: int) -> tuple[list[str], list[list]]:
    """Columns and rows of a table of training samples: the first n_prompts prompts of this rank with their selected
    samples (rows_BK): prompt, response, each source's value (None where it does not apply), reward, advantage,
    has_end."""
    table = []
    for b in range(min(n_prompts, rows_BK.shape[0])):
        for j, n in enumerate(rows_BK[b].tolist()):
            values, applies = scores.values[n].tolist(), scores.applies[n].tolist()
            table.append([
                spec.tok.decode(prompts.ids[b][prompts.mask[b]].tolist()),
                spec.tok.decode(samples.response_ids[n][samples.response_mask[n]].tolist()),
                *(float(v) if a else None for v, a in zip(values, applies)),
                float(scores.total[n]), float(advantages[b * rows_BK.shape[1] + j]), bool(samples.has_end[n]),
            ])
    return ["prompt", "response", *(x.name for x in spec.sources), "reward", "advantage", "has_end"], table

def load_eval_sets(cfg, tok, sources, rank: int, world: int, device) -> tuple[PromptSet | None, object]:
    """This rank's validation prompts (the summary evaluation) and preference pairs, or None for each that is off."""
    val = pref = None
    if cfg.val_data and cfg.eval_every >= 0:
        rows = load_rows(cfg.val_data, cfg.val_split, PROMPT_COLUMNS)
        n = min(cfg.val_rows or len(rows), len(rows))
        applies = source_applies(cfg.reward_column, cfg.val_data, cfg.val_split, len(rows), sources)
        # contiguous slices of ceil(n / world) prompts, the last ones padded with copies of prompt 0 that count for
        # nothing: every rank generates and scores as many prompts, and the evaluation ends in collectives
        per_rank = -(-n // world)
        index = [i if i < n else -1 for i in range(rank * per_rank, (rank + 1) * per_rank)]
        mine = [max(i, 0) for i in index]
        where = f"{cfg.val_data}[{cfg.val_split}]"
        dataset = PromptDataset([rows[i] for i in mine], tok, cfg.max_prompt_len, name=where)
        val = prompt_set(dataset, list(range(per_rank)), applies[mine], device, where)
        val.rows = mine
        val.counted = torch.tensor([i >= 0 for i in index], device=device)
    if cfg.pref_data and cfg.eval_every >= 0:
        rows = load_rows(cfg.pref_data, cfg.pref_split, PREF_COLUMNS)
        rows = rows[: cfg.pref_rows] if cfg.pref_rows else rows
        pref = build_eval_set(rows, tok, cfg.max_prompt_len, cfg.pref_max_response_len, cfg.micro_batch_size, rank,
                              world, name=f"{cfg.pref_data}[{cfg.pref_split}]")
    return val, pref

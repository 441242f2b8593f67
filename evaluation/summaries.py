"""The reward of held-out summaries: one greedy (or sampled) summary per validation prompt, scored by every reward
source; GRPO's evaluation next to the implicit-reward preference accuracy (evaluation/preference.py)."""

from dataclasses import dataclass

import torch

from data.tldr import PREF_COLUMNS, PROMPT_COLUMNS, PromptDataset, encode_response, load_optional_column, load_rows
from data.tokenizer import PAD_ID
from evaluation.preference import build_eval_set, gather_pair_scores, preference_metric_names
from model.sampler import SampleOutput
from rlhf.policy_gradient import penalize_missing_end
from rlhf.rewards import combine_sources, source_stats
from rlhf.stats import win_rate
from rollouts.prompts import PromptSet, prompt_set, source_applies
from rollouts.sampling import RewardSpec, rollout, score, source_values
from utils.config import ConfigError, option
from utils.dist import all_reduce_sum, rank_and_world, stream
from utils.logging import EvalProgress
from utils.metrics import metric

# GRPO's evaluation metrics; its headlines in the order its end-of-run table shows them
metric("eval/reward", "max", "mean training reward of the greedy summaries of --val_data", headline=("grpo",))
metric("eval/win_rate", "max", "share of prompts whose summary the reward model scores above the reference", ("grpo",))
metric("eval/win_rate_ci_low", None, "lower bound of eval/win_rate's 95% bootstrap interval", headline=("grpo",))
metric("eval/win_rate_ci_high", None, "upper bound of eval/win_rate's 95% bootstrap interval", headline=("grpo",))
metric("eval/pref_accuracy", "max", "the policy's implicit-reward accuracy on --pref_data", headline=("grpo",))
metric("eval/end_fraction", "max", "share of the greedy summaries that end with the end token", headline=("grpo",))
metric("eval/response_length", "min", "mean tokens of the greedy summaries", headline=("grpo",))
metric("eval/reward_penalized", "max", "mean reward-model score with the missing-end penalty")
metric("eval/reward_{source}", "max", "one reward source's mean on the greedy summaries it applies to")


@torch.no_grad()
def evaluate_summaries(policy, reward_model, spec: RewardSpec, val: PromptSet, cfg, step: int) -> dict:
    """One greedy (or sampled) summary per validation prompt, scored by every source, over all ranks.

    eval/reward: the weighted sum of the sources' values before any batch whitening (reward model: gain/bias
    normalized, no penalty; functions: raw); eval/reward_penalized: the reward model's with the missing-end penalty;
    eval/reward_<name>: each function's mean over the prompts it applies to; with a reward model and reference
    summaries (the validation rows' `completion`), eval/win_rate (reference_win_rate)."""
    device = val.ids.device
    counted = val.counted if val.counted is not None else torch.ones(val.ids.shape[0], dtype=torch.bool, device=device)
    n_prompts = int(all_reduce_sum(counted.sum().double()))
    generator = stream(cfg.seed, step, rank_and_world()[0], "eval", device=device)
    progress = EvalProgress("summaries", n_prompts, unit="prompts")
    samples = rollout(policy, val.ids, val.mask, cfg, 1, generator, greedy=cfg.eval_greedy, on_chunk=progress.advance)
    progress.close()
    scores = source_values(spec, reward_model, val, samples, 1, cfg)
    values, rm = scores.values, spec.rm_column
    applies = scores.applies & counted[:, None]  # (n, S): padding prompts count for no source
    penalized = torch.zeros(values.shape[0], device=device)
    if rm is not None:
        values[:, rm] = reward_model.normalize(scores.raw).double()
        penalized = reward_model.normalize(penalize_missing_end(scores.raw, samples.has_end, cfg.missing_end_penalty))
    total = combine_sources(torch.where(applies, values, 0.0), spec.weights_S)  # (n,)
    count_S, mean_S, _ = source_stats(values, applies, all_reduce_sum)
    w = counted.double()  # (n,)
    n, r, rp, end, length = all_reduce_sum(
        torch.stack(
            [
                w.sum(),
                (w * total).sum(),
                (w * penalized.double()).sum(),
                (w * samples.has_end.double()).sum(),
                (w * samples.response_mask.double().sum(1)).sum(),
            ]
        )
    ).tolist()
    out = {"eval/reward": r / n, "eval/end_fraction": end / n, "eval/response_length": length / n}
    if rm is not None:
        out["eval/reward_penalized"] = rp / n
    for i, source in enumerate(spec.sources):
        if source.fn is not None and count_S[i] > 0:
            out[f"eval/reward_{source.name}"] = float(mean_S[i])
    if rm is not None and val.references is not None:
        out |= reference_win_rate(reward_model, val, scores.raw, counted, n_prompts, cfg)
    return out


def summary_metric_names(spec: RewardSpec, val: PromptSet) -> set[str]:
    """Every metric evaluate_summaries may log on `val`: a function's eval/reward_<name> is logged only when it applies
    to a validation prompt, so this may name one more than an evaluation logs (never one fewer)."""
    rm = spec.rm_column is not None
    names = {"eval/reward", "eval/end_fraction", "eval/response_length"} | ({"eval/reward_penalized"} if rm else set())
    names |= {f"eval/reward_{s.name}" for s in spec.sources if s.fn is not None}
    if rm and val.references is not None:
        one = torch.zeros(1)
        names |= {f"eval/{k}" for k in win_rate(one, one, n_resamples=1)}
    return names


def evaluation_metric_names(spec: RewardSpec, val: PromptSet | None, pref, frontier) -> set[str]:
    """Every metric grpo.py's evaluation may log: the summaries' on `val`, the frontier's (`frontier`, or None) and the
    preference pairs' (`pref`); --best_metric is checked against it before the first step."""
    names = summary_metric_names(spec, val) if val is not None else set()
    names |= frontier.metric_names() if frontier is not None else set()
    return names | (preference_metric_names("eval/pref_") if pref else set())


def reference_win_rate(
    reward_model, val: PromptSet, policy_raw: torch.Tensor, counted: torch.Tensor, n_prompts: int, cfg
) -> dict:
    """eval/win_rate: the share of validation prompts whose policy summary the reward model scores above the
    prompt's reference summary (raw scores, no missing-end penalty; ties count half), with its bootstrap interval
    (rlhf.stats.win_rate). The references are cut to --max_new_tokens like the policy's summaries. Collective: every
    rank scores its slice."""
    reference_raw = score(
        reward_model,
        val.ids,
        val.mask,
        val.references,
        1,
        cfg.score_micro_batch_size,
        cfg.prefix_sharing,
        cfg.group_by_length,
    )  # (n,)
    index = torch.where(counted, torch.tensor(val.rows, device=counted.device), -1)  # (n,) -1: padding prompts
    policy_scores, reference_scores = gather_pair_scores(index, policy_raw, reference_raw, n_prompts)
    return {f"eval/{k}": v for k, v in win_rate(policy_scores, reference_scores).items()}


def reference_summaries(texts: list, tok, max_new_tokens: int, device) -> SampleOutput:
    """The reference summaries as the sampler returns summaries: (n, max_new_tokens) ids ending in the end token,
    right-padded, each cut to max_new_tokens tokens (data.tldr.encode_response)."""
    encoded = [encode_response(tok, t, max_new_tokens) for t in texts]
    ids = torch.full((len(encoded), max_new_tokens), PAD_ID, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    mask = torch.arange(max_new_tokens)[None, :] < torch.tensor([len(e) for e in encoded])[:, None]  # (n, R)
    return SampleOutput(
        ids.to(device),
        mask.to(device),
        torch.zeros(ids.shape, device=device),
        torch.ones(len(encoded), dtype=torch.bool, device=device),
    )


@dataclass
class SampleTableConfig:
    # --- evaluation and logging
    table_every: int = option(20, free=True)
    """Log a table of sample responses every N steps; 0 disables."""
    table_prompts: int = option(2, free=True)
    """Prompts (with all their selected samples) in each table, from rank 0."""


def sample_table(spec: RewardSpec, prompts: PromptSet, result, n_prompts: int) -> tuple[list[str], list[list]]:
    """Columns and rows of a table of training samples: the first n_prompts prompts of this rank with their selected
    samples (a GRPO step's `result`: its samples, scores, rows_BK and advantages): prompt, response, each source's
    value (None where it does not apply), reward, advantage, has_end."""
    samples, scores, rows_BK, advantages = result.samples, result.scores, result.rows_BK, result.advantages
    table = []
    for b in range(min(n_prompts, rows_BK.shape[0])):
        for j, n in enumerate(rows_BK[b].tolist()):
            values, applies = scores.values[n].tolist(), scores.applies[n].tolist()
            table.append(
                [
                    spec.tok.decode(prompts.ids[b][prompts.mask[b]].tolist()),
                    spec.tok.decode(samples.response_ids[n][samples.response_mask[n]].tolist()),
                    *(float(v) if a else None for v, a in zip(values, applies, strict=True)),
                    float(scores.total[n]),
                    float(advantages[b * rows_BK.shape[1] + j]),
                    bool(samples.has_end[n]),
                ]
            )
    return ["prompt", "response", *(x.name for x in spec.sources), "reward", "advantage", "has_end"], table


@dataclass
class EvalSetsConfig:
    """GRPO's preference pairs for the implicit-reward accuracy, beside --val_data's prompts (load_eval_sets)."""

    # --- data
    pref_data: str = "trl-lib/tldr-preference"
    """Preference pairs for the implicit-reward accuracy (evaluation/preference.py); empty string to skip."""
    pref_split: str = "validation"
    """Split of --pref_data."""
    pref_rows: int = 512
    """Preference pairs used (the first N); 0 for all."""
    # --- evaluation and logging
    pref_max_response_len: int = 64
    """Tokens kept of each preference response, the end token included."""

    def validate_eval_sets(self) -> None:
        if self.pref_rows < 0:
            raise ConfigError(f"--pref_rows must be >= 0, got {self.pref_rows}")
        if self.pref_max_response_len <= 0:
            raise ConfigError(f"--pref_max_response_len must be positive, got {self.pref_max_response_len}")


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
        references = load_optional_column(cfg.val_data, cfg.val_split, "completion")
        if references is not None and all(isinstance(references[i], str) and references[i].strip() for i in range(n)):
            val.references = reference_summaries([references[i] for i in mine], tok, cfg.max_new_tokens, device)
    if cfg.pref_data and cfg.eval_every >= 0:
        rows = load_rows(cfg.pref_data, cfg.pref_split, PREF_COLUMNS)
        rows = rows[: cfg.pref_rows] if cfg.pref_rows else rows
        pref = build_eval_set(
            rows,
            tok,
            cfg.max_prompt_len,
            cfg.pref_max_response_len,
            cfg.micro_batch_size,
            rank,
            world,
            name=f"{cfg.pref_data}[{cfg.pref_split}]",
        )
    return val, pref

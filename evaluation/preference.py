"""Preference accuracy on TL;DR comparisons: the library every stage calls (eval_preferences.py is its command line).

A reward model scores a response with its scalar r(x, y); a policy (DPO, GRPO, ...) with the implicit reward
beta * log(pi(y|x) / pi_ref(y|x)), the log-probs summed over the response tokens (Rafailov et al. 2023, sec. 5).
A pair counts as correct when the chosen response scores higher, and as half correct on an exact tie (a policy
equal to its reference ties every pair and scores 0.5). Reported: accuracy with a percentile-bootstrap 95%
interval (fixed seed), the number of pairs and ties, the same split by whether the chosen summary is the longer
one (in tokens; equal lengths count as "not longer"), mean scores and the Bradley-Terry loss of the scores.

reward_model.py, dpo.py and grpo.py call build_eval_set once, then evaluate_reward_model or evaluate_policy, on
every rank (the scoring is collective under FSDP); dpo.py's training forward is pair_logprobs.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from data.tldr import PreferenceDataset, collate_pairs, encode_response, eval_slice, shortest
from model.gpt2 import SharedPrefix
from rlhf.logprobs import linear_processed_logprobs
from rlhf.stats import preference_summary
from utils.dist import to_device, true_positions
from utils.logging import track
from utils.metrics import metric

# (label, key prefix of the accuracy fields, field holding the number of pairs) of each reported subset
SUBSETS = (
    ("all", "", "n_pairs"),
    ("chosen longer", "chosen_longer_", "n_chosen_longer"),
    ("chosen not longer", "chosen_not_longer_", "n_chosen_not_longer"),
)


# ----------------------------------------------------------------------------------------------------
# Scoring one batch of pairs (collate_pairs layout: chosen rows 0..B-1, rejected rows B..2B-1)


def packed_pairs(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor, SharedPrefix]:
    """A collate_pairs batch as one packed row (input_ids (1, T), position_ids (1, T), layout; model.gpt2.SharedPrefix):
    each pair's prompt once, then the 2B responses, chosen i and rejected i both attending to prompt i. The numbers
    of the padded rows (tests/test_prefix_sharing.py) for about half the prompt tokens."""
    B, P = batch["n_pairs"], batch["prompt_len"]
    group = torch.arange(B, device=device).repeat(2)  # rows i and B + i share prompt i
    return SharedPrefix.pack(
        to_device(batch["input_ids"][:B, :P], device),
        to_device(batch["attention_mask"][:B, :P], device),
        to_device(batch["response_ids"], device),
        to_device(batch["response_mask"], device),
        group,
    )


def pair_logprobs(model: nn.Module, batch: dict, device, prefix_sharing: bool = True) -> torch.Tensor:
    """log pi(y | x) of every row (2B,), summed over response tokens, in fp32; differentiable. `prefix_sharing`:
    packed rows (packed_pairs); else one padded row per response.

    The LM head runs only at the positions that predict real response tokens (columns P-1 .. P+R-2 of the padded
    rows, or their places in the packed row; see data/tldr.py), inside rlhf/logprobs.py's chunked pass (GRPO's
    function), so the (2B, R, V) logits are never materialised."""
    n, R = batch["response_ids"].shape
    targets, mask = to_device(batch["response_ids"], device), to_device(batch["response_mask"], device)
    positions = true_positions(batch["response_mask"], device)  # row-major: the same in (n, R) and (1, n * R)
    if prefix_sharing:
        input_ids, position_ids, layout = packed_pairs(batch, device)
        logp, _ = model(
            input_ids,
            position_ids,
            layout,
            logits_slice=layout.logits_index().view(1, n * R),
            head=partial(linear_processed_logprobs, targets_NR=targets.view(1, n * R), positions_K=positions),
        )
    else:
        P = batch["prompt_len"]
        logp, _ = model(
            to_device(batch["input_ids"], device),
            to_device(batch["position_ids"], device),
            to_device(batch["attention_mask"], device),
            logits_slice=slice(P - 1, P + R - 1),
            head=partial(linear_processed_logprobs, targets_NR=targets, positions_K=positions),
        )
    return (logp.view(n, R) * mask).sum(-1)  # (2B,); 0 at padding


def reward_scores(model: nn.Module, batch: dict, device, prefix_sharing: bool = True) -> torch.Tensor:
    """Raw reward of every row (2B,) (read at each row's last real token, or summed over its response: the model's
    pooling). `prefix_sharing`: packed rows (packed_pairs); else one padded row per response."""
    if prefix_sharing:
        return model(*packed_pairs(batch, device))
    return model(
        to_device(batch["input_ids"], device),
        to_device(batch["position_ids"], device),
        to_device(batch["attention_mask"], device),
        prompt_len=batch["prompt_len"],
    )


# ----------------------------------------------------------------------------------------------------
# Evaluation sets: disjoint per-rank slices, padded to the same number of batches


@dataclass
class EvalSet:
    batches: list[dict]
    """This rank's micro-batches (collate_pairs) plus "pair_index" (B,) long: the global pair index of each
    row pair, -1 for padding pairs (copies of pair 0 that keep the number of forward passes equal on every
    rank, which FSDP's collectives need)."""
    chosen_longer: torch.Tensor
    """(N,) bool over all pairs: the chosen response has more tokens than the rejected one."""
    n_pairs: int
    name: str


def build_eval_set(
    rows: list[dict[str, str]],
    tok,
    max_prompt_len: int,
    max_response_len: int,
    micro_batch_size: int,
    rank: int,
    world: int,
    name: str = "preference",
    by_length: bool = True,
) -> EvalSet:
    """Tokenize preference rows and cut this rank's slice (pairs rank, rank + world, ...; dealt out longest first
    with `by_length`, data.tldr.eval_slice) into micro-batches."""
    n = len(rows)
    data = PreferenceDataset(rows, tok, max_prompt_len, max_response_len, name=name)
    # Lengths of the whole responses (not the truncated ones), so the split does not depend on max_response_len.
    chosen_len = torch.tensor([len(encode_response(tok, r["chosen"], 1 << 30)) for r in rows])
    rejected_len = torch.tensor([len(encode_response(tok, r["rejected"], 1 << 30)) for r in rows])
    lengths = data.lengths()
    mine = eval_slice(n, rank, world, lengths if by_length else None)
    filler = shortest(mine, lengths)  # computed in place of the padding pairs (-1), with weight 0
    batches = []
    for start in range(0, len(mine), micro_batch_size):
        index = mine[start : start + micro_batch_size]
        rows_idx = [i if i >= 0 else filler for i in index]
        batch = collate_pairs(
            [data.prompts[i] for i in rows_idx],
            [data.chosen[i] for i in rows_idx],
            [data.rejected[i] for i in rows_idx],
        )
        batch["pair_index"] = torch.tensor(index, dtype=torch.long)
        batches.append(batch)
    return EvalSet(batches, chosen_len > rejected_len, n, name)


def real_pairs(batch: dict) -> int:
    """Pairs of a batch that are not padding."""
    return int((batch["pair_index"] >= 0).sum())


@torch.no_grad()
def score_local(
    score_fn, eval_set: EvalSet, device, desc: str = "preference pairs"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score this rank's pairs with score_fn(batch) -> (2B,): (pair_index (n,), chosen (n,), rejected (n,)); rank 0
    shows the progress over all ranks' pairs as `desc`."""
    index, chosen, rejected = [], [], []
    for batch in track(eval_set.batches, desc, eval_set.n_pairs, real_pairs, unit="pairs"):
        B = batch["n_pairs"]
        s = score_fn(batch).double()  # (2B,)
        index.append(batch["pair_index"].to(s.device))
        chosen.append(s[:B])
        rejected.append(s[B:])
    return torch.cat(index), torch.cat(chosen), torch.cat(rejected)


def gather_pair_scores(
    index: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, n_pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' per-pair scores in pair order, (N,) chosen and (N,) rejected, on every rank (a collective).

    Every rank holds the same number of rows (padding included), so a plain all_gather works."""
    local = torch.stack([index.double(), chosen.double(), rejected.double()], dim=1)  # (n, 3)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        local = torch.cat(parts)
    local = local[local[:, 0] >= 0].cpu()
    local = local[local[:, 0].argsort()]
    if not torch.equal(local[:, 0].long(), torch.arange(n_pairs)):
        raise RuntimeError(f"gathered scores do not cover pairs 0..{n_pairs - 1} exactly once")
    return local[:, 1], local[:, 2]


def _in_eval_mode(models: list[nn.Module]):
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    return was_training


def evaluate_reward_model(
    model: nn.Module, eval_set: EvalSet, device, n_resamples: int = 2000, seed: int = 0, prefix_sharing: bool = True
) -> dict:
    """Preference accuracy of a reward model's raw scalar (call on every rank; every rank gets the results).
    `prefix_sharing`: packed rows (packed_pairs)."""
    was = _in_eval_mode([model])
    index, c, r = score_local(
        lambda b: reward_scores(model, b, device, prefix_sharing),
        eval_set,
        device,
        "preference accuracy (reward model)",
    )
    model.train(was[0])
    c, r = gather_pair_scores(index, c, r, eval_set.n_pairs)
    return preference_summary(c, r, eval_set.chosen_longer, n_resamples, seed=seed)


# reward_model.py's and dpo.py's training metrics of a step's pairs (means over the pairs of every rank)
metric("train/accuracy", "max", "share of the step's pairs whose chosen response scores higher", ("reward_model",))
metric("train/reward_chosen", "max", "mean reward (DPO: implicit reward) of the chosen responses")
metric("train/reward_rejected", "max", "mean reward (DPO: implicit reward) of the rejected responses")
metric("train/reward_margin", "max", "mean reward of the chosen minus the rejected response", headline=("dpo",))
metric("train/logp_chosen", "max", "DPO: the policy's mean summed log-prob of the chosen responses")
metric("train/logp_rejected", "max", "DPO: the policy's mean summed log-prob of the rejected responses")
# preference_summary's metrics under each prefix they are logged with: reward_model.py's and dpo.py's validation
# (whose accuracy is a headline of both), eval_preferences.py's results, grpo.py's evaluation of the implicit reward
for _prefix in ("val/", "eval/", "eval/pref_"):
    for _part in ("", "chosen_longer_", "chosen_not_longer_"):
        _pairs = {"": "every pair", "chosen_longer_": "pairs whose chosen response is the longer"}.get(
            _part, "the rest"
        )
        _headline = ("reward_model", "dpo") if _prefix + _part == "val/" else ()
        metric(f"{_prefix}{_part}accuracy", "max", f"share of {_pairs} whose chosen response scores higher", _headline)
        for _bound in ("low", "high"):
            _help = f"{_bound}er bound of {_prefix}{_part}accuracy's 95% bootstrap interval"
            metric(f"{_prefix}{_part}accuracy_ci_{_bound}", None, _help, _headline)
    metric(f"{_prefix}n_pairs", None, "preference pairs evaluated")
    metric(f"{_prefix}n_ties", None, "pairs whose two scores are equal")
    metric(f"{_prefix}n_chosen_longer", None, "pairs whose chosen response is the longer")
    metric(f"{_prefix}n_chosen_not_longer", None, "pairs whose chosen response is not the longer")
    metric(f"{_prefix}chosen_score_mean", "max", "mean score of the chosen responses")
    metric(f"{_prefix}rejected_score_mean", "max", "mean score of the rejected responses")
    metric(f"{_prefix}margin_mean", "max", "mean score of the chosen minus the rejected response")
    metric(f"{_prefix}bt_loss", "min", "Bradley-Terry loss of the scores, -log sigmoid(chosen - rejected)")


def preference_metric_names(prefix: str) -> set[str]:
    """The metrics evaluate_reward_model and evaluate_policy log under `prefix`: preference_summary's keys, taken from
    the function itself (one pair, one resample), so the names cannot drift from what it returns."""
    one = torch.zeros(1)
    return {prefix + k for k in preference_summary(one, one, one.bool(), n_resamples=1)}


def eval_set_logps(
    model: nn.Module,
    eval_set: EvalSet,
    device,
    prefix_sharing: bool = True,
    desc: str = "preference log-probs (reference)",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's summed response log-probs: (pair_index, chosen, rejected), each (n,). A frozen reference's
    can be computed once and passed to evaluate_policy at every evaluation. `prefix_sharing`: packed rows
    (packed_pairs); `desc`: the progress shown."""
    was = _in_eval_mode([model])
    out = score_local(lambda b: pair_logprobs(model, b, device, prefix_sharing), eval_set, device, desc)
    model.train(was[0])
    return out


def evaluate_policy(
    policy: nn.Module,
    reference: nn.Module | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    eval_set: EvalSet,
    beta: float,
    device,
    n_resamples: int = 2000,
    seed: int = 0,
    prefix_sharing: bool = True,
) -> dict:
    """Preference accuracy of the implicit reward beta * (log pi(y|x) - log pi_ref(y|x)). `reference` is the
    reference model or its eval_set_logps on this eval set. `prefix_sharing`: packed rows (packed_pairs)."""
    index, pc, pr = eval_set_logps(policy, eval_set, device, prefix_sharing, "preference accuracy (policy)")
    ref = reference if isinstance(reference, tuple) else eval_set_logps(reference, eval_set, device, prefix_sharing)
    if not torch.equal(ref[0], index):
        raise ValueError("reference log-probs were computed on another evaluation set")
    c, r = gather_pair_scores(index, beta * (pc - ref[1]), beta * (pr - ref[2]), eval_set.n_pairs)
    return preference_summary(c, r, eval_set.chosen_longer, n_resamples, seed=seed)


# ----------------------------------------------------------------------------------------------------
# Reporting


def format_table(results: dict, title: str = "preference accuracy") -> str:
    """The results as a small text table: one line per subset (all pairs, chosen longer, chosen not longer)."""
    lines = [title, f"{'subset':<20}{'pairs':>7}{'accuracy':>10}{'95% CI':>18}"]
    for label, key, n_key in SUBSETS:
        acc, lo, hi = results[f"{key}accuracy"], results[f"{key}accuracy_ci_low"], results[f"{key}accuracy_ci_high"]
        lines.append(f"{label:<20}{results[n_key]:>7}{acc:>10.4f}{f'[{lo:.4f}, {hi:.4f}]':>18}")
    lines.append(
        f"ties {results['n_ties']}; mean score chosen {results['chosen_score_mean']:.4f}, rejected "
        f"{results['rejected_score_mean']:.4f}, margin {results['margin_mean']:.4f}; BT loss {results['bt_loss']:.4f}"
    )
    return "\n".join(lines)


def log_results(logger, results: dict, step: int, prefix: str = "val/") -> None:
    """Scalars under `prefix` and a wandb table of the three subsets (rank 0's Logger; others are no-ops)."""
    logger.log({f"{prefix}{k}": v for k, v in results.items()}, step)
    rows = [
        [
            label,
            results[n_key],
            results[f"{key}accuracy"],
            results[f"{key}accuracy_ci_low"],
            results[f"{key}accuracy_ci_high"],
        ]
        for label, key, n_key in SUBSETS
    ]
    logger.table(f"{prefix}accuracy_table", ["subset", "pairs", "accuracy", "ci_low", "ci_high"], rows, step)

"""Preference accuracy on TL;DR comparisons (trl-lib/tldr-preference, validation split by default).

    python evaluate.py --reward_model runs/rm/hf --data trl-lib/tldr-preference --split validation
    python evaluate.py --policy runs/dpo/hf --reference runs/sft/hf --beta 0.1
    torchrun --nproc_per_node=2 evaluate.py ...      # each rank scores a disjoint slice of the pairs
    python evaluate.py --help                        # every option

A reward model scores a response with its scalar r(x, y); a policy (DPO, GRPO, ...) with the implicit reward
beta * log(pi(y|x) / pi_ref(y|x)), the log-probs summed over the response tokens (Rafailov et al. 2023, sec. 5).
A pair counts as correct when the chosen response scores higher, and as half correct on an exact tie (a policy
equal to its reference ties every pair and scores 0.5). Reported: accuracy with a percentile-bootstrap 95%
interval (fixed seed), the number of pairs and ties, the same split by whether the chosen summary is the longer
one (in tokens; equal lengths count as "not longer"), mean scores and the Bradley-Terry loss of the scores.

The functions below are what reward_model.py and dpo.py call during training: build_eval_set once, then
evaluate_reward_model or evaluate_policy, on every rank (the scoring is collective under FSDP).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from data.tldr import PREF_COLUMNS, PreferenceDataset, collate_pairs, encode_response, load_rows
from data.tokenizer import get_tokenizer
from model.weights import build_policy, build_reward_model, model_config
from utils.config import ConfigError, check_context, config_to_dict, parse_config
from utils.dist import cleanup_distributed, setup_distributed
from utils.fsdp import resolve_dtype, shard_model
from utils.guard import exit_on_error
from utils.logging import Logger
from utils.losses import sequence_logprobs
from utils.stats import preference_summary

# (label, key prefix of the accuracy fields, field holding the number of pairs) of each reported subset
SUBSETS = (
    ("all", "", "n_pairs"),
    ("chosen longer", "chosen_longer_", "n_chosen_longer"),
    ("chosen not longer", "chosen_not_longer_", "n_chosen_not_longer"),
)


# ----------------------------------------------------------------------------------------------------
# Scoring one batch of pairs (collate_pairs layout: chosen rows 0..B-1, rejected rows B..2B-1)


def response_logprobs(model: nn.Module, batch: dict, device) -> torch.Tensor:
    """log pi(y | x) of every row (2B,), summed over response tokens, in fp32; differentiable.

    The LM head runs only at the columns P-1 .. P+R-2 that predict the response (see data/tldr.py)."""
    P, R = batch["prompt_len"], batch["response_ids"].shape[1]
    logits = model(
        batch["input_ids"].to(device), batch["position_ids"].to(device), batch["attention_mask"].to(device),
        logits_slice=slice(P - 1, P + R - 1),
    )  # (2B, R, V)
    return sequence_logprobs(logits, batch["response_ids"].to(device), batch["response_mask"].to(device))  # (2B,)


def reward_scores(model: nn.Module, batch: dict, device) -> torch.Tensor:
    """Raw reward of every row (2B,), read at each row's last real token (the response's end token)."""
    return model(batch["input_ids"].to(device), batch["position_ids"].to(device), batch["attention_mask"].to(device))


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
) -> EvalSet:
    """Tokenize preference rows and cut this rank's slice (pairs rank, rank + world, ...) into micro-batches."""
    n = len(rows)
    data = PreferenceDataset(rows, tok, max_prompt_len, max_response_len, name=name)
    # Lengths of the whole responses (not the truncated ones), so the split does not depend on max_response_len.
    chosen_len = torch.tensor([len(encode_response(tok, r["chosen"], 1 << 30)) for r in rows])
    rejected_len = torch.tensor([len(encode_response(tok, r["rejected"], 1 << 30)) for r in rows])
    per_rank = math.ceil(n / world)
    mine = list(range(rank, n, world))
    mine += [-1] * (per_rank - len(mine))
    batches = []
    for start in range(0, per_rank, micro_batch_size):
        index = mine[start : start + micro_batch_size]
        rows_idx = [i if i >= 0 else 0 for i in index]
        batch = collate_pairs(
            [data.prompts[i] for i in rows_idx], [data.chosen[i] for i in rows_idx], [data.rejected[i] for i in rows_idx]
        )
        batch["pair_index"] = torch.tensor(index, dtype=torch.long)
        batches.append(batch)
    return EvalSet(batches, chosen_len > rejected_len, n, name)


@torch.no_grad()
def score_local(score_fn, eval_set: EvalSet, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score this rank's pairs with score_fn(batch) -> (2B,): (pair_index (n,), chosen (n,), rejected (n,))."""
    index, chosen, rejected = [], [], []
    for batch in eval_set.batches:
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


def evaluate_reward_model(model: nn.Module, eval_set: EvalSet, device, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Preference accuracy of a reward model's raw scalar (call on every rank; every rank gets the results)."""
    was = _in_eval_mode([model])
    index, c, r = score_local(lambda b: reward_scores(model, b, device), eval_set, device)
    model.train(was[0])
    c, r = gather_pair_scores(index, c, r, eval_set.n_pairs)
    return preference_summary(c, r, eval_set.chosen_longer, n_resamples, seed=seed)


def policy_logps(model: nn.Module, eval_set: EvalSet, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's summed response log-probs: (pair_index, chosen, rejected), each (n,). A frozen reference's
    can be computed once and passed to evaluate_policy at every evaluation."""
    was = _in_eval_mode([model])
    out = score_local(lambda b: response_logprobs(model, b, device), eval_set, device)
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
) -> dict:
    """Preference accuracy of the implicit reward beta * (log pi(y|x) - log pi_ref(y|x)). `reference` is the
    reference model or its policy_logps on this eval set."""
    index, pc, pr = policy_logps(policy, eval_set, device)
    ref = reference if isinstance(reference, tuple) else policy_logps(reference, eval_set, device)
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
        [label, results[n_key], results[f"{key}accuracy"], results[f"{key}accuracy_ci_low"], results[f"{key}accuracy_ci_high"]]
        for label, key, n_key in SUBSETS
    ]
    logger.table(f"{prefix}accuracy_table", ["subset", "pairs", "accuracy", "ci_low", "ci_high"], rows, step)


# ----------------------------------------------------------------------------------------------------
# Command line


@dataclass
class Config:
    reward_model: str = ""
    """Reward model to evaluate: a Hugging Face-format folder (reward_model.py's hf/) or hub name."""
    policy: str = ""
    """Policy to evaluate with its implicit reward (DPO/GRPO hf/ folder); needs --reference."""
    reference: str = ""
    """Reference policy of the implicit reward (usually the SFT model the policy started from)."""
    beta: float = 0.1
    """beta of the implicit reward beta * log(pi/pi_ref) (does not change the accuracy, only the scores)."""
    data: str = "trl-lib/tldr-preference"
    """Preference rows (prompt, chosen, rejected): a hub dataset name, a .jsonl/.parquet file or a folder."""
    split: str = "validation"
    """Split of --data (hub datasets and folders)."""
    max_pairs: int = 0
    """Evaluate the first N pairs only; 0 for all."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token."""
    micro_batch_size: int = 8
    """Pairs per forward pass on each rank."""
    bootstrap_samples: int = 2000
    """Bootstrap resamples for the 95% confidence intervals."""
    seed: int = 0
    """Seed of the bootstrap."""
    out_dir: str = ""
    """When set: write preference_eval.json and metrics.jsonl there and log to wandb (see --wandb_mode)."""
    device: str = "auto"
    """auto, cuda or cpu."""
    dtype: str = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU)."""
    wandb_mode: str = "auto"
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise); used with --out_dir."""
    wandb_project: str = "tldr-rlhf"
    """wandb project."""
    run_name: str = "evaluate"
    """wandb run name."""

    def validate(self) -> None:
        if bool(self.reward_model) == bool(self.policy):
            raise ConfigError("give exactly one of --reward_model or --policy")
        if self.policy and not self.reference:
            raise ConfigError("--policy needs --reference (the implicit reward is beta * log pi/pi_ref)")
        if self.reference and not self.policy:
            raise ConfigError("--reference is only used with --policy")
        for name in ("micro_batch_size", "max_prompt_len", "max_response_len", "bootstrap_samples"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.max_pairs < 0:
            raise ConfigError(f"--max_pairs must be >= 0, got {self.max_pairs}")
        if self.wandb_mode not in ("online", "offline", "disabled", "auto"):
            raise ConfigError(f"--wandb_mode must be online, offline, disabled or auto, got '{self.wandb_mode}'")


def main(cfg: Config) -> dict:
    # 1. distributed set-up; the models' configs and context lengths (before data is tokenized or models are built)
    info = setup_distributed(cfg.device)
    rank, world, device = info.rank, info.world_size, info.device
    dtype = resolve_dtype(cfg.dtype, device)
    for what, name in (("reward model", cfg.reward_model), ("policy", cfg.policy), ("reference", cfg.reference)):
        if name:
            check_context(model_config(name), cfg.max_prompt_len, cfg.max_response_len, what)

    # 2. data: this rank's disjoint slice of the pairs
    rows = load_rows(cfg.data, cfg.split, PREF_COLUMNS)
    rows = rows[: cfg.max_pairs] if cfg.max_pairs else rows
    name = f"{cfg.data}[{cfg.split}]"
    eval_set = build_eval_set(rows, get_tokenizer(), cfg.max_prompt_len, cfg.max_response_len, cfg.micro_batch_size, rank, world, name)

    # 3. models and scores
    if cfg.reward_model:
        model = build_reward_model(cfg.reward_model)
        model = shard_model(model, dtype).to(device)
        results = evaluate_reward_model(model, eval_set, device, cfg.bootstrap_samples, cfg.seed)
        title = f"reward model {cfg.reward_model} on {name}"
    else:
        policy, reference = build_policy(cfg.policy), build_policy(cfg.reference)
        policy, reference = shard_model(policy, dtype).to(device), shard_model(reference, dtype).to(device)
        results = evaluate_policy(policy, reference, eval_set, cfg.beta, device, cfg.bootstrap_samples, cfg.seed)
        title = f"policy {cfg.policy} vs reference {cfg.reference} (beta {cfg.beta}) on {name}"

    # 4. report
    if rank == 0:
        print(format_table(results, title))
    if cfg.out_dir:
        logger = Logger(cfg.out_dir, config_to_dict(cfg), cfg.wandb_project, cfg.run_name, cfg.wandb_mode, rank == 0)
        log_results(logger, results, step=0, prefix="eval/")
        logger.finish()
        if rank == 0:
            (Path(cfg.out_dir) / "preference_eval.json").write_text(
                json.dumps({"config": config_to_dict(cfg), "results": results}, indent=2)
            )
    cleanup_distributed()
    return results


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

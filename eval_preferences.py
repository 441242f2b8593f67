"""Preference accuracy of a reward model or a policy on TL;DR comparisons (trl-lib/tldr-preference validation).

    python eval_preferences.py --reward_model runs/rm/hf --val_data trl-lib/tldr-preference --val_split validation
    python eval_preferences.py --policy runs/dpo/hf --reference runs/sft/hf --beta 0.1
    python eval_preferences.py --policy runs/dpo/hf --reference runs/sft/hf --judge runs/rm/hf   # + the win rate
    torchrun --nproc_per_node=2 eval_preferences.py ...   # each rank scores a disjoint slice of the pairs
    python eval_preferences.py --help                     # every option

What is measured and how: evaluation/preference.py (the library the training stages call). With --policy and
--judge, also the policy's win rate against the reference summaries of --summary_data: the share of its prompts where
the judge (a reward model) scores the policy's greedy summary above the human one (evaluation/samples.py).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from data.tldr import PREF_COLUMNS, SFT_COLUMNS, load_rows
from data.tokenizer import get_tokenizer
from evaluation.preference import build_eval_set, evaluate_policy, evaluate_reward_model, format_table, log_results
from evaluation.samples import JudgeConfig, summary_win_rate
from model.weights import build_policy, build_reward_model, freeze, model_config
from utils.config import ConfigError, config_to_dict, fit_context, option, parse_config
from utils.dist import cleanup_distributed, setup_distributed
from utils.fsdp import resolve_dtype, shard_model
from utils.guard import all_ranks_agree, exit_on_error
from utils.logging import Logger
from utils.rundir import check_run_dir, lock_run_dir, release_run_dir


@dataclass
class Config(JudgeConfig):  # --judge (with --policy): the win rate against reference summaries
    # --- models
    reward_model: str = option("", model="reward_model")
    """Reward model to evaluate: a Hugging Face-format folder (reward_model.py's hf/) or hub name."""
    policy: str = option("", model="policy")
    """Policy to evaluate with its implicit reward (DPO/GRPO hf/ folder); needs --reference."""
    reference: str = option("", model="policy")
    """Reference policy of the implicit reward (usually the SFT model the policy started from)."""
    beta: float = 0.1
    """beta of the implicit reward beta * log(pi/pi_ref) (does not change the accuracy, only the scores)."""
    # --- data
    val_data: str = "trl-lib/tldr-preference"
    """Preference rows (prompt, chosen, rejected) to evaluate on: a hub dataset name, a .jsonl/.parquet file or a
    folder."""
    val_split: str = "validation"
    """Split of --val_data (hub datasets and folders)."""
    val_rows: int = 0
    """Pairs evaluated (the first N); 0 for all."""
    max_prompt_len: int = 512
    """Prompt tokens kept; longer posts are cut so subreddit, title and "TL;DR:" survive."""
    max_response_len: int = 64
    """Response tokens kept, including the "\\n" end token."""
    # --- batch sizes and optimisation
    micro_batch_size: int = 8
    """Pairs per forward pass on each rank."""
    # --- evaluation and logging
    bootstrap_samples: int = 2000
    """Bootstrap resamples for the 95% confidence intervals."""
    seed: int = 0
    """Seed of the bootstrap."""
    # --- run
    out_dir: str = ""
    """When set: write preference_eval.json and metrics.jsonl there and log to wandb (see --wandb_mode); a training
    run's folder is written under its lock (refused while the run holds it), its config.json left alone."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda when available), cuda or cpu."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU)."""
    dist_timeout_minutes: float = 30.0
    """Process-group timeout: a collective that waits longer than this for another rank fails the run (NCCL and gloo
    alike) instead of hanging."""
    # --- evaluation and logging
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """online, offline, disabled, or auto (online with a wandb login, offline otherwise); used with --out_dir."""
    wandb_project: str = "tldr-rlhf"
    """wandb project."""
    run_name: str = "eval_preferences"
    """wandb run name."""
    tensorboard: bool = True
    """TensorBoard event files in --out_dir beside metrics.jsonl (the results at step 0, the accuracy tables as text;
    a training run's options stay its hyperparameters); used with --out_dir."""

    def validate(self) -> None:
        if bool(self.reward_model) == bool(self.policy):
            raise ConfigError("give exactly one of --reward_model or --policy")
        if self.policy and not self.reference:
            raise ConfigError("--policy needs --reference (the implicit reward is beta * log pi/pi_ref)")
        if self.reference and not self.policy:
            raise ConfigError("--reference is only used with --policy")
        if self.judge and not self.policy:
            raise ConfigError("--judge scores a policy's summaries: it needs --policy")
        for name in ("micro_batch_size", "max_prompt_len", "max_response_len", "bootstrap_samples"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.val_rows < 0:
            raise ConfigError(f"--val_rows must be >= 0, got {self.val_rows}")
        self.validate_judge()


def main(cfg: Config) -> dict:
    # 1. distributed set-up; the models' configs and context lengths (before data is tokenized or models are built)
    info = setup_distributed(cfg.device, cfg.dist_timeout_minutes)
    rank, world, device = info.rank, info.world_size, info.device
    dtype = resolve_dtype(cfg.dtype, device)
    limits = []
    for what, name, kind in (
        ("reward model", cfg.reward_model, "reward_model"),
        ("policy", cfg.policy, "policy"),
        ("reference", cfg.reference, "policy"),
    ):
        if name:  # accuracy does not depend on the reward model's gain and bias: it may lack them
            model_cfg = model_config(name, kind=kind, option="--" + what.replace(" ", "_"), normalized=False)
            limits.append((model_cfg, "max_response_len", what))
    fit_context(cfg, *limits, *cfg.judge_limits(model_config(cfg.policy) if cfg.policy else None))
    with all_ranks_agree("the run directory's checks", device):  # one writer at a time, as in training
        if cfg.out_dir and rank == 0:
            check_run_dir(cfg.out_dir)
            lock_run_dir(cfg.out_dir)

    # 2. data: this rank's disjoint slice of the pairs
    rows = load_rows(cfg.val_data, cfg.val_split, PREF_COLUMNS)
    rows = rows[: cfg.val_rows] if cfg.val_rows else rows
    name = f"{cfg.val_data}[{cfg.val_split}]"
    tok = get_tokenizer()
    eval_set = build_eval_set(
        rows, tok, cfg.max_prompt_len, cfg.max_response_len, cfg.micro_batch_size, rank, world, name
    )
    summary_rows = []
    if cfg.judge:
        summary_rows = load_rows(cfg.summary_data, cfg.summary_split, SFT_COLUMNS)
        summary_rows = summary_rows[: cfg.summary_rows] if cfg.summary_rows else summary_rows

    # 3. models and scores
    if cfg.reward_model:
        # every model here is frozen before sharding (nothing trains): shard_model then empties FSDP2's per-forward
        # records after each forward
        model = shard_model(freeze(build_reward_model(cfg.reward_model)), dtype).to(device)
        results = evaluate_reward_model(model, eval_set, device, cfg.bootstrap_samples, cfg.seed)
        title = f"reward model {cfg.reward_model} on {name}"
    else:
        policy, reference = freeze(build_policy(cfg.policy)), freeze(build_policy(cfg.reference))
        policy, reference = shard_model(policy, dtype).to(device), shard_model(reference, dtype).to(device)
        results = evaluate_policy(policy, reference, eval_set, cfg.beta, device, cfg.bootstrap_samples, cfg.seed)
        title = f"policy {cfg.policy} vs reference {cfg.reference} (beta {cfg.beta}) on {name}"
        if cfg.judge:
            del reference
            judge = shard_model(freeze(build_reward_model(cfg.judge)), dtype).to(device)
            lengths = (cfg.max_prompt_len, cfg.max_new_tokens, 2 * cfg.micro_batch_size)
            results |= summary_win_rate(policy, judge, summary_rows, tok, *lengths, cfg.bootstrap_samples, cfg.seed)

    # 4. report
    if rank == 0:
        print(format_table(results, title))
        if cfg.judge:
            print(
                f"win rate against the reference summaries of {cfg.summary_data}[{cfg.summary_split}], judged by "
                f"{cfg.judge}: {results['summary_win_rate']:.4f} [{results['summary_win_rate_ci_low']:.4f}, "
                f"{results['summary_win_rate_ci_high']:.4f}] over {results['summary_prompts']} prompts; mean reward "
                f"{results['summary_reward_mean']:.4f} (references {results['summary_reference_reward_mean']:.4f})"
            )
    if cfg.out_dir:
        logger = Logger(
            cfg.out_dir,
            config_to_dict(cfg),
            cfg.wandb_project,
            cfg.run_name,
            cfg.wandb_mode,
            rank == 0,
            record=False,
            tensorboard=cfg.tensorboard,
        )
        log_results(logger, results, step=0, prefix="eval/")
        logger.finish()
        if rank == 0:
            (Path(cfg.out_dir) / "preference_eval.json").write_text(
                json.dumps({"config": config_to_dict(cfg), "results": results}, indent=2)
            )
            release_run_dir(cfg.out_dir)
    cleanup_distributed()
    return results


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

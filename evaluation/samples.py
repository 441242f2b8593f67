"""Summaries sampled from a policy, to read: sample.py's command line and the table of sample summaries that sft.py
and dpo.py log at every evaluation (samples.jsonl in the run directory and a wandb table, as grpo.py's).

A post given as text becomes a TL;DR prompt (tldr_prompt); prompts are cut to --max_prompt_len as in training
(data.tldr.encode_prompt: the end of the post goes, subreddit, title and "TL;DR:" stay).
"""

from dataclasses import dataclass

import torch

from data.tldr import SFT_COLUMNS, PromptDataset, decode_responses, load_rows, pad_prompts
from evaluation.summaries import reference_summaries
from model.sampler import SampleOutput
from model.weights import build_reward_model, freeze, model_config
from rlhf.stats import win_rate
from rollouts.sampling import sample_responses, score
from utils.config import ConfigError, option
from utils.dist import rank_and_world, stream
from utils.fsdp import shard_model
from utils.logging import EvalProgress
from utils.metrics import metric

SAMPLE_COLUMNS = ["prompt", "response", "reference"]
"""Columns of the samples table sft.py and dpo.py log: the prompt, the policy's greedy summary and the data's own
response (SFT's reference summary, DPO's chosen one)."""


def tldr_prompt(post: str, subreddit: str = "", title: str = "") -> str:
    """A post as the TL;DR prompt the models are trained on; a text already ending in "TL;DR:" is kept as it is."""
    post = post.strip()
    if post.endswith("TL;DR:"):
        return post
    header = (f"SUBREDDIT: r/{subreddit}\n\n" if subreddit else "") + (f"TITLE: {title}\n\n" if title else "")
    return f"{header}POST: {post}\n\nTL;DR:"


@torch.no_grad()
def sample_summaries(
    policy,
    prompts: list[list[int]],
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    batch_prompts: int = 8,
    on_chunk=None,
) -> tuple[torch.Tensor, torch.Tensor, SampleOutput]:
    """`num_samples` summaries of each prompt (token ids), `batch_prompts` prompts per generation call, through
    rollouts.sampling.sample_responses (under FSDP every rank calls it with the same prompts). Returns the padded
    prompts (B, P) ids and mask and the samples, rows b*G .. b*G+G-1 belonging to prompt b. `greedy`: temperature 0
    (the most likely token; num_samples identical rows). `on_chunk(prompts)` after each call (progress)."""
    prompt_ids, prompt_mask = pad_prompts(prompts)  # (B, P) left-padded
    device = next(policy.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    samples = sample_responses(
        policy,
        prompt_ids,
        prompt_mask,
        num_samples,
        max_new_tokens,
        prompts_per_call=batch_prompts,
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        generator=generator,
        on_chunk=on_chunk,
    )
    return prompt_ids, prompt_mask, samples


@torch.no_grad()
def reward_of_samples(
    reward_model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: SampleOutput,
    group: int,
    micro_batch_size: int = 16,
) -> torch.Tensor:
    """The reward model's normalized score (gain * raw + bias: reward_model.py's normalisation) of every sample (N,),
    sample n answering prompt n // group."""
    raw = score(reward_model, prompt_ids, prompt_mask, samples, group, micro_batch_size, prefix_sharing=False)  # (N,)
    return reward_model.normalize(raw).float()


class SampleLog:
    """The validation prompts whose greedy summaries sft.py and dpo.py log at every evaluation: a table of
    SAMPLE_COLUMNS under the key "samples" (samples.jsonl in the run directory, a wandb table). Every rank generates
    the same summaries (the policy's parameters are gathered once, a collective); rank 0's logger writes them."""

    def __init__(
        self,
        rows: list[dict[str, str]],
        reference_column: str,
        tok,
        max_prompt_len: int,
        max_new_tokens: int,
        seed: int,
    ):
        self.tok, self.max_new_tokens, self.seed = tok, max_new_tokens, seed
        self.texts = [r["prompt"] for r in rows]
        self.references = [r[reference_column] for r in rows]
        self.prompts = PromptDataset(rows, tok, max_prompt_len, name="sample prompts").prompts

    def log(self, logger, policy, step: int) -> None:
        if not self.prompts:
            return
        # a stream of its own: greedy decoding still draws, and the run's other streams must not move
        generator = stream(self.seed, step, rank_and_world()[0], "samples", device=next(policy.parameters()).device)
        _, _, samples = sample_summaries(policy, self.prompts, 1, self.max_new_tokens, greedy=True, generator=generator)
        texts = decode_responses(self.tok, samples.response_ids, samples.response_mask, samples.has_end)
        rows = [[p, t.strip(), r.strip()] for p, t, r in zip(self.texts, texts, self.references, strict=True)]
        logger.table("samples", SAMPLE_COLUMNS, rows, step)


@torch.no_grad()
def summary_win_rate(
    policy,
    reward_model,
    rows: list[dict[str, str]],
    tok,
    max_prompt_len: int,
    max_new_tokens: int,
    micro_batch_size: int = 16,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """The policy's greedy summary of each row's prompt against the row's reference summary (`completion`, cut to
    max_new_tokens like the policy's), judged by the reward model's raw score: the win rate with its bootstrap
    interval (rlhf.stats.win_rate) and both mean normalized rewards. Every rank computes all rows (a command line's
    evaluation: eval_preferences.py)."""
    prompts = PromptDataset(rows, tok, max_prompt_len, name="summary prompts").prompts
    progress = EvalProgress("summaries", len(prompts), unit="prompts", split=False)
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)  # greedy still draws
    ids, mask, samples = sample_summaries(
        policy, prompts, 1, max_new_tokens, greedy=True, generator=generator, on_chunk=progress.advance
    )
    progress.close()
    references = reference_summaries([r["completion"] for r in rows], tok, max_new_tokens, ids.device)
    policy_raw = score(reward_model, ids, mask, samples, 1, micro_batch_size, prefix_sharing=False).double().cpu()
    reference_raw = score(reward_model, ids, mask, references, 1, micro_batch_size, prefix_sharing=False).double().cpu()
    out = {f"summary_{k}": v for k, v in win_rate(policy_raw, reference_raw, n_resamples, seed=seed).items()}
    gain, bias = float(reward_model.gain), float(reward_model.bias)
    out |= {
        "summary_prompts": len(rows),
        "summary_reward_mean": float((gain * policy_raw + bias).mean()),
        "summary_reference_reward_mean": float((gain * reference_raw + bias).mean()),
    }
    return out


@dataclass
class JudgeConfig:
    # --- evaluation and logging
    judge: str = option("", model="reward_model")
    """A reward model (reward_model.py's hf/ folder) that judges the policy's greedy summaries of --summary_data
    against their reference summaries (in a training stage, at every evaluation): the win rate (docs/reporting.md);
    empty: none."""
    summary_data: str = "trl-lib/tldr"
    """Rows with prompt and completion (the human reference summary) for --judge: a hub dataset name, a .jsonl/.parquet
    file or a folder."""
    summary_split: str = "validation"
    """Split of --summary_data."""
    summary_rows: int = 256
    """Posts of --summary_data summarized for --judge (the first N); 0 for all. Every rank summarizes all of them."""
    max_new_tokens: int = 53
    """Tokens of each judged summary at most, the end token included (the reference summaries are cut alike)."""

    def validate_judge(self) -> None:
        """The --judge options, and that a judge has something to judge at an evaluation that runs: --summary_data,
        and in a training stage its validation (--val_data, --eval_every >= 0), the same in every script."""
        if self.judge and not self.summary_data:
            raise ConfigError("--judge scores summaries of --summary_data's posts, and --summary_data is empty")
        if self.judge and hasattr(self, "eval_every") and (not getattr(self, "val_data", "") or self.eval_every < 0):
            raise ConfigError(
                f"--judge scores the policy at each validation, and --val_data {getattr(self, 'val_data', '')!r} "
                f"with --eval_every {self.eval_every} runs none: give --val_data and --eval_every >= 0, or leave "
                f"--judge empty"
            )
        if self.summary_rows < 0:
            raise ConfigError(f"--summary_rows must be >= 0, got {self.summary_rows}")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"--max_new_tokens must be positive, got {self.max_new_tokens}")

    def judge_limits(self, policy_cfg) -> list[tuple]:
        """utils.config.fit_context's limits of the judged summaries: prompt + max_new_tokens in the policy and the
        judge (none without --judge). Checks that --judge is a reward model (model.weights.model_config)."""
        if not self.judge:
            return []
        # the win rate compares two rewards of one model: its gain and bias cancel, so it need not hold them
        judge_cfg = model_config(self.judge, kind="reward_model", option="--judge", normalized=False)
        return [(policy_cfg, "max_new_tokens", "policy"), (judge_cfg, "max_new_tokens", "judge")]


_WIN = "--judge: share of the posts whose greedy summary it scores above the reference"
# summary_win_rate's results as eval_preferences.py logs them (--judge with --policy)
metric("eval/summary_win_rate", "max", _WIN)
metric("eval/summary_win_rate_ci_low", None, "lower bound of eval/summary_win_rate's 95% bootstrap interval")
metric("eval/summary_win_rate_ci_high", None, "upper bound of eval/summary_win_rate's 95% bootstrap interval")
metric("eval/summary_prompts", None, "--judge: the posts summarized")
metric("eval/summary_reward_mean", "max", "--judge: the judge's mean normalised score of the greedy summaries")
metric(
    "eval/summary_reference_reward_mean", "max", "--judge: the judge's mean normalised score of the reference summaries"
)

JUDGE_METRICS = {  # summary_win_rate's result -> the metric a training stage's evaluation logs it as (its declaration;
    # Judge.evaluate under val/): the win rate and its interval are headlines of SFT and DPO
    "summary_win_rate": metric("val/win_rate", "max", _WIN, ("sft", "dpo")),
    "summary_win_rate_ci_low": metric(
        "val/win_rate_ci_low", None, "lower bound of val/win_rate's 95% bootstrap interval", ("sft", "dpo")
    ),
    "summary_win_rate_ci_high": metric(
        "val/win_rate_ci_high", None, "upper bound of val/win_rate's 95% bootstrap interval", ("sft", "dpo")
    ),
    "summary_reward_mean": metric(
        "val/summary_reward", "max", "--judge: the judge's mean normalised score of the summaries"
    ),
    "summary_reference_reward_mean": metric(
        "val/reference_reward", "max", "--judge: the judge's mean normalised score of the reference summaries"
    ),
}


class Judge:
    """--judge's reward model, sharded like the run's models, and its --summary_data rows; evaluate() gives the
    policy's win rate against the references under the stage's evaluation prefix (a collective: every rank calls it)."""

    def __init__(self, cfg: JudgeConfig, tok, max_prompt_len: int, dtype, device, micro_batch_size: int, seed: int):
        rows = load_rows(cfg.summary_data, cfg.summary_split, SFT_COLUMNS)
        self.rows = rows[: cfg.summary_rows] if cfg.summary_rows else rows
        # frozen before sharding: shard_model gives a frozen model the hook that empties FSDP2's per-forward records
        self.model = shard_model(freeze(build_reward_model(cfg.judge)), dtype).to(device)
        self.tok, self.max_prompt_len, self.max_new_tokens = tok, max_prompt_len, cfg.max_new_tokens
        self.micro_batch_size, self.seed = micro_batch_size, seed

    def evaluate(self, policy, prefix: str) -> dict:
        out = summary_win_rate(
            policy,
            self.model,
            self.rows,
            self.tok,
            self.max_prompt_len,
            self.max_new_tokens,
            self.micro_batch_size,
            seed=self.seed,
        )
        return {prefix + name.removeprefix("val/"): out[key] for key, name in JUDGE_METRICS.items()}

    @staticmethod
    def metric_names(prefix: str) -> set[str]:
        """The metrics evaluate() logs under `prefix`."""
        return {prefix + name.removeprefix("val/") for name in JUDGE_METRICS.values()}

"""Summaries from a trained policy: any stage's hf/ export, a hub name, or a random preset.

    python sample.py --policy runs/grpo/hf --data ../shared/data/tldr/validation.jsonl --rows 3
    python sample.py --policy runs/sft/hf --post "My landlord kept my deposit ..." --num_samples 4 --temperature 0.7
    echo "My landlord kept my deposit ..." | python sample.py --policy runs/dpo/hf --greedy true
    python sample.py --policy runs/grpo/hf --data ... --reward_model runs/rm/hf --jsonl true > samples.jsonl

Prompts come from a data file (its prompt column, the first --rows), from --post (a post's text, or a whole TL;DR
prompt ending in "TL;DR:"), or from standard input when neither is given (or --post -). With --reward_model every
summary is scored (normalized reward, reward_model.py's gain and bias). Output: each prompt with its summaries, or
with --jsonl one JSON object per summary (prompt, sample, summary, ended, reward).
"""

import json
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from data.tldr import PROMPT_COLUMNS, PromptDataset, decode_responses, load_rows
from data.tokenizer import get_tokenizer
from evaluation.samples import reward_of_samples, sample_summaries, tldr_prompt
from model.weights import build_policy, build_reward_model, model_config
from utils.config import ConfigError, fit_context, option, parse_config
from utils.fsdp import resolve_dtype
from utils.guard import exit_on_error
from utils.host import cpu_memory_settings


@dataclass
class Config:
    # --- models
    policy: str = option("runs/grpo/hf", model="policy")
    """Policy to sample from: a Hugging Face-format folder (any stage's hf/), a hub name, or with --random_init a
    preset (tiny, small, ...)."""
    random_init: bool = False
    """A random GPT-2 of the preset named by --policy (smoke tests)."""
    # --- data
    data: str = ""
    """Prompts: a .jsonl/.parquet file, a folder or a hub dataset with a prompt column; empty: --post or stdin."""
    split: str = "validation"
    """Split of --data (folders and hub datasets)."""
    rows: int = 4
    """Prompts of --data used (the first N); 0 for all."""
    post: str = ""
    """A post to summarize (or a whole prompt ending in "TL;DR:"); "-" reads it from standard input."""
    subreddit: str = ""
    """Subreddit of --post (without r/), written into its prompt; empty: none."""
    title: str = ""
    """Title of --post, written into its prompt; empty: none."""
    # --- sampling
    num_samples: int = 1
    """Summaries per prompt."""
    temperature: float = 0.7
    """Sampling temperature (> 0); see --greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""
    greedy: bool = False
    """The most likely token at every step (then every sample of a prompt is the same)."""
    max_new_tokens: int = 53
    """Summary tokens at most, the end token included."""
    max_prompt_len: int = 512
    """Prompt tokens kept (the end of a longer post is cut); lowered to what the policy's positions hold."""
    # --- models
    reward_model: str = option("", model="reward_model")
    """Score every summary with this reward model (reward_model.py's hf/ folder); empty: no score."""
    # --- evaluation and logging
    jsonl: bool = False
    """One JSON object per summary instead of the readable listing."""
    # --- run
    seed: int = 0
    """Seed of the sampling."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (cuda when available), cuda or cpu."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: bf16, fp32, or auto (bf16 on GPU, fp32 on CPU)."""

    def validate(self) -> None:
        if self.data and self.post:
            raise ConfigError("give --data or --post, not both")
        if not self.temperature > 0:
            raise ConfigError(
                f"--temperature must be > 0 (the most likely token: --greedy true), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        for name in ("num_samples", "max_new_tokens", "max_prompt_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.rows < 0:
            raise ConfigError(f"--rows must be >= 0, got {self.rows}")


def prompt_rows(cfg: Config, stdin=None) -> list[dict[str, str]]:
    """The prompts to summarize: --data's first --rows, --post, or standard input."""
    if cfg.data:
        rows = load_rows(cfg.data, cfg.split, PROMPT_COLUMNS)
        return rows[: cfg.rows] if cfg.rows else rows
    post = cfg.post
    if not post or post == "-":
        stdin = stdin or sys.stdin
        if not post and stdin.isatty():
            raise ConfigError("no prompts: give --data, --post, or a post on standard input")
        post = stdin.read()
    if not post.strip():
        raise ConfigError("the post is empty")
    return [{"prompt": tldr_prompt(post, cfg.subreddit, cfg.title)}]


def main(cfg: Config, stdin=None, out=None) -> list[dict]:
    """Sample and print; returns one record per summary (prompt, sample, summary, ended, and reward when scored)."""
    out = out or sys.stdout
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        cpu_memory_settings()  # utils/host.py
    dtype = resolve_dtype(cfg.dtype, device)
    limits = [(model_config(cfg.policy, cfg.random_init, kind="policy", option="--policy"), "max_new_tokens", "policy")]
    if cfg.reward_model:  # its rewards are reported normalized: it must hold its gain and bias
        rm_cfg = model_config(cfg.reward_model, kind="reward_model", option="--reward_model")
        limits.append((rm_cfg, "max_new_tokens", "reward model"))
    fit_context(cfg, *limits)
    tok = get_tokenizer()
    rows = prompt_rows(cfg, stdin)
    prompts = PromptDataset(rows, tok, cfg.max_prompt_len, name=cfg.data or "--post")

    policy = build_policy(cfg.policy, cfg.random_init).to(device)
    if dtype is not None:
        policy.to(dtype)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    prompt_ids, prompt_mask, samples = sample_summaries(
        policy, prompts.prompts, cfg.num_samples, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.greedy, generator
    )
    del policy
    rewards = None
    if cfg.reward_model:
        reward_model = build_reward_model(cfg.reward_model).to(device)
        if dtype is not None:
            reward_model.to(dtype)
        rewards = reward_of_samples(reward_model, prompt_ids, prompt_mask, samples, cfg.num_samples).tolist()
    texts = decode_responses(tok, samples.response_ids, samples.response_mask, samples.has_end)

    records = []
    for n, text in enumerate(texts):
        record = {
            "prompt": prompts.texts[n // cfg.num_samples],
            "sample": n % cfg.num_samples,
            "summary": text.strip(),
            "ended": bool(samples.has_end[n]),
        }
        if rewards is not None:
            record["reward"] = rewards[n]
        records.append(record)
    for n, record in enumerate(records):
        if cfg.jsonl:
            print(json.dumps(record), file=out)
            continue
        if record["sample"] == 0:
            print(("\n" if n else "") + "=" * 100 + "\n" + record["prompt"], file=out)
        score = f"  reward {record['reward']:+.3f}" if "reward" in record else ""
        cut = "" if record["ended"] else "  (no end token: cut at --max_new_tokens)"
        print(f"--- summary {record['sample'] + 1}{score}{cut}\n{record['summary']}", file=out)
    return records


if __name__ == "__main__":
    with exit_on_error():
        main(parse_config(Config, description=__doc__.split("\n\n")[0]))

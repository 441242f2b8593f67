"""Helpers that several test files use (a test file never imports another: tests/test_layering.py). Rows and model
folders made up on the spot, a run's metrics, a script's command line run in this process, and the inputs of
rollouts.step.train_step on the CPU without a reward model."""

import errno
import json
import os
import random

import pytest
import torch

from data.tldr import pad_prompts
from data.tokenizer import get_tokenizer
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.sampler import END_ID
from model.weights import save_hf
from rlhf.rewards import RewardSource
from rollouts.prompts import PromptSet
from rollouts.sampling import RewardSpec
from utils.config import parse_config
from utils.guard import exit_on_error

WORDS = "cat dog car house job money friend sister brother school game phone rent boss date trip".split()


# ----------------------------------------------------------------------------------------------------
# Rows, model folders, metrics


def tldr_prompt(subreddit: str, title: str, post: str) -> str:
    return f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"


def write_sft_rows(path, n=64, seed=0):
    """TL;DR-shaped prompt and completion rows, so a test needs no downloaded data."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            post = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
            summary = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            prompt = tldr_prompt(rng.choice(WORDS), f"{rng.choice(WORDS)} {rng.choice(WORDS)}", post)
            f.write(json.dumps({"prompt": prompt, "completion": " " + summary}) + "\n")
    return path


def write_pref_rows(path, n=48, seed=0):
    """TL;DR-shaped preference rows with a learnable signal: chosen summaries end with a "good" word, rejected
    ones with a "bad" word."""
    rng = random.Random(seed)
    good, bad = "happy great love kind calm".split(), "angry awful hate rude sad".split()
    with open(path, "w") as f:
        for _ in range(n):
            post = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))
            prompt = tldr_prompt(rng.choice(WORDS), f"{rng.choice(WORDS)} {rng.choice(WORDS)}", post)
            chosen = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) + " " + rng.choice(good)
            rejected = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) + " " + rng.choice(bad)
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def pair_run_args(data, run, steps):
    """The options a small reward_model.py or dpo.py run on `data` shares."""
    return [
        "--train_data",
        str(data),
        "--val_data",
        str(data),
        "--val_rows",
        "16",
        "--steps",
        str(steps),
        "--batch_size",
        "8",
        "--micro_batch_size",
        "2",
        "--warmup_steps",
        "1",
        "--max_prompt_len",
        "64",
        "--max_response_len",
        "16",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(run),
    ]


def raise_on_rank_1(prompt: str, response: str) -> float:
    """A GRPO reward function ("tests.helpers:raise_on_rank_1") that fails on the rows rank 1 holds only."""
    if os.environ.get("RANK") == "1":
        raise ValueError("this function cannot score rank 1's rows")
    return float(len(response))


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def end_biased_policy(folder, n_positions=256, seed=0) -> GPT2LMHeadModel:
    """A random tiny GPT-2 whose "\\n" is likely (about half the responses end by themselves, some hit the limit),
    saved as a Hugging Face folder: ending is a signal GRPO can learn in a few steps."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=n_positions))
    with torch.no_grad():
        # the logit of "\n" is h . wte[END], h the final layer norm's output: bias h towards wte[END]
        direction = torch.randn(32)
        direction /= direction.norm()
        model.transformer.ln_f.bias.copy_(3 * direction)
        model.transformer.wte.weight[END_ID] = 2.2 * direction
    save_hf(model.state_dict(), model.cfg, folder)
    return model


def adapted_weight_names(cfg: GPTConfig) -> set[str]:
    """Hugging Face names of the weights LoRA adapts by default (the export merges the adapters into these)."""
    return {
        f"transformer.h.{i}.{m}.weight"
        for i in range(cfg.n_layer)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }


def changed_weights(before_folder, after_folder) -> set[str]:
    """Names of the weights that differ between two Hugging Face folders of a plain GPT-2."""
    from safetensors.torch import load_file

    before, after = (
        load_file(str(before_folder / "model.safetensors")),
        load_file(str(after_folder / "model.safetensors")),
    )
    assert before.keys() == after.keys()  # a plain GPT-2: no adapter keys
    return {k for k in before if not torch.equal(before[k], after[k])}


# ----------------------------------------------------------------------------------------------------
# A script's command line in this process


def run_cli(script, argv: list[str], capsys) -> tuple[int, str]:
    """`python SCRIPT.py ARGV` for the imported script module `script`, in this process (parse_config, main,
    exit_on_error): (exit code, the `error:` line). Asserts the error is one line and carries no traceback."""
    with pytest.raises(SystemExit) as info:
        with exit_on_error():
            script.main(parse_config(script.Config, argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return info.value.code, lines[0]


# ----------------------------------------------------------------------------------------------------
# rollouts.step.train_step's inputs on the CPU, one process


def zero_reward(prompt: str, response: str) -> float:
    """Every response alike: all advantages are exactly 0."""
    return 0.0


ZERO_REWARD = RewardSource("zero_reward", "tests.helpers:zero_reward", 1.0, zero_reward)


def prompts_and_rewards(
    cfg, sources: list[RewardSource] | None = None, prompts: list[list[int]] | None = None
) -> tuple[PromptSet, RewardSpec]:
    """rollouts.step.train_step's prompts and rewards on the CPU, without a reward model: `prompts` (token ids; by
    default cfg.prompts_per_step short ragged ones, for a tiny GPT-2), every one of the reward sources of cfg.rewards,
    or `sources`, applying to each."""
    tok = get_tokenizer()
    sources = cfg.sources() if sources is None else sources
    if prompts is None:
        prompts = [[11 + i + j for j in range(2 + i % 3)] for i in range(cfg.prompts_per_step)]
    ids, mask = pad_prompts(prompts)  # (B, P) left-padded
    applies = torch.ones(len(prompts), len(sources), dtype=torch.bool)
    prompt_set = PromptSet(
        ids, mask, [tok.decode(p) for p in prompts], list(range(len(prompts))), applies, "test prompts"
    )
    return prompt_set, RewardSpec(sources, cfg.normalize_reward_fns, tok)


class FullDiskFile:
    """A file whose writes fail as on a full disk (ENOSPC): every write, or only those whose text (or bytes, read as
    latin-1: a TensorBoard record holds its tags as they are) holds `trigger`."""

    def __init__(self, file, trigger: str = ""):
        self.file, self.trigger = file, trigger

    def write(self, text):
        if self.trigger in (text if isinstance(text, str) else bytes(text).decode("latin-1")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

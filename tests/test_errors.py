"""The catalogue of bad inputs (docs/errors.md): each runs a script's command line in this process, exactly as
`python SCRIPT.py ARGS` does (parse_config, main, exit_on_error), and must end with exit code 2 and one line,
`error: ...`, naming the input and what was expected, before any model is put on a device. Numerical faults end
with exit code 3 and leave the newest checkpoint intact. Two subprocess runs check the same from the outside
(one plain process, one torchrun launch where only rank 0 prints).

ERRORS_LOG=FILE appends each case's message to FILE as JSON lines (how docs/errors.md's messages were taken).
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import dpo
import eval_preferences
import grpo
import reward_model
import sample
import sft
from model.gpt2 import PRESETS, GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from model.weights import save_hf
from rollouts.step import train_step
from tests import helpers
from tests.conftest import ROOT, checkpoint_step, free_port, run_script
from utils.checkpoint import newest_intact, read_tensors, save_checkpoint
from utils.config import config_to_dict, parse_config
from utils.optim import build_optimizer, build_scheduler

SCRIPTS = {
    "sft": sft,
    "reward_model": reward_model,
    "dpo": dpo,
    "grpo": grpo,
    "eval_preferences": eval_preferences,
    "sample": sample,
}
TINY = PRESETS["tiny"]


# ----------------------------------------------------------------------------------------------------
# Inputs made up on the spot: rows, model folders, a checkpoint


def tldr_prompt(rng, words):
    post = " ".join(rng.choice(words) for _ in range(rng.randint(8, 20)))
    return (
        f"SUBREDDIT: r/{rng.choice(words)}\n\nTITLE: {rng.choice(words)} {rng.choice(words)}\n\nPOST: {post}\n\nTL;DR:"
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    rng = random.Random(0)
    words = "cat dog car house job money friend sister brother school game phone rent boss date trip".split()
    sft_rows = [
        {"prompt": tldr_prompt(rng, words), "completion": " " + " ".join(rng.sample(words, 3))} for _ in range(16)
    ]
    pref_rows = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": " " + rng.choice(words)} for r in sft_rows
    ]
    f = {
        "sft": write_jsonl(d / "sft.jsonl", sft_rows),
        "pref": write_jsonl(d / "pref.jsonl", pref_rows),
        "empty_field": write_jsonl(d / "empty_field.jsonl", [sft_rows[0], {**sft_rows[1], "completion": "   "}]),
        "not_text": write_jsonl(d / "not_text.jsonl", [sft_rows[0], sft_rows[1], {**sft_rows[2], "completion": 42}]),
        "no_tldr": write_jsonl(
            d / "no_tldr.jsonl", [sft_rows[0], {**sft_rows[1], "prompt": "POST: my cat ate my homework"}]
        ),
        "few_rows": write_jsonl(d / "few_rows.jsonl", sft_rows[:3]),
        "no_rows": write_jsonl(d / "no_rows.jsonl", []),
        "csv": d / "rows.csv",
        "broken_json": d / "broken.jsonl",
        "split_dir": d / "split_dir",
    }
    f["csv"].write_text("prompt,completion\n")
    f["broken_json"].write_text(json.dumps(sft_rows[0]) + "\n" + '{"prompt": "SUBREDDIT' + "\n")
    f["split_dir"].mkdir()
    shutil.copy(f["sft"], f["split_dir"] / "train.jsonl")

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(TINY)
    save_hf(policy.state_dict(), TINY, d / "policy")
    f["policy"] = d / "policy"
    (d / "no_config").mkdir()
    f["no_config"] = d / "no_config"
    shutil.copytree(d / "policy", d / "no_weights")
    (d / "no_weights" / "model.safetensors").unlink()
    f["no_weights"] = d / "no_weights"
    shutil.copytree(d / "policy", d / "bad_weights")
    (d / "bad_weights" / "model.safetensors").write_bytes(b"not a safetensors file")
    f["bad_weights"] = d / "bad_weights"
    nan_policy = GPT2LMHeadModel(TINY)
    with torch.no_grad():
        nan_policy.transformer.ln_f.weight.fill_(float("nan"))
    save_hf(nan_policy.state_dict(), TINY, d / "nan_policy")
    f["nan_policy"] = d / "nan_policy"
    for name, value in (("nan_rm", float("nan")), ("constant_rm", 0.0)):
        rm = RewardModel(TINY)
        with torch.no_grad():
            rm.score.weight.fill_(value)
        save_hf(rm.state_dict(), TINY, d / name)
        f[name] = d / name

    # an SFT checkpoint of the tiny model, after one optimizer step, at data position 0 of a 999-row dataset
    model = GPT2LMHeadModel(TINY)
    optimizer = build_optimizer(model, 1e-3, 0.0)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    loader = {"epoch": 0, "batch_in_epoch": 0, "n_examples": 999, "global_batch": 2}
    meta = {"stage": "sft", "model_config": TINY.to_dict()}
    scheduler = build_scheduler(optimizer, 1, 10)
    f["ckpt"] = save_checkpoint(d / "sft_run", 1, model, optimizer, scheduler, meta, extra={"loader": loader})
    shutil.copytree(f["ckpt"], d / "garbage_ckpt")
    (d / "garbage_ckpt" / "state.pt").write_bytes(b"truncated")
    f["garbage_ckpt"] = d / "garbage_ckpt"
    # the run's record of options, as its first start wrote it
    recorded = config_to_dict(parse_config(sft.Config, base_args("sft", f, d / "sft_run")))
    (d / "sft_run" / "config.json").write_text(json.dumps(recorded))
    shutil.copytree(d / "sft_run", d / "damaged_run")  # its only checkpoint altered: one byte of state.pt flipped
    state_pt = d / "damaged_run" / "checkpoints" / f["ckpt"].name / "state.pt"
    data = bytearray(state_pt.read_bytes())
    data[len(data) // 2] ^= 1
    state_pt.write_bytes(bytes(data))
    f["damaged_run"] = d / "damaged_run"
    shutil.copytree(d / "constant_rm", d / "rm_no_norm")
    (d / "rm_no_norm" / "reward_normalization.json").unlink()
    f["rm_no_norm"] = d / "rm_no_norm"
    return f


def base_args(script, f, out_dir) -> list[str]:
    """A small run of `script` that would work; each case adds or overrides options."""
    common = ["--max_prompt_len", "64", "--wandb_mode", "disabled", "--out_dir", str(out_dir), "--steps", "1"]
    if script == "sft":
        return [
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--train_data",
            str(f["sft"]),
            "--val_data",
            "",
            "--max_response_len",
            "16",
            "--batch_size",
            "4",
            "--micro_batch_size",
            "2",
            *common,
        ]
    if script in ("dpo", "reward_model"):
        extra = ["--norm_prompts", "0"] if script == "reward_model" else []
        return [
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--train_data",
            str(f["pref"]),
            "--val_data",
            "",
            "--max_response_len",
            "16",
            "--batch_size",
            "4",
            "--micro_batch_size",
            "2",
            *extra,
            *common,
        ]
    if script == "grpo":
        return [
            "--model",
            str(f["policy"]),
            "--reward_model",
            "tiny",
            "--reward_random_init",
            "true",
            "--train_data",
            str(f["sft"]),
            "--val_data",
            "",
            "--pref_data",
            "",
            "--eval_every",
            "-1",
            "--num_samples",
            "4",
            "--num_kept",
            "2",
            "--max_new_tokens",
            "4",
            "--prompts_per_step",
            "2",
            "--micro_batch_size",
            "4",
            "--table_every",
            "0",
            *common,
        ]
    if script == "sample":
        return [
            "--policy",
            "tiny",
            "--random_init",
            "true",
            "--post",
            "my cat ate my homework",
            "--max_new_tokens",
            "4",
        ]
    return ["--val_data", str(f["pref"]), "--max_prompt_len", "64", "--max_response_len", "16"]


def run_cli(script: str, argv: list[str], capsys) -> tuple[int, str]:
    """`python SCRIPT.py ARGV` in this process: (exit code, the `error:` line). Asserts the error is one line
    and carries no traceback (tests/helpers.py)."""
    return helpers.run_cli(SCRIPTS[script], argv, capsys)


def log_case(case: str, script: str, message: str, code: int, f) -> None:
    if os.environ.get("ERRORS_LOG"):
        for name in sorted(f, key=lambda k: -len(str(f[k]))):  # placeholders for the temporary paths
            message = message.replace(str(f[name]), f"<{name}>")
        message = re.sub(r"/\S*pytest-\d+/\S+?/", "<tmp>/", message).replace(
            "python __main__.py", f"python {script}.py"
        )
        with open(os.environ["ERRORS_LOG"], "a") as log:
            log.write(json.dumps({"case": case, "script": script, "code": code, "message": message}) + "\n")


def config_file(out, text: str) -> list[str]:
    """`--config FILE` for a YAML file of `text` beside the run directory `out`."""
    path = out.parent / "run.yaml"
    path.write_text(text)
    return ["--config", str(path)]


# ----------------------------------------------------------------------------------------------------
# The catalogue: (case, script, extra arguments (f = the inputs, out = a fresh run directory), expected fragments)

CASES = [
    # options
    (
        "misspelled_option",
        "sft",
        lambda f, out: ["--micro_batchsize", "2"],
        ["unrecognized arguments: --micro_batchsize 2", "did you mean --micro_batch_size"],
    ),
    (
        "wrong_type_int",
        "sft",
        lambda f, out: ["--batch_size", "eight"],
        ["argument --batch_size: invalid int value: 'eight'"],
    ),
    (
        "wrong_type_bool",
        "dpo",
        lambda f, out: ["--resume", "maybe"],
        ["argument --resume", "expected a boolean", "'maybe'"],
    ),
    ("missing_value", "sft", lambda f, out: ["--lr"], ["argument --lr: expected one argument"]),
    (
        "bad_choice",
        "grpo",
        lambda f, out: ["--on_nonfinite", "ignore"],
        ["--on_nonfinite: invalid choice: 'ignore'", "'stop', 'skip'"],
    ),
    (
        "empty_required_option",
        "sft",
        lambda f, out: ["--train_data", ""],
        ["--train_data is empty; expected training rows"],
    ),
    (
        "missing_required_option",
        "eval_preferences",
        lambda f, out: [],
        ["give exactly one of --reward_model or --policy"],
    ),
    (
        "non_positive_size",
        "reward_model",
        lambda f, out: ["--micro_batch_size", "0"],
        ["--micro_batch_size must be positive, got 0"],
    ),
    (
        "out_of_range_value",
        "dpo",
        lambda f, out: ["--label_smoothing", "0.7"],
        ["--label_smoothing must be in [0, 0.5), got 0.7"],
    ),
    ("cuda_without_gpu", "sft", lambda f, out: ["--device", "cuda"], ["--device cuda", "no CUDA device is available"]),
    (
        "unknown_best_metric",
        "sft",
        lambda f, out: ["--best_metric", "val/los", "--val_data", str(f["sft"]), "--eval_every", "1"],
        ["--best_metric val/los is not logged by this stage; its val/ metrics are ['val/loss']"],
    ),
    (
        "per_rank_best_metric",
        "grpo",
        lambda f, out: ["--best_metric", "perf/step_seconds", "--best_mode", "min"],
        ["--best_metric perf/step_seconds is measured on each rank separately", "ranks would disagree about saving"],
    ),
    # sizes
    (
        "batch_not_divisible_by_micro_batch",
        "sft",
        lambda f, out: ["--batch_size", "6", "--micro_batch_size", "4"],
        ["--batch_size 6 must be divisible by --micro_batch_size 4 x world size 1 = 4"],
    ),
    (
        "kept_samples_not_divisible_by_micro_batch",
        "grpo",
        lambda f, out: ["--num_samples", "4", "--num_kept", "3", "--selection", "uniform", "--micro_batch_size", "4"],
        ["2 prompts per rank x 3 kept samples = 6 sequences must be divisible by --micro_batch_size 4"],
    ),
    (
        "group_smaller_than_kept",
        "grpo",
        lambda f, out: ["--num_samples", "4", "--num_kept", "8"],
        ["--num_kept 8 exceeds --num_samples 4"],
    ),
    (
        "top_bottom_odd_kept",
        "grpo",
        lambda f, out: ["--selection", "top_bottom", "--num_kept", "3"],
        ["--selection top_bottom needs an even --num_kept, got 3"],
    ),
    (
        "context_longer_than_model",
        "sft",
        lambda f, out: ["--max_prompt_len", "500"],
        [
            "--max_prompt_len 500 + --max_response_len 16 exceeds the model's 512 positions; "
            "the largest --max_prompt_len that fits is 496"
        ],
    ),
    (
        "fewer_rows_than_one_batch",
        "sft",
        lambda f, out: ["--train_data", str(f["few_rows"]), "--micro_batch_size", "4"],
        ["3 examples cannot fill one global batch of world_size 1 x batch_size 4 = 4"],
    ),
    # run directory and checkpoints
    ("out_dir_is_a_file", "sft", lambda f, out: ["--out_dir", str(f["sft"])], ["is a file; expected a directory"]),
    (
        "resume_false_over_checkpoints",
        "sft",
        lambda f, out: ["--out_dir", str(f["ckpt"].parent.parent), "--resume", "false"],
        ["already holds checkpoints (newest: step_00000001) and --resume is false"],
    ),
    (
        "missing_checkpoint",
        "sft",
        lambda f, out: ["--resume_from", str(out / "nowhere")],
        ["--resume_from", "nowhere: no checkpoint there (expected a checkpoint folder holding state.pt"],
    ),
    (
        "checkpoint_from_another_stage",
        "dpo",
        lambda f, out: ["--resume_from", str(f["ckpt"])],
        ["was written by another stage: stage='sft' but this run expects stage='dpo'"],
    ),
    (
        "checkpoint_of_another_model_size",
        "sft",
        lambda f, out: ["--model", "small", "--resume_from", str(f["ckpt"])],
        [
            "holds another model: n_embd=64, n_head=2, n_layer=2 "
            "but this run's model has n_embd=128, n_head=4, n_layer=4"
        ],
    ),
    (
        "unreadable_checkpoint",
        "sft",
        lambda f, out: ["--resume_from", str(f["garbage_ckpt"])],
        ["--resume_from", "garbage_ckpt: checkpoint is damaged:", "state.pt has 9 bytes", "were written"],
    ),
    (
        "checkpoint_from_other_data",
        "sft",
        lambda f, out: ["--resume_from", str(f["ckpt"])],
        ["its data position does not fit this run's training data", "for 999 examples, but this data has 16"],
    ),
    (
        "no_intact_checkpoint",
        "sft",
        lambda f, out: ["--out_dir", str(f["damaged_run"])],
        [
            "no intact checkpoint in",
            "damaged_run/checkpoints (step_00000001:",
            "state.pt was altered",
            "restore the files, or move",
        ],
    ),
    (
        "options_changed_on_resume",
        "sft",
        lambda f, out: ["--out_dir", str(f["ckpt"].parent.parent), "--lr", "0.01", "--seed", "5"],
        [
            "holds a run started with other options (--lr 3e-05 -> 0.01, --seed 1 -> 5)",
            "use another --out_dir",
            "--resume_changes allow to continue from step 1",
        ],
    ),
    (
        "wandb_online_without_login",
        "sft",
        lambda f, out: ["--wandb_mode", "online"],
        ["--wandb_mode online needs a wandb login", "WANDB_API_KEY is unset", "--wandb_mode offline"],
    ),
    # models
    (
        "missing_model_folder",
        "dpo",
        lambda f, out: ["--model", str(out / "sft" / "hf"), "--random_init", "false"],
        ["model folder", "sft/hf does not exist (expected a Hugging Face-format folder)"],
    ),
    (
        "model_folder_without_config",
        "sft",
        lambda f, out: ["--model", str(f["no_config"]), "--random_init", "false"],
        ["has no config.json (expected a Hugging Face-format folder)"],
    ),
    (
        "model_folder_without_weights",
        "grpo",
        lambda f, out: ["--model", str(f["no_weights"])],
        ["has no model.safetensors or pytorch_model.bin"],
    ),
    (
        "unreadable_weights",
        "sft",
        lambda f, out: ["--model", str(f["bad_weights"]), "--random_init", "false"],
        ["cannot read weights file", "model.safetensors"],
    ),
    (
        "random_init_of_unknown_preset",
        "sft",
        lambda f, out: ["--model", "gpt5"],
        ["--random_init needs a preset name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny, small), got 'gpt5'"],
    ),
    (
        "missing_reward_model",
        "grpo",
        lambda f, out: ["--reward_model", str(out / "rm" / "hf"), "--reward_random_init", "false"],
        ["rm/hf does not exist"],
    ),
    (
        "missing_normalisation_policy",
        "reward_model",
        lambda f, out: ["--norm_prompts", "4", "--sft_policy", str(out / "sft")],
        ["model folder", "does not exist"],
    ),
    (
        "reward_pooling_mismatch",
        "reward_model",
        lambda f, out: ["--model", str(f["nan_rm"]), "--random_init", "false", "--pooling", "sum"],
        ["nan_rm is a reward model with pooling 'last', not 'sum'"],
    ),
    (
        "reward_model_as_policy",
        "sft",
        lambda f, out: ["--model", str(f["constant_rm"]), "--random_init", "false"],
        ["--model", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_reference",
        "dpo",
        lambda f, out: ["--reference", str(f["constant_rm"])],
        ["--reference", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "policy_as_reward_model",
        "grpo",
        lambda f, out: ["--reward_model", str(f["policy"]), "--reward_random_init", "false"],
        ["--reward_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_reward_model_to_evaluate",
        "eval_preferences",
        lambda f, out: ["--reward_model", str(f["policy"])],
        ["--reward_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_judge",
        "sft",
        lambda f, out: ["--judge", str(f["policy"]), "--val_data", str(f["sft"])],
        ["--judge", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_judge_of_dpo",
        "dpo",
        lambda f, out: ["--judge", str(f["policy"]), "--val_data", str(f["pref"])],
        ["--judge", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_frontier_reward_model",
        "dpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_reward_model",
            str(f["policy"]),
            "--val_data",
            str(f["pref"]),
        ],
        ["--frontier_reward_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_frontier_reward_model_of_grpo",
        "grpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_reward_model",
            str(f["policy"]),
            "--frontier_data",
            str(f["sft"]),
        ],
        ["--frontier_reward_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "frontier_reward_model_without_normalisation",
        "dpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_reward_model",
            str(f["rm_no_norm"]),
            "--val_data",
            str(f["pref"]),
        ],
        ["--frontier_reward_model", "rm_no_norm is a reward model whose reward_normalization.json is missing"],
    ),
    (
        "frontier_max_new_tokens_overflows",
        "grpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_data",
            str(f["sft"]),
            "--frontier_max_new_tokens",
            "5000",
        ],
        ["--frontier_max_new_tokens 5000 leaves no room for a prompt in the policy's"],
    ),
    (
        "policy_as_frontier_gold_model",
        "dpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_gold_model",
            str(f["policy"]),
            "--val_data",
            str(f["pref"]),
        ],
        ["--frontier_gold_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "policy_as_frontier_gold_model_of_grpo",
        "grpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_gold_model",
            str(f["policy"]),
            "--frontier_data",
            str(f["sft"]),
        ],
        ["--frontier_gold_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "frontier_gold_model_is_the_proxy",
        "dpo",
        lambda f, out: [
            "--frontier_prompts",
            "2",
            "--frontier_reward_model",
            str(f["constant_rm"]),
            "--frontier_gold_model",
            str(f["constant_rm"]),
            "--val_data",
            str(f["pref"]),
        ],
        ["--frontier_gold_model", "constant_rm is the frontier's proxy", "the gold column reads as the proxy"],
    ),
    (
        "policy_as_judge_to_evaluate",
        "eval_preferences",
        lambda f, out: ["--policy", str(f["policy"]), "--reference", str(f["policy"]), "--judge", str(f["policy"])],
        ["--judge", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "missing_judge_folder",
        "sft",
        lambda f, out: ["--judge", str(out / "rm" / "hf"), "--val_data", str(f["sft"])],
        ["--judge: model folder", "rm/hf does not exist"],
    ),
    (
        "policy_as_reward_model_to_sample",
        "sample",
        lambda f, out: ["--reward_model", str(f["policy"])],
        ["--reward_model", "policy is a policy (a GPT-2 language model), not a reward model"],
    ),
    (
        "reward_model_as_policy_to_sample",
        "sample",
        lambda f, out: ["--policy", str(f["constant_rm"]), "--random_init", "false"],
        ["--policy", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_dpo_policy",
        "dpo",
        lambda f, out: ["--model", str(f["constant_rm"]), "--random_init", "false"],
        ["--model", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_grpo_policy",
        "grpo",
        lambda f, out: ["--model", str(f["constant_rm"])],
        ["--model", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_normalisation_policy",
        "reward_model",
        lambda f, out: ["--norm_prompts", "4", "--sft_policy", str(f["constant_rm"])],
        ["--sft_policy", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_policy_to_evaluate",
        "eval_preferences",
        lambda f, out: ["--policy", str(f["constant_rm"]), "--reference", str(f["policy"])],
        ["--policy", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "reward_model_as_reference_to_evaluate",
        "eval_preferences",
        lambda f, out: ["--policy", str(f["policy"]), "--reference", str(f["constant_rm"])],
        ["--reference", "constant_rm is a reward model (a GPT-2 with a scalar head), not a policy"],
    ),
    (
        "judge_without_validation",
        "sft",
        lambda f, out: ["--judge", str(f["constant_rm"])],
        ["--judge scores the policy at each validation, and --val_data '' with --eval_every", "runs none"],
    ),
    (
        "judge_without_validation_in_dpo",
        "dpo",
        lambda f, out: ["--judge", str(f["constant_rm"])],
        ["--judge scores the policy at each validation, and --val_data '' with --eval_every", "runs none"],
    ),
    (
        "judge_without_summary_data",
        "sft",
        lambda f, out: ["--judge", str(f["constant_rm"]), "--val_data", str(f["sft"]), "--summary_data", ""],
        ["--judge scores summaries of --summary_data's posts, and --summary_data is empty"],
    ),
    (
        "best_metric_not_logged",
        "sft",
        lambda f, out: ["--val_data", str(f["sft"]), "--best_metric", "val/los"],
        ["--best_metric val/los is not logged by this stage; its val/ metrics are ['val/loss']"],
    ),
    (
        "best_metric_not_logged_in_dpo",
        "dpo",
        lambda f, out: ["--val_data", str(f["pref"]), "--eval_every", "1", "--best_metric", "val/acc"],
        ["--best_metric val/acc is not logged by this stage; its val/ metrics are ['val/accuracy'"],
    ),
    (
        "best_metric_not_logged_in_reward_model",
        "reward_model",
        lambda f, out: ["--val_data", str(f["pref"]), "--eval_every", "1", "--best_metric", "val/acc"],
        ["--best_metric val/acc is not logged by this stage; its val/ metrics are ['val/accuracy'"],
    ),
    (
        "best_metric_not_logged_in_grpo",
        "grpo",
        lambda f, out: ["--pref_data", str(f["pref"]), "--eval_every", "1", "--best_metric", "eval/pref_acc"],
        ["--best_metric eval/pref_acc is not logged by this stage; its eval/ metrics are ["],
    ),
    (
        "reward_model_without_normalisation",
        "grpo",
        lambda f, out: ["--reward_model", str(f["rm_no_norm"]), "--reward_random_init", "false"],
        ["--reward_model", "rm_no_norm is a reward model whose reward_normalization.json is missing"],
    ),
    (
        "hub_model_without_network",
        "sft",
        lambda f, out: ["--model", "gpt2-medium", "--random_init", "false"],
        [
            "could not load model 'gpt2-medium' from the Hugging Face hub (no network: cannot connect to 127.0.0.1:9",
            "Pass a local Hugging Face-format folder instead",
        ],
    ),
    (
        "bad_gold_reward_function",
        "grpo",
        lambda f, out: ["--gold_reward_fn", "data.synthetic:no_such_function"],
        ["--gold_reward_fn: cannot load function 'data.synthetic:no_such_function' (expected module:function)"],
    ),
    # data
    (
        "missing_data_file",
        "sft",
        lambda f, out: ["--train_data", str(out / "train.jsonl")],
        ["train.jsonl: no such file or directory"],
    ),
    (
        "wrong_columns",
        "sft",
        lambda f, out: ["--train_data", str(f["pref"])],
        [
            "missing column(s) ['completion']: expected ['prompt', 'completion'], "
            "columns of row 0: ['prompt', 'chosen', 'rejected']"
        ],
    ),
    (
        "empty_field",
        "sft",
        lambda f, out: ["--train_data", str(f["empty_field"])],
        ["row 1: column 'completion' is empty or only whitespace"],
    ),
    (
        "non_text_field",
        "sft",
        lambda f, out: ["--train_data", str(f["not_text"])],
        ["row 2: column 'completion' is int, expected a str"],
    ),
    (
        "prompt_without_tldr",
        "grpo",
        lambda f, out: ["--train_data", str(f["no_tldr"])],
        ["row 1: column 'prompt': prompt does not end with 'TL;DR:'"],
    ),
    ("empty_data_file", "dpo", lambda f, out: ["--train_data", str(f["no_rows"])], ["no_rows.jsonl: no rows"]),
    (
        "invalid_json_line",
        "sft",
        lambda f, out: ["--train_data", str(f["broken_json"])],
        ["broken.jsonl: row 1 (line 2): invalid JSON"],
    ),
    ("unsupported_file_type", "sft", lambda f, out: ["--train_data", str(f["csv"])], ["unsupported file type '.csv'"]),
    (
        "folder_without_split",
        "sft",
        lambda f, out: ["--train_data", str(f["split_dir"]), "--train_split", "test"],
        ["no test.jsonl or test.parquet for split 'test' (the directory holds ['train.jsonl'])"],
    ),
    (
        "hub_dataset_without_network",
        "reward_model",
        lambda f, out: ["--train_data", "trl-lib/tldr-preference"],
        [
            "could not load hub dataset 'trl-lib/tldr-preference' split 'train': "
            "no network (cannot connect to 127.0.0.1:9",
            "Pass a local .jsonl/.json/.parquet file",
        ],
    ),
    # --config FILE
    (
        "config_unknown_key",
        "sft",
        lambda f, out: config_file(out, "lr: 1.0e-4\nlrr: 1.0e-3\n"),
        ["--config ", "run.yaml: unknown option 'lrr'; did you mean lr?"],
    ),
    (
        "config_wrong_type",
        "dpo",
        lambda f, out: config_file(out, "beta: 0.1\nsteps: 1.5\n"),
        ["--config ", "run.yaml: steps: expected an integer, got 1.5 (float)"],
    ),
]


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """The hub at a closed local port and an empty Hugging Face cache: "no network", whatever this machine has."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # and no wandb login
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))


@pytest.mark.parametrize("case, script, extra, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_with_one_clear_line(case, script, extra, fragments, inputs, tmp_path, capsys, no_network):
    if case == "cuda_without_gpu" and torch.cuda.is_available():
        pytest.skip("there is a GPU")
    out = tmp_path / "run"
    code, message = run_cli(script, base_args(script, inputs, out) + extra(inputs, out), capsys)
    log_case(case, script, message, code, inputs)
    assert code == 2, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not (out / "checkpoints").exists() and not (out / "hf").exists()  # nothing written


def test_catalogue_has_twenty_cases_and_matches_the_docs():
    assert len(CASES) >= 20
    doc = (ROOT / "docs" / "errors.md").read_text()
    missing = [case for case, *_ in CASES if f"`{case}`" not in doc]
    assert not missing, missing


def test_eval_preferences_writes_into_a_run_folder_under_its_lock_and_leaves_its_record(inputs, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"lr": 1.0}\n')  # a training run's record
    args = base_args("eval_preferences", inputs, run) + ["--reward_model", str(inputs["constant_rm"])]
    args += ["--out_dir", str(run), "--wandb_mode", "disabled", "--bootstrap_samples", "10"]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from utils.rundir import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(300)",
            str(run),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, message = run_cli("eval_preferences", args, capsys)
        assert code == 2 and f"--out_dir {run} is in use by another run (pid {holder.pid} on " in message, message
    finally:
        holder.kill()
        holder.wait()
    eval_preferences.main(parse_config(eval_preferences.Config, args))
    assert (run / "config.json").read_text() == '{"lr": 1.0}\n'
    assert (run / "preference_eval.json").is_file() and (run / ".lock").read_text() == ""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_every_evaluation_option_combination_fails_at_start_or_runs_to_its_export(script, inputs, tmp_path, capsys):
    # validation data or none, a judge or none, evaluations or none: each either stops before training (exit 2,
    # nothing written) or trains, evaluates what it promised and exports; never a stop at the first evaluation
    import itertools

    judge = ["--summary_data", str(inputs["sft"]), "--summary_rows", "2", "--max_new_tokens", "4"]
    data = inputs["sft"] if script == "sft" else inputs["pref"]
    for i, (val, judged, every) in enumerate(itertools.product(("", str(data)), (False, True), ("-1", "1"))):
        out = tmp_path / f"run{i}"
        args = base_args(script, inputs, out) + ["--val_data", val, "--eval_every", every, "--steps", "2"]
        args += ["--judge", str(inputs["constant_rm"]), *judge] if judged else []
        with pytest.raises(SystemExit) as info:
            with helpers.exit_on_error():
                SCRIPTS[script].main(parse_config(SCRIPTS[script].Config, args))
                raise SystemExit(0)
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").is_file() else []
        evaluated = {k for r in rows for k in r if k.startswith("val/")}
        if info.value.code == 2:
            assert not (out / "checkpoints").exists() and judged, (val, judged, every)
        else:
            assert info.value.code == 0 and (out / "hf").is_dir(), (val, judged, every, info.value.code)
            assert ("val/win_rate" in evaluated) == judged and bool(evaluated) == bool(val and every == "1")
        capsys.readouterr()


def test_a_best_metric_no_evaluation_logs_stops_before_the_first_training_step(inputs, tmp_path, capsys):
    # not at the first evaluation after training, which left no checkpoint of the steps it trained: with an evaluation
    # at step 0 (--eval_every 1), with only the one after the last step (--eval_every 0), and on resume
    for case, script, extra, expected in [c for c in CASES if c[0].startswith("best_metric_not_logged")]:
        for every in ("1", "0"):
            out = tmp_path / f"{case}_{every}"
            args = base_args(script, inputs, out) + extra(inputs, out) + ["--steps", "2", "--eval_every", every]
            code, message = run_cli(script, args, capsys)
            logged = (
                [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
                if (out / "metrics.jsonl").exists()
                else []
            )
            assert code == 2 and all(step == 0 for step in logged), (case, every, logged, message)
            assert expected[0] in message, (case, every, message)
    # on resume (--best_metric may change freely): a run of one step, resumed for a second with a wrong name
    out = tmp_path / "resumed"
    args = base_args("dpo", inputs, out) + ["--val_data", str(inputs["pref"]), "--eval_every", "0"]
    with helpers.exit_on_error():
        dpo.main(parse_config(dpo.Config, args + ["--steps", "1"]))
    capsys.readouterr()
    code, message = run_cli("dpo", args + ["--steps", "2", "--best_metric", "val/acc"], capsys)
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert code == 2 and "--best_metric val/acc is not logged by this stage" in message and max(steps) == 1, message


def test_every_option_that_names_a_model_has_its_kind_checked_in_every_script():
    # each script option that declares the kind of model it names (utils.config.option(..., model=KIND)) must have a
    # case above giving a folder of the other kind, answered by one line naming the option (reward_model.py's --model
    # takes either kind): a new model option fails here until its script checks it through model_config
    from collections import defaultdict
    from pathlib import Path

    from model.weights import KINDS
    from utils.config import declared, field_docs

    kinds = {script: declared(module.Config, "model") for script, module in SCRIPTS.items()}
    assert {kind for declared_kinds in kinds.values() for kind in declared_kinds.values()} == set(KINDS)
    dummy = defaultdict(lambda: Path("folder"))
    covered = set()
    for _, script, extra, fragments in CASES:
        argv = extra(dummy, Path("out"))
        for option in kinds[script]:
            named = f"--{option}" in argv and f"--{option}" in fragments
            if named and any(" is a policy (" in f or " is a reward model (" in f for f in fragments):
                covered.add((script, option))
    # and every option whose help says it takes a model folder (a stage's hf/ export, a Hugging Face-format folder)
    # declares its kind, so an option that does not fails here too
    undeclared = [
        (script, name)
        for script, module in SCRIPTS.items()
        for name, doc in field_docs(module.Config).items()
        if name != "out_dir" and re.search(r"\bhf/|Hugging Face-format folder", doc) and name not in kinds[script]
    ]
    assert not undeclared, undeclared
    unchecked = [
        (script, option)
        for script, declared_kinds in kinds.items()
        for option in declared_kinds
        if (script, option) not in covered | {("reward_model", "model")}
    ]
    assert not unchecked, unchecked


# ----------------------------------------------------------------------------------------------------
# Numerical faults: exit code 3, named stage and step, the newest checkpoint intact


def test_nonfinite_loss_stops_before_the_optimizer_step_and_saves_nothing(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args("sft", inputs, out) + ["--model", str(inputs["nan_policy"]), "--random_init", "false"]
    code, message = run_cli("sft", args, capsys)
    log_case("nonfinite_loss", "sft", message, code, inputs)
    assert code == 3
    assert "sft: non-finite train/loss and train/grad_norm at step 1 (train/loss=nan" in message
    assert "stopped before the optimizer step" in message
    assert newest_intact(out) is None and not (out / "hf").exists()


def test_nonfinite_mid_run_leaves_the_last_good_checkpoint(inputs, tmp_path, capsys):
    # lr 1e20: the first AdamW step moves every weight by ~1e20; the next forward overflows
    out = tmp_path / "run"
    args = base_args("sft", inputs, out) + ["--steps", "4", "--lr", "1e20", "--warmup_steps", "0", "--save_every", "1"]
    code, message = run_cli("sft", args, capsys)
    failed = int(re.search(r"at step (\d+)", message).group(1))
    assert code == 3 and failed >= 2, message
    assert checkpoint_step(out) == failed - 1  # nothing saved at or after the failing step
    assert all(torch.isfinite(v).all() for v in read_tensors(newest_intact(out)).values())
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in lines] == list(range(1, failed))


def test_skip_drops_nonfinite_steps_without_stepping(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args("sft", inputs, out) + [
        "--model",
        str(inputs["nan_policy"]),
        "--random_init",
        "false",
        "--steps",
        "2",
        "--on_nonfinite",
        "skip",
    ]
    metrics = sft.main(parse_config(sft.Config, args))
    err = capsys.readouterr().err
    assert re.search(r"warning: sft: non-finite train/loss and train/grad_norm at step 2 \(.*\); step skipped", err), (
        err
    )
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["train/skipped"] for m in lines] == [1.0, 1.0]
    assert metrics["train/lr"] == pytest.approx(sft.Config.lr / sft.Config.warmup_steps)  # the schedule never moved
    ckpt = newest_intact(out)
    # no gradient ever reached AdamW's moments (saving initialises them with zeros) and no weight moved
    assert all(not s["exp_avg"].any() for s in read_tensors(ckpt, "optimizer")["state"].values())
    start = load_file(str(inputs["nan_policy"] / "model.safetensors"))
    saved = read_tensors(ckpt)["transformer.h.0.mlp.c_fc.weight"]
    assert torch.equal(saved, start["transformer.h.0.mlp.c_fc.weight"].t())  # HF stores it transposed


@pytest.mark.parametrize(
    "rm, fragment",
    [
        ("nan_rm", "grpo: the reward model returned non-finite scores at step 1"),
        ("constant_rm", "grpo: the reward model gave every sample the same score (0) at step 1: it is constant"),
    ],
)
def test_reward_model_nan_or_constant_is_caught_at_rollout(rm, fragment, inputs, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args("grpo", inputs, out) + ["--reward_model", str(inputs[rm]), "--reward_random_init", "false"]
    code, message = run_cli("grpo", args, capsys)
    log_case(f"reward_model_{rm.split('_')[0]}", "grpo", message, code, inputs)
    assert code == 3 and fragment in message, message
    assert newest_intact(out) is None


def test_grpo_step_skips_a_nonfinite_update_and_leaves_weights_and_schedule_alone():
    from model.weights import freeze
    from rollouts.models import Models
    from utils.guard import NonFiniteGuard, NumericalError
    from utils.optim import build_scheduler

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    reference = freeze(GPT2LMHeadModel(policy.cfg))
    # a NaN weight of the KL term: sampling, rewards and advantages are finite, the update's loss and gradients not
    cfg = grpo.Config(
        rewards="length",
        num_samples=4,
        num_kept=4,
        max_new_tokens=4,
        prompts_per_step=2,
        micro_batch_size=4,
        beta=float("nan"),
        lr=1e-2,
        warmup_steps=1,
    )
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    scheduler = build_scheduler(optimizer, 1, 10)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    guard = NonFiniteGuard("grpo", "skip", torch.device("cpu"), max_consecutive_skips=2)
    models, (prompts, spec) = Models(policy, reference, None), helpers.prompts_and_rewards(cfg)
    result = train_step(models, optimizer, scheduler, prompts, spec, cfg, 7, guard)
    assert result.advantages.isfinite().all() and result.update["train/skipped"] == 1.0 and scheduler.last_epoch == 0
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    assert all(p.grad is None for p in policy.parameters())
    with pytest.raises(
        NumericalError, match="grpo: non-finite train/loss and train/grad_norm at step 8.*2 steps in a row"
    ):
        train_step(models, optimizer, scheduler, prompts, spec, cfg, 8, guard)


# ----------------------------------------------------------------------------------------------------
# Signals, in this process: SIGINT finishes the step, saves, returns; the rerun matches an uninterrupted run


def test_sigint_saves_and_returns_and_the_rerun_matches_an_uninterrupted_run(inputs, tmp_path):
    def args(out):
        return base_args("sft", inputs, out) + [
            "--steps",
            "8",
            "--save_every",
            "0",
            "--lr",
            "1e-3",
            "--warmup_steps",
            "1",
        ]

    sft.main(parse_config(sft.Config, args(tmp_path / "full")))
    full = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]

    out = tmp_path / "run"

    def interrupt_after_two_steps():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a process started in the background
    watcher = threading.Thread(target=interrupt_after_two_steps)
    watcher.start()
    sft.main(parse_config(sft.Config, args(out)))  # returns: no KeyboardInterrupt
    watcher.join()
    stopped = checkpoint_step(out)
    assert 2 <= stopped < 8 and not (out / "hf").exists()
    assert signal.getsignal(signal.SIGINT) is before  # the handler was put back
    sft.main(parse_config(sft.Config, args(out)))
    resumed = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["train/loss"] for m in resumed] == [m["train/loss"] for m in full]


# ----------------------------------------------------------------------------------------------------
# From the outside: a plain process and a torchrun launch


def test_plain_process_prints_exactly_one_line_and_exits_2(inputs, tmp_path):
    args = base_args("sft", inputs, tmp_path / "run") + ["--train_data", str(tmp_path / "missing.jsonl")]
    out = subprocess.run([sys.executable, "sft.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr == f"error: {tmp_path / 'missing.jsonl'}: no such file or directory\n"


@pytest.mark.slow
def test_torchrun_batch_not_divisible_by_world_size_prints_once(inputs, tmp_path):
    args = base_args("grpo", inputs, tmp_path / "run") + ["--prompts_per_step", "3"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "grpo.py",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]
    log_case("batch_not_divisible_by_world_size", "grpo", lines[0] if lines else "", 2, inputs)
    assert out.returncode != 0
    assert lines == ["error: --prompts_per_step 3 must be divisible by the world size 2"], out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr  # torchrun's own failure report names the code
    assert 'File "' + str(ROOT / "grpo.py") not in out.stderr  # no traceback from the script


@pytest.mark.slow
def test_error_on_one_rank_stops_every_rank_with_one_line(inputs, tmp_path):
    """A reward function that raises on rank 1's rows only: rank 0 would otherwise wait in the next collective for a
    rank that is gone (gloo fails it with a connection error and a traceback; NCCL leaves it waiting out the
    process-group timeout). Every rank must stop within seconds with the same code and one error line."""
    args = base_args("grpo", inputs, tmp_path / "run") + [
        "--rewards",
        "tests.helpers:raise_on_rank_1",
        "--micro_batch_size",
        "2",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "grpo.py",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    seconds = time.monotonic() - start
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]
    assert out.returncode != 0
    assert len(lines) == 1 and "reward function 'tests.helpers:raise_on_rank_1' raised on row" in lines[0], out.stderr[
        -3000:
    ]
    assert "cannot score rank 1's rows" in lines[0]
    # torchrun's report: the first rank out exited with 2; the other exited with 2 too, or was still leaving when
    # torchrun stopped it (SIGTERM), never a failure of its own (before, the surviving rank 0 died in a collective)
    codes = re.findall(r"exitcode  : (-?\d+)", out.stderr)
    assert len(codes) == 2 and codes.count("2") >= 1 and set(codes) <= {"2", "-15"}, out.stderr[-3000:]
    assert 'File "' + str(ROOT / "grpo.py") not in out.stderr  # no traceback from the script on either rank
    assert seconds < 90, seconds


@pytest.mark.slow
def test_all_ranks_agree_raises_the_same_error_on_every_rank(tmp_path):
    """utils.guard.all_ranks_agree with rank 1 alone raising: a user error becomes the same RankFailure (message,
    exit code 2) on both ranks; a bug keeps its own exception on rank 1 and ends rank 0 with code 1 naming rank 1."""
    run_script(["tests/scripts/agree.py", str(tmp_path)], nproc=2, timeout=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["user_error"] == r1["user_error"] == ["RankFailure", "row 7 of the data is bad", 2]
    assert r1["bug"] == ["ZeroDivisionError", "division by zero", None]
    assert r0["bug"] == [
        "RankFailure",
        "rank 1 failed in case bug (ZeroDivisionError: division by zero); its traceback is in its output",
        1,
    ]
    assert r0["none"] is None and r1["none"] is None

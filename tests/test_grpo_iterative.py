"""Iterative GRPO and reward functions in grpo.py: mu > 1 updates move the ratio off 1 and engage clipping, a
reference refresh makes the KL exactly 0 (full copy and LoRA), the entropy bonus, reward functions that fail stop
with their name and row, and two-process runs with LoRA and rule-based rewards (no reward model) that improve
the reward on the embedded synthetic task and resume bit for bit."""

import copy
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

import grpo
from data.synthetic import write_task
from data.tokenizer import get_tokenizer
from grpo import Config
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.lora import AdaptersOff, LoRAConfig, apply_lora
from model.weights import freeze
from rollouts.models import Models, refresh_reference
from rollouts.step import train_step
from tests.conftest import assert_same_metrics, run_script
from tests.helpers import (
    ZERO_REWARD,
    adapted_weight_names,
    changed_weights,
    end_biased_policy,
    prompts_and_rewards,
    read_metrics,
    run_cli,
    write_sft_rows,
)
from utils.optim import build_optimizer, build_scheduler

SMALL = GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32)


def tiny_config(**options) -> Config:
    """GRPO on 2 prompts x 8 samples of 5 tokens, 4 kept each: two micro-batches of 4 rows, the length reward."""
    return Config(
        **{
            "rewards": "length",
            "num_samples": 8,
            "num_kept": 4,
            "max_new_tokens": 5,
            "prompts_per_step": 2,
            "micro_batch_size": 4,
            "warmup_steps": 1,
            **options,
        }
    )


def test_second_of_two_updates_moves_the_ratio_off_one_and_clipping_engages():
    updates, samples = {}, {}
    for mu in (2, 1):  # the same starting policy and step seed: the same samples, selection and advantages
        torch.manual_seed(0)
        policy = GPT2LMHeadModel(SMALL)
        models = Models(policy, freeze(copy.deepcopy(policy)), None)
        # crafted: no KL, no clipping of the gradient and a large step, so the first update moves every token's ratio
        cfg = tiny_config(beta=0.0, lr=5e-2, grad_clip=0.0, policy_epochs=mu)
        optimizer = build_optimizer(policy, cfg.lr, 0.0)
        prompts, spec = prompts_and_rewards(cfg)
        r = train_step(models, optimizer, build_scheduler(optimizer, 1, 10), prompts, spec, cfg, step=1)
        assert (r.batches[0].old_logprobs is not None) == (mu > 1)  # mu > 1: the sampling policy's log-probs, kept
        updates[mu], samples[mu] = r.update, r.samples.response_ids[r.rows_BK.flatten()]
    m = updates[2]
    # update 1: the old log-probs are the sampling policy's, i.e. the current ones: ratio exactly 1, nothing clipped
    assert m["train/epoch_1/ratio_deviation"] == 0.0 and m["train/epoch_1/clip_fraction"] == 0.0
    # update 2: the policy moved, the ratio left [1 - eps, 1 + eps] on some tokens and the clip took over there
    assert m["train/epoch_2/ratio_deviation"] > 0.1
    assert m["train/epoch_2/clip_fraction"] > 0.1
    assert m["train/clip_fraction"] == pytest.approx(m["train/epoch_2/clip_fraction"] / 2)
    # with mu = 1 the same batch never clips: one update, ratio exactly 1 in value
    assert torch.equal(samples[1], samples[2])
    assert updates[1]["train/clip_fraction"] == 0.0 and updates[1]["train/ratio_deviation"] == 0.0


@pytest.mark.parametrize("lora", [False, True], ids=["full_copy", "lora_adapters_off"])
def test_after_a_reference_refresh_the_kl_term_is_exactly_zero(lora):
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(SMALL)
    if lora:
        apply_lora(policy, LoRAConfig(lora_rank=4, lora_alpha=8.0))
        models = Models(policy, AdaptersOff(policy), None)
    else:
        models = Models(policy, freeze(copy.deepcopy(policy)), None)
    # 16 prompts x 8 samples, all kept: the KL is a mean over enough sampled tokens to show the drift step by step
    cfg = tiny_config(beta=0.1, lr=2e-2, prompts_per_step=16, selection="all", micro_batch_size=32)
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    scheduler = build_scheduler(optimizer, 1, 10)
    prompts, spec = prompts_and_rewards(cfg)

    def kl(step: int) -> float:
        return train_step(models, optimizer, scheduler, prompts, spec, cfg, step).update["train/kl"]

    kls = [kl(step) for step in range(1, 4)]
    assert kls[0] == 0.0 and kls[1] > 0 and kls[2] > kls[1]  # the policy drifts from the reference
    refresh_reference(models)
    assert kl(4) == 0.0  # exactly, not ~
    assert kl(5) > 0


@pytest.mark.parametrize("coef", [0.5, -0.5])
def test_entropy_term_is_the_loss_when_advantages_and_beta_are_zero_and_moves_the_entropy_its_way(coef):
    # coef > 0: a bonus that raises the entropy; coef < 0: a penalty that lowers it (entropy minimisation)
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(SMALL)
    with torch.no_grad():  # larger logits (the head is tied to wte): a peaked distribution, well below log(V)
        policy.transformer.wte.weight.mul_(30)
    models = Models(policy, freeze(copy.deepcopy(policy)), None)
    cfg = tiny_config(beta=0.0, lr=1e-2, loss_type="bnpo", entropy_coef=coef)
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    scheduler = build_scheduler(optimizer, 1, 10)
    prompts, spec = prompts_and_rewards(cfg, [ZERO_REWARD])  # every advantage exactly 0
    steps = [train_step(models, optimizer, scheduler, prompts, spec, cfg, step) for step in range(1, 5)]
    assert all(not r.advantages.any() for r in steps)
    # token-mean aggregation: loss = -coef * mean token entropy (the surrogate is 0 with zero advantages)
    first = steps[0].update
    assert first["train/loss"] == pytest.approx(-coef * first["train/entropy"], rel=1e-5)
    entropies = [r.update["train/entropy"] for r in steps]
    assert (entropies[-1] - entropies[0]) * (1 if coef > 0 else -1) > 0.5, entropies  # 4 steps of lr 1e-2
    no_bonus = replace(cfg, entropy_coef=0.0)
    assert train_step(models, optimizer, scheduler, prompts, spec, no_bonus, 5).update["train/grad_norm"] == 0.0


def test_train_step_names_a_constant_reward_source_at_the_step_it_runs(capsys):
    # train_step's step is 1-based: the warning names that step, not the next
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(SMALL)
    models = Models(policy, freeze(copy.deepcopy(policy)), None)
    cfg = tiny_config()
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    prompts, spec = prompts_and_rewards(cfg, [ZERO_REWARD])
    train_step(models, optimizer, build_scheduler(optimizer, 1, 10), prompts, spec, cfg, 3)
    warned = [line for line in capsys.readouterr().err.splitlines() if "gave every one of its" in line]
    assert len(warned) == 1 and "the same value (0) at step 3:" in warned[0], warned


def test_entropy_every_logs_the_entropy_on_its_steps_only_and_changes_nothing_else():
    torch.manual_seed(0)
    start = GPT2LMHeadModel(SMALL)
    updates = {}
    for every, step in ((1, 1), (2, 1), (2, 2), (0, 2)):  # --entropy_every 2 logs steps 2, 4, ...
        policy = copy.deepcopy(start)
        models = Models(policy, freeze(copy.deepcopy(start)), None)
        cfg = tiny_config(entropy_every=every)
        optimizer = build_optimizer(policy, cfg.lr, 0.0)
        prompts, spec = prompts_and_rewards(cfg)
        scheduler = build_scheduler(optimizer, 1, 10)
        updates[every, step] = train_step(models, optimizer, scheduler, prompts, spec, cfg, step).update
    assert "train/entropy" in updates[1, 1] and "train/entropy" in updates[2, 2]
    assert "train/entropy" not in updates[2, 1] and "train/entropy" not in updates[0, 2]
    assert updates[2, 1] == {k: v for k, v in updates[1, 1].items() if k != "train/entropy"}
    assert 0 < updates[1, 1]["train/entropy"] <= math.log(SMALL.vocab_size)


# ----------------------------------------------------------------------------------------------------
# Reward functions that fail: one line naming the function and the row, exit code 2


def raises_on_second_call(prompt, response, calls=[]):  # noqa: B006 (counts calls across the run)
    calls.append(1)
    if len(calls) == 2:
        raise ZeroDivisionError("boom")
    return 0.0


def returns_text(prompt, response):
    return "high"


@pytest.mark.parametrize(
    "fn, fragment",
    [
        ("raises_on_second_call", "raised on row {row} of {data}[train] (response "),
        ("returns_text", "returned 'high' (str) on row {row} of {data}[train]"),
    ],
)
def test_a_reward_function_that_fails_stops_naming_itself_and_the_row(fn, fragment, tmp_path, capsys):
    rows = write_sft_rows(tmp_path / "rows.jsonl", n=16)
    args = [
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--rewards",
        f"format + tests.test_grpo_iterative:{fn}",
        "--train_data",
        str(rows),
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
        "--max_prompt_len",
        "64",
        "--prompts_per_step",
        "2",
        "--micro_batch_size",
        "4",
        "--steps",
        "1",
        "--seed",
        "3",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(tmp_path / "run"),
    ]
    code, message = run_cli(grpo, args, capsys)
    assert code == 2, message
    assert f"error: reward function 'tests.test_grpo_iterative:{fn}'" in message
    row = int(message.split(" on row ")[1].split()[0])
    assert fragment.format(row=row, data=rows) in message, message
    if fn == "raises_on_second_call":
        assert "ZeroDivisionError: boom (at " in message and "test_grpo_iterative.py:" in message


# ----------------------------------------------------------------------------------------------------
# End to end: two processes, rule-based rewards, no reward model


def ends(prompt, response):
    """1 for a response that ended by itself: the signal the end-biased policy learns in a few steps."""
    return float(response.endswith("\n"))


def grpo_args(policy, prompts, val, run, *extra):
    return [
        "grpo.py",
        "--model",
        str(policy),
        "--train_data",
        str(prompts),
        "--val_data",
        str(val),
        "--pref_data",
        "",
        "--val_rows",
        "8",
        "--num_samples",
        "8",
        "--num_kept",
        "4",
        "--max_new_tokens",
        "16",
        "--max_prompt_len",
        "192",
        "--prompts_per_step",
        "8",
        "--micro_batch_size",
        "16",
        "--steps",
        "5",
        "--warmup_steps",
        "1",
        "--beta",
        "0.05",
        "--eval_every",
        "5",
        "--save_every",
        "3",
        "--keep_last",
        "5",
        "--table_every",
        "3",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(run),
        *extra,
    ]


def resume_from_step_3(run, args, full):
    """Pretend the run died after step 3 (checkpoint 3 and its metrics kept), rerun, and compare bit for bit."""
    shutil.rmtree(run / "checkpoints" / "step_00000005")
    (run / "checkpoints" / "latest").write_text("step_00000003")
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in full if m["step"] <= 3))
    run_script(args, nproc=2)
    keys = ("train/loss", "train/kl", "train/grad_norm", "reward/mean", "sample/end_fraction")
    assert_same_metrics(full, read_metrics(run), keys, "resumed from step 3")


@pytest.mark.slow
def test_two_process_grpo_with_lora_and_a_reward_function_improves_it(tmp_path):
    data = write_task(tmp_path / "data", n_sft_train=8, n_sft_val=16, n_pref_train=4, n_pref_val=4, n_prompts=64)
    start = end_biased_policy(tmp_path / "policy")
    run = tmp_path / "run"
    args = grpo_args(
        tmp_path / "policy",
        data["prompts_train"],
        data["sft_validation"],
        run,
        "--rewards",
        "tests.test_grpo_iterative:ends",
        "--lora_rank",
        "4",
        "--lora_alpha",
        "8",
        "--lr",
        "1e-2",
        "--policy_epochs",
        "2",
        "--ref_refresh_every",
        "2",
        "--gold_reward_fn",
        "data.synthetic:gold_reward",
        "--gold_parts_fn",
        "data.synthetic:gold_parts",
    )
    out = run_script(args, nproc=2)
    assert "LoRA adapters on 8 projections" in out.stdout and "rewards: 1*ends" in out.stdout
    m = [x for x in read_metrics(run) if x["step"] > 0]
    score = [x["reward/ends_mean"] for x in m]
    assert score[-1] > score[0] + 0.15, score  # the trained-on rule reward improves (the policy learns to end)
    # the monitored gold reward's parts, averaged over both ranks' samples: "ended" is the end fraction
    assert [x["gold/ended"] for x in m] == [x["sample/end_fraction"] for x in m]
    assert all({"reward/gold_mean", "gold/items_correct", "gold/items_invented", "gold/words"} <= set(x) for x in m)
    assert all("reward/raw_mean" not in x for x in m)  # no reward model anywhere
    # mu = 2: the first update's ratio is exactly 1, the second's is not
    assert all(x["train/epoch_1/ratio_deviation"] == 0.0 and x["train/epoch_2/ratio_deviation"] > 0 for x in m)
    # refreshes before steps 3 and 5 (adapters merged into the base): the first update's KL is exactly 0 there
    kl = {x["step"]: x["train/epoch_1/kl"] for x in m}
    assert kl[1] == kl[3] == kl[5] == 0.0 and kl[2] > 0 and kl[4] > 0, kl
    # the export is a plain GPT-2: the adapted projections moved (LoRA merged), nothing else did
    assert changed_weights(tmp_path / "policy", run / "hf") == adapted_weight_names(start.cfg)
    columns = json.loads((run / "samples.jsonl").read_text().splitlines()[0])["columns"]
    assert columns == ["prompt", "response", "ends", "reward", "advantage", "has_end"]
    resume_from_step_3(run, args, read_metrics(run))  # the merged base (the reference) is in the model state


@pytest.mark.slow
def test_two_process_grpo_mixing_tasks_by_a_reward_column_with_a_refreshed_full_reference(tmp_path):
    data = write_task(tmp_path / "data", n_sft_train=8, n_sft_val=16, n_pref_train=4, n_pref_val=4, n_prompts=64)
    rows = [json.loads(line) for line in open(data["prompts_train"])]
    # half the prompts are scored by ending (a test-local function: the embedded gold reward pays nothing to a random
    # policy's content-free summaries, so it would carry no signal), half by the format check
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        "".join(json.dumps({**r, "reward_fns": ["ends", "format"][i % 2]}) + "\n" for i, r in enumerate(rows))
    )
    end_biased_policy(tmp_path / "policy")
    run = tmp_path / "run"
    args = grpo_args(
        tmp_path / "policy",
        mixed,
        data["sft_validation"],
        run,
        "--rewards",
        "tests.test_grpo_iterative:ends + 0.5*format",
        "--lr",
        "3e-3",
        "--ref_refresh_every",
        "2",
        "--entropy_coef",
        "0.01",
    )
    run_script(args, nproc=2)
    m = [x for x in read_metrics(run) if x["step"] > 0]
    for x in m:
        assert x["reward/ends_fraction"] + x["reward/format_fraction"] == 1.0
        assert 0.25 <= x["reward/ends_fraction"] <= 0.75
    kl = {x["step"]: x["train/kl"] for x in m}
    assert kl[1] == kl[3] == kl[5] == 0.0 and kl[2] > 0 and kl[4] > 0, kl  # mu = 1, refreshed before 3 and 5
    first, final = read_metrics(run)[0], read_metrics(run)[-1]
    assert first["step"] == 0 and {"eval/reward", "eval/reward_ends", "eval/reward_format"} <= set(first) & set(final)
    # Learning, judged on the held-out rows before step 1 and after the last: one step's 32 samples per reward are
    # too few to compare a single step with another (format_mean went 0.725, 0.22, 1.0, 0.575, 0.7 on one machine)
    assert final["eval/reward_format"] > first["eval/reward_format"], (first, final)
    assert final["eval/reward"] > first["eval/reward"], (first, final)
    # the checkpoint at step 3 holds the reference refreshed at step 3: step 4's KL after resuming must match
    resume_from_step_3(run, args, read_metrics(run))


# ----------------------------------------------------------------------------------------------------
# eval/kl after a reference refresh: still the KL to the policy the run started from


@pytest.mark.parametrize("lora", [False, True], ids=["full_copy", "lora"])
def test_eval_kl_after_a_reference_refresh_is_the_kl_to_the_starting_policy(lora, tmp_path):
    """--ref_refresh_every 1 with --frontier_prompts: the reference becomes the policy after step 1, yet eval/kl at
    step 2 is exactly the frontier's measurement of the exported policy against the starting one (the same samples:
    its generator is keyed by the step), not against the refreshed reference."""
    from evaluation.measure import load_frontier_prompts, measure
    from model.weights import build_policy
    from utils.checkpoint import read_tensors
    from utils.dist import stream

    data = write_task(tmp_path / "data", n_sft_train=8, n_sft_val=8, n_pref_train=4, n_pref_val=4, n_prompts=16)
    end_biased_policy(tmp_path / "policy")
    run = tmp_path / "run"
    args = grpo_args(tmp_path / "policy", data["prompts_train"], "", run, "--rewards", "tests.test_grpo_iterative:ends")
    args = args[1:] + ["--steps", "2", "--eval_every", "1", "--save_every", "1", "--lr", "3e-2", "--beta", "0.0"]
    args += ["--ref_refresh_every", "1", "--frontier_prompts", "3", "--frontier_samples", "6"]
    args += ["--frontier_data", str(data["sft_validation"]), "--frontier_max_new_tokens", "8", "--seed", "1"]
    args += ["--lora_rank", "4", "--lora_alpha", "8"] if lora else []
    grpo.main(grpo.parse_config(Config, args))
    logged = {m["step"]: m["eval/kl"] for m in read_metrics(run) if "eval/kl" in m}
    assert set(logged) == {0, 1, 2} and logged[0] == pytest.approx(0.0, abs=1e-6)

    tok = get_tokenizer()
    prompts = load_frontier_prompts(str(data["sft_validation"]), "validation", 3, tok, 192, 8)
    final, start = build_policy(str(run / "hf")).eval(), build_policy(str(tmp_path / "policy")).eval()

    def kl(reference) -> float:
        return measure(final, reference, prompts, 6, 8, tok, stream(1, 2, 0, "frontier"))["kl"]

    assert logged[2] == pytest.approx(kl(start), rel=1e-4, abs=1e-6)
    assert logged[2] > 0.05  # the policy moved; measured against the refreshed reference it would restart near 0
    if not lora:  # the refreshed reference: the policy after step 1 (its checkpoint)
        after_step_1 = copy.deepcopy(start)
        after_step_1.load_state_dict(read_tensors(run / "checkpoints" / "step_00000001", "model"))
        assert abs(kl(after_step_1) - logged[2]) > 0.02, (kl(after_step_1), logged[2])

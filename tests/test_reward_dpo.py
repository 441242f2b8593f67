"""Reward model, DPO and preference evaluation: statistics worked by hand, gradient plumbing, and short two-process
runs on tiny random models (every trained parameter changes, the loss falls on fixed pairs, resume is exact)."""

import copy
import json
import math
import random
import re
import signal

import pytest
import torch
from safetensors.torch import load_file

import dpo
import eval_preferences
import reward_model
from data.tldr import PREF_COLUMNS, collate_pairs, load_rows
from data.tokenizer import get_tokenizer
from evaluation.preference import build_eval_set, evaluate_reward_model, gather_pair_scores, pair_logprobs
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from model.weights import build_reward_model, save_hf
from rlhf.losses import preference_loss
from rlhf.stats import bootstrap_ci, pair_outcomes, preference_summary, standardizing_gain_bias
from tests.conftest import (
    assert_same_metrics,
    checkpoint_step,
    kill_and_rerun,
    run_and_interrupt,
    run_script,
    shared_file,
)
from tests.helpers import pair_run_args, read_metrics, write_pref_rows
from training.reference import build_policy_and_reference
from utils.config import parse_config

LOG2 = math.log(2.0)
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=128)


# ----------------------------------------------------------------------------------------------------
# Data and models made up on the spot


def random_pairs(n, seed=0):
    g = torch.Generator().manual_seed(seed)

    def seq(lo, hi):
        return torch.randint(0, 50000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [seq(3, 9) for _ in range(n)], [seq(1, 6) + [198] for _ in range(n)], [seq(1, 6) + [198] for _ in range(n)]


def changed_and_unchanged(before_folder, after_folder):
    before = load_file(str(before_folder / "model.safetensors"))
    after = load_file(str(after_folder / "model.safetensors"))
    assert before.keys() == after.keys()
    return [k for k in before if torch.equal(before[k], after[k])]


# ----------------------------------------------------------------------------------------------------
# Statistics


def test_ties_count_half():
    chosen = torch.tensor([2.0, 1.0, 0.5, 3.0])
    rejected = torch.tensor([1.0, 1.0, 0.7, 3.0])
    assert pair_outcomes(chosen, rejected).tolist() == [1.0, 0.5, 0.0, 0.5]
    s = preference_summary(chosen, rejected, torch.tensor([True, False, False, True]), n_resamples=200)
    assert s["accuracy"] == pytest.approx(2.0 / 4)
    assert s["n_ties"] == 2 and s["n_pairs"] == 4
    assert s["chosen_longer_accuracy"] == pytest.approx(0.75)  # pairs 0 (win) and 3 (tie)
    assert s["chosen_not_longer_accuracy"] == pytest.approx(0.25)  # pairs 1 (tie) and 2 (loss)
    assert s["n_chosen_longer"] == 2 and s["n_chosen_not_longer"] == 2
    assert s["margin_mean"] == pytest.approx((1.0 + 0.0 - 0.2 + 0.0) / 4)
    assert s["bt_loss"] == pytest.approx(sum(math.log1p(math.exp(-m)) for m in (1.0, 0.0, -0.2, 0.0)) / 4)


def test_bootstrap_ci_brackets_the_accuracy_and_is_reproducible():
    g = torch.Generator().manual_seed(0)
    outcomes = (torch.rand(400, generator=g) < 0.62).double()
    acc = outcomes.mean().item()
    lo, hi = bootstrap_ci(outcomes, n_resamples=2000, seed=0)
    assert lo < acc < hi
    # normal approximation of a proportion: half-width 1.96 sqrt(p(1-p)/n) = 0.0476 here
    half = 1.96 * math.sqrt(acc * (1 - acc) / 400)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)
    assert bootstrap_ci(outcomes, n_resamples=2000, seed=0) == (lo, hi)
    assert bootstrap_ci(torch.full((50,), 0.5)) == (0.5, 0.5)  # all ties: no spread
    assert all(math.isnan(x) for x in bootstrap_ci(torch.zeros(0)))


def test_standardizing_gain_bias_gives_mean_0_std_1():
    r = torch.tensor([1.0, 2.0, 4.0, 9.0], dtype=torch.float64)
    gain, bias = standardizing_gain_bias(len(r), r.sum().item(), (r * r).sum().item())
    z = gain * r + bias
    assert z.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert z.std(unbiased=False).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="spread"):
        standardizing_gain_bias(3, 6.0, 12.0)  # all rewards 2


def test_eval_set_slices_are_disjoint_equal_sized_and_gather_in_order(tmp_path):
    rows = load_rows(str(write_pref_rows(tmp_path / "p.jsonl", n=7)), "validation", PREF_COLUMNS)
    tok = get_tokenizer()
    sets = [build_eval_set(rows, tok, 64, 16, 3, rank, 2, by_length=False) for rank in range(2)]
    # rank 0: pairs 0 2 4 6; rank 1: 1 3 5 and one padding pair; the same number of forward passes each
    assert [len(s.batches) for s in sets] == [2, 2]
    index = [torch.cat([b["pair_index"] for b in s.batches]).tolist() for s in sets]
    assert index == [[0, 2, 4, 6], [1, 3, 5, -1]]
    # by length (the default): the same pairs dealt out longest first
    grouped = [build_eval_set(rows, tok, 64, 16, 3, rank, 2) for rank in range(2)]
    index = [torch.cat([b["pair_index"] for b in s.batches]).tolist() for s in grouped]
    assert sorted(index[0] + index[1]) == [-1, 0, 1, 2, 3, 4, 5, 6] and index[1][-1] == -1
    width = [b["input_ids"].shape[1] for s in grouped for b in s.batches]
    assert width[0] >= width[1] and width[2] >= width[3]  # each rank's first batch holds its longest pairs
    # a single process "gathers" its own rows: padding dropped, sorted back into pair order
    idx = torch.tensor([3, -1, 0, 2, 1])
    c, r = gather_pair_scores(idx, idx.double() * 10, -idx.double(), 4)
    assert c.tolist() == [0.0, 10.0, 20.0, 30.0] and r.tolist() == [0.0, -1.0, -2.0, -3.0]
    with pytest.raises(RuntimeError, match="exactly once"):
        gather_pair_scores(torch.tensor([0, 0]), torch.zeros(2), torch.zeros(2), 2)


# ----------------------------------------------------------------------------------------------------
# Gradients (one process, no FSDP)


def test_frozen_reference_receives_no_gradient():
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(TINY)
    reference = copy.deepcopy(policy)  # requires_grad left True on purpose: only torch.no_grad protects it
    batch = collate_pairs(*random_pairs(3))
    losses, stats = dpo.pair_losses(policy, reference, batch, preference_loss(dpo.Config()), 0.1, "cpu")
    assert torch.allclose(losses, torch.full((3,), LOG2))  # policy == reference: zero margin
    assert stats[1].item() == 1.5  # accuracy: three ties count 1/2 each
    losses.sum().backward()
    assert all(p.grad is None for p in reference.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_pair_logprobs_sum_the_response_tokens_of_the_full_logits():
    """evaluation.preference.pair_logprobs (the fused head pass) == log_softmax of the full logits gathered at
    the response tokens and summed over the real ones, in value and in every parameter's gradient."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(TINY)
    batch = collate_pairs(*random_pairs(4, seed=3))
    P, mask = batch["prompt_len"], batch["response_mask"]
    assert not mask.all()  # some response padding is masked out
    got = pair_logprobs(policy, batch, "cpu")
    grads_got = torch.autograd.grad(got.sum(), list(policy.parameters()))
    logits = policy(batch["input_ids"], batch["position_ids"], batch["attention_mask"])  # (2B, T, V) every column
    R = batch["response_ids"].shape[1]
    logp = logits[:, P - 1 : P + R - 1].log_softmax(-1).gather(-1, batch["response_ids"][..., None]).squeeze(-1)
    want = (logp * mask).sum(-1)
    grads_want = torch.autograd.grad(want.sum(), list(policy.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for g_got, g_want in zip(
        grads_got, grads_want, strict=True
    ):  # summation order differs: within 1e-5 of each tensor's scale
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5 * g_want.abs().max().item())


def test_loss_choice_and_offload_needs_gpu():
    z, h = torch.zeros(2), torch.tensor([1.0, -2.0])
    ipo = preference_loss(dpo.Config(loss="ipo", beta=0.5))
    assert torch.allclose(ipo(h, z, z, z), torch.tensor([0.0, 9.0]))  # (h - 1)^2
    smooth = preference_loss(dpo.Config(beta=1.0, label_smoothing=0.25))
    assert smooth(h, z, z, z)[0].item() == pytest.approx(math.log1p(math.exp(-1.0)) + 0.25, abs=1e-6)
    with pytest.raises(SystemExit):
        parse_config(dpo.Config, ["--loss", "ipo", "--label_smoothing", "0.1"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_config(dpo.Config, ["--frozen_cpu_offload", "true"])


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("stage", ["reward_model", "reward_model_sum", "dpo"])
def test_gradient_does_not_depend_on_micro_batch_size(stage, shared):
    prompts, chosen, rejected = random_pairs(4, seed=1)
    grads, metrics = [], []
    for sizes in ([4], [1, 3], [2, 2]):
        torch.manual_seed(0)
        model = (
            GPT2LMHeadModel(TINY) if stage == "dpo" else RewardModel(TINY, "sum" if stage.endswith("sum") else "last")
        )
        if stage == "dpo":  # a reference that differs from the policy, so margins are not zero
            reference = GPT2LMHeadModel(TINY).requires_grad_(False)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        micro = [
            collate_pairs(prompts[s : s + n], chosen[s : s + n], rejected[s : s + n])
            for s, n in zip(starts, sizes, strict=True)
        ]
        if stage == "dpo":
            loss_fn = preference_loss(dpo.Config(beta=0.5))
            m = dpo.accumulate_gradients(model, reference, micro, 1, 4, loss_fn, 0.5, "cpu", shared)
        else:
            m = reward_model.accumulate_gradients(model, micro, 1, 4, "cpu", shared)
        metrics.append(m)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for m, g in zip(metrics[1:], grads[1:], strict=True):
        for k, v in metrics[0].items():
            assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        for n, ref in grads[0].items():
            assert torch.allclose(g[n], ref, rtol=1e-4, atol=1e-6), n  # fp32 sums in another order
    assert metrics[0]["train/loss"] > 0.1


# ----------------------------------------------------------------------------------------------------
# Evaluation on real TL;DR comparisons


def test_evaluate_reward_model_on_real_pairs_two_processes(tmp_path):
    data = shared_file("tldr-preference-validation-sample.jsonl")
    torch.manual_seed(0)
    rm = RewardModel(TINY)
    folder = tmp_path / "rm"
    save_hf(rm.state_dict(), rm.cfg, folder)
    out = tmp_path / "eval"
    run_script(
        [
            "eval_preferences.py",
            "--reward_model",
            str(folder),
            "--val_data",
            str(data),
            "--val_rows",
            "64",
            "--max_prompt_len",
            "96",
            "--max_response_len",
            "32",
            "--micro_batch_size",
            "5",
            "--out_dir",
            str(out),
            "--wandb_mode",
            "disabled",
        ],
        nproc=2,
    )
    res = json.loads((out / "preference_eval.json").read_text())["results"]
    assert res["n_pairs"] == 64 and res["n_chosen_longer"] + res["n_chosen_not_longer"] == 64
    for key in ("", "chosen_longer_", "chosen_not_longer_"):
        assert res[f"{key}accuracy_ci_low"] <= res[f"{key}accuracy"] <= res[f"{key}accuracy_ci_high"]
    assert res["accuracy"] * 64 == pytest.approx(round(res["accuracy"] * 128) / 2)  # a multiple of 1/128
    assert (
        res["n_chosen_longer"] * res["chosen_longer_accuracy"]
        + res["n_chosen_not_longer"] * res["chosen_not_longer_accuracy"]
    ) == pytest.approx(64 * res["accuracy"])
    logged = read_metrics(out)[0]
    assert logged["eval/accuracy"] == res["accuracy"] and logged["eval/n_pairs"] == 64
    # the same scores in this process, unsharded and in one slice: the gather put every pair back in place
    rows = load_rows(str(data), "validation", PREF_COLUMNS)[:64]
    local = evaluate_reward_model(
        build_reward_model(str(folder)), build_eval_set(rows, get_tokenizer(), 96, 32, 8, 0, 1), "cpu"
    )
    assert local["accuracy"] == res["accuracy"]
    assert local["n_chosen_longer"] == res["n_chosen_longer"]
    assert local["chosen_score_mean"] == pytest.approx(res["chosen_score_mean"], abs=1e-5)
    assert local["bt_loss"] == pytest.approx(res["bt_loss"], abs=1e-5)


# ----------------------------------------------------------------------------------------------------
# Two-process training runs


def tiny_folders(tmp_path, pooling: str = "last"):
    """A tiny random reward model and policy saved as Hugging Face folders: the runs' starting points."""
    torch.manual_seed(0)
    rm, pol = RewardModel(TINY, pooling), GPT2LMHeadModel(TINY)
    save_hf(rm.state_dict(), rm.cfg, tmp_path / "init_rm", reward_pooling=pooling)
    save_hf(pol.state_dict(), pol.cfg, tmp_path / "policy")
    return tmp_path / "init_rm", tmp_path / "policy"


@pytest.mark.slow
def test_two_process_reward_model_fits_a_fixed_batch_and_normalizes(tmp_path):
    data = write_pref_rows(tmp_path / "pairs.jsonl")
    init, policy = tiny_folders(tmp_path, "sum")
    run = tmp_path / "run"
    run_script(
        [
            "reward_model.py",
            "--model",
            str(init),
            "--sft_policy",
            str(policy),
            "--lr",
            "1e-3",
            "--overfit_batch",
            "true",
            "--eval_every",
            "5",
            "--norm_prompts",
            "6",
            "--norm_samples_per_prompt",
            "2",
            "--norm_batch_size",
            "2",
            "--pooling",
            "sum",
            *pair_run_args(data, run, 5),
        ],
        nproc=2,
    )
    m = read_metrics(run)
    assert [x["step"] for x in m] == [0, 1, 2, 3, 4, 5, 5]
    assert m[5]["train/loss"] < m[1]["train/loss"] - 0.15  # the same 8 pairs at every step
    assert m[5]["train/accuracy"] == 1.0
    assert changed_and_unchanged(init, run / "hf") == []  # every trained tensor moved, the score head included
    norm, saved = m[6], json.loads((run / "hf" / "reward_normalization.json").read_text())
    assert norm["norm/samples"] == 12  # 6 prompts x 2 samples; each rank's padding prompt is not counted
    assert saved["gain"] == pytest.approx(1 / norm["norm/raw_std"], rel=1e-5)
    assert saved["bias"] == pytest.approx(-norm["norm/raw_mean"] / norm["norm/raw_std"], rel=1e-5)
    loaded = build_reward_model(str(run / "hf"))
    assert (loaded.gain.item(), loaded.bias.item()) == pytest.approx((saved["gain"], saved["bias"]))
    assert loaded.pooling == "sum"  # --pooling sum: written to config.json, read back


@pytest.mark.slow
def test_two_process_reward_model_resumes_exactly_after_sigkill(tmp_path):
    data = write_pref_rows(tmp_path / "pairs.jsonl")
    init, policy = tiny_folders(tmp_path)

    def args(run):
        return [
            "reward_model.py",
            "--model",
            str(init),
            "--sft_policy",
            str(policy),
            "--lr",
            "1e-3",
            "--eval_every",
            "3",
            "--save_every",
            "1",
            "--keep_last",
            "2",
            "--norm_prompts",
            "4",
            "--norm_samples_per_prompt",
            "2",
            *pair_run_args(data, run, 6),
        ]

    run_script(args(tmp_path / "full"), nproc=2)
    full = read_metrics(tmp_path / "full")
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4, 5, 6, 6]
    saved = json.loads((tmp_path / "full" / "hf" / "reward_normalization.json").read_text())

    # SIGKILL torchrun and both workers once a checkpoint of a random step exists (possibly the last one, while the
    # normalisation runs), then rerun the same command to the end
    run = tmp_path / "run"
    kill_at = random.randint(1, 5)
    killed_at = kill_and_rerun(args(run), run, kill_at, nproc=2)
    keys = ("train/loss", "train/grad_norm", "train/accuracy", "val/accuracy", "val/bt_loss", "norm/gain", "norm/bias")
    assert_same_metrics(full, read_metrics(run), keys, f"SIGKILL after checkpoint {killed_at} (asked >= {kill_at})")
    assert json.loads((run / "hf" / "reward_normalization.json").read_text()) == saved


@pytest.mark.slow
def test_two_process_dpo_starts_at_log2_learns_and_evaluates(tmp_path):
    data = write_pref_rows(tmp_path / "pairs.jsonl")
    torch.manual_seed(0)
    init = tmp_path / "sft"
    pol = GPT2LMHeadModel(TINY)
    save_hf(pol.state_dict(), pol.cfg, init)
    run = tmp_path / "run"
    run_script(
        [
            "dpo.py",
            "--model",
            str(init),
            "--lr",
            "2e-3",
            "--eval_every",
            "5",
            "--label_smoothing",
            "0.1",
            *pair_run_args(data, run, 5),
        ],
        nproc=2,
    )
    m = read_metrics(run)
    assert [x["step"] for x in m] == [0, 1, 2, 3, 4, 5]
    # the policy starts equal to its reference: every implicit reward is 0, every pair a tie
    assert m[0]["val/bt_loss"] == pytest.approx(LOG2, abs=1e-6) and m[0]["val/n_ties"] == 16
    assert m[1]["train/loss"] == pytest.approx(LOG2, abs=1e-6) and m[1]["train/accuracy"] == 0.5
    assert m[5]["val/bt_loss"] < LOG2 - 0.05 and m[5]["train/loss"] < m[1]["train/loss"]
    assert m[5]["train/reward_margin"] > 0
    assert changed_and_unchanged(init, run / "hf") == []

    # the stand-alone evaluation of the export against its reference agrees with the last validation (in this
    # process: `python eval_preferences.py ...` without the start-up)
    eval_preferences.main(
        parse_config(
            eval_preferences.Config,
            [
                "--policy",
                str(run / "hf"),
                "--reference",
                str(init),
                "--val_data",
                str(data),
                "--val_rows",
                "16",
                "--max_prompt_len",
                "64",
                "--max_response_len",
                "16",
                "--out_dir",
                str(tmp_path / "eval"),
                "--wandb_mode",
                "disabled",
            ],
        )
    )
    res = json.loads((tmp_path / "eval" / "preference_eval.json").read_text())["results"]
    assert res["accuracy"] == m[5]["val/accuracy"]
    assert res["bt_loss"] == pytest.approx(m[5]["val/bt_loss"], abs=1e-5)


@pytest.mark.slow
def test_ipo_one_process_starts_at_its_target_and_learns(tmp_path):
    data = write_pref_rows(tmp_path / "pairs.jsonl", n=16)
    run = tmp_path / "run"
    dpo.main(  # in this process: `python dpo.py ...` without the start-up
        parse_config(
            dpo.Config,
            [
                "--model",
                "tiny",
                "--random_init",
                "true",
                "--loss",
                "ipo",
                "--beta",
                "0.5",
                "--lr",
                "1e-3",
                "--overfit_batch",
                "true",
                "--eval_every",
                "0",
                *pair_run_args(data, run, 4),
                "--val_data",
                "",
            ],
        )
    )
    m = read_metrics(run)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert m[0]["train/loss"] == pytest.approx(1.0, abs=1e-6)  # h = 0: (0 - 1/(2 * 0.5))^2
    assert m[-1]["train/loss"] < 0.9


@pytest.mark.slow
def test_dpo_resumes_exactly_after_sigkill_and_exits_cleanly_on_sigterm(tmp_path):
    data = write_pref_rows(tmp_path / "pairs.jsonl", n=32)

    def args(run):
        return [
            "dpo.py",
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--lr",
            "2e-3",
            "--eval_every",
            "2",
            "--save_every",
            "1",
            "--keep_last",
            "1",
            *pair_run_args(data, run, 6),
        ]

    def run_here(run):  # `python dpo.py ...` in this process, without the start-up (one thread, as run_script's)
        dpo.main(parse_config(dpo.Config, args(run)[1:]))

    run_here(tmp_path / "full")
    full = read_metrics(tmp_path / "full")
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4, 5, 6]

    # SIGKILL at a random checkpoint; rerun and SIGTERM it (one process: it saves and exits with code 0, no
    # traceback); rerun to the end: the metrics equal the uninterrupted run's to the last bit
    run = tmp_path / "run"
    kill_at = random.randint(1, 3)
    code, _ = run_and_interrupt(args(run), run, kill_at, signal.SIGKILL)
    assert code == -signal.SIGKILL
    killed_at = checkpoint_step(run)
    code, out = run_and_interrupt(args(run), run, killed_at + 1, signal.SIGTERM)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", out)
    assert stopped and int(stopped.group(1)) == checkpoint_step(run), out[-3000:]
    run_here(run)
    keys = ("train/loss", "train/grad_norm", "train/accuracy", "train/lr", "val/accuracy", "val/bt_loss")
    context = f"SIGKILL after checkpoint {killed_at} (asked >= {kill_at}), SIGTERM after step {stopped.group(1)}"
    assert_same_metrics(full, read_metrics(run), keys, context)


@pytest.mark.parametrize("stage", ["reward_model", "dpo"])
def test_eval_every_minus_one_never_reads_or_evaluates_the_validation_pairs(stage, tmp_path):
    module = reward_model if stage == "reward_model" else dpo
    data = write_pref_rows(tmp_path / "pairs.jsonl", n=16)
    run = tmp_path / "run"
    args = [
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--eval_every",
        "-1",
        "--lr",
        "1e-3",
        *pair_run_args(data, run, 2),
        "--val_data",
        str(tmp_path / "missing.jsonl"),
    ]
    if stage == "reward_model":
        args += ["--norm_prompts", "0"]
    module.main(parse_config(module.Config, args))  # the missing validation file is never opened
    m = read_metrics(run)
    assert [x["step"] for x in m] == [1, 2]
    assert not [k for x in m for k in x if k.startswith("val/")]
    assert (run / "hf" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------
# bf16 on CPU: the reward head's precision, DPO's reference dtype


def test_reward_head_is_fp32_under_bf16_mixed_precision(one_rank_group):
    """Under bf16 FSDP mixed precision the body runs in bf16 but the scalar head must not round its output to bf16
    (scores on bf16 steps, 0.0625 apart near |r| = 10, would tie in RSO's r == r_max and shift advantages)."""
    from utils.fsdp import shard_model

    torch.manual_seed(0)
    model = RewardModel(GPTConfig(vocab_size=512, n_positions=64, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        model.score.weight.mul_(40)  # rewards of a few units, like a trained reward model's
    weight_bf16 = model.score.weight.detach().bfloat16().float()  # what FSDP's bf16 cast of the head holds
    shard_model(model, torch.bfloat16)
    hidden = []
    model.transformer.register_forward_hook(lambda m, a, out: hidden.append(out))  # (B, T, C): the body's output
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (64, 12), generator=g)
    mask = torch.arange(12)[None] >= torch.randint(0, 4, (64, 1), generator=g)  # left padding
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        scores = model(ids, pos, mask)  # (64,)
    h = hidden[0][torch.arange(64), mask.long().cumsum(-1).argmax(-1)]  # (64, C): each row's last real token
    assert scores.dtype == torch.float32 and h.dtype == torch.bfloat16
    assert scores.abs().max() > 5
    assert not torch.equal(scores.bfloat16().float(), scores)  # off the bf16 grid
    expected = h.float() @ weight_bf16[0]  # the bf16 body's last hidden state through the head in fp32
    assert torch.allclose(scores, expected, rtol=1e-5, atol=1e-5), (scores - expected).abs().max()


def test_dpo_reference_dtype_auto_follows_the_policy_and_the_first_loss_is_log2(one_rank_group, tmp_path):
    """--dtype bf16 with --reference_dtype auto: the reference computes in bf16 as the policy does, so every implicit
    reward is exactly 0 at step 0 and the sigmoid loss exactly log 2 (an fp32 reference under a bf16 policy gives
    rewards of bf16 noise). CPU shows it with --dtype bf16; tests/test_collectives.py checks --dtype fp32 on a GPU."""
    from types import SimpleNamespace

    data = write_pref_rows(tmp_path / "pairs.jsonl", n=8)
    cfg = parse_config(
        dpo.Config,
        [
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--dtype",
            "bf16",
            "--train_data",
            str(data),
            "--out_dir",
            str(tmp_path / "run"),
        ],
    )
    torch.manual_seed(0)
    run = SimpleNamespace(say=lambda message: None, device=torch.device("cpu"), dtype=torch.bfloat16)
    policy, reference = build_policy_and_reference(cfg, run)
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    rows = load_rows(str(data), "train", PREF_COLUMNS)
    tok = get_tokenizer()
    ds = build_eval_set(rows, tok, 64, 16, 8, 0, 1).batches[0]
    losses, stats = dpo.pair_losses(policy, reference, ds, preference_loss(cfg), cfg.beta, torch.device("cpu"))
    assert stats[2] == 0 and stats[3] == 0  # summed chosen and rejected implicit rewards
    assert torch.equal(losses, torch.full_like(losses, LOG2))

"""sample.py (summaries from a policy folder) and what a stage's run leaves to read: sample tables, summary.json,
progress lines, and the default prompt length fitted to a small preset."""

import io
import json

import pytest
import torch

import dpo
import sample
import sft
from data.tldr import PromptDataset, decode_responses, pad_prompts
from data.tokenizer import get_tokenizer
from evaluation.samples import tldr_prompt
from model.gpt2 import GPT2LMHeadModel, GPTConfig
from model.heads import RewardModel
from model.sampler import generate
from model.weights import save_export, save_hf
from tests import helpers
from tests.conftest import run_script
from utils.config import parse_config

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=128)


def policy_folder(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG)
    save_hf(model.state_dict(), CFG, tmp_path / "policy")
    return tmp_path / "policy", model


def run_sample(argv, stdin=None):
    out = io.StringIO()
    records = sample.main(parse_config(sample.Config, argv), stdin=stdin, out=out)
    return records, out.getvalue()


def test_a_post_becomes_the_training_prompt_format():
    assert (
        tldr_prompt(" my post \n", "tifu", "A title")
        == "SUBREDDIT: r/tifu\n\nTITLE: A title\n\nPOST: my post\n\nTL;DR:"
    )
    assert tldr_prompt("my post") == "POST: my post\n\nTL;DR:"
    whole = "SUBREDDIT: r/x\n\nTITLE: t\n\nPOST: p\n\nTL;DR:"
    assert tldr_prompt(whole) == whole


def test_greedy_summaries_are_the_samplers_and_the_jsonl_carries_them(tmp_path):
    folder, model = policy_folder(tmp_path)
    data = helpers.write_sft_rows(tmp_path / "rows.jsonl", n=5)
    argv = [
        "--policy",
        str(folder),
        "--data",
        str(data),
        "--rows",
        "3",
        "--greedy",
        "true",
        "--max_new_tokens",
        "8",
        "--max_prompt_len",
        "96",
        "--device",
        "cpu",
        "--jsonl",
        "true",
    ]
    records, text = run_sample(argv)
    # the same prompts through the sampler directly, greedy
    tok = get_tokenizer()
    rows = [json.loads(line) for line in open(data)][:3]
    ids, mask = pad_prompts(PromptDataset(rows, tok, 96).prompts)
    out = generate(model.eval(), ids, mask, 1, 8, temperature=0.0)
    want = [t.strip() for t in decode_responses(tok, out.response_ids, out.response_mask, out.has_end)]
    assert [r["summary"] for r in records] == want
    assert [r["prompt"] for r in records] == [r["prompt"] for r in rows]
    assert [json.loads(line) for line in text.splitlines()] == records
    assert all(r["ended"] == bool(e) for r, e in zip(records, out.has_end, strict=True))


def test_samples_from_stdin_scored_by_a_reward_model_and_printed_readably(tmp_path):
    folder, _ = policy_folder(tmp_path)
    for name, gain, bias in (("rm", 2.0, 0.5), ("rm_raw", 1.0, 0.0)):  # one head, two normalisations
        torch.manual_seed(1)
        rm = RewardModel(CFG)
        with torch.no_grad():
            rm.gain.fill_(gain)
            rm.bias.fill_(bias)
        save_export(rm, rm.state_dict(), CFG, tmp_path / name)
    argv = [
        "--policy",
        str(folder),
        "--num_samples",
        "3",
        "--temperature",
        "1.0",
        "--max_new_tokens",
        "6",
        "--max_prompt_len",
        "64",
        "--device",
        "cpu",
        "--seed",
        "5",
    ]
    post = "my sister took my computer on a trip\n"
    records, text = run_sample([*argv, "--reward_model", str(tmp_path / "rm")], stdin=io.StringIO(post))
    assert [r["sample"] for r in records] == [0, 1, 2]
    assert records[0]["prompt"] == "POST: my sister took my computer on a trip\n\nTL;DR:"
    assert text.count("--- summary") == 3 and text.startswith("=" * 100 + "\nPOST: my sister")
    assert f"reward {records[0]['reward']:+.3f}" in text
    # the same seed draws the same summaries; the reward is the normalized score, gain * raw + bias
    raw, _ = run_sample([*argv, "--reward_model", str(tmp_path / "rm_raw")], stdin=io.StringIO(post))
    assert [r["summary"] for r in raw] == [r["summary"] for r in records]
    assert [r["reward"] for r in records] == [pytest.approx(2 * r["reward"] + 0.5, abs=1e-5) for r in raw]
    assert len({r["reward"] for r in raw}) > 1  # three different summaries, three scores


def test_a_stage_on_real_rows_at_default_lengths_reports_progress_samples_and_summary(tmp_path, capfd):
    data = helpers.write_sft_rows(tmp_path / "rows.jsonl", n=24)
    run = tmp_path / "sft"
    args = [
        "sft.py",
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--train_data",
        str(data),
        "--val_data",
        str(data),
        "--val_rows",
        "6",
        "--steps",
        "2",
        "--batch_size",
        "4",
        "--micro_batch_size",
        "2",
        "--eval_every",
        "1",
        "--eval_samples",
        "2",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(run),
        "--device",
        "cpu",
    ]
    first = run_script(args)
    err = first.stderr
    # tiny has 512 positions: the default 512 + 64 is fitted, in one line
    assert (
        "--max_prompt_len 512 + --max_response_len 64 exceeds the model's 512 positions: using --max_prompt_len 448"
        in err
    )
    assert json.loads((run / "config.json").read_text())["max_prompt_len"] == 448
    # stderr is a pipe: whole progress lines, the evaluation's own among them, no carriage returns
    assert "\r" not in err
    assert err.count("validation loss: 6/6 rows (100%)") == 2
    assert "sft: 2/2 step (100%)" in err and "tok/s=" in err
    # a samples table at each evaluation: the two prompts, a greedy summary each, the reference completion
    tables = [json.loads(line) for line in open(run / "samples.jsonl")]
    rows = [json.loads(line) for line in open(data)]
    assert [t["step"] for t in tables] == [1, 2] and tables[0]["columns"] == ["prompt", "response", "reference"]
    assert [r[0] for r in tables[1]["rows"]] == [rows[0]["prompt"], rows[1]["prompt"]]
    assert [r[2] for r in tables[1]["rows"]] == [rows[0]["completion"].strip(), rows[1]["completion"].strip()]
    # summary.json and the table
    summary = json.loads((run / "summary.json").read_text())
    val = [json.loads(line)["val/loss"] for line in open(run / "metrics.jsonl")]
    assert (
        summary["evaluation"]["val/loss"]["final"] == val[-1] and summary["evaluation"]["val/loss"]["final_step"] == 2
    )
    assert summary["evaluation"]["val/loss"]["best"] == min(val)
    assert summary["paths"]["export"] == str(run / "hf") and summary["paths"]["samples"] == str(run / "samples.jsonl")
    assert summary["tokens_per_second"] > 0 and summary["steps"] == 2
    assert "sft summary after 2 steps" in first.stdout and "val/loss" in first.stdout.split("sft summary")[1]
    # a rerun of the finished run prints the same summary and trains nothing (in this process, both streams captured
    # at their file descriptors: `python sft.py ...` without the start-up)
    capfd.readouterr()
    sft.main(parse_config(sft.Config, args[1:]))
    again = capfd.readouterr()
    assert json.loads((run / "summary.json").read_text()) == summary
    assert "sft summary after 2 steps" in again.out and "validation loss" not in again.err
    # sample.py reads the export (in this process: `python sample.py ...` without the start-up)
    _, text = run_sample(
        [
            "--policy",
            str(run / "hf"),
            "--data",
            str(data),
            "--rows",
            "2",
            "--greedy",
            "true",
            "--device",
            "cpu",
        ]
    )
    assert text.count("--- summary 1") == 2 and rows[0]["prompt"] in text


def test_a_default_prompt_length_is_fitted_and_a_given_one_is_refused_naming_what_fits(capsys):
    from dataclasses import dataclass

    from utils.config import ConfigError, fit_context

    @dataclass
    class Lengths:
        max_prompt_len: int = 512
        max_new_tokens: int = 53
        pref_max_response_len: int = 64

    small, large = GPTConfig(n_positions=512), GPTConfig(n_positions=1024)
    cfg = Lengths()
    fit_context(cfg, (large, "max_new_tokens", "policy"))  # fits: unchanged, nothing said
    assert cfg.max_prompt_len == 512 and capsys.readouterr().err == ""
    # the tightest limit decides: 512 - 64 for the preference responses
    fit_context(cfg, (small, "max_new_tokens", "policy"), (small, "pref_max_response_len", "policy"))
    assert cfg.max_prompt_len == 448
    assert capsys.readouterr().err == (
        "--max_prompt_len 512 + --pref_max_response_len 64 exceeds the policy's 512 "
        "positions: using --max_prompt_len 448\n"
    )
    with pytest.raises(
        ConfigError, match="exceeds the reward model's 512 positions; the largest --max_prompt_len that fits is 459"
    ):
        fit_context(Lengths(max_prompt_len=500), (small, "max_new_tokens", "reward model"))
    with pytest.raises(ConfigError, match="beside --max_prompt_len 100 the largest --max_new_tokens that fits is 412"):
        fit_context(Lengths(max_prompt_len=100, max_new_tokens=600), (small, "max_new_tokens", "policy"))


def test_summary_win_rate_against_the_references_scored_one_row_at_a_time(tmp_path):
    from data.tldr import collate_sft, encode_response
    from evaluation.samples import summary_win_rate

    _, policy = policy_folder(tmp_path)
    torch.manual_seed(3)
    judge = RewardModel(CFG).eval()
    tok = get_tokenizer()
    rows = [json.loads(line) for line in open(helpers.write_sft_rows(tmp_path / "rows.jsonl", n=12, seed=2))]
    got = summary_win_rate(policy, judge, rows, tok, 96, 6, micro_batch_size=5, n_resamples=200, seed=1)
    # independently: greedy summaries, then each prompt + summary and prompt + reference scored in its own batch
    prompts = PromptDataset(rows, tok, 96).prompts
    ids, mask = pad_prompts(prompts)
    out = generate(policy.eval(), ids, mask, 1, 6, temperature=0.0)
    outcomes = []
    for i, row in enumerate(rows):
        mine = out.response_ids[i][out.response_mask[i]].tolist()
        ref = encode_response(tok, row["completion"], 6)
        scores = []
        for response in (mine, ref):
            b = collate_sft([prompts[i]], [response])
            with torch.no_grad():
                scores.append(
                    float(judge(b["input_ids"], b["position_ids"], b["attention_mask"], prompt_len=b["prompt_len"]))
                )
        outcomes.append(1.0 if scores[0] > scores[1] else 0.5 if scores[0] == scores[1] else 0.0)
    assert got["summary_win_rate"] == pytest.approx(sum(outcomes) / len(outcomes))
    assert (
        got["summary_prompts"] == 12
        and got["summary_win_rate_ci_low"] <= got["summary_win_rate"] <= got["summary_win_rate_ci_high"]
    )
    assert 0 < sum(outcomes) < len(outcomes)  # a comparison that can go either way


def test_dpo_judges_its_summaries_against_the_references_at_every_evaluation(tmp_path):
    from evaluation.samples import summary_win_rate
    from model.weights import build_policy, build_reward_model

    folder, _ = policy_folder(tmp_path)
    torch.manual_seed(3)
    judge = RewardModel(CFG)
    save_export(judge, judge.state_dict(), CFG, tmp_path / "judge")
    pairs = helpers.write_pref_rows(tmp_path / "pairs.jsonl", n=16)
    posts = helpers.write_sft_rows(tmp_path / "posts.jsonl", n=10, seed=4)
    run = tmp_path / "dpo"
    dpo.main(  # in this process: `python dpo.py ...` without the start-up
        parse_config(
            dpo.Config,
            [
                "--model",
                str(folder),
                *helpers.pair_run_args(pairs, run, 2),
                "--eval_every",
                "2",
                "--judge",
                str(tmp_path / "judge"),
                "--summary_data",
                str(posts),
                "--summary_rows",
                "6",
                "--max_new_tokens",
                "8",
                "--device",
                "cpu",
            ],
        )
    )
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    judged = [r for r in rows if "val/win_rate" in r]
    assert [r["step"] for r in judged] == [0, 2]
    # the last one is the exported policy's, computed again outside the run
    posts_rows = [json.loads(line) for line in open(posts)][:6]
    again = summary_win_rate(
        build_policy(str(run / "hf")), build_reward_model(str(tmp_path / "judge")), posts_rows, get_tokenizer(), 64, 8
    )
    assert judged[-1]["val/win_rate"] == again["summary_win_rate"]
    assert judged[-1]["val/reference_reward"] == pytest.approx(again["summary_reference_reward_mean"], abs=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evaluation"]["val/win_rate"]["final"] == judged[-1]["val/win_rate"]


def test_the_sampling_loop_is_one_generate_call_per_chunk_of_prompts_cut_to_its_own_padding():
    """rollouts.sampling.sample_responses, the loop every sampler of the project calls, against generate called by
    hand on each chunk padded on its own: the same tokens, masks, log-probs and ends, rows grouped by prompt, and the
    policy's training mode given back."""
    from rollouts.sampling import sample_responses

    torch.manual_seed(0)
    model = GPT2LMHeadModel(CFG)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16], [17]]  # chunk 3 (prompts 4, 5) is 2 columns wide
    ids, mask = pad_prompts(prompts)  # (5, 6)
    model.train()
    widths = []  # (rows, columns) of every forward: the prefill's are (prompts of the call, its width)
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(tuple(args[0].shape)))
    got = sample_responses(
        model,
        ids,
        mask,
        3,
        7,
        prompts_per_call=2,
        temperature=0.9,
        top_p=0.95,
        generator=torch.Generator().manual_seed(1),
    )
    hook.remove()
    assert model.training
    assert [w for w in widths if w[0] < 3] == [(2, 3), (2, 6), (1, 1)]  # decode steps run 6, 6, 3 rows
    model.eval()
    g = torch.Generator().manual_seed(1)
    parts = [generate(model, *pad_prompts(prompts[s : s + 2]), 3, 7, 0.9, 0.95, generator=g) for s in (0, 2, 4)]
    for name in ("response_ids", "response_mask", "logprobs", "has_end"):
        want = torch.cat([getattr(p, name) for p in parts])  # (15, ...) rows b*3 .. b*3+2 answer prompt b
        assert torch.equal(getattr(got, name), want), name
    assert got.response_ids.shape == (15, 7)

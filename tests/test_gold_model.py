"""Gold from a reward model (Gao, Schulman and Hilton 2022, arXiv 2210.10760) on real TL;DR rows: the labelling rule
by hand, and the whole path with tiny models: a gold reward model trained on real human pairs, pairs of a policy's
samples labelled by it (python -m evaluation.label_pairs), a proxy trained on those labels (reward_model.py), two
arms of two seeds measured with gold from the gold model (dpo.py --frontier_gold_model), best-of-n and the table
(python -m evaluation.frontier --gold_model) and the verdict's rows."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import dpo
import reward_model
from data.labels import pairs_by_score
from data.tldr import encode_prompt, encode_response
from data.tokenizer import get_tokenizer
from evaluation.frontier import frontier_points, load_frontier_prompts, verdict_rows
from evaluation.frontier_declarations import FrontierConfig
from evaluation.label_pairs import labelled_rows, usable_summary
from evaluation.samples import sample_summaries
from model.weights import build_reward_model
from tests.conftest import shared_file
from tests.helpers import end_biased_policy, read_metrics
from utils.config import ConfigError, parse_config
from utils.dist import stream

# ----------------------------------------------------------------------------------------------------
# The labelling rule, by hand


def test_pairs_by_score_pairs_in_order_and_skips_ties():
    # 0 ties 1 and pairs with 2 (lower: 0 chosen); 1 then pairs with 3 (higher: 3 chosen)
    assert pairs_by_score([1.0, 1.0, 0.0, 2.0], [True] * 4) == [(0, 2), (3, 1)]
    # all tied: no preference, no pair
    assert pairs_by_score([0.5, 0.5, 0.5], [True] * 3) == []
    # three left that all tie the first one left after a pair: they stay unpaired
    assert pairs_by_score([2.0, 1.0, 1.0, 1.0], [True] * 4) == [(0, 1)]
    # an unusable summary is skipped whatever its score (NaN is never read)
    assert pairs_by_score([math.nan, 3.0, 1.0, 5.0], [False, True, True, True]) == [(1, 2)]
    assert pairs_by_score([], []) == []
    with pytest.raises(ValueError, match="2 scores, 3 usable"):
        pairs_by_score([1.0, 2.0], [True] * 3)


def test_labelled_rows_by_hand():
    texts = [[" a b\n", " c\n", " d", " \n"], [" e\n", " f\n"]]
    usable = [[usable_summary(t) for t in group] for group in texts]
    assert usable == [[True, True, False, False], [True, True]]  # no end token; nothing said
    scores = [[0.2, 0.7, math.nan, math.nan], [-1.0, -1.0]]
    rows = labelled_rows(["P0", "P1"], texts, scores, usable)
    assert rows == [{"prompt": "P0", "chosen": " c", "rejected": " a b", "gold_chosen": 0.7, "gold_rejected": 0.2}]


# ----------------------------------------------------------------------------------------------------
# The whole path on real rows, tiny models


def run(module, argv: list[str]) -> None:
    module.main(parse_config(module.Config, argv))


COMMON = ["--dtype", "fp32", "--device", "cpu", "--wandb_mode", "disabled", "--max_prompt_len", "96"]
FRONTIER = ["--frontier_prompts", "3", "--frontier_samples", "2", "--frontier_max_new_tokens", "12"]
ARMS = {"beta0.1": ["--beta", "0.1"], "beta0.5": ["--beta", "0.5"]}


@torch.no_grad()
def direct_score(model, prompt: list[int], response: list[int]) -> float:
    """A reward model's normalized score of one prompt + response, one unpadded row (its own forward, none of
    rollouts.sampling's packing)."""
    ids = torch.tensor([prompt + response])
    raw = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool), len(prompt))
    return float(model.normalize(raw.double())[0])


@pytest.fixture(scope="module")
def gold_path(tmp_path_factory):
    """The procedure of docs/reporting.md (Gold from a reward model) on real TL;DR rows with tiny models."""
    from evaluation import frontier, label_pairs

    posts = str(shared_file("tldr-validation-sample.jsonl"))
    tmp = tmp_path_factory.mktemp("gold")
    human_pairs = str(tmp / "human_pairs.jsonl")  # the first 64 real comparisons
    lines = shared_file("tldr-preference-validation-sample.jsonl").read_text().splitlines(keepends=True)
    (tmp / "human_pairs.jsonl").write_text("".join(lines[:64]))
    sft = tmp / "sft" / "hf"
    end_biased_policy(sft)  # the policy every arm starts from (about half its summaries end by themselves)
    sizes = ["--batch_size", "8", "--micro_batch_size", "8", "--max_response_len", "24", "--lr", "1e-3"]
    sizes += ["--warmup_steps", "0", "--norm_prompts", "4", "--norm_samples_per_prompt", "2"]
    sizes += ["--norm_batch_size", "4", "--sft_policy", str(sft)]
    # 1. the gold reward model: larger than the proxy, trained on human pairs
    gold = tmp / "gold_rm"
    run(
        reward_model,
        ["--model", "small", "--random_init", "true", "--train_data", human_pairs, "--steps", "2", "--eval_every"]
        + ["-1", "--out_dir", str(gold), *sizes, *COMMON],
    )
    # 2. pairs of the policy's samples, labelled by the gold model
    pairs = tmp / "gold_pairs.jsonl"
    label_argv = ["--policy", str(sft), "--gold_model", str(gold / "hf"), "--prompts", human_pairs]
    label_argv += ["--n_prompts", "12", "--samples", "4", "--max_new_tokens", "24", "--max_prompt_len", "96"]
    counts = label_pairs.main(label_argv + ["--device", "cpu", "--out", str(pairs)])
    # 3. the proxy, on those labels: a fixed batch, so that its loss falls if it learns them
    proxy = tmp / "proxy_rm"
    run(
        reward_model,
        ["--model", "tiny", "--random_init", "true", "--train_data", str(pairs), "--steps", "3", "--eval_every", "-1"]
        + ["--overfit_batch", "true", "--out_dir", str(proxy), *sizes, *COMMON],
    )
    # 4. two arms (DPO at two betas on the gold-labelled pairs), two seeds each, measured with gold from the gold model
    measured = [*FRONTIER, "--frontier_data", posts, "--frontier_reward_model", str(proxy / "hf")]
    measured += ["--frontier_gold_model", str(gold / "hf")]
    runs = {}
    for arm, options in ARMS.items():
        for seed in (0, 1):
            out = tmp / arm / f"seed{seed}"
            argv = ["--model", str(sft), "--train_data", str(pairs), "--val_data", "", "--steps", "2"]
            argv += ["--batch_size", "4", "--micro_batch_size", "4", "--max_response_len", "24", "--lr", "2e-3"]
            argv += ["--eval_every", "1", "--seed", str(seed), "--out_dir", str(out), *options, *measured, *COMMON]
            run(dpo, argv)
            runs.setdefault(arm, []).append(out)
    # 5. best-of-n from the policy on the same posts, and the table, with gold from the gold model
    table = frontier.main(
        [str(d) for seeds in runs.values() for d in seeds]
        + ["--reference", str(sft), "--reward_model", str(proxy / "hf"), "--gold_model", str(gold / "hf")]
        + ["--data", posts, "--prompts", "3", "--best_of", "4", "--pool", "8", "--max_new_tokens", "12"]
        + ["--max_prompt_len", "96", "--out", str(tmp / "frontier.png"), "--tensorboard", "false"]
        + ["--pair", "beta=0.1", "beta=0.5"]
    )
    record = json.loads((tmp / "frontier.json").read_text())
    return SimpleNamespace(
        sft=sft, gold=gold / "hf", proxy=proxy, pairs=pairs, counts=counts, runs=runs, table=table, record=record
    )


def test_gold_models_labels_are_its_own_scores_of_what_the_proxy_reads(gold_path):
    rows = [json.loads(line) for line in gold_path.pairs.read_text().splitlines()]
    assert len(rows) == gold_path.counts["pairs"] >= 4 and gold_path.counts["usable"] < gold_path.counts["summaries"]
    tok, gold = get_tokenizer(), build_reward_model(str(gold_path.gold)).eval()
    for row in rows:
        assert row["gold_chosen"] > row["gold_rejected"]
        prompt = encode_prompt(tok, row["prompt"], 96)
        for side in ("chosen", "rejected"):
            expected = direct_score(gold, prompt, encode_response(tok, row[side], 24))
            assert row[f"gold_{side}"] == pytest.approx(expected, abs=1e-5)


def test_the_proxy_trained_on_the_gold_labels(gold_path):
    config = json.loads((gold_path.proxy / "config.json").read_text())
    assert config["train_data"] == str(gold_path.pairs)
    losses = [row["train/loss"] for row in read_metrics(gold_path.proxy) if "train/loss" in row]
    assert len(losses) == 3 and losses[2] < losses[0]  # one batch of the gold model's labels, learnt


def gold_of_samples(gold, prompts, samples, group: int) -> list[float]:
    """Per post, the mean of the gold model's direct_score of its `group` samples."""
    out = []
    for p, prompt in enumerate(prompts.prompts):
        rows = range(group * p, group * (p + 1))
        ids = [samples.response_ids[n][samples.response_mask[n]].tolist() for n in rows]
        out.append(sum(direct_score(gold, prompt, r) for r in ids) / group)
    return out


def test_the_gold_column_is_the_gold_models_score_of_the_samples(gold_path):
    """Every gold value is the gold model's: at step 0 each arm's policy is the SFT policy, whose frontier samples,
    drawn again with the evaluation's own generator and scored by the gold model one row at a time, give the gold
    column post by post; best-of-1's gold is the same for the pool of best-of-n's generator."""
    from model.weights import build_policy

    tok, gold = get_tokenizer(), build_reward_model(str(gold_path.gold)).eval()
    prompts = load_frontier_prompts(str(shared_file("tldr-validation-sample.jsonl")), "validation", 3, tok, 96, 12)
    policy = build_policy(str(gold_path.sft)).eval()
    for seed in (0, 1):
        _, _, samples = sample_summaries(policy, prompts.prompts, 2, 12, generator=stream(seed, 0, 0, "frontier"))
        expected = gold_of_samples(gold, prompts, samples, 2)
        for arm in ARMS:
            point = frontier_points(gold_path.runs[arm][seed])[0]
            assert point["step"] == 0 and point["posts"]["gold"] == pytest.approx(expected, abs=1e-5), (arm, seed)
            assert point["posts"]["proxy"] != pytest.approx(expected, abs=1e-3)  # the proxy is another model
    _, _, pool = sample_summaries(policy, prompts.prompts, 8, 12, generator=stream(0, 0, 0, "best-of-n"))
    best_of_1 = gold_path.record["best_of_n"][0]
    assert best_of_1["n"] == 1 and best_of_1["posts"]["gold"] == pytest.approx(gold_of_samples(gold, prompts, pool, 8))


def test_the_verdict_reads_gold_from_the_gold_model(gold_path):
    """The command's table has the gold column and every arm against best-of-n at its KL; the verdict's rows pair
    the two arms' two seeds post by post on the gold model's values."""
    record, table = gold_path.record, gold_path.table
    assert table.splitlines()[0] == "| policy | seeds | kl | kl bound | gold | proxy | win_rate |"
    assert [p["n"] for p in record["best_of_n"]] == [1, 2, 4] and len(record["methods"]) == 2
    assert "| beta=0.1 - best-of-n | " in table and "beyond best-of-n" not in table
    methods = {arm: [frontier_points(d) for d in dirs] for arm, dirs in gold_path.runs.items()}
    assert [[p["step"] for p in points] for seeds in methods.values() for points in seeds] == [[0, 1, 2]] * 4
    (pair,) = verdict_rows(methods, record["best_of_n"], [("beta0.1", "beta0.5")])
    assert pair["seeds"] == 2 and pair["posts"] == 3 and "note" not in pair, pair
    # --pair's row in the command's table: the same numbers, read from the same runs' gold values
    assert f"| beta=0.1 - beta=0.5 | {pair['kl']:.3f} | {pair['difference']:+.3f} | {pair['se_posts']:.3f} |" in table


def test_a_gold_model_that_is_the_proxy_is_refused(gold_path, tmp_path):
    proxy = str(gold_path.proxy / "hf")
    cfg = FrontierConfig(frontier_prompts=2, frontier_reward_model=proxy, frontier_gold_model=proxy + "/")
    with pytest.raises(ConfigError, match="--frontier_gold_model .* is the frontier's proxy"):
        cfg.validate_frontier()
    with pytest.raises(ConfigError, match="is the frontier's proxy"):  # dpo.py's --judge is the frontier's proxy
        FrontierConfig(frontier_gold_model=proxy).validate_frontier(stage_proxy=proxy)
    with pytest.raises(ConfigError, match="both give the gold reward"):
        FrontierConfig(
            frontier_gold_model=str(gold_path.gold), frontier_gold_fn="data.synthetic:gold_reward"
        ).validate_frontier()


# ----------------------------------------------------------------------------------------------------
# configs/verdict/tldr.toml


def tldr_verdict_runs() -> dict[str, tuple[str, list[str]]]:
    """arm -> (stage, its seed-0 command line) as docs/reporting.md expands configs/verdict/tldr.toml: the stage's
    configs/tldr/ file, [base.<stage>], the arm's options, then the measurement the verdict sets from [task]."""
    import tomllib

    from tests.conftest import ROOT

    verdict = tomllib.loads((ROOT / "configs" / "verdict" / "tldr.toml").read_text())
    task = verdict["task"]
    measured = {
        "frontier_prompts": verdict["posts"],
        "frontier_samples": verdict["samples"],
        "frontier_data": task["data"],
        "frontier_reward_model": task["proxy"],
        "frontier_gold_model": task["gold_model"],
        "frontier_max_new_tokens": task["max_new_tokens"],
    }
    runs = {}
    for arm, table in verdict["arms"].items():
        stage = table["stage"]
        (config,) = (ROOT / "configs" / "tldr").glob(f"{stage}.*")
        options = verdict["base"][stage] | {k: v for k, v in table.items() if k != "stage"} | measured
        options |= {"seed": 0, "out_dir": f"runs/{verdict['name']}/{arm}/seed0"}
        argv = ["--config", str(config)]
        argv += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]
        runs[arm] = (stage, argv)
    return runs


def test_the_tldr_verdicts_arms_are_valid_runs_measured_by_the_gold_model():
    import grpo

    scripts = {"grpo": grpo, "dpo": dpo}
    runs = tldr_verdict_runs()
    assert set(runs) == {"rso", "uniform", "plain8", "dpo"}
    for arm, (stage, argv) in runs.items():
        cfg = parse_config(scripts[stage].Config, argv)  # every option declared, of its type, and validated
        assert cfg.frontier_gold_model == "runs/gold_rm/hf" and cfg.frontier_reward_model == "runs/proxy_rm/hf", arm
        assert cfg.model == "runs/sft/hf" and cfg.frontier_prompts == 400, arm
        if stage == "grpo":
            assert cfg.reward_model == cfg.frontier_reward_model  # GRPO trains on the proxy the table reads
        else:
            assert cfg.train_data == "runs/gold_pairs/train.jsonl"  # DPO on the gold model's labels

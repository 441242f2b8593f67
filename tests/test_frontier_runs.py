"""The reward-KL frontier end to end on random tiny models: a tiny `demo.py --frontier_seeds` run and a tiny verdict
run, what the frontier's command lines draw and check, and the selection signal
(evaluation/selection_signal.py) by hand, on normal pools and on tiny models. The estimators' own tests:
tests/test_frontier.py."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.synthetic import write_task
from evaluation.frontier import frontier_table
from evaluation.matched import frontier_points
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.heads import RewardModel
from model.weights import save_hf

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# A tiny frontier run: demo.py --frontier_seeds on random tiny models


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """A demo folder holding what --reuse reads: a random tiny SFT policy, random reward model, labelled pairs."""
    out = tmp_path_factory.mktemp("frontier") / "demo"
    paths = write_task(out / "data", seed=0)
    torch.manual_seed(0)
    save_hf(GPT2LMHeadModel(PRESETS["tiny"]).state_dict(), PRESETS["tiny"], out / "sft" / "hf")
    save_hf(RewardModel(PRESETS["tiny"], "sum").state_dict(), PRESETS["tiny"], out / "rm" / "hf", reward_pooling="sum")
    (out / "data" / "policy_pairs").mkdir(parents=True)
    shutil.copy(paths["preference_train"], out / "data" / "policy_pairs" / "train.jsonl")
    shutil.copy(paths["preference_validation"], out / "data" / "policy_pairs" / "validation.jsonl")
    return out


@pytest.mark.slow  # four processes: the demo, GRPO twice, DPO
def test_a_tiny_frontier_run(tiny_demo, tmp_path):
    cmd = [sys.executable, "demo.py", "--out", str(tiny_demo), "--reuse", "--assets", str(tmp_path)]
    cmd += ["--frontier_seeds", "1", "--frontier_dpo_betas", "0.1", "--frontier_grpo_betas", "0.4"]
    cmd += ["--frontier_dpo_steps", "2", "--grpo_steps", "2", "--frontier_prompts", "4", "--frontier_samples", "2"]
    cmd += ["--frontier_best_of", "4", "--frontier_grpo_samples", "8", "--frontier_eval_rows", "8"]
    cmd += ["--wandb_mode", "disabled"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "frontier.png").stat().st_size > 0
    record = json.loads((tiny_demo / "frontier" / "frontier.json").read_text())
    assert [p["n"] for p in record["best_of_n"]] == [1, 2, 4]
    assert set(record["methods"]) == {"GRPO rso 8->8, beta 0.4", "GRPO uniform 8->8, beta 0.4", "DPO beta 0.1"}
    for name, seeds in record["methods"].items():
        points = seeds[0]
        # every evaluation: before the first step, then GRPO's every --eval_every, DPO's every third of its steps (1)
        assert [p["step"] for p in points] == ([0, 1, 2] if name.startswith("DPO") else [0, 2]), name
        assert points[0]["kl"] == pytest.approx(0.0, abs=1e-5), name  # the policy is its reference at step 0
        for p in points:
            assert {"kl", "kl_se", "gold", "gold_se", "proxy", "proxy_raw", "win_rate"} <= set(p), name
    grpo = frontier_points(tiny_demo / "frontier" / "grpo_rso_beta0.4" / "seed0")
    assert grpo == record["methods"]["GRPO rso 8->8, beta 0.4"][0]
    for p in grpo + record["best_of_n"]:  # per-post values on the 4 posts, averaging to the point
        assert len(p["posts"]["gold"]) == 4 and p["gold"] == pytest.approx(sum(p["posts"]["gold"]) / 4)
    text = (tiny_demo / "frontier" / "frontier.md").read_text()
    assert text.strip() == frontier_table(record["best_of_n"], record["methods"]).strip()
    assert "| DPO beta 0.1 | 1 |" in text and "best-of-4" in text
    assert "| DPO beta 0.1 - best-of-n |" in text and "| best-of-n | d (alpha - beta d) |" in text
    # the picture and its table as TensorBoard events beside the runs (their own event files are in their folders)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_demo / "frontier"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [i.encoded_image_string for i in events.Images("frontier")] == [(tmp_path / "frontier.png").read_bytes()]
    (table,) = events.Tensors("frontier/table")
    assert "DPO beta 0.1 | 1 |" in table.tensor_proto.string_val[0].decode()


TINY_VERDICT = """# RLOO against GRPO's advantage, both keeping all 8 samples per prompt, and DPO: a contrast of its own
name = "rloo_verdict"
seeds = 1
posts = 6
samples = 2
pool = 8
best_of = 4
pairs = [["rloo", "grpo"], ["rloo", "dpo"]]

[base.grpo]
steps = 2
selection = "all"
num_samples = 8
val_rows = 8
pref_rows = 8

[base.dpo]
steps = 2
eval_every = 1
val_rows = 8

[arms.rloo]
stage = "grpo"
advantage = "rloo"

[arms.grpo]
stage = "grpo"
advantage = "grpo"
global_norm = false

[arms.dpo]
stage = "dpo"
beta = 0.3
"""


@pytest.mark.slow  # four processes: the demo and three runs, one per arm
def test_a_tiny_verdict_run(tiny_demo, tmp_path):
    """A verdict from a file of its own (not the package's): its arms' options reach their runs; its tables, written
    after the round of seeds, pair its arms and each against best-of-n on its posts; --reuse again runs nothing and
    writes the same tables from the runs it finds."""
    verdict = tmp_path / "rloo.toml"
    verdict.write_text(TINY_VERDICT)
    cmd = [sys.executable, "demo.py", "--verdict", str(verdict), "--out", str(tiny_demo), "--reuse"]
    cmd += ["--assets", str(tmp_path), "--wandb_mode", "disabled"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pictures = ("rloo_verdict.png", "rloo_verdict_forest.png", "rloo_verdict_compute.png")  # named for the verdict
    for picture in pictures:
        assert (tmp_path / picture).stat().st_size > 10_000
    # redrawn from the folder's record alone (verdict_record.json), without training: the demo's pictures
    replot = [sys.executable, "-m", "evaluation.plots", "--verdict", str(tiny_demo / "rloo_verdict")]
    replot += ["--out", str(tmp_path / "replot"), "--title", "embedded task"]
    done = subprocess.run(replot, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for picture in pictures:
        assert (tmp_path / "replot" / picture).read_bytes() == (tmp_path / picture).read_bytes(), picture
    root = tiny_demo / "rloo_verdict"
    options = {arm: json.loads((root / arm / "seed0" / "experiment_run.json").read_text()) for arm in ("rloo", "grpo")}
    assert options["rloo"]["options"]["advantage"] == "rloo" and options["grpo"]["options"]["global_norm"] == "false"
    assert {r["options"]["num_samples"] for r in options.values()} == {"8"}
    record = json.loads((root / "verdict.json").read_text())
    arms = ["rloo", "grpo", "dpo"]
    assert list(record["methods"]) == arms and [p["n"] for p in record["best_of_n"]] == [1, 2, 4]
    assert [p["step"] for p in record["methods"]["dpo"][0]] == [0, 1, 2]  # --eval_every 1 of [base.dpo]
    for seeds in record["methods"].values():
        assert len(seeds[0][-1]["posts"]["gold"]) == 6  # every run measured on the verdict's six posts
    pairs = [row["pair"] for row in record["rows"]]
    assert pairs == ["rloo - grpo", "rloo - dpo"] + [f"{arm} - best-of-n" for arm in arms], pairs
    text = (root / "verdict.md").read_text()
    # final (one round of one seed), each row read at its matched KL, the pairs also at the common KL, the families
    assert text.startswith("Final: after the last round of seeds, every arm's 1 seed.\n\n| pair (gold, A - B) |")
    assert "| rloo - grpo | " in text and " (matched) | " in text and "(pairs) |" in text and "(best-of-n) |" in text
    common = min(points[-1]["kl"] for seeds in record["methods"].values() for points in seeds)
    assert f" at KL {common:.3f} |" in text  # the smallest final KL of the paired arms (all three here)
    # the record beside it: no per-post values, and verdict.md's text rebuilt from it alone
    from evaluation.verdict_report import RECORD, read_record, report

    assert (root / RECORD).stat().st_size < 50_000 and '"posts":{' not in (root / RECORD).read_text()
    assert report(read_record(root))[0] + "\n" == text
    kept = text[text.index("What each GRPO arm's selection kept") :].splitlines()
    assert kept[2].startswith("| arm | runs | rs/kept_mean_shift |") and [r.split(" | ")[0] for r in kept[4:]] == [
        "| rloo",
        "| grpo",
    ]  # the GRPO arms' selection diagnostics, DPO's none
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    for picture in pictures[:2]:  # the verdict's picture and its forest plot beside it
        (image,) = events.Images(picture.removesuffix(".png"))
        assert image.encoded_image_string == (tmp_path / picture).read_bytes()
    # --reuse again: every run finished with these options, so none runs and the tables are written again from them
    (root / "verdict.md").unlink()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("(finished with these options)") == len(arms) and "\n$ " not in again.stdout
    assert (root / "verdict.md").read_text() == text


def test_compare_draws_evaluation_metrics_against_eval_kl_by_default(tmp_path, monkeypatch):
    """A run that logged eval/kl (--frontier_prompts) is drawn against it, not against the per-step train/kl."""
    from evaluation import compare
    from utils.logging import Logger

    log = Logger(tmp_path / "run", {"seed": 0}, "test", "run", "disabled", enabled=True)
    for step in (1, 2, 3):
        row = {"train/kl": 0.5 * step}
        if step != 2:
            row |= {"eval/kl": 0.1 * step, "eval/kl_se": 0.01, "eval/gold": 2.0 + step}
        log.log(row, step=step)
    log.finish()
    drawn = {}
    monkeypatch.setattr(compare, "plot", lambda groups, metrics, out, x, smooth: drawn.update(metrics=metrics, x=x))
    text = compare.main([str(tmp_path / "run"), "--out", str(tmp_path / "c.png"), "--tensorboard", "false"])  # no PNG
    assert drawn == {"metrics": ["eval/gold", "train/kl"], "x": "eval/kl"}
    assert "eval/gold (final)" in text
    groups = compare.group_runs([compare.load_run(tmp_path / "run")])
    fig = compare.figure(groups, ["eval/gold"], x="eval/kl")
    path = fig.axes[1].lines[0]
    assert list(path.get_xdata()) == pytest.approx([0.1, 0.3]) and list(path.get_ydata()) == [3.0, 5.0]


def test_the_command_line_draws_runs_without_a_gold_reward(tiny_demo, tmp_path, capsys):
    """python -m evaluation.frontier on two seeds of a run that logged the frontier, on prompts with reference
    summaries and no gold reward: best-of-n from the reference, proxy and win rate in the table; a run that did not
    measure the frontier is one line naming it."""
    from evaluation import frontier
    from evaluation.compare import CompareError
    from utils.logging import Logger

    runs = []
    for seed in (0, 1):
        log = Logger(tmp_path / f"seed{seed}", {"seed": seed, "beta": 0.1}, "test", "run", "disabled", enabled=True)
        for step in (0, 5):
            values = {"kl": 0.1 * step, "proxy": 0.2 * step + seed, "proxy_raw": 0.0, "win_rate_sampled": 0.5}
            log.log({f"eval/{k}": v for k, v in values.items()} | {f"eval/{k}_se": 0.01 for k in values}, step=step)
        log.finish()
        runs.append(str(tmp_path / f"seed{seed}"))
    data = str(tiny_demo / "data" / "sft" / "validation.jsonl")
    common = ["--reference", str(tiny_demo / "sft" / "hf"), "--reward_model", str(tiny_demo / "rm" / "hf")]
    common += [
        "--data",
        data,
        "--prompts",
        "3",
        "--best_of",
        "2",
        "--pool",
        "4",
        "--max_new_tokens",
        "6",
        "--max_prompt_len",
        "192",
    ]
    text = frontier.main([*runs, *common, "--out", str(tmp_path / "f.png")])
    assert text.splitlines()[0] == "| policy | seeds | kl | kl bound | proxy | win_rate |"
    assert "| best-of-2 (reference, pool 4) | | " in text and " | 0.193 | " in text  # the bound beside the estimate
    row = "| all runs | 2 | 0.500 ± 0.000 (se 0.010) | | 1.500 ± 0.707 (se 0.010) | 0.500 ± 0.000 (se 0.010) |"
    assert row in text
    assert "paired" not in text and "A - B" not in text  # runs without per-post values: no paired comparisons
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "f.json").is_file()
    # best-of-n alone (no runs): its table, the picture, and its TensorBoard events beside the picture
    alone = frontier.main([*common, "--out", str(tmp_path / "alone" / "b.png")])
    assert "| best-of-2 (reference, pool 4) | | " in alone and "all runs" not in alone
    assert (tmp_path / "alone" / "b.png").stat().st_size > 0 and list((tmp_path / "alone").glob("events.out.*"))
    Logger(tmp_path / "plain", {"seed": 0}, "test", "run", "disabled", enabled=True).finish()
    with pytest.raises(CompareError, match="plain: no eval/kl in its metrics.jsonl"):
        frontier.main([str(tmp_path / "plain"), *common, "--out", ""])


def test_frontier_points_read_a_torn_last_line_and_a_missing_standard_error(tmp_path):
    # a kill mid-write leaves a torn last line; a standard error of one prompt and one sample is NaN, which the logger
    # does not write (utils.logging keeps finite values only): the points read it as NaN
    rows = [{"step": 0, "eval/kl": 0.0, "eval/gold": 0.5}, {"step": 1, "eval/kl": 0.1, "eval/kl_se": 0.01}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "eval/k'
    (tmp_path / "metrics.jsonl").write_text(text)
    points = frontier_points(tmp_path)
    assert [p["step"] for p in points] == [0, 1]
    assert points[0]["kl"] == 0.0 and math.isnan(points[0]["kl_se"]) and math.isnan(points[0]["gold_se"])
    assert points[1]["kl_se"] == 0.01 and "gold" not in points[1]


def test_the_command_line_checks_each_models_kind_in_one_line(tiny_demo, tmp_path):
    # a reward model as --reference, a policy as --reward_model: one line naming the option, exit 2, no traceback
    run = tmp_path / "run"
    run.mkdir()
    sft, rm = str(tiny_demo / "sft" / "hf"), str(tiny_demo / "rm" / "hf")
    data = str(tiny_demo / "data" / "sft" / "validation.jsonl")
    for reference, reward_model, option in ((rm, rm, "--reference"), (sft, sft, "--reward_model")):
        cmd = [sys.executable, "-m", "evaluation.frontier", str(run), "--reference", reference]
        cmd += ["--reward_model", reward_model, "--data", data, "--out", str(tmp_path / "f.png")]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {option} "), done.stderr[
            -2000:
        ]


def odd_length(prompt: str, summary: str) -> float:
    """A gold reward of two values for the selection signal's case worked by hand
    ("tests.test_frontier_runs:odd_length")."""
    return float(len(summary) % 2)


def test_selection_signal_by_hand_and_in_any_order(tiny_demo, tmp_path):
    """--reward gold (the null: gold is the training reward) with a gold of two values, a pool of 2, both kept, grpo
    advantages: a pool whose gold differs has kept gold 0, 1 about the mean 1/2 with advantages -+c, so sum A (gold -
    m_G) = c; a tied pool has advantages 0 and adds 0. In a batch where a fraction f of the pools differ, rms = c sqrt f
    and s_pool = sqrt(f / 2): each differing post's signal is c / (2 c sqrt f sqrt(f / 2)) = 1 / (sqrt 2 f) and the
    batch's mean exactly 1 / sqrt 2, positive, whatever f, so its error over batches is 0 (over posts it would not be:
    the posts' values are 0 and 1 / (sqrt 2 f)). Reward = gold: the kept correlation and slope are 1. Then each
    selection draws from its own generator, so its row is the same whichever order --selections names them in."""
    from evaluation.selection_signal import main

    data = ["--data", str(tiny_demo / "data" / "sft" / "validation.jsonl"), "--prompts", "6", "--prompts_per_step", "4"]
    models = ["--policy", str(tiny_demo / "sft" / "hf"), "--reward_model", str(tiny_demo / "rm" / "hf")]
    out = tmp_path / "signal.json"
    hand = [*models, *data, "--gold_fn", "tests.test_frontier_runs:odd_length", "--reward", "gold", "--pool", "2"]
    main([*hand, "--kept", "2", "--selections", "all", "--out", str(out)])
    saved = json.loads(out.read_text())
    (row,) = saved["rows"]
    assert saved["settings"]["reward"] == "gold" and row["posts"] > 0
    assert row["signal"] == pytest.approx([1 / math.sqrt(2), 0.0], abs=1e-9), row["signal"]
    assert row["corr"][0] == pytest.approx(1, abs=1e-12) == row["slope"][0]

    args = [*models, *data, "--gold_fn", "data.synthetic:gold_reward", "--pool", "8", "--kept", "4", "--draws", "2"]
    rows = {}
    for order in (["uniform", "rso:2", "top"], ["top", "rso:2", "uniform"]):
        main([*args, "--selections", *order, "--out", str(out)])
        rows[order[0]] = {row["selection"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["uniform"] == rows["top"], (rows["uniform"], rows["top"])


def test_selection_signal_null_on_normal_pools():
    """The null of --reward gold on normal pools: reward = gold exactly (no reward-model error at all), 8 of 64 kept,
    grpo advantages with global normalization over batches of 16, as the tool's defaults. The gold signal still falls
    as selection tilts (uniform, RSO at beta_rs 0.5, top: about -0.5 for top against uniform, issue 63), by range
    restriction alone, so a row's signal means nothing until read against this null's; the kept slope of gold on the
    reward reads 1 for every selection (no reward-model error at the top end or anywhere)."""
    from evaluation.selection_signal import selection_stats

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1024, 64, generator=g, dtype=torch.float64)
    logp = torch.zeros_like(pool)
    got = {}
    for name, beta in (("uniform", 0.0), ("rso", 2.0), ("rso", 0.5), ("top", 0.0), ("top_bottom", 0.0)):
        gen = torch.Generator().manual_seed(1)
        stats = selection_stats(pool, pool, logp, name, beta, 8, "grpo", True, 16, 2, gen)
        got[name, beta] = {k: float(v.nanmean()) for k, v in stats.items()}
        assert (stats["slope"] - 1).abs().max() < 1e-9 and (stats["corr"] - 1).abs().max() < 1e-9, name
    signal = {k: v["signal"] for k, v in got.items()}
    assert signal["top", 0.0] < signal["rso", 0.5] < signal["uniform", 0.0] < signal["top_bottom", 0.0], signal
    assert -0.6 < signal["top", 0.0] - signal["uniform", 0.0] < -0.4, signal  # -0.51 on this draw
    assert -0.3 < signal["rso", 0.5] - signal["uniform", 0.0] < -0.15, signal  # -0.23
    assert abs(signal["rso", 2.0] - signal["uniform", 0.0]) < 0.03, signal


def test_selection_signal_on_tiny_models(tiny_demo, tmp_path):
    """evaluation/selection_signal.py end to end on the tiny random models: one row per selection, the whole pool's
    row at no shift and the pool's own spread, the top K above the pool's mean, the paired
    difference to uniform, the JSON; a bad --selections entry is one ConfigError naming it."""
    from evaluation.selection_signal import main
    from utils.config import ConfigError

    out = tmp_path / "signal.json"
    args = ["--policy", str(tiny_demo / "sft" / "hf"), "--reward_model", str(tiny_demo / "rm" / "hf")]
    args += ["--data", str(tiny_demo / "data" / "sft" / "validation.jsonl"), "--gold_fn", "data.synthetic:gold_reward"]
    args += ["--prompts", "6", "--pool", "8", "--kept", "4", "--draws", "2", "--prompts_per_step", "4"]
    text = main([*args, "--selections", "uniform", "rso:2", "top", "top_bottom", "all", "--out", str(out)])
    saved = json.loads(out.read_text())
    rows = {row["selection"]: row for row in saved["rows"]}
    assert list(rows) == ["uniform", "rso:2", "top", "top_bottom", "all"]
    assert text.count("\n| ") == 1 + 1 + 5 - 1 and "gold signal - uniform's" in text  # heading, rule, 5 rows
    assert rows["all"]["reward_shift"][0] == 0 == rows["all"]["logp_shift"][0]
    assert abs(rows["all"]["gold_std_ratio"][0] - 1) < 1e-12
    assert rows["top"]["reward_shift"][0] > max(0.0, rows["uniform"]["reward_shift"][0])  # the top K lie above
    assert "signal_minus_baseline" in rows["top"] and "signal_minus_baseline" not in rows["uniform"]
    assert saved["settings"]["pool"] == 8 and -1 <= saved["settings"]["pool_corr"] <= 1
    for bad, match in (("best", "unknown selection 'best'"), ("rso", "RSO needs beta_rs > 0"), ("rso:x", "a number")):
        with pytest.raises(ConfigError, match=match):
            main([*args, "--selections", bad, "--out", str(out)])

"""Every metric the code logs is declared (utils/metrics.py) and listed in its stage's docs: tiny runs of every stage
and of eval_preferences.py, with the options that add metrics (--judge, --frontier_prompts, the gold functions,
dynamic sampling, --kl_in reward, --rollout_correction, two policy epochs), and the names they logged; their
directions and the stages' headlines are pinned."""

import json
import re
from pathlib import Path

import pytest

import dpo
import eval_preferences
import grpo
import reward_model
import sft
from tests.golden.stages import DATA, configurations
from utils.metrics import DECLARED_FILE, find, headlines, metric_direction


def run(module, argv: list[str]) -> None:
    module.main(module.parse_config(module.Config, argv))


def logged_names(folder: Path) -> tuple[set[str], dict]:
    """The metrics a run logged (metrics.jsonl) and the declarations it recorded beside them."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {k for row in rows for k in row} - {"step"}, json.loads((folder / DECLARED_FILE).read_text())


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict[str, tuple[set[str], dict]]:
    """stage -> the metric names its tiny runs logged and the declarations recorded beside them (the golden
    configurations, plus every option that adds metrics)."""
    tmp = tmp_path_factory.mktemp("metrics")
    stages = configurations()
    rm = tmp / "reward_model"
    run(reward_model, stages["reward_model"][1](rm)[1:])
    judge = ["--judge", str(rm / "hf"), "--summary_data", str(DATA / "sft" / "validation.jsonl")]
    judge += ["--summary_split", "validation", "--summary_rows", "2"]
    frontier = ["--frontier_prompts", "2", "--frontier_samples", "2", "--frontier_max_new_tokens", "6"]
    gold = ["--gold_reward_fn", "data.synthetic:gold_reward", "--gold_parts_fn", "data.synthetic:gold_parts"]
    run(sft, stages["sft"][1](tmp / "sft")[1:] + judge)
    run(dpo, stages["dpo"][1](tmp / "dpo")[1:] + judge + frontier + ["--frontier_reward_model", str(rm / "hf")])
    extra = ["--min_group_std", "0.01", "--kl_in", "reward", "--rollout_correction", "tis", "--policy_epochs", "2"]
    grpo_argv = stages["grpo_rso"][1](tmp / "grpo")[1:] + frontier + gold + extra
    run(grpo, grpo_argv + ["--steps", "2", "--eval_every", "2", "--entropy_coef", "0.01"])
    evaluated = tmp / "eval_preferences"
    pairs = ["--val_data", str(DATA / "preference" / "validation.jsonl"), "--val_split", "validation"]
    pairs += ["--out_dir", str(evaluated), "--device", "cpu", "--wandb_mode", "disabled"]
    run(eval_preferences, ["--reward_model", str(rm / "hf"), *pairs])
    names = {stage: logged_names(tmp / stage) for stage in ("sft", "reward_model", "dpo", "grpo")}
    return names | {"eval_preferences": logged_names(evaluated)}


# Every direction, as summary.json and compare.py use it: these are best at their minimum, counts and interval bounds
# have none, every other metric is best at its maximum (the directions the earlier name rule gave, kept).
MINIMIZED = {
    "eval/kl", "eval/kl_se", "eval/gold_se", "eval/proxy_se", "eval/proxy_raw_se", "eval/win_rate_sampled_se",
    "eval/sampled_length", "eval/response_length", "eval/pref_bt_loss", "val/bt_loss", "eval/bt_loss", "val/loss",
    "train/loss", "train/kl", "train/epoch_1/kl", "train/epoch_2/kl", "train/grad_norm", "train/ratio_deviation",
    "train/epoch_1/ratio_deviation", "train/epoch_2/ratio_deviation",
    "train/mismatch/max_abs_log_gap", "train/mismatch/mean_abs_log_gap", "train/mismatch/outside_band_fraction",
    "train/outside_top_k_p_fraction", "train/skipped", "sample/response_length", "sample/selected_response_length",
    "sample/dropped_group_fraction", "reward/kl_penalty_mean", "gold/items_invented", "perf/step_seconds",
    "perf/advantages_seconds", "perf/generate_seconds", "perf/reference_seconds", "perf/sample_seconds",
    "perf/score_seconds", "perf/select_seconds", "perf/update_seconds", "val/win_rate_se",
    "train/logprob_gap_to_sampler",
}  # fmt: skip
# No best either: grpo.py's preference counts (eval/pref_n_pairs, ...), the judge's posts, the selection's rounds and
# what it kept against its pool (a description of the selection, not a goal), the learning rate and the reward
# model's normalisation fit (a property of the SFT samples, not a goal).
COUNTS = {"eval/pref_n_pairs", "eval/pref_n_ties", "eval/pref_n_chosen_longer", "eval/pref_n_chosen_not_longer"}
COUNTS |= {"eval/summary_prompts", "rs/rounds_mean", "rs/rounds_max", "train/lr"}
COUNTS |= {"rs/kept_mean_shift", "rs/kept_std_ratio", "rs/pool_group_std", "rs/kept_ess", "rs/tied_group_fraction"}
COUNTS |= {f"norm/{n}" for n in ("raw_mean", "raw_std", "samples", "end_rate", "gain", "bias")}


def test_every_logged_metric_keeps_its_direction(logged):
    for stage, (names, _) in logged.items():
        for name in sorted(names):
            last = name.split("/")[-1]
            no_best = last.startswith("n_") or "_ci_" in last or name in COUNTS
            want = None if no_best else "min" if name in MINIMIZED else "max"
            assert metric_direction(name) == want, (stage, name)


def test_headlines_are_the_stages_own():
    assert {stage: headlines(stage) for stage in ("sft", "reward_model", "dpo", "grpo")} == {
        "sft": ("train/loss", "val/loss", "val/win_rate", "val/win_rate_ci_low", "val/win_rate_ci_high"),
        "reward_model": ("train/loss", "train/accuracy", "val/accuracy", "val/accuracy_ci_low", "val/accuracy_ci_high"),
        "dpo": (
            "train/loss", "train/reward_margin", "val/accuracy", "val/accuracy_ci_low", "val/accuracy_ci_high",
            "val/win_rate", "val/win_rate_ci_low", "val/win_rate_ci_high",
        ),
        "grpo": (
            "reward/mean", "train/kl", "eval/reward", "eval/win_rate", "eval/win_rate_ci_low", "eval/win_rate_ci_high",
            "eval/pref_accuracy", "eval/end_fraction", "eval/response_length",
        ),
    }  # fmt: skip


DOCS = {"sft": "sft.md", "reward_model": "reward_dpo.md", "dpo": "reward_dpo.md", "eval_preferences": "reward_dpo.md"}


def test_every_logged_metric_is_declared_and_recorded_in_its_run(logged, tmp_path):
    """Each metric a stage logs has a declaration (a direction and what it measures), and the run's folder holds it
    (metrics_declared.json, from which evaluation/compare.py reads the direction)."""
    for stage, (names, declared) in logged.items():
        for name in sorted(names):
            assert find(name) is not None, f"{stage} logs {name} without a declaration (utils.metrics.metric)"
            assert declared.get(name) == {"direction": find(name).direction, "help": find(name).help}, (stage, name)


def documented(text: str) -> set[str]:
    """The metric names a docs page lists: in backticks, each a name or a family ({part} or <part> for a part)."""
    return {re.sub(r"<(\w+)>", r"{\1}", name) for name in re.findall(r"`([a-z_]+/[a-z0-9_/{}<>]+)`", text)}


def test_every_logged_metric_is_in_its_stages_docs(logged):
    """Each metric a stage logs is listed in its stage's docs page (docs/grpo.md's metric table, docs/sft.md,
    docs/reward_dpo.md): by its name, or by its declared family (reward/<source>_mean)."""
    root = Path(__file__).resolve().parents[1]
    for stage, (names, _) in logged.items():
        listed = documented((root / "docs" / DOCS.get(stage, f"{stage}.md")).read_text())
        missing = sorted(name for name in names if name not in listed and find(name).name not in listed)
        assert not missing, f"docs/{DOCS.get(stage, stage + '.md')} does not list {stage}'s metrics {missing}"


def test_the_metrics_docs_list_are_declared():
    """A metric the docs name (under one of the stages' prefixes) is declared: a renamed or retired one leaves no
    stale line."""
    import evaluation.compare  # noqa: F401 (GRPO's and the evaluations' declarations)

    root = Path(__file__).resolve().parents[1]
    for page in sorted(set(DOCS.values()) | {"grpo.md"}):
        for name in documented((root / "docs" / page).read_text()):
            if name.split("/")[0] in {"train", "val", "eval", "reward", "rs", "sample", "perf", "gold", "norm"}:
                concrete = re.sub(r"\{\w+\}", "x", name)
                assert find(name) is not None or find(concrete) is not None, f"docs/{page}: {name} is not declared"


def test_every_declared_metric_is_in_the_docs():
    """Every metric the code declares (the scripts and the packages they import) is listed in the docs, by its name
    or its family's: one whose option no tiny run above sets is covered too."""
    import evaluation.compare  # noqa: F401
    from utils.metrics import METRICS

    root = Path(__file__).resolve().parents[1]
    listed = set().union(*(documented((root / "docs" / page).read_text()) for page in {*DOCS.values(), "grpo.md"}))
    assert not sorted(name for name in METRICS if name not in listed and not name.startswith("test_only/"))

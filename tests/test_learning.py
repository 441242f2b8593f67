"""Each stage learns what it should: the whole demo pipeline on the embedded task, with the demo's defaults.

Thresholds come from demo runs (docs/results.md records every field), set below the worst of three seeds with a
margin: the reward model and DPO beat chance on held-out pairs, and GRPO raises the gold reward of sampled summaries
over the SFT policy's. The other tests hold what the gold reward is for: the SFT policy copies key items from the post
(at chance it names about 0.08 per summary; its likelihood prefers the post's item to an invented one), the reward
model and DPO check a summary's items against the post (the swap probe), DPO names more key items than SFT and invents
fewer, GRPO names more key items than SFT, and no summary without content (empty, generic, filler) scores as high as
the SFT policy's samples. Not tested, because it does not hold on every run: that GRPO invents no more items than SFT
(five runs of three seeds: -0.083 to +0.034 per summary; +0.034 on one of the three runs of seed 0, where GRPO named
more items at the SFT policy's precision; docs/results.md). Two-thread runs of seed 0 from two checkouts of the
same code can differ (SFT's losses part at step 8, at 1e-7, docs/results.md), so a seed alone does not fix a run.
The run is the demo's own: on half its SFT schedule (five seeds, docs/results.md) the SFT policy scored below an empty
summary on three seeds and GRPO's and DPO's extra items fell within noise on some, so a shorter run would test less.
"""

import json
import math
import sys

import pytest

from data.synthetic import END, SUMMARIES, mean_gold_reward
from tests.conftest import SUITE_UNSET, run_script

RM_ACCURACY_MIN = 0.55  # chance is 0.5; seven runs of three seeds: 0.66 to 0.78 on 256 held-out pairs
DPO_ACCURACY_MIN = 0.55  # seven runs: 0.61 to 0.70
GRPO_GOLD_GAIN_MIN = 0.1  # grpo_gold_reward - sft_gold_reward (gold rewards lie in [-3, 4]); seven runs: 0.16 to 0.39
SFT_ITEMS_CORRECT_MIN = 1.0  # key items named per summary; seven runs: 1.43 to 2.27; at chance (300 SFT steps) 0.08
# the swap probe, 1,233 held-out pairs (standard error 0.014 at 0.65): the reward model beats chance by more than three
# standard errors; seven runs of three seeds: 0.636 to 0.851 (0.636 on a run of seed 0 whose SFT parted from the
# usual one by a rounding at step 2, docs/results.md). DPO: seven runs 0.85 to 0.89
RM_SWAP_ACCURACY_MIN = 0.55
DPO_SWAP_ACCURACY_MIN = 0.65
# (a last-token reward model without swap pairs: 0.48 to 0.52, chance)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[dict, object]:
    """The demo's summary.json, its assets folder and its run folder: one run shared by every test here."""
    tmp_path = tmp_path_factory.mktemp("demo")
    out = tmp_path / "demo"
    run_script(
        ["demo.py", "--out", str(out), "--assets", str(tmp_path / "assets"), "--wandb_mode", "disabled"],
        timeout=3600,  # alone 499 s on the AMD EPYC Zen 4 (make check, 6fbf1d4); make demo ~20 min on the AVX2 kind
        # make demo's two threads, which wait for each other without spinning (OMP_WAIT_POLICY=passive): make check runs
        # this file alone, where passive threads are as fast as spinning ones; run beside other tests (pytest -n 2 over
        # the whole folder), two spinning threads would each wait for the other's core
        env={"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"},
        unset=SUITE_UNSET,  # the demo's own memory settings, as `make demo` runs it
    )
    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps(summary, indent=2), file=sys.stderr)
    return summary, tmp_path / "assets", out


@pytest.mark.slow
def test_demo_pipeline_learns_on_the_embedded_task(demo):
    summary, assets, _ = demo
    assert summary["rm_accuracy"] > RM_ACCURACY_MIN, summary
    assert summary["dpo_accuracy"] > DPO_ACCURACY_MIN, summary
    assert summary["grpo_gold_reward"] - summary["sft_gold_reward"] > GRPO_GOLD_GAIN_MIN, summary
    for name in ("pipeline.png", "demo_curves.png"):
        assert (assets / name).stat().st_size > 10_000


@pytest.mark.slow
def test_sft_copies_and_grpo_names_more_key_items(demo):
    summary, _, _ = demo
    assert summary["sft_items_correct"] > SFT_ITEMS_CORRECT_MIN, summary
    assert summary["sft_swap_accuracy"] > 0.9, (
        summary
    )  # the policy's likelihood picks the post's item over an invented one
    assert summary["grpo_items_correct"] > summary["sft_items_correct"], summary


@pytest.mark.slow
def test_reward_model_and_dpo_check_items_against_the_post(demo):
    """The reward model (summed head, trained with swap pairs) and DPO's implicit reward prefer a summary to the same
    summary with one key item swapped for an invented one, and DPO names more key items than SFT (seven runs: +0.21
    to +0.33 per summary) and invents fewer (-0.04 to -0.31)."""
    summary, _, _ = demo
    assert summary["rm_swap_accuracy"] > RM_SWAP_ACCURACY_MIN, summary
    assert summary["dpo_swap_accuracy"] > DPO_SWAP_ACCURACY_MIN, summary
    # the appended-item probe ran (its sign is the reward model's, either way: docs/results.md)
    assert all(math.isfinite(summary[k]) for k in ("rm_append_correct", "rm_append_invented")), summary
    assert summary["dpo_items_invented"] < summary["sft_items_invented"], summary
    assert summary["dpo_items_correct"] > summary["sft_items_correct"], summary


@pytest.mark.slow
def test_no_summary_without_content_beats_the_sft_policy(demo):
    """An empty summary, a generic one, or one padded with filler scores below the trained SFT policy's mean gold
    reward on the demo's own held-out prompts: the gold reward cannot be won without naming the post's items."""
    summary, _, out = demo
    prompts = [json.loads(line)["prompt"] for line in open(out / "data" / "sft" / "validation.jsonl")][:128]
    generic = [END, " need advice" + END, " please help" + END, " so basically" + END]
    generic += [" " + text + END for text in SUMMARIES[""]]
    for text in generic:
        assert mean_gold_reward(prompts, [text] * len(prompts)) < summary["sft_gold_reward"], (text, summary)

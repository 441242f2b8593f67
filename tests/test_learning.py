"""Each stage learns what it should: the whole demo pipeline on the embedded task, with the demo's defaults.

Thresholds come from demo runs (docs/demo_results.md records every field), set below the worst run with a margin:
the reward model and DPO beat chance on held-out pairs by a clear margin, and GRPO raises the gold reward of
sampled summaries over the SFT policy's. The second test holds what the gold reward is for: GRPO names more of the
post's key items than SFT and invents no more, and the SFT policy beats every summary without content. The tiny
demo policy does not copy items from the post yet (docs/demo_results.md), so that test is expected to fail, strictly:
the day it passes, pytest reports it and the mark comes off.
"""

import json
import sys

import pytest

from tests.conftest import run_script

RM_ACCURACY_MIN = 0.65  # chance is 0.5
DPO_ACCURACY_MIN = 0.65
GRPO_GOLD_GAIN_MIN = 0.5  # grpo_gold_reward - sft_gold_reward, gold rewards lie in [-3, 4]
NO_CONTENT_GOLD_MAX = 0.0  # the most a summary naming no key item of the post can score (data/synthetic.py)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[dict, object]:
    """The demo's summary.json and its assets folder: one run shared by both tests."""
    tmp_path = tmp_path_factory.mktemp("demo")
    out = tmp_path / "demo"
    run_script(["demo.py", "--out", str(out), "--assets", str(tmp_path / "assets"), "--wandb_mode", "disabled"], timeout=1800, env={"OMP_NUM_THREADS": "2"})
    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps(summary, indent=2), file=sys.stderr)
    return summary, tmp_path / "assets"


@pytest.mark.slow
def test_demo_pipeline_learns_on_the_embedded_task(demo):
    summary, assets = demo
    assert summary["rm_accuracy"] > RM_ACCURACY_MIN, summary
    assert summary["dpo_accuracy"] > DPO_ACCURACY_MIN, summary
    assert summary["grpo_gold_reward"] - summary["sft_gold_reward"] > GRPO_GOLD_GAIN_MIN, summary
    for name in ("pipeline.png", "demo_curves.png"):
        assert (assets / name).stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the tiny SFT policy names almost none of the post's key items "
                   "(docs/demo_results.md), so summaries without content beat it and GRPO learns those")
def test_grpo_raises_the_gold_reward_with_content(demo):
    summary, _ = demo
    assert summary["sft_gold_reward"] > NO_CONTENT_GOLD_MAX, summary
    assert summary["grpo_items_correct"] > summary["sft_items_correct"], summary
    assert summary["grpo_items_invented"] <= summary["sft_items_invented"], summary

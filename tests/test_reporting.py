"""What a run reports: the win rate against reference summaries (hand-computed), progress lines when the output is
not a terminal, and summary.json with its table (utils/logging.py)."""

import io
import json
import math

import numpy as np
import pytest
import torch

from rlhf.stats import win_rate
from utils import logging as log
from utils.logging import LineProgress, Logger, format_summary, report_summary, run_summary

# ----------------------------------------------------------------------------------------------------
# Win rate


def test_win_rate_counts_wins_and_half_ties_by_hand():
    policy = torch.tensor([1.0, 2.0, 3.0, 4.0])
    reference = torch.tensor([0.0, 2.0, 5.0, 1.0])  # win, tie, loss, win: (1 + 0.5 + 0 + 1) / 4
    assert win_rate(policy, reference)["win_rate"] == 0.625
    assert win_rate(reference, policy)["win_rate"] == 0.375  # the other side of the same comparisons


def test_win_rate_interval_is_the_percentile_bootstrap_of_the_outcomes():
    policy = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, 7.0])
    reference = torch.tensor([0.0, 2.0, 5.0, 1.0, 0.6, 6.0])
    outcomes = np.array([1.0, 0.5, 0.0, 1.0, 0.0, 1.0])
    got = win_rate(policy, reference, n_resamples=500, seed=4)
    # the same resamples drawn here, the means and their 2.5% / 97.5% percentiles taken with numpy
    idx = torch.randint(0, 6, (500, 6), generator=torch.Generator().manual_seed(4)).numpy()
    lo, hi = np.percentile(outcomes[idx].mean(1), [2.5, 97.5])
    assert got["win_rate"] == pytest.approx(3.5 / 6)
    assert (got["win_rate_ci_low"], got["win_rate_ci_high"]) == (pytest.approx(lo), pytest.approx(hi))
    assert lo < 3.5 / 6 < hi


def test_win_rate_of_a_policy_that_always_wins_has_a_point_interval():
    got = win_rate(torch.tensor([2.0, 3.0, 4.0]), torch.tensor([1.0, 1.0, 1.0]))
    assert (got["win_rate"], got["win_rate_ci_low"], got["win_rate_ci_high"]) == (1.0, 1.0, 1.0)
    assert all(math.isnan(v) for v in win_rate(torch.zeros(0), torch.zeros(0)).values())


# ----------------------------------------------------------------------------------------------------
# Progress off a terminal


def test_line_progress_writes_whole_lines_never_carriage_returns():
    out = io.StringIO()
    bar = LineProgress(total=4, initial=0, desc="validation loss", unit="rows", every=3600.0, file=out)
    bar.update(1)  # within the interval: nothing yet
    assert out.getvalue() == ""
    bar.set_postfix({"loss": "2.5"})
    bar.update(3)  # done: one line
    bar.close()  # nothing new since: no second line
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "\r" not in out.getvalue()
    assert lines[0].startswith("validation loss: 4/4 rows (100%), ") and lines[0].endswith(", loss=2.5")


def test_line_progress_interval_and_the_last_line_at_close():
    out = io.StringIO()
    bar = LineProgress(total=10, initial=2, desc="sft", unit="step", every=0.0, file=out)
    bar.update(1)
    bar.update(1)
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["sft: 3/10 step", "sft: 4/10 step"]
    out2 = io.StringIO()
    bar2 = LineProgress(total=10, initial=0, desc="sft", unit="step", every=3600.0, file=out2)
    bar2.update(5)
    bar2.close()  # a stopped run: where it got to
    assert out2.getvalue().startswith("sft: 5/10 step (50%)")


def test_step_postfix_shows_tokens_per_second_beside_the_loss():
    assert log.step_postfix({"train/loss": 2.345678, "perf/tokens_per_second": 12345.6, "train/lr": 1.0}) == {
        "loss": "2.346",
        "tok/s": "1.23e+04",
    }


# ----------------------------------------------------------------------------------------------------
# summary.json


def write_run(path, rows):
    logger = Logger(path, {"seed": 1}, "test", "run", "disabled", enabled=True)
    for row in rows:
        logger.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    logger.finish()


ROWS = [
    {"step": 0, "val/loss": 3.0, "val/accuracy": 0.5, "val/n_pairs": 8},
    {"step": 1, "train/loss": 2.0, "perf/step_seconds": 2.0, "perf/tokens_per_second": 100.0},
    {
        "step": 2,
        "train/loss": 1.5,
        "perf/step_seconds": 1.0,
        "perf/tokens_per_second": 400.0,
        "val/loss": 2.0,
        "val/accuracy": 0.75,
        "val/accuracy_ci_low": 0.5,
        "val/n_pairs": 8,
    },
    {
        "step": 3,
        "train/loss": 1.8,
        "perf/step_seconds": 1.0,
        "perf/tokens_per_second": 200.0,
        "val/loss": 2.5,
        "val/accuracy": 0.625,
        "val/accuracy_ci_low": 0.4,
        "val/n_pairs": 8,
    },
]


def test_summary_holds_final_and_best_of_every_evaluation_metric_with_steps(tmp_path):
    import sft  # noqa: F401  (declares val/loss: lower is better; the test holds alone, as under pytest -n)

    write_run(tmp_path, ROWS)
    (tmp_path / "hf").mkdir()
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    s = run_summary(tmp_path, "reward_model", wall_seconds=9.5)
    ev = s["evaluation"]
    assert sorted(ev) == ["val/accuracy", "val/accuracy_ci_low", "val/loss", "val/n_pairs"]
    assert ev["val/loss"] == {"final": 2.5, "final_step": 3, "best": 2.0, "best_step": 2, "mode": "min"}
    assert ev["val/accuracy"] == {"final": 0.625, "final_step": 3, "best": 0.75, "best_step": 2, "mode": "max"}
    assert ev["val/n_pairs"] == {"final": 8, "final_step": 3}  # a count has no best
    assert ev["val/accuracy_ci_low"] == {"final": 0.4, "final_step": 3}
    assert s["training"]["train/loss"]["final"] == 1.8 and s["training"]["train/loss"]["best"] == 1.5
    # tokens over seconds: (2 x 100 + 1 x 400 + 1 x 200) / (2 + 1 + 1)
    assert (s["steps"], s["train_seconds"], s["tokens_per_second"], s["wall_seconds"]) == (3, 4.0, 200.0, 9.5)
    paths = s["paths"]
    assert paths["export"] == str(tmp_path / "hf") and paths["metrics"] == str(tmp_path / "metrics.jsonl")
    assert paths["checkpoints"] == [str(tmp_path / "checkpoints" / "step_00000003")] and paths["samples"] is None
    table = format_summary(s).splitlines()
    assert table[0] == "reward_model summary after 3 steps"
    row = next(line for line in table if line.strip().startswith("val/accuracy "))
    assert row.split() == ["val/accuracy", "0.625", "(3)", "0.75", "(2)"]


def test_a_rerun_that_trains_nothing_prints_the_summary_already_written(tmp_path, capsys):
    write_run(tmp_path, ROWS)
    first = report_summary(tmp_path, "sft", 12.0, new_steps=True)
    assert json.loads((tmp_path / "summary.json").read_text()) == first
    printed = capsys.readouterr().out
    assert "sft summary after 3 steps" in printed and "wall 12.0s" in printed
    again = report_summary(tmp_path, "sft", 0.1, new_steps=False)
    assert again == first and "wall 12.0s" in capsys.readouterr().out

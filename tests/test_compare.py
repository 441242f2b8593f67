"""evaluation/compare.py: runs written by the Logger, grouped by the options that differ apart from the seed, the
table's means and spreads worked by hand, and the picture."""

import json
import math

import pytest

from evaluation import compare
from utils.logging import Logger


def write_run(path, config: dict, rows: list[dict]):
    log = Logger(path, config, "test", "run", "disabled", enabled=True)
    for row in rows:
        log.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    log.finish()
    return path


@pytest.fixture
def runs(tmp_path):
    """Two groups (selection rso / uniform) of two seeds each, and one run whose out_dir and eval_every differ
    only; reward at steps 1..3 and KL, eval/pref_accuracy logged at step 3 only."""
    dirs = []
    for selection, offset in (("rso", 0.0), ("uniform", -1.0)):
        for seed in (0, 1):
            rows = [{"step": s, "reward/mean": offset + s + seed, "train/kl": 0.1 * s} for s in (1, 2, 3)]
            rows[-1]["eval/pref_accuracy"] = 0.6 + 0.1 * seed
            config = {"selection": selection, "seed": seed, "out_dir": f"r/{selection}{seed}", "lr": 0.1, "eval_every": 1}
            dirs.append(write_run(tmp_path / f"{selection}{seed}", config, rows))
    return dirs


def test_the_logger_writes_the_config_next_to_the_metrics(tmp_path):
    write_run(tmp_path, {"a": 1, "b": "x"}, [{"step": 1, "m": 2.0}])
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1, "b": "x"}


def test_runs_that_differ_only_in_seed_and_folder_form_one_group(runs):
    groups = compare.group_runs([compare.load_run(d) for d in runs])
    assert [options for options, _ in groups] == [{"selection": "rso"}, {"selection": "uniform"}]
    assert [[m.dir.name for m in members] for _, members in groups] == [["rso0", "rso1"], ["uniform0", "uniform1"]]
    one = compare.group_runs([compare.load_run(d) for d in runs[:2]])
    assert [options for options, _ in one] == [{}]  # one group: nothing differs, the label is empty


def test_final_and_best_over_seeds_by_hand(runs):
    groups = compare.group_runs([compare.load_run(d) for d in runs])
    rso = groups[0][1]
    s = compare.summarize(rso, "reward/mean", minimize=False)
    # seeds 0 and 1: final values 3 and 4 (best = final here), mean 3.5, sample std sqrt(0.5)
    assert s["final"] == pytest.approx((3.5, math.sqrt(0.5))) and s["best"] == s["final"] and s["seeds"] == 2
    s = compare.summarize(rso, "train/kl", minimize=True)
    assert s["best"] == pytest.approx((0.1, 0.0)) and s["final"] == pytest.approx((0.3, 0.0))
    assert compare.summarize(rso, "no/such_metric", minimize=False) is None
    # the final value as the mean of the last two: seeds (2 + 3) / 2 and (3 + 4) / 2
    assert compare.summarize(rso, "reward/mean", minimize=False, last=2)["final"] == pytest.approx((3.0, math.sqrt(0.5)))
    assert compare.mean_curve(rso, "eval/pref_accuracy") == [(3, pytest.approx(0.65))]


def test_command_prints_one_row_per_group_and_draws_the_curves(runs, tmp_path, capsys):
    out = tmp_path / "compare.png"
    text = compare.main([*map(str, runs), "--metrics", "reward/mean", "eval/pref_accuracy", "--out", str(out),
                         "--smooth", "2"])
    lines = text.splitlines()
    assert lines[0] == ("| group | seeds | reward/mean (final) | reward/mean (best) | eval/pref_accuracy (final) | "
                        "eval/pref_accuracy (best) |")
    assert lines[2] == "| selection=rso | 2 | 3.500 ± 0.707 | 3.500 ± 0.707 | 0.650 ± 0.071 | 0.650 ± 0.071 |"
    assert lines[3].startswith("| selection=uniform | 2 | 2.500 ± 0.707 |")
    assert out.stat().st_size > 10_000
    assert text in capsys.readouterr().out


def test_moving_average_shrinks_at_the_ends():
    assert compare.moving_average([1.0, 2.0, 3.0, 10.0], 3) == [1.5, 2.0, 5.0, 6.5]
    assert compare.moving_average([1.0, 5.0], 1) == [1.0, 5.0]


def test_a_folder_without_metrics_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        compare.load_run(tmp_path)

"""evaluation/compare.py: runs written by the Logger, grouped by the options that differ apart from the seed, the
table's means and spreads worked by hand, and the picture."""

import json
import math
import re
from pathlib import Path

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
            config = {
                "selection": selection,
                "seed": seed,
                "out_dir": f"r/{selection}{seed}",
                "lr": 0.1,
                "eval_every": 1,
            }
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
    assert compare.summarize(rso, "reward/mean", minimize=False, last=2)["final"] == pytest.approx(
        (3.0, math.sqrt(0.5))
    )
    assert compare.mean_curve(rso, "eval/pref_accuracy") == [(3, pytest.approx(0.65))]


def test_step_means_table_averages_each_run_over_its_steps_then_over_seeds_by_hand(tmp_path):
    """Two RSO runs (kept_mean_shift over steps 0.2, 0.4, 0.6 and 0.5, 0.7, 0.9: per run 0.4 and 0.7, mean 0.55, sample
    std 0.3 / sqrt 2), one uniform run that logged no grad norm, and a DPO run (no rs/ metric: no row)."""
    rso = [
        write_run(
            tmp_path / f"rso{seed}",
            {"seed": seed},
            [{"step": s, "rs/kept_mean_shift": 0.3 * seed + 0.2 * s, "train/grad_norm": 2.0 + seed} for s in (1, 2, 3)],
        )
        for seed in (0, 1)
    ]
    uniform = [write_run(tmp_path / "uniform0", {"seed": 0}, [{"step": 1, "rs/kept_mean_shift": -0.1}])]
    dpo = [write_run(tmp_path / "dpo0", {"seed": 0}, [{"step": 1, "train/grad_norm": 1.0}])]
    metrics = ("rs/kept_mean_shift", "train/grad_norm")
    text = compare.step_means_table({"rso": rso, "uniform": uniform, "dpo": dpo}, metrics)
    lines = text.splitlines()
    assert lines[0] == "| arm | runs | rs/kept_mean_shift | train/grad_norm |" and len(lines) == 4
    assert lines[2] == f"| rso | 2 | 0.550 ± {0.3 / math.sqrt(2):.3f} | 2.500 ± {math.sqrt(0.5):.3f} |"
    assert lines[3] == "| uniform | 1 | -0.100 ± 0.000 | n/a |"
    assert compare.step_means_table({"dpo": dpo}, metrics) == ""


def test_an_evaluation_metrics_final_value_is_its_last_evaluation(tmp_path):
    # evaluations along training (eval/kl at steps 0, 10, 20) are not averaged into the final value as per-step
    # metrics are: the KL at step 0 is the reference's 0
    rows = [{"step": s, "eval/kl": 0.1 * s, "train/kl": 0.01 * s} for s in (0, 10, 20)]
    run = compare.load_run(write_run(tmp_path / "run", {"seed": 0}, rows))
    assert compare.summarize([run], "eval/kl", minimize=True, last=3)["final"] == pytest.approx((2.0, 0.0))
    assert compare.summarize([run], "train/kl", minimize=True, last=3)["final"] == pytest.approx((0.1, 0.0))


def test_command_prints_one_row_per_group_and_draws_the_curves(runs, tmp_path, capsys):
    out = tmp_path / "compare.png"
    text = compare.main(
        [*map(str, runs), "--metrics", "reward/mean", "eval/pref_accuracy", "--out", str(out), "--smooth", "2"]
    )
    lines = text.splitlines()
    assert lines[0] == (
        "| group | seeds | reward/mean (final) | reward/mean (best) | eval/pref_accuracy (final) | "
        "eval/pref_accuracy (best) |"
    )
    assert lines[2] == "| selection=rso | 2 | 3.500 ± 0.707 | 3.500 ± 0.707 | 0.650 ± 0.071 | 0.650 ± 0.071 |"
    assert lines[3].startswith("| selection=uniform | 2 | 2.500 ± 0.707 |")
    assert out.stat().st_size > 10_000
    assert text in capsys.readouterr().out


def test_moving_average_shrinks_at_the_ends():
    assert compare.moving_average([1.0, 2.0, 3.0, 10.0], 3) == [1.5, 2.0, 5.0, 6.5]
    assert compare.moving_average([1.0, 5.0], 1) == [1.0, 5.0]


def test_a_folder_without_metrics_is_named(tmp_path):
    with pytest.raises(compare.CompareError, match="no metrics.jsonl"):
        compare.load_run(tmp_path)


@pytest.fixture
def evaluated(tmp_path):
    """Two seeds of one configuration, 9 steps of reward/mean and train/kl, eval/reward at three evaluations (steps
    3, 6, 9) that a 5-step smoothing would flatten."""
    dirs = []
    for seed in (0, 1):
        rows = [{"step": s, "reward/mean": float(s % 2), "train/kl": 0.01 * s} for s in range(1, 10)]
        for s, value in ((3, 1.0), (6, 2.0), (9, 4.0)):
            rows[s - 1]["eval/reward"] = value + seed
        dirs.append(write_run(tmp_path / "grpo" / f"seed{seed}", {"seed": seed, "lr": 0.1}, rows))
    return dirs


def test_every_evaluation_point_is_drawn_at_its_value(evaluated):
    groups = compare.group_runs([compare.load_run(d) for d in evaluated])
    fig = compare.figure(groups, ["eval/reward", "reward/mean"], x="train/kl", smooth=5)
    eval_ax, step_ax = fig.axes[0], fig.axes[2]
    (line,) = eval_ax.lines
    assert list(line.get_xdata()) == [3, 6, 9] and list(line.get_ydata()) == [1.5, 2.5, 4.5]  # means over seeds
    assert line.get_marker() == "o"
    assert "each evaluation, unsmoothed" in eval_ax.get_title()
    # the per-step metric is smoothed, and its panel says so
    (smoothed,) = step_ax.lines
    assert list(smoothed.get_ydata()) == compare.moving_average([float(s % 2) for s in range(1, 10)], 5)
    assert "moving average of 5 logged steps" in step_ax.get_title()
    # against KL: the evaluation points at the KL of their steps, unsmoothed
    against_kl = fig.axes[1].lines[0]
    assert list(against_kl.get_xdata()) == pytest.approx([0.03, 0.06, 0.09]) and list(against_kl.get_ydata()) == [
        1.5,
        2.5,
        4.5,
    ]


def test_x_never_draws_itself(evaluated):
    groups = compare.group_runs([compare.load_run(d) for d in evaluated])
    fig = compare.figure(groups, ["eval/reward", "train/kl"], x="train/kl", smooth=1)
    assert len(fig.axes[3].lines) == 0 and not fig.axes[3].axison  # the train/kl row's panel against train/kl
    assert len(fig.axes[1].lines) == 3  # eval/reward against train/kl: the path, its first and last points


def test_defaults_exist_on_the_runs_and_the_picture_goes_next_to_them(evaluated, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    text = compare.main([str(d) for d in evaluated])
    assert text.splitlines()[0].startswith(
        "| group | seeds | eval/reward (final) | eval/reward (best) | reward/mean (final)"
    )
    assert "train/loss" not in text  # not logged: not a default
    assert (tmp_path / "grpo" / "compare.png").is_file() and not (tmp_path / "compare.png").exists()
    assert f"wrote {tmp_path / 'grpo' / 'compare.png'}" in capsys.readouterr().out


def test_bad_inputs_are_one_line_each(evaluated, tmp_path):
    with pytest.raises(compare.CompareError, match="nowhere: no such folder"):
        compare.main([str(tmp_path / "nowhere")])
    with pytest.raises(compare.CompareError) as info:
        compare.main([str(evaluated[0]), "--metrics", "reward/gold_mean", "--out", ""])
    assert str(info.value) == (
        "--metrics reward/gold_mean: no run logged it; the runs logged eval/reward, reward/mean, train/kl"
    )
    with pytest.raises(compare.CompareError, match="--x train/klx: no run logged it"):
        compare.main([str(evaluated[0]), "--x", "train/klx", "--out", ""])
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "evaluation.compare", str(tmp_path / "nowhere")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: ")


def test_runs_of_different_stages_are_labelled_by_their_folders(tmp_path):
    sft = write_run(
        tmp_path / "sft", {"seed": 1, "max_response_len": 64, "prompt_loss_weight": 0.0}, [{"step": 1, "m": 1.0}]
    )
    dpo = write_run(
        tmp_path / "dpo", {"seed": 1, "max_response_len": 64, "beta": 0.1, "loss": "sigmoid"}, [{"step": 1, "m": 2.0}]
    )
    groups = compare.group_runs([compare.load_run(d) for d in (sft, dpo)])
    assert [options for options, _ in groups] == [{"run": str(sft)}, {"run": str(dpo)}]
    # runs of one stage: the options that differ, not the ones some lack
    a = write_run(tmp_path / "a", {"seed": 1, "lr": 0.1, "beta": 0.1}, [{"step": 1, "m": 1.0}])
    b = write_run(tmp_path / "b", {"seed": 1, "lr": 0.2, "beta": 0.1}, [{"step": 1, "m": 1.0}])
    assert [o for o, _ in compare.group_runs([compare.load_run(d) for d in (a, b)])] == [{"lr": 0.1}, {"lr": 0.2}]


def test_a_torn_last_line_is_skipped_with_one_warning(runs, capsys):
    with open(runs[0] / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a run still writing
    run = compare.load_run(runs[0])
    assert [r["step"] for r in run.rows] == [1, 2, 3]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f'warning: {runs[0] / "metrics.jsonl"}: line 4 is not a whole JSON row (\'{{"step": 4, "reward/me\'); skipped'
    ]


def test_the_best_of_a_loss_is_its_minimum_and_the_options_override(tmp_path):
    import sft  # noqa: F401  (declares val/loss: lower is better)

    run = write_run(
        tmp_path / "a",
        {"seed": 0},
        [{"step": s, "val/loss": v, "eval/win_rate": v} for s, v in ((1, 3.0), (2, 1.0), (3, 2.0))],
    )
    groups = compare.group_runs([compare.load_run(run)])
    text = compare.table(groups, ["val/loss", "eval/win_rate"], set())
    assert text.splitlines()[-1] == "| all runs | 1 | 2.000 ± 0.000 | 1.000 ± 0.000 | 2.000 ± 0.000 | 3.000 ± 0.000 |"
    text = compare.table(groups, ["val/loss", "eval/win_rate"], {"eval/win_rate"}, maximize=frozenset({"val/loss"}))
    assert text.splitlines()[-1] == "| all runs | 1 | 2.000 ± 0.000 | 3.000 ± 0.000 | 2.000 ± 0.000 | 1.000 ± 0.000 |"


def logged_metric_names() -> set[str]:
    """The metric names the stages log: those of every golden run (tests/golden) and every complete metric name
    written as a string literal in the code outside tests/ (a name built from parts, "eval/{key}", is left out)."""
    import glob

    root = Path(__file__).resolve().parents[1]
    pattern = r'"((?:train|val|eval|sample|reward|gold|rs|norm)/[a-z0-9_/]+)"'
    names = set()
    for file in glob.glob(str(root / "tests" / "golden" / "*" / "*.json")):
        names |= set(re.findall(pattern, Path(file).read_text()))
    for file in root.glob("**/*.py"):
        if not {"tests", ".venv"} & set(file.relative_to(root).parts):
            names |= set(re.findall(pattern, file.read_text()))
    return names


# no best though not a count by name: the learning rate, the selection's rounds and what it kept against its pool (a
# description of the selection), the judge's posts, the reward model's normalisation fit (a property of the SFT samples)
NO_BEST = {"train/lr", "rs/rounds_mean", "rs/rounds_max", "eval/summary_prompts"}
NO_BEST |= {"rs/kept_mean_shift", "rs/kept_std_ratio", "rs/pool_group_std", "rs/kept_ess", "rs/tied_group_fraction"}
NO_BEST |= {f"norm/{n}" for n in ("raw_mean", "raw_std", "samples", "end_rate", "gain", "bias")}


def test_every_metric_the_stages_log_has_a_direction_and_the_known_ones_are_right():
    # each metric the code logs is declared (utils/metrics.py), with a direction unless it is a count or a bound
    import dpo  # noqa: F401 (each script's own declarations: sft.py's val/loss, ...)
    import eval_preferences  # noqa: F401
    import grpo  # noqa: F401
    import reward_model  # noqa: F401
    import sft  # noqa: F401
    from utils.metrics import find, metric_direction

    names = {name for name in logged_metric_names() if not name.endswith("_")}  # not a prefix ("eval/pref_")
    assert len(names) > 50
    for name in names:
        last = name.split("/")[-1]
        assert find(name) is not None, f"{name} is not declared"
        no_best = last.startswith(("n_", "pref_n_")) or "_ci_" in last or name in NO_BEST
        assert (metric_direction(name) is None) == no_best, name
    lower = [
        "val/loss",
        "train/loss",
        "val/bt_loss",
        "eval/pref_bt_loss",
        "train/kl",
        "train/epoch_1/kl",
        "eval/response_length",
        "sample/response_length",
        "train/grad_norm",
        "train/ratio_deviation",
        # shares and counts of what went wrong, and a standard error: lower is better (issue 43)
        "sample/dropped_group_fraction",
        "train/skipped",
        "gold/items_invented",
        "train/outside_top_k_p_fraction",
        "train/mismatch/outside_band_fraction",
        "reward/kl_penalty_mean",
        "eval/kl_se",
    ]
    higher = [
        "eval/win_rate",
        "val/accuracy",
        "eval/reward",
        "reward/mean",
        "reward/length_mean",
        "eval/pref_accuracy",
        "eval/end_fraction",
        "rs/acceptance_rate",
        "train/reward_margin",
        "gold/items_correct",
        "eval/gold",
    ]
    assert [metric_direction(m) for m in lower] == ["min"] * len(lower)
    assert [metric_direction(m) for m in higher] == ["max"] * len(higher)
    assert set(lower + higher) <= names | {name + "_se" for name in names}  # each frontier mean has its error


def test_seed_reruns_differing_in_free_options_or_their_changes_on_resume_group_with_their_siblings(tmp_path):
    rows = [{"step": 1, "reward/mean": 1.0}]
    base = {"lr": 0.1, "keep_last": 2, "resume_changes": "refuse"}
    runs = [
        write_run(tmp_path / "s0", {**base, "seed": 0}, rows),
        write_run(tmp_path / "s1", {**base, "seed": 1, "keep_last": 3}, rows),  # a free option
        write_run(  # resumed with --resume_changes allow, changing only how often it saved
            tmp_path / "s2",
            {**base, "seed": 2, "option_changes": [{"step": 1, "options": {"save_every": [500, 1]}}]},
            rows,
        ),
        write_run(  # resumed with a change of the learning rate: another group, labelled by that change
            tmp_path / "s3",
            {**base, "seed": 3, "option_changes": [{"step": 1, "options": {"lr": [0.1, 0.2], "keep_last": [2, 1]}}]},
            rows,
        ),
    ]
    groups = compare.group_runs([compare.load_run(d) for d in runs])
    assert [[m.dir.name for m in members] for _, members in groups] == [["s0", "s1", "s2"], ["s3"]]
    assert [options for options, _ in groups] == [
        {"option_changes": []},
        {"option_changes": [{"step": 1, "options": {"lr": [0.1, 0.2]}}]},
    ]


def test_ignored_options_are_what_every_script_declares_free_or_unrecorded():
    """compare.IGNORED reads the declarations of the packages' option groups (a package does not import the scripts):
    each script's options declared free on resume (but --steps) or unrecorded are among them, a shared option a
    script redeclares with its own default (grpo.py's --eval_every) included, and nothing else but --seed and
    --device is."""
    import dpo
    import eval_preferences
    import grpo
    import reward_model
    import sft
    from utils.config import declared

    scripts = (sft, reward_model, dpo, grpo, eval_preferences)
    names = {n for s in scripts for fact in ("free", "recorded") for n in declared(s.Config, fact)} - {"steps"}
    assert "eval_every" in grpo.Config.__annotations__ and "eval_every" in names
    assert {"table_every", "frozen_cpu_offload", "keep_last", "out_dir"} <= names
    assert compare.IGNORED == names | {"seed", "device"}


def test_the_picture_and_the_table_go_to_tensorboard_and_wandb_in_the_runs_group(runs, tmp_path):
    """The comparison beside the runs: TensorBoard events in their common folder (the PNG's bytes as they are, the
    table's rows as text) and an offline wandb run of its own holding both, in the group the runs share."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "pictures" / "compare.png"
    out.parent.mkdir()
    text = compare.main([*map(str, runs), "--metrics", "reward/mean", "--out", str(out), "--wandb_mode", "offline"])
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    (image,) = events.Images("compare")
    assert image.encoded_image_string == out.read_bytes()
    (table,) = events.Tensors("compare/table")
    shown = table.tensor_proto.string_val[0].decode()
    assert shown.splitlines()[2:] == text.splitlines()[2:]  # the rows as they are printed ("=" and "±" need no escape)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert len(list(run.glob("files/media/images/compare_*.png"))) == 1
    (logged,) = run.glob("files/media/table/compare/table_*.table.json")
    assert json.loads(logged.read_text())["data"][0][:2] == ["selection=rso", "2"]


def test_the_wandb_run_of_the_picture_joins_the_group_the_runs_share(runs, tmp_path, monkeypatch):
    published = []
    monkeypatch.setattr(compare, "publish_picture", lambda *args: published.append(args))
    for run, group in zip(runs, ["ablation", "ablation", "ablation", "other"], strict=True):
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps(config | {"wandb_group": group}))
    compare.main([*map(str, runs[:3]), "--metrics", "reward/mean", "--out", str(tmp_path / "a.png")])
    compare.main([*map(str, runs), "--metrics", "reward/mean", "--out", str(tmp_path / "b.png")])
    compare.main([*map(str, runs), "--metrics", "reward/mean", "--out", str(tmp_path / "c.png"), "--wandb_group", "g"])
    # (png, folder, tag, table, tensorboard, wandb_mode, project, group, run name)
    assert [(p[1], p[7]) for p in published] == [(tmp_path, "ablation"), (tmp_path, ""), (tmp_path, "g")]


def test_a_metrics_direction_is_read_from_the_run_that_logged_it(tmp_path):
    """compare.py reads a metric's direction from the run's metrics_declared.json (written by the Logger from the
    declarations of the process that logged it), so a metric declared in a script it does not import is still
    minimised; a run without the file (logged before runs recorded declarations) falls back to this process's."""
    from utils.metrics import DECLARED_FILE, METRICS, metric

    metric("test_only/gap", "min", "a lower-is-better metric declared only in this test")
    try:
        run = write_run(
            tmp_path / "run", {"lr": 0.1}, [{"step": 1, "test_only/gap": 1.0}, {"step": 2, "test_only/gap": 3.0}]
        )
    finally:
        del METRICS["test_only/gap"]  # as in compare.py's own process, which never imported the declaring module
    recorded = json.loads((run / DECLARED_FILE).read_text())
    assert recorded == {
        "test_only/gap": {"direction": "min", "help": "a lower-is-better metric declared only in this test"}
    }
    last = compare.table(compare.group_runs([compare.load_run(run)]), ["test_only/gap"], set()).splitlines()[-1]
    assert last == "| all runs | 1 | 3.000 ± 0.000 | 1.000 ± 0.000 |"  # final 3, best the minimum 1
    (run / DECLARED_FILE).unlink()
    last = compare.table(compare.group_runs([compare.load_run(run)]), ["test_only/gap"], set()).splitlines()[-1]
    assert last == "| all runs | 1 | 3.000 ± 0.000 | 3.000 ± 0.000 |"  # undeclared here: its best is its maximum

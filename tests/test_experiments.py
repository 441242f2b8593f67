"""Experiments as data (experiments/): the runner's order and --reuse, and the declared grids' runs: each a command a
user could type (the script parses its options), every arm with its own folder and wandb group."""

import json
import subprocess
from pathlib import Path

import pytest

from demo import parse_args
from experiments.embedded import ABLATION, PREPARED, Demo, ablation_runs, frontier_runs, pipeline, verdict_runs
from experiments.runner import FINISHED, ExperimentRun, finished_record, run_all
from experiments.verdict import check_runs, read_verdict
from experiments.verdict import verdict_runs as file_verdict_runs
from tests.conftest import ROOT
from utils.config import parse_config


def test_run_all_runs_in_order_and_reuse_keeps_only_a_leading_run_that_is_done(tmp_path):
    done = tmp_path / "a"
    done.mkdir()
    calls = []
    runs = [
        ExperimentRun("a", call=lambda: calls.append("a"), done=done),
        ExperimentRun("b", call=lambda: calls.append("b"), done=tmp_path / "missing"),
        ExperimentRun("c", call=lambda: calls.append("c"), done=done),  # done, but after a run that was redone
    ]
    after = []
    run_all(runs, 1, reuse=True, after=lambda run: after.append(run.name))
    assert calls == ["b", "c"] and after == ["b", "c"]
    calls.clear()
    run_all(runs, 1)
    assert calls == ["a", "b", "c"]


def test_keep_finished_keeps_each_grid_run_that_finished_with_the_same_options(tmp_path):
    """A grid's runs are independent: with keep_finished a run is kept when its script exited 0 with exactly these
    options (its FINISHED record), whatever ran before it, and `after` sees it; a changed option or a failed run
    runs again."""
    script = tmp_path / "count.py"
    script.write_text(
        "import sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out_dir') + 1]); out.mkdir(parents=True, exist_ok=True)\n"
        "with open(out.parent / 'calls.txt', 'a') as f: f.write(out.name + '\\n')\n"
        "sys.exit(int(sys.argv[sys.argv.index('--fail') + 1]))\n"
    )

    def grid(fail_b: int = 0, lr: float = 0.1) -> list[ExperimentRun]:
        return [
            ExperimentRun("a", str(script), {"out_dir": tmp_path / "a", "lr": lr, "fail": 0}),
            ExperimentRun("b", str(script), {"out_dir": tmp_path / "b", "lr": 0.1, "fail": fail_b}),
        ]

    def calls() -> list[str]:
        return (tmp_path / "calls.txt").read_text().split() if (tmp_path / "calls.txt").exists() else []

    with pytest.raises(subprocess.CalledProcessError):
        run_all(grid(fail_b=1), 1, keep_finished=True)
    assert calls() == ["a", "b"] and (tmp_path / "a" / FINISHED).exists() and not (tmp_path / "b" / FINISHED).exists()
    after = []
    run_all(grid(), 1, keep_finished=True, after=lambda run: after.append(run.name))
    assert calls() == ["a", "b", "b"] and after == ["a", "b"]  # a kept, b (failed) redone
    run_all(grid(), 1, keep_finished=True)
    assert calls() == ["a", "b", "b"]
    run_all(grid(lr=0.2), 1, keep_finished=True)
    assert calls() == ["a", "b", "b", "a"]  # a's options changed
    run_all(grid(lr=0.2), 1)
    assert calls() == ["a", "b", "b", "a", "a", "b"]  # without keep_finished every run runs


def demo_for(tmp_path: Path, *argv: str) -> Demo:
    paths = {name: tmp_path / f"{name}.jsonl" for name in ("sft_train", "sft_validation", "prompts_train")}
    paths["preference_validation"] = tmp_path / "preference_validation.jsonl"
    return Demo(tmp_path / "demo", paths, parse_args(["--out", str(tmp_path / "demo"), *argv]))


def script_config(run: ExperimentRun):
    """The run's options parsed by its own script's Config, as its command line would be."""
    import importlib

    cls = importlib.import_module(run.script.removesuffix(".py")).Config
    return parse_config(cls, [arg for k, v in run.options.items() for arg in (f"--{k}", str(v))])


def test_the_pipeline_and_grids_are_commands_their_scripts_accept(tmp_path):
    demo = demo_for(tmp_path, "--ablation_seeds", "2", "--frontier_seeds", "2", "--verdict_seeds", "2")
    runs = pipeline(demo)
    assert [run.script for run in runs] == ["sft.py", "", "reward_model.py", "dpo.py", "grpo.py"]
    assert [run.done is not None for run in runs] == [True] * PREPARED + [False] * (len(runs) - PREPARED)
    scripts = [run for run in runs if run.script]
    for run in scripts + ablation_runs(demo) + frontier_runs(demo) + verdict_runs(demo, tmp_path / "posts.jsonl"):
        cfg = script_config(run)
        assert Path(cfg.out_dir) == run.out_dir, run.name

    ablation = ablation_runs(demo)
    assert len(ablation) == 2 * len(ABLATION) and len({run.out_dir for run in ablation}) == len(ablation)
    for run in ablation:
        cfg = script_config(run)
        assert cfg.wandb_group == f"ablation-{run.name}" and cfg.selection == ABLATION[run.name]["selection"]

    frontier = frontier_runs(demo)
    names = [run.name for run in frontier]
    # the method's first point, DPO's, the contrast's, then the rest of the grids; both seeds of each in a row
    assert names[::2] == names[1::2]
    assert names[::2] == [
        "GRPO rso 64->8, beta 0.4",
        "DPO beta 0.1",
        "GRPO uniform 64->8, beta 0.4",
        "GRPO rso 64->8, beta 0.1",
        "DPO beta 0.3",
    ]
    assert [script_config(run).seed for run in frontier[:2]] == [0, 1]
    assert len({run.out_dir for run in frontier}) == len(frontier)

    verdict = verdict_runs(demo, tmp_path / "posts.jsonl")
    assert len(verdict) == 2 * 7 and [script_config(run).seed for run in verdict] == [0] * 7 + [1] * 7
    plain, rso = script_config(verdict[3]), script_config(verdict[0])
    assert (plain.num_samples, plain.selection, rso.num_samples, rso.selection) == (8, "all", 64, "rso")
    assert all(script_config(run).frontier_prompts == 400 for run in verdict)


def test_an_unknown_ablation_variant_is_one_line_naming_it(tmp_path):
    demo = demo_for(tmp_path, "--ablation_seeds", "1", "--ablation_variants", "rso", "rso_sometimes")
    with pytest.raises(SystemExit, match="--ablation_variants: unknown rso_sometimes; expected some of rso, "):
        ablation_runs(demo)


# ----------------------------------------------------------------------------------------------------
# The verdict as a file (experiments/verdict.py)

VERDICT = ROOT / "configs" / "verdict" / "embedded.toml"
MAKE_VERDICT = ["--out", "runs/demo", "--reuse"]  # make verdict's command line beside --verdict FILE


def make_verdict_demo(*argv: str) -> Demo:
    """The Demo of make verdict's command line (its paths as data.synthetic.write_task names them, none written)."""
    out, data = Path("runs/demo"), Path("runs/demo") / "data"
    paths = {name: data / kind / f"{split}.jsonl" for name, kind, split in PATHS}
    return Demo(out, paths, parse_args([*MAKE_VERDICT, *argv]))


PATHS = [
    ("sft_train", "sft", "train"),
    ("sft_validation", "sft", "validation"),
    ("prompts_train", "prompts", "train"),
    ("preference_validation", "preference", "validation"),
]


def records(runs: list[ExperimentRun]) -> list[dict]:
    """What experiments.runner.finished compares (each run's FINISHED record), with its name and folder."""
    return [{"name": run.name, "out_dir": str(run.out_dir)} | finished_record(run.script, run.options) for run in runs]


def test_the_embedded_verdict_file_runs_what_make_verdict_ran_at_ddecd20():
    """configs/verdict/embedded.toml gives make verdict's 42 runs with the options and folders the code before it gave
    (tests/embedded_verdict_runs.json: their FINISHED records), so --reuse keeps the runs that code finished."""
    frozen = json.loads((ROOT / "tests" / "embedded_verdict_runs.json").read_text())["seed0"]
    expected = []
    for seed in range(6):
        for record in frozen:
            options = record["options"] | {"seed": str(seed), "run_name": f"verdict-{record['name']}-{seed}"}
            options["out_dir"] = str(Path(options["out_dir"]).parent / f"seed{seed}")
            expected.append({"name": record["name"], "out_dir": options["out_dir"]} | record | {"options": options})
    verdict = read_verdict(str(VERDICT))
    posts = Path("runs/demo/verdict/data/sft/validation.jsonl")  # verdict_posts(demo, verdict), not written here
    runs = file_verdict_runs(make_verdict_demo(), verdict, posts)
    assert records(runs) == expected
    # the code the file replaces, on the same command lines (a wandb mode, processes per stage)
    old = ["--verdict_seeds", "6", "--frontier_pool", "256", "--frontier_best_of", "128"]
    for argv in ([], ["--wandb_mode", "disabled"], ["--nproc", "2"]):
        runs = file_verdict_runs(make_verdict_demo(*argv), verdict, posts)
        assert records(runs) == records(verdict_runs(make_verdict_demo(*argv, *old), posts)), argv
    check_runs(verdict, runs)  # every arm passes its script's checks

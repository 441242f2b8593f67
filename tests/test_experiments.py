"""Experiments as data (experiments/): the runner's order and --reuse, and the declared grids' runs: each a command a
user could type (the script parses its options), every arm with its own folder and wandb group."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from demo import parse_args
from experiments.embedded import ABLATION, PREPARED, Demo, ablation_runs, frontier_runs, pipeline
from experiments.runner import FINISHED, ExperimentRun, finished, finished_record, run_all
from experiments.verdict import check_runs, read_verdict, verdict_runs
from tests.conftest import ROOT
from utils.config import ConfigError, parse_config

VERDICT = ROOT / "configs" / "verdict" / "embedded.toml"  # make verdict's


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
    for run in grid(lr=0.2):  # where a run is logged is not what it computes: another --wandb_mode keeps it
        run.options["wandb_mode"] = "online"
        assert finished(run), run.name
    for run in grid(lr=0.2):  # an arm renamed: its folder moved, its names changed, the same run
        moved = run.out_dir.with_name(run.out_dir.name + "_renamed")
        run.out_dir.rename(moved)
        run.options |= {"out_dir": moved, "run_name": "renamed", "wandb_group": "renamed", "wandb_tags": "renamed"}
        assert finished(run), run.name
        run.options["lr"] = 0.3
        assert not finished(run), run.name  # what it computes still decides


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
    demo = demo_for(tmp_path, "--ablation_seeds", "2", "--frontier_seeds", "2")
    runs = pipeline(demo)
    assert [run.script for run in runs] == ["sft.py", "", "reward_model.py", "dpo.py", "grpo.py"]
    assert [run.done is not None for run in runs] == [True] * PREPARED + [False] * (len(runs) - PREPARED)
    scripts = [run for run in runs if run.script]
    verdict = verdict_runs(demo, read_verdict(str(VERDICT)), tmp_path / "posts.jsonl")
    for run in scripts + ablation_runs(demo) + frontier_runs(demo) + verdict:
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

    assert len(verdict) == 6 * 7 and [script_config(run).seed for run in verdict] == [
        s for s in range(6) for _ in range(7)
    ]
    plain, rso = script_config(verdict[3]), script_config(verdict[0])
    assert (plain.num_samples, plain.selection, rso.num_samples, rso.selection) == (8, "all", 64, "rso")
    assert all(script_config(run).frontier_prompts == 400 for run in verdict)


def test_an_unknown_ablation_variant_is_one_line_naming_it(tmp_path):
    demo = demo_for(tmp_path, "--ablation_seeds", "1", "--ablation_variants", "rso", "rso_sometimes")
    with pytest.raises(SystemExit, match="--ablation_variants: unknown rso_sometimes; expected some of rso, "):
        ablation_runs(demo)


# ----------------------------------------------------------------------------------------------------
# The verdict as a file (experiments/verdict.py)

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
    (tests/embedded_verdict_runs.json: their FINISHED records), two arms renamed for what they vary (rso_beta2: the KL
    coefficient 0.1; dpo_beta2: DPO's beta 0.3), so --reuse keeps the runs that code finished once their folders move
    to the new names (experiments.runner NOT_RESULTS: the names and folder are not what a run computes)."""
    frozen = json.loads((ROOT / "tests" / "embedded_verdict_runs.json").read_text())["seed0"]
    renamed = {"rso_beta2": "rso_kl0.1", "dpo_beta2": "dpo_beta0.3"}
    expected = []
    for seed in range(6):
        for record in frozen:
            name = renamed.get(record["name"], record["name"])
            options = record["options"] | {"seed": str(seed), "run_name": f"verdict-{name}-{seed}"}
            options |= {"wandb_group": f"verdict-{name}", "wandb_tags": name}
            options["out_dir"] = str(Path(options["out_dir"]).parent.with_name(name) / f"seed{seed}")
            expected.append(record | {"name": name, "out_dir": options["out_dir"], "options": options})
    verdict = read_verdict(str(VERDICT))
    posts = Path("runs/demo/verdict/data/sft/validation.jsonl")  # verdict_posts(demo, verdict), not written here
    runs = verdict_runs(make_verdict_demo(), verdict, posts)
    assert records(runs) == expected
    check_runs(verdict, runs)  # every arm passes its script's checks


SMALL = """name = "small"
seeds = 2
posts = 8
samples = 2
pool = 8
best_of = 4
pairs = [["rloo", "grpo"]]

[base.grpo]
selection = "all"
num_samples = 8

[arms.grpo]
stage = "grpo"
advantage = "grpo"

[arms.rloo]
stage = "grpo"
advantage = "rloo"

[arms.dpo]
stage = "dpo"
"""


def test_a_verdict_file_reads_as_its_arms_options_as_the_command_line_writes_them(tmp_path):
    """In the file's order; a boolean as true/false, an integer for a number as the number (what str() of the option
    gives in the run's FINISHED record, as the command line's value does)."""
    path = tmp_path / "small.toml"
    path.write_text(SMALL.replace('advantage = "rloo"', 'advantage = "rloo"\nglobal_norm = false') + "beta = 1\n")
    verdict = read_verdict(str(path))
    scalars = (verdict.name, verdict.seeds, verdict.posts, verdict.samples, verdict.pool, verdict.best_of)
    assert scalars == ("small", 2, 8, 2, 8, 4)
    assert verdict.pairs == [("rloo", "grpo")] and verdict.base == {"grpo": {"selection": "all", "num_samples": 8}}
    assert verdict.primary is None and verdict.margin == 0.05  # every pair one family; the default margin
    path.write_text(SMALL.replace('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\nprimary = [["rloo", "grpo"]]\nmargin = 1'))
    assert (read_verdict(str(path)).primary, read_verdict(str(path)).margin) == ([("rloo", "grpo")], 1.0)
    trend = '[["rloo", "grpo"], ["dpo", "grpo"]]\ntrends = [[["dpo", "grpo"], ["rloo", "grpo"]]]'
    path.write_text(SMALL.replace('[["rloo", "grpo"]]', trend))
    assert read_verdict(str(path)).trends == [[("dpo", "grpo"), ("rloo", "grpo")]]  # the file's order, not pairs'
    path.write_text(SMALL.replace('advantage = "rloo"', 'advantage = "rloo"\nglobal_norm = false') + "beta = 1\n")
    verdict = read_verdict(str(path))
    assert verdict.arms == {
        "grpo": ("grpo", {"advantage": "grpo"}),
        "rloo": ("grpo", {"advantage": "rloo", "global_norm": "false"}),
        "dpo": ("dpo", {"beta": 1.0}),
    }
    assert [str(v) for v in verdict.arms["dpo"][1].values()] == ["1.0"]
    demo = demo_for(tmp_path)
    runs = verdict_runs(demo, verdict, tmp_path / "posts.jsonl")
    assert [(run.name, run.script, script_config(run).seed) for run in runs] == [
        (arm, script, seed)
        for seed in (0, 1)
        for arm, script in (("grpo", "grpo.py"), ("rloo", "grpo.py"), ("dpo", "dpo.py"))
    ]
    rloo = script_config(runs[1])
    assert (rloo.advantage, rloo.global_norm, rloo.selection, rloo.num_samples) == ("rloo", False, "all", 8)
    assert (rloo.frontier_prompts, rloo.frontier_samples, Path(rloo.frontier_data)) == (8, 2, tmp_path / "posts.jsonl")
    assert Path(rloo.out_dir) == tmp_path / "demo" / "small" / "rloo" / "seed0" and rloo.wandb_group == "small-rloo"
    assert script_config(runs[2]).beta == 1.0 and script_config(runs[0]).global_norm is True  # grpo.py's default


@pytest.mark.parametrize(
    "edit, message",
    [
        (("seeds = 2", "seeds = 2\nseed = 3"), "unknown key 'seed'; did you mean seeds?"),
        (("seeds = 2", "seeds = 2\ngold = 3"), "unknown key 'gold'; expected some of name, seeds, posts, samples, "),
        (("posts = 8\n", ""), "missing key 'posts' (held-out posts every run and best-of-n are measured on)"),
        (("seeds = 2", 'seeds = "two"'), "seeds: expected an integer (seeds of every arm), got 'two'"),
        (("seeds = 2", "seeds = true"), "seeds: expected an integer (seeds of every arm), got True"),
        (("seeds = 2", "seeds = 0"), "seeds: expected a positive integer, got 0"),
        (("best_of = 4", "best_of = 6"), "best_of: expected a power of 2, got 6"),
        (("pool = 8", "pool = 2"), "pool: expected at least best_of = 4, got 2"),
        (('name = "small"', 'name = "a/b"'), "name: expected a folder name (letters, digits, _ . -), got 'a/b'"),
        (('[["rloo", "grpo"]]', '[["rloo", "grpo2"]]'), "pairs: ['rloo', 'grpo2'] names 'grpo2', which is not an arm"),
        (('[["rloo", "grpo"]]', '[["rloo"]]'), "pairs: expected pairs of arm names [A, B], got ['rloo']"),
        (('[["rloo", "grpo"]]', '[["rloo", "rloo"]]'), "pairs: ['rloo', 'rloo'] compares an arm with itself"),
        (
            ('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\nprimary = [["grpo", "rloo"]]'),
            "primary: ['grpo', 'rloo'] is not",
        ),
        (('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\nmargin = 0'), "margin: expected a positive number (gold), got 0"),
        (
            ('[["rloo", "grpo"]]', '[["rloo", "grpo"], ["dpo", "grpo"]]\ntrends = [[["rloo", "grpo"]]]'),
            "trends: [['rloo', 'grpo']]: a trend needs two or more pairs",
        ),
        (
            ('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\ntrends = [[["rloo", "grpo"], ["dpo", "grpo"]]]'),
            "trends: ['dpo', 'grpo'] is not one of the pairs",
        ),
        (
            ('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\ntrends = [["rloo", "grpo"]]'),
            "trends: pairs: expected pairs of arm names [A, B], got 'rloo'",
        ),
        (('[["rloo", "grpo"]]', '[["rloo", "grpo"]]\nmargin = "x"'), "margin: expected a number (the equivalence"),
        (('advantage = "rloo"', 'advantag = "rloo"'), "arms.rloo: unknown option 'advantag'; did you mean advantage?"),
        (('advantage = "rloo"', 'advantage = "ppo"'), "arms.rloo: advantage: expected one of grpo, "),
        (('advantage = "rloo"', "advantage = 2"), "arms.rloo: advantage: expected a string, got 2 (int)"),
        (('stage = "dpo"', 'stage = "dpo"\nnum_samples = 8'), "arms.dpo: unknown option 'num_samples'"),
        (('stage = "dpo"', 'stage = "ppo"'), "arms.dpo: stage: expected one of grpo, dpo, got 'ppo'"),
        (('stage = "dpo"\n', ""), "arms.dpo: missing key 'stage' (one of grpo, dpo)"),
        (("num_samples = 8", "num_samples = 8\nseed = 1"), "base.grpo: seed is set by the verdict "),
        (('advantage = "rloo"', 'model = "runs/other/hf"'), "arms.rloo: model is set by the verdict: every arm "),
        (("[base.grpo]", "[task]\ndata = 'x'\n[base.grpo]"), "task: missing key 'configs' (the folder of the stages' "),
        (('advantage = "rloo"', "frontier_samples = 4"), "arms.rloo: frontier_samples is set by the verdict "),
        (("[base.grpo]", "[base.sft]"), "base: unknown stage 'sft'; expected some of grpo, dpo"),
        (("[base.grpo]\n", "[base]\ngrpo = 3\n[base.x]\n"), "base.grpo: expected a table of grpo.py's options, got 3"),
        (("[arms.dpo]\n", "[arms]\ndpo = 3\n[arms.y]\n"), "arms.dpo: expected a table (stage = ..., then the options"),
        (('stage = "dpo"', 'stage = "dpo"\nbeta = [0.1]'), "arms.dpo: beta: expected a number, got [0.1] (list)"),
        (("seeds = 2", "seeds = [2"), "not valid TOML: "),
    ],
)
def test_a_bad_verdict_file_is_one_error_naming_the_file_and_the_key(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    assert SMALL.count(edit[0]) == 1, edit
    path.write_text(SMALL.replace(*edit))
    with pytest.raises(ConfigError) as info:
        read_verdict(str(path))
    assert str(info.value).startswith(f"--verdict {path}: {message}"), str(info.value)


def test_an_arm_its_script_refuses_is_named_before_any_run(tmp_path):
    """What only the script's own checks see (its Config's validate): GRPO keeping more samples than it draws."""
    path = tmp_path / "small.toml"
    path.write_text(SMALL.replace('advantage = "rloo"', 'advantage = "rloo"\nselection = "rso"\nnum_kept = 16'))
    verdict = read_verdict(str(path))
    demo = demo_for(tmp_path)
    with pytest.raises(ConfigError, match=r"small.toml: arms.rloo: --num_kept 16 exceeds --num_samples 8: "):
        check_runs(verdict, verdict_runs(demo, verdict, tmp_path / "posts.jsonl"))


def test_demo_stops_at_a_bad_verdict_file_in_one_line_with_exit_2_before_anything_runs(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(SMALL.replace('[["rloo", "grpo"]]', '[["rloo", "ppo"]]'))
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "demo.py", "--verdict", str(path), "--out", str(out), "--wandb_mode", "disabled"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    assert (
        done.stderr
        == f"error: --verdict {path}: pairs: ['rloo', 'ppo'] names 'ppo', which is not an arm (grpo, rloo, dpo)\n"
    )
    assert not out.exists()


def test_each_command_refuses_the_other_kind_of_verdict_in_one_line(tmp_path, capsys, monkeypatch):
    """demo.py runs verdicts on the embedded task, verdict.py those with a [task] table; each names the other."""
    import demo
    import verdict

    tldr = ROOT / "configs" / "verdict" / "tldr.toml"
    monkeypatch.setattr(sys, "argv", ["demo.py", "--verdict", str(tldr), "--out", str(tmp_path / "demo")])
    with pytest.raises(SystemExit) as exit_:
        demo.main()
    assert exit_.value.code == 2 and not (tmp_path / "demo").exists()
    assert capsys.readouterr().err == (
        f"error: --verdict {tldr}: its [task] names its own models and posts: run it with python verdict.py "
        f"--verdict {tldr} (demo.py runs verdicts on the embedded task)\n"
    )
    with pytest.raises(SystemExit) as exit_:
        verdict.main(["--verdict", str(VERDICT), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.startswith(
        f"error: --verdict {VERDICT}: no [task] table: a verdict on the embedded "
    )


EMBEDDED_VERDICTS = sorted(p.stem for p in (ROOT / "configs" / "verdict").glob("*.toml") if p.stem != "tldr")
"""Every checked-in verdict of the embedded task (tldr.toml has a [task] of its own: tested apart)."""


@pytest.mark.parametrize("name", EMBEDDED_VERDICTS)
def test_each_embedded_verdict_file_is_read_and_its_arms_pass_their_scripts_checks(name):
    """The checked-in verdicts of the embedded task as demo.py --verdict reads them: every arm's first run through its
    script's parser and validate, each pair naming two arms, every arm's options as the file says (an option a script
    renamed, or a choice no longer registered, fails here rather than hours into a grid)."""
    verdict = read_verdict(str(ROOT / "configs" / "verdict" / f"{name}.toml"))
    configs = check_runs(verdict, verdict_runs(make_verdict_demo(), verdict, Path("runs/demo/posts.jsonl")))
    assert set(configs) == set(verdict.arms) and all(a in configs and b in configs for a, b in verdict.pairs)
    for arm, (_, options) in verdict.arms.items():
        config = configs[arm]
        for key, value in {**verdict.base.get(verdict.arms[arm][0], {}), **options}.items():
            value = str(value).replace("{out}", "runs/demo")  # a proxy of demo.py --proxies, in make verdict's --out
            assert str(getattr(config, key)).lower() == value.lower(), (name, arm, key)


def test_the_proxies_are_reward_model_runs_on_a_quarter_and_four_times_the_pairs(tmp_path, monkeypatch):
    """demo.py --proxies: the pairs of the first quarter of the labelled prompts (whole prompts, in order), and every
    pair with those of three times as many new prompts (labelled as the demo's: here a stand-in labeller), each file
    written whole; then reward_model.py with the demo's options but those pairs and its own folder. A verdict's arm
    names one as {out}/rm_4x/hf."""
    import experiments.embedded as embedded
    from experiments.embedded import PROXIES, proxy_runs

    demo = demo_for(tmp_path, "--pair_prompts", "4")
    for path in demo.paths.values():
        path.write_text(
            "".join(json.dumps({"prompt": f"{path.stem} {i}", "completion": " x"}) + "\n" for i in range(3))
        )
    demo.pairs["train"].parent.mkdir(parents=True)
    posts = [0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3]  # pairs per prompt vary: a quarter of the rows is not of the prompts
    rows = [{"prompt": f"post {p}", "chosen": f"a{i}", "rejected": "b", "swap": False} for i, p in enumerate(posts)]
    demo.pairs["train"].write_text("".join(json.dumps(row) + "\n" for row in rows))
    labelled = []

    def label(policy, prompts_file, n_prompts, out_file, seed, swap_pairs):
        prompts = [json.loads(line)["prompt"] for line in open(prompts_file)]
        labelled.append((n_prompts, len(prompts), swap_pairs))
        out_file.write_text("".join(json.dumps({"prompt": p, "chosen": "c", "rejected": "r"}) + "\n" for p in prompts))
        return len(prompts), 0

    monkeypatch.setattr(embedded, "label_policy_pairs", label)
    runs = proxy_runs(demo)
    assert [run.name for run in runs] == [f"the pairs of {n}" for n in PROXIES] + [
        f"the reward model {n}" for n in PROXIES
    ]
    for run in runs[:2]:
        run.call()
    quarter, four = (runs[i].done.read_text().splitlines() for i in (0, 1))
    assert [json.loads(line)["prompt"] for line in quarter] == ["post 0"] * 2  # 1 of 4 prompts: its 2 pairs
    assert four[:12] == demo.pairs["train"].read_text().splitlines() and len(four) == 12 + 12
    assert labelled == [(12, 12, True)]  # 3 x --pair_prompts new prompts
    new = {json.loads(line)["prompt"] for line in four[12:]}
    taken = {json.loads(line)["prompt"] for path in demo.paths.values() for line in open(path)}
    assert len(new) == 12 and not new & taken
    for run, name in zip(runs[2:], PROXIES, strict=True):
        cfg = script_config(run)
        assert Path(cfg.out_dir) == tmp_path / "demo" / name and run.done == tmp_path / "demo" / name / "hf"
        assert Path(cfg.train_data) == runs[list(PROXIES).index(name)].done
        assert cfg.steps == demo.args.rm_steps and Path(cfg.val_data) == demo.pairs["validation"]
    verdict = read_verdict(str(ROOT / "configs" / "verdict" / "rm_quality.toml"))
    arms = {run.name: script_config(run) for run in verdict_runs(demo, verdict, tmp_path / "posts.jsonl")}
    assert Path(arms["rso_4x"].reward_model) == runs[3].done and Path(arms["rso_quarter"].reward_model) == runs[2].done
    assert Path(arms["rso_beta2"].reward_model) == tmp_path / "demo" / "rm" / "hf"  # the demo's


def test_more_prompts_are_new_posts_and_the_same_for_the_same_arguments(tmp_path):
    from data.synthetic import write_more_prompts, write_task

    paths = write_task(tmp_path / "task", n_sft_train=20, n_sft_val=5, n_pref_train=20, n_pref_val=5, n_prompts=20)
    taken = {json.loads(line)["prompt"] for path in paths.values() for line in open(path)}
    first = write_more_prompts(tmp_path / "a.jsonl", 30, 0, taken).read_bytes()
    assert first == write_more_prompts(tmp_path / "b.jsonl", 30, 0, taken).read_bytes()
    prompts = [json.loads(line)["prompt"] for line in first.decode().splitlines()]
    assert len(set(prompts)) == 30 and not set(prompts) & taken


def test_best_of_n_is_kept_with_its_inputs_and_drawn_again_when_one_changes(tmp_path, monkeypatch):
    """kept_best_of_n writes best-of-n's curve with its inputs; --reuse takes it back while they are the same (the posts
    written again with the same rows, as the embedded task writes them at every start, are the same), and draws it
    again when one changes: the pool, a model's weights rewritten at the same path, the posts' rows. Without --reuse it
    is drawn at every start."""
    import os

    import experiments.verdict_best_of_n as verdict_module
    from experiments.verdict import Measurement
    from experiments.verdict_best_of_n import BEST_OF_N, kept_best_of_n

    models = {}
    for name in ("sft", "proxy"):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "model.safetensors").write_bytes(b"weights " + name.encode())
        (models[name] / "config.json").write_text("{}")
    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"prompt": "a"}\n')
    measured = Measurement(models["sft"], models["proxy"], posts, 12, gold_fn="data.synthetic:gold_reward")
    drawn = []

    def draw(measured, posts, best_of, pool, reading, *, seed, device):
        drawn.append(pool)
        return [{"n": 1, "gold": 0.1 * len(drawn), "posts": {"gold": [1 / 3, 2.5e-7 * len(drawn)]}}]

    monkeypatch.setattr(verdict_module, "reference_best_of_n", draw)
    folder = tmp_path / "verdict"

    def best_of_n(pool=8, reuse=True):
        return kept_best_of_n(measured, 2, 4, pool, ("validation", 96), folder, seed=0, reuse=reuse)

    first = best_of_n(reuse=False)
    assert best_of_n() == first and len(drawn) == 1  # kept: the same inputs
    posts.write_text('{"prompt": "a"}\n')  # the same rows written again
    assert best_of_n() == first and len(drawn) == 1
    moved = tmp_path / "other_verdict" / "posts.jsonl"  # the same rows in another verdict's folder: the same posts
    moved.parent.mkdir()
    moved.write_text('{"prompt": "a"}\n')
    measured.data = moved
    assert best_of_n() == first and len(drawn) == 1
    measured.data = posts
    assert best_of_n(pool=16) != first and drawn == [8, 16]  # another pool: drawn again, and written
    assert best_of_n(pool=16) == best_of_n(pool=16) and len(drawn) == 2
    weights = models["proxy"] / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"weights PROXY")  # retrained at the same path: same size, another time
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    best_of_n(pool=16)
    assert len(drawn) == 3
    posts.write_text('{"prompt": "b"}\n')  # other posts at the same path
    best_of_n(pool=16)
    assert len(drawn) == 4
    best_of_n(pool=16, reuse=False)
    assert len(drawn) == 5
    record = json.loads((folder / BEST_OF_N).read_text())
    assert record["inputs"]["pool"] == 16 and record["inputs"]["posts"]["max_prompt_len"] == 96
    assert record["best_of_n"] == best_of_n(pool=16) and len(drawn) == 5


def test_a_best_of_n_record_cut_short_is_never_reused(tmp_path, monkeypatch):
    """The record is written beside its place and renamed over it: a start killed while writing it leaves the record
    before it whole (here: the rename fails), and a record that is not whole JSON is drawn again, not read."""
    import experiments.verdict_best_of_n as verdict_module
    import utils.rundir
    from experiments.verdict import Measurement
    from experiments.verdict_best_of_n import BEST_OF_N, kept_best_of_n

    posts = tmp_path / "posts.jsonl"
    posts.write_text('{"prompt": "a"}\n')
    measured = Measurement(tmp_path / "sft", tmp_path / "proxy", posts, 12, gold_fn="data.synthetic:gold_reward")
    drawn = []
    monkeypatch.setattr(verdict_module, "reference_best_of_n", lambda *a, **k: drawn.append(1) or [{"n": len(drawn)}])
    folder = tmp_path / "verdict"

    def best_of_n(pool):
        return kept_best_of_n(measured, 2, 4, pool, ("validation", 96), folder, seed=0, reuse=True)

    assert best_of_n(8) == [{"n": 1}]
    before = (folder / BEST_OF_N).read_text()

    def killed(src, dst):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(utils.rundir.os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            best_of_n(16)
    assert (folder / BEST_OF_N).read_text() == before and [p.name for p in folder.iterdir()] == [BEST_OF_N]
    assert best_of_n(8) == [{"n": 1}] and len(drawn) == 2  # the record before it, whole, kept
    (folder / BEST_OF_N).write_text(before[: len(before) // 2])  # a record cut short by another writer
    assert best_of_n(8) == [{"n": 3}] and json.loads((folder / BEST_OF_N).read_text())["best_of_n"] == [{"n": 3}]

"""--config FILE (utils/config.py read_config_file): a YAML or TOML file of options under the command line, one line
and exit 2 for an unknown key or a wrong type, and configs/: every file valid for its script, the demo's files equal
to the options demo.py runs its stages with, the TL;DR files to the README's commands."""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import demo
import grpo
import sft
from experiments.embedded import Demo, pipeline
from tests import helpers
from tests.conftest import ROOT, run_script
from utils.config import ConfigError, parse_config, read_config_file, script_config

CONFIGS = ROOT / "configs"
STAGES = ("sft", "reward_model", "dpo", "grpo")


def config_files() -> list[Path]:
    """The stages' option files (configs/verdict/ holds verdicts: tests/test_experiments.py)."""
    return sorted(
        p for p in CONFIGS.rglob("*") if p.suffix in (".yaml", ".yml", ".toml") and p.parent.name != "verdict"
    )


# ----------------------------------------------------------------------------------------------------
# 1. configs/


def test_every_file_in_configs_is_valid_for_its_script():
    """A file's name is its script's (configs/tldr/grpo.toml: grpo.py); parse_config reads and validates it whole."""
    files = config_files()
    assert {(p.parent.name, p.stem) for p in files} == {(kind, s) for kind in ("tldr", "demo") for s in STAGES}
    for path in files:
        cls = script_config(path.stem)
        options = read_config_file(str(path), cls)
        cfg = parse_config(cls, ["--config", str(path)])
        assert options and all(getattr(cfg, k) == v for k, v in options.items()), path


def test_the_demo_files_are_the_options_demo_py_runs_its_stages_with():
    args = demo.parse_args([])
    out, data = Path(args.out), Path(args.out) / "data"
    paths = {
        "sft_train": data / "sft" / "train.jsonl",
        "sft_validation": data / "sft" / "validation.jsonl",
        "prompts_train": data / "prompts" / "train.jsonl",
    }
    runs = {run.script.removesuffix(".py"): run for run in pipeline(Demo(out, paths, args)) if run.script}
    stages = {stage: run.options for stage, run in runs.items()}
    for stage, options in stages.items():
        cls = script_config(stage)
        # the options as the demo's command line gives them; --resume false is how the demo starts, not what it runs
        given = parse_config(cls, [f"--{k}={v}" for k, v in options.items() if k != "resume"])
        from_file = parse_config(cls, ["--config", str(CONFIGS / "demo" / f"{stage}.yaml")])
        assert from_file == given, stage


def test_the_tldr_files_run_the_readmes_commands():
    """Each of the README's four commands ("One command each") is its file's run: the same options, with the file
    spelling out the defaults that define it (grpo: RSO keeping 8 of 64 samples per prompt)."""
    block = (ROOT / "README.md").read_text().split("One command each")[1].split("```bash")[1].split("```")[0]
    commands = {}
    for line in block.splitlines():
        words = shlex.split(line.split("#")[0])
        if words and words[1].removesuffix(".py") in STAGES:
            commands[words[1].removesuffix(".py")] = words[2:]
    assert set(commands) == set(STAGES)
    for stage, argv in commands.items():
        (path,) = (CONFIGS / "tldr").glob(f"{stage}.*")
        cls = script_config(stage)
        assert parse_config(cls, ["--config", str(path)]) == parse_config(cls, argv), stage
    cfg = parse_config(grpo.Config, ["--config", str(CONFIGS / "tldr" / "grpo.toml")])
    assert (cfg.selection, cfg.num_samples, cfg.num_kept, cfg.global_norm) == ("rso", 64, 8, True)


# ----------------------------------------------------------------------------------------------------
# 2. The file under the command line


def test_the_command_line_overrides_the_file_and_strings_read_as_on_the_command_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nlr = 2e-4\nsteps = 7\nresume = false\nbest_mode = "max"\nwarmup_steps = "3"\n')
    cfg = parse_config(sft.Config, ["--config", str(toml), "--steps", "9", "--resume=true"])
    assert (cfg.model, cfg.lr, cfg.steps, cfg.resume, cfg.best_mode, cfg.warmup_steps) == (
        "tiny",
        2e-4,
        9,
        True,
        "max",
        3,
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text("lr: 1e-4\nbatch_size: 16\nresume: 'no'\nresume_from:\n")  # YAML 1.1: 1e-4 is a string
    cfg = parse_config(sft.Config, [f"--config={yaml}"])
    assert (cfg.lr, cfg.batch_size, cfg.resume, cfg.resume_from) == (1e-4, 16, False, "")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert parse_config(sft.Config, ["--config", str(empty)]) == parse_config(sft.Config, [])


@pytest.mark.parametrize(
    "text, message",
    [
        ("lrr: 1.0e-4\n", "unknown option 'lrr'; did you mean lr?"),
        ("steps: 1.5\n", "steps: expected an integer, got 1.5 (float)"),
        ("steps: true\n", "steps: expected an integer, got True (bool)"),
        ("lr: fast\n", "lr: expected a number, got 'fast'"),
        ("resume: 1\n", "resume: expected a boolean (true/false), got 1 (int)"),
        ("dtype: fp16\n", "dtype: expected one of auto, bf16, fp32, got 'fp16'"),
        ("model: [gpt2]\n", "model: expected a string, got ['gpt2'] (list)"),
        ("- lr\n", "expected a mapping of option names to values, got a list"),
        ("lr: [1\n", "not valid YAML: "),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        parse_config(sft.Config, ["--config", str(path), "--steps", "2"])
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --config {path}: {message}"), err


def test_a_missing_file_or_another_suffix_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*none.yaml: cannot be read \(No such file or directory\)"):
        read_config_file(str(tmp_path / "none.yaml"), sft.Config)
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"run.json: expected a .yaml, .yml or .toml file"):
        read_config_file(str(tmp_path / "run.json"), sft.Config)


def grpo_file(tmp_path) -> Path:
    """A tiny GRPO run as a YAML file, its lr 1e-3 (the command line gives another) on a constant schedule."""
    prompts = helpers.write_sft_rows(tmp_path / "prompts.jsonl", n=16)
    pairs = helpers.write_pref_rows(tmp_path / "pairs.jsonl", n=8)
    options = {
        "model": "tiny",
        "random_init": True,
        "reward_model": "tiny",
        "reward_random_init": True,
        "train_data": str(prompts),
        "val_data": "",
        "pref_data": str(pairs),
        "pref_rows": 4,
        "num_samples": 4,
        "num_kept": 2,
        "max_new_tokens": 8,
        "max_prompt_len": 64,
        "prompts_per_step": 2,
        "micro_batch_size": 4,
        "steps": 2,
        "lr": 1.0e-3,
        "warmup_steps": 0,
        "min_lr_ratio": 1.0,
        "beta": 0.1,
        "eval_every": -1,
        "wandb_mode": "disabled",
        "out_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "grpo.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in options.items()))
    return path


def test_grpo_trains_with_the_files_options_and_the_command_lines_lr(tmp_path):
    path = grpo_file(tmp_path)
    run_script(["grpo.py", "--config", str(path), "--lr", "1e-6"], timeout=300)
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    expected = read_config_file(str(path), grpo.Config) | {"lr": 1e-6}
    assert {k: record[k] for k in expected} == expected
    assert "config" not in record and set(record) == {f.name for f in dataclasses.fields(grpo.Config)}
    rows = helpers.read_metrics(tmp_path / "run")
    assert [(r["step"], r["train/lr"]) for r in rows] == [(1, 1e-6), (2, 1e-6)]  # a constant schedule at the peak


@pytest.mark.parametrize("line, message", [("lrr: 1\n", "unknown option 'lrr'"), ("num_kept: two\n", "num_kept: ")])
def test_grpo_stops_at_a_bad_key_or_value_in_one_line_with_exit_2(tmp_path, line, message):
    path = grpo_file(tmp_path)
    path.write_text(path.read_text() + line)
    done = subprocess.run(
        [sys.executable, "grpo.py", "--config", str(path), "--lr", "1e-6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    assert re.fullmatch(rf"error: --config {re.escape(str(path))}: {message}.*\n", done.stderr), done.stderr
    assert not (tmp_path / "run").exists()

"""Gold from a reward model (Gao, Schulman and Hilton 2022, arXiv 2210.10760) on real TL;DR rows: the labelling rule
by hand, and the whole path with tiny models: a gold reward model trained on real human pairs, pairs of a policy's
samples labelled by it (python -m evaluation.label_pairs), a proxy trained on those labels (reward_model.py), then a
verdict file with a [task] table run by verdict.py: two arms of two seeds measured with gold from the gold model
(dpo.py --frontier_gold_model), best-of-n on the same posts and the verdict's table."""

import importlib
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dpo
import reward_model
from data.labels import pairs_by_score
from data.tldr import encode_prompt, encode_response
from data.tokenizer import get_tokenizer
from evaluation.frontier_declarations import FrontierConfig
from evaluation.label_pairs import labelled_rows, usable_summary
from evaluation.matched import frontier_points, verdict_rows
from evaluation.measure import load_frontier_prompts
from evaluation.samples import sample_summaries
from experiments import runner
from experiments.verdict import (
    check_runs,
    posts_reading,
    read_verdict,
    task_measurement,
    task_runs,
)
from experiments.verdict_best_of_n import BEST_OF_N, kept_best_of_n
from model.weights import build_reward_model
from tests.conftest import ROOT, shared_file
from tests.helpers import end_biased_policy, read_metrics
from utils.config import ConfigError, parse_config
from utils.dist import stream

# ----------------------------------------------------------------------------------------------------
# The labelling rule, by hand


def test_pairs_by_score_pairs_in_order_and_skips_ties():
    # 0 ties 1 and pairs with 2 (lower: 0 chosen); 1 then pairs with 3 (higher: 3 chosen)
    assert pairs_by_score([1.0, 1.0, 0.0, 2.0], [True] * 4) == [(0, 2), (3, 1)]
    # all tied: no preference, no pair
    assert pairs_by_score([0.5, 0.5, 0.5], [True] * 3) == []
    # three left that all tie the first one left after a pair: they stay unpaired
    assert pairs_by_score([2.0, 1.0, 1.0, 1.0], [True] * 4) == [(0, 1)]
    # an unusable summary is skipped whatever its score (NaN is never read)
    assert pairs_by_score([math.nan, 3.0, 1.0, 5.0], [False, True, True, True]) == [(1, 2)]
    assert pairs_by_score([], []) == []
    with pytest.raises(ValueError, match="2 scores, 3 usable"):
        pairs_by_score([1.0, 2.0], [True] * 3)


def test_labelled_rows_by_hand():
    texts = [[" a b\n", " c\n", " d", " \n"], [" e\n", " f\n"]]
    usable = [[usable_summary(t) for t in group] for group in texts]
    assert usable == [[True, True, False, False], [True, True]]  # no end token; nothing said
    scores = [[0.2, 0.7, math.nan, math.nan], [-1.0, -1.0]]
    rows = labelled_rows(["P0", "P1"], texts, scores, usable)
    assert rows == [{"prompt": "P0", "chosen": " c", "rejected": " a b", "gold_chosen": 0.7, "gold_rejected": 0.2}]


# ----------------------------------------------------------------------------------------------------
# The whole path on real rows, tiny models


def run(module, argv: list[str]) -> None:
    module.main(parse_config(module.Config, argv))


COMMON = ["--dtype", "fp32", "--device", "cpu", "--wandb_mode", "disabled", "--max_prompt_len", "96"]
ARMS = {"beta0.1": 0.1, "beta0.5": 0.5}

# The verdict the fixture runs: DPO at two betas on the gold-labelled pairs, two seeds each, measured on three posts
# with gold from the gold model, best-of-4 from a pool of 8; its [task] and the DPO file are filled in by the fixture
VERDICT = """name = "gold_verdict"
seeds = 2
posts = 3
samples = 2
pool = 8
best_of = 4
pairs = [["beta0.1", "beta0.5"]]

[task]
configs = "{configs}"
data = "{posts}"
reference = "{sft}"
proxy = "{proxy}"
gold_model = "{gold}"
max_new_tokens = 12

[arms."beta0.1"]
stage = "dpo"
beta = 0.1

[arms."beta0.5"]
stage = "dpo"
beta = 0.5
"""
DPO_OPTIONS = """train_data: {pairs}
val_data: ""
steps: 2
eval_every: 1
batch_size: 4
micro_batch_size: 4
max_prompt_len: 96
max_response_len: 24
lr: 2.0e-3
dtype: fp32
device: cpu
"""


def launch_here(cmd: list[str], env: dict) -> None:
    """experiments.runner.launch in this process: the script's main() on the command line verdict.py built (a
    subprocess per run would import torch again, a few seconds each)."""
    assert cmd[1].endswith(".py"), cmd  # one process: python SCRIPT --option value ...
    script = importlib.import_module(Path(cmd[1]).stem)
    script.main(parse_config(script.Config, cmd[2:]))


def write_verdict(path: Path, **task) -> Path:
    path.write_text(VERDICT.format(**task))
    return path


@torch.no_grad()
def direct_score(model, prompt: list[int], response: list[int]) -> float:
    """A reward model's normalized score of one prompt + response, one unpadded row (its own forward, none of
    rollouts.sampling's packing)."""
    ids = torch.tensor([prompt + response])
    raw = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool), len(prompt))
    return float(model.normalize(raw.double())[0])


@pytest.fixture(scope="module")
def gold_path(tmp_path_factory):
    """The procedure of docs/reporting.md (Gold from a reward model) on real TL;DR rows with tiny models: the models,
    then the verdict by python verdict.py --verdict FILE, its runs in this process (launch_here)."""
    import verdict
    from evaluation import label_pairs

    posts = str(shared_file("tldr-validation-sample.jsonl"))
    tmp = tmp_path_factory.mktemp("gold")
    human_pairs = str(tmp / "human_pairs.jsonl")  # the first 64 real comparisons
    lines = shared_file("tldr-preference-validation-sample.jsonl").read_text().splitlines(keepends=True)
    (tmp / "human_pairs.jsonl").write_text("".join(lines[:64]))
    sft = tmp / "sft" / "hf"
    end_biased_policy(sft)  # the policy every arm starts from (about half its summaries end by themselves)
    sizes = ["--batch_size", "8", "--micro_batch_size", "8", "--max_response_len", "24", "--lr", "1e-3"]
    sizes += ["--warmup_steps", "0", "--norm_prompts", "4", "--norm_samples_per_prompt", "2"]
    sizes += ["--norm_batch_size", "4", "--sft_policy", str(sft)]
    # 1. the gold reward model: larger than the proxy, trained on human pairs
    gold = tmp / "gold_rm"
    run(
        reward_model,
        ["--model", "small", "--random_init", "true", "--train_data", human_pairs, "--steps", "2", "--eval_every"]
        + ["-1", "--out_dir", str(gold), *sizes, *COMMON],
    )
    # 2. pairs of the policy's samples, labelled by the gold model
    pairs = tmp / "gold_pairs.jsonl"
    label_argv = ["--policy", str(sft), "--gold_model", str(gold / "hf"), "--prompts", human_pairs]
    label_argv += ["--n_prompts", "12", "--samples", "4", "--max_new_tokens", "24", "--max_prompt_len", "96"]
    counts = label_pairs.main(label_argv + ["--device", "cpu", "--out", str(pairs)])
    # 3. the proxy, on those labels: a fixed batch, so that its loss falls if it learns them
    proxy = tmp / "proxy_rm"
    run(
        reward_model,
        ["--model", "tiny", "--random_init", "true", "--train_data", str(pairs), "--steps", "3", "--eval_every", "-1"]
        + ["--overfit_batch", "true", "--out_dir", str(proxy), *sizes, *COMMON],
    )
    # 4. the verdict: its arms from the DPO file of its [task], best-of-n on the same posts, gold from the gold model
    configs = tmp / "configs"
    configs.mkdir()
    (configs / "dpo.yaml").write_text(DPO_OPTIONS.format(pairs=pairs))
    task = {"configs": configs, "posts": posts, "sft": sft, "proxy": proxy / "hf", "gold": gold / "hf"}
    path = write_verdict(tmp / "gold_verdict.toml", **task)
    argv = ["--verdict", str(path), "--out", str(tmp), "--device", "cpu", "--wandb_mode", "disabled", "--reuse"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "launch", launch_here)
        table = verdict.main(argv)
    root = tmp / "gold_verdict"
    runs = {arm: [root / arm / f"seed{seed}" for seed in (0, 1)] for arm in ARMS}
    record = json.loads((root / "verdict.json").read_text())
    return SimpleNamespace(
        sft=sft,
        gold=gold / "hf",
        proxy=proxy,
        pairs=pairs,
        counts=counts,
        runs=runs,
        table=table,
        record=record,
        root=root,
        task=task,
        argv=argv,
    )


def test_gold_models_labels_are_its_own_scores_of_what_the_proxy_reads(gold_path):
    rows = [json.loads(line) for line in gold_path.pairs.read_text().splitlines()]
    assert len(rows) == gold_path.counts["pairs"] >= 4 and gold_path.counts["usable"] < gold_path.counts["summaries"]
    tok, gold = get_tokenizer(), build_reward_model(str(gold_path.gold)).eval()
    for row in rows:
        assert row["gold_chosen"] > row["gold_rejected"]
        prompt = encode_prompt(tok, row["prompt"], 96)
        for side in ("chosen", "rejected"):
            expected = direct_score(gold, prompt, encode_response(tok, row[side], 24))
            assert row[f"gold_{side}"] == pytest.approx(expected, abs=1e-5)


def test_the_proxy_trained_on_the_gold_labels(gold_path):
    config = json.loads((gold_path.proxy / "config.json").read_text())
    assert config["train_data"] == str(gold_path.pairs)
    losses = [row["train/loss"] for row in read_metrics(gold_path.proxy) if "train/loss" in row]
    assert len(losses) == 3 and losses[2] < losses[0]  # one batch of the gold model's labels, learnt


def gold_of_samples(gold, prompts, samples, group: int) -> list[float]:
    """Per post, the mean of the gold model's direct_score of its `group` samples."""
    out = []
    for p, prompt in enumerate(prompts.prompts):
        rows = range(group * p, group * (p + 1))
        ids = [samples.response_ids[n][samples.response_mask[n]].tolist() for n in rows]
        out.append(sum(direct_score(gold, prompt, r) for r in ids) / group)
    return out


def test_the_gold_column_is_the_gold_models_score_of_the_samples(gold_path):
    """Every gold value is the gold model's: at step 0 each arm's policy is the SFT policy, whose frontier samples,
    drawn again with the evaluation's own generator and scored by the gold model one row at a time, give the gold
    column post by post; best-of-1's gold is the same for the pool of best-of-n's generator."""
    from model.weights import build_policy

    tok, gold = get_tokenizer(), build_reward_model(str(gold_path.gold)).eval()
    prompts = load_frontier_prompts(str(shared_file("tldr-validation-sample.jsonl")), "validation", 3, tok, 96, 12)
    policy = build_policy(str(gold_path.sft)).eval()
    for seed in (0, 1):
        _, _, samples = sample_summaries(policy, prompts.prompts, 2, 12, generator=stream(seed, 0, 0, "frontier"))
        expected = gold_of_samples(gold, prompts, samples, 2)
        for arm in ARMS:
            point = frontier_points(gold_path.runs[arm][seed])[0]
            assert point["step"] == 0 and point["posts"]["gold"] == pytest.approx(expected, abs=1e-5), (arm, seed)
            assert point["posts"]["proxy"] != pytest.approx(expected, abs=1e-3)  # the proxy is another model
    _, _, pool = sample_summaries(policy, prompts.prompts, 8, 12, generator=stream(0, 0, 0, "best-of-n"))
    best_of_1 = gold_path.record["best_of_n"][0]
    assert best_of_1["n"] == 1 and best_of_1["posts"]["gold"] == pytest.approx(gold_of_samples(gold, prompts, pool, 8))


def test_the_verdict_reads_gold_from_the_gold_model(gold_path):
    """verdict.py's table: the pair and each arm against best-of-n at matched KL, its numbers verdict_rows of the runs
    read again here from their folders (two arms, two seeds, post by post on the gold model's values), the frontier's
    table with the gold column under it; each run's command line the task's DPO file, the arm's beta and the
    measurement [task] sets."""
    record, table = gold_path.record, gold_path.table
    assert (gold_path.root / "verdict.md").read_text() == table + "\n"
    assert [p["n"] for p in record["best_of_n"]] == [1, 2, 4] and list(record["methods"]) == list(ARMS)
    methods = {arm: [frontier_points(d) for d in dirs] for arm, dirs in gold_path.runs.items()}
    assert methods == record["methods"]
    assert [[p["step"] for p in points] for seeds in methods.values() for points in seeds] == [[0, 1, 2]] * 4
    assert [row["pair"] for row in record["rows"]] == [
        "beta0.1 - beta0.5",
        "beta0.1 - best-of-n",
        "beta0.5 - best-of-n",
    ]
    (pair,) = verdict_rows(methods, record["best_of_n"], [("beta0.1", "beta0.5")])
    assert pair["seeds"] == 2 and pair["posts"] == 3 and "note" not in pair, pair
    assert table.startswith("Final: ") and "\n| pair (gold, A - B) |" in table and "beyond best-of-n" not in table
    # the pair's row in the table: the same numbers, read from the same runs' gold values
    low, high = pair["ci_low"], pair["ci_high"]
    assert (
        f"| beta0.1 - beta0.5 | {pair['kl']:.3f} (matched) | {pair['difference']:+.3f} | [{low:+.3f}, {high:+.3f}] |"
        in table
    )
    scalars = {k: v for k, v in pair.items() if not isinstance(v, list)}  # verdict.json's row: decided, and more
    assert {k: record["rows"][0][k] for k in scalars} == pytest.approx(scalars, nan_ok=True)
    assert record["rows"][0]["seed_differences"] == pytest.approx(pair["seed_differences"])
    assert "| policy | seeds | kl | kl bound | gold | proxy | win_rate |" in table.splitlines()
    for arm, beta in ARMS.items():
        for seed, folder in enumerate(gold_path.runs[arm]):
            cfg = json.loads((folder / "config.json").read_text())
            assert (cfg["beta"], cfg["seed"], cfg["model"], cfg["lr"]) == (beta, seed, str(gold_path.sft), 2e-3)
            assert (cfg["train_data"], cfg["frontier_data"]) == (str(gold_path.pairs), gold_path.task["posts"])
            assert (cfg["frontier_gold_model"], cfg["frontier_reward_model"]) == (
                str(gold_path.gold),
                str(gold_path.proxy / "hf"),
            )
    for picture in ("gold_verdict.png", "gold_verdict_forest.png", "gold_verdict_compute.png"):
        assert (gold_path.root / picture).stat().st_size > 10_000


def test_a_second_start_keeps_every_run(gold_path):
    """--reuse: the same file gives each run the options its FINISHED record holds, so a second start of the command
    keeps all four (experiments.runner.finished) and rebuilds the tables from them."""
    spec = read_verdict(gold_path.argv[1])
    runs = task_runs(spec, Path(gold_path.argv[3]), "disabled")
    assert [run.out_dir for run in runs] == [gold_path.runs[arm][seed] for seed in (0, 1) for arm in ARMS]
    assert all(runner.finished(run) for run in runs)
    offline = task_runs(spec, Path(gold_path.argv[3]), "offline")  # where a run is logged, not what it computes
    assert all(runner.finished(run) for run in offline)
    changed = [replace(run, options=run.options | {"lr": 1e-3}) for run in runs]  # another option: every run again
    assert not any(runner.finished(run) for run in changed)


def test_a_second_start_keeps_best_of_n(gold_path, monkeypatch):
    """--reuse: the first start wrote best-of-n's curve with its inputs (the three model folders, the posts, how the
    arms read them, pool, n, seed, device); the same file on the same models takes it back without drawing, equal to
    the curve verdict.json holds; a proxy exported again at the same path (another modification time) draws it again."""
    import os

    import experiments.verdict_best_of_n as verdict_module

    spec = read_verdict(gold_path.argv[1])
    reading = posts_reading(spec, check_runs(spec, task_runs(spec, Path(gold_path.argv[3]), "disabled")))
    drawn = []
    monkeypatch.setattr(verdict_module, "reference_best_of_n", lambda *a, **k: drawn.append(1) or [])

    def best_of_n() -> list[dict]:
        measured = task_measurement(spec.task)
        return kept_best_of_n(
            measured, spec.posts, spec.best_of, spec.pool, reading, gold_path.root, seed=0, reuse=True
        )

    assert best_of_n() == gold_path.record["best_of_n"] and not drawn
    record = gold_path.root / BEST_OF_N
    kept = record.read_text()
    weights = gold_path.proxy / "hf" / "model.safetensors"
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert best_of_n() == [] and drawn == [1]
    finally:  # the fixture's folder as it was, for the tests after this one
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        record.write_text(kept)


def refuses(argv: list[str], capsys) -> str:
    """verdict.py's one line on stderr and its exit code 2, nothing on stdout."""
    import verdict

    with pytest.raises(SystemExit) as exit_:
        verdict.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and err.count("\n") == 1, (exit_.value.code, out, err)
    return err


@pytest.mark.parametrize(
    "change, message",
    [
        (("gold_model = ", "gold_modle = "), "task: unknown key 'gold_modle'; did you mean gold_model?"),
        (("max_new_tokens = 12\n", ""), "task: missing key 'max_new_tokens' (tokens of each measured summary "),
        (("max_new_tokens = 12", "max_new_tokens = 0"), "task.max_new_tokens: expected a positive integer, got 0"),
        ({"configs": "nowhere"}, "task.configs: nowhere holds none of dpo.yaml, dpo.yml, dpo.toml "),
        ({"sft": "runs/nowhere/hf"}, "task.reference: model folder runs/nowhere/hf does not exist"),
        ({"proxy": "SFT"}, "task.proxy SFT is a policy"),
        ({"gold": "PROXY"}, "task.gold_model PROXY is task.proxy (PROXY): gold must be a reward model the policy "),
        (("beta = 0.5", "beta = 0.5\nmodel = 'x'"), "arms.beta0.5: model is set by the verdict: every arm starts "),
        (("beta = 0.5", "beta = 0.5\nmax_prompt_len = 64"), "arms.beta0.5: reads the posts with --val_split "),
    ],
)
def test_a_bad_task_is_one_line_and_exit_2_before_any_run(gold_path, tmp_path, capsys, change, message):
    """A fault of the file or of its [task]'s models: one line naming the key, exit 2, nothing written or run."""
    names = {"SFT": str(gold_path.sft), "PROXY": str(gold_path.proxy / "hf")}
    task = gold_path.task | ({k: names.get(v, v) for k, v in change.items()} if isinstance(change, dict) else {})
    text = VERDICT.format(**task)
    if isinstance(change, tuple):
        assert text.count(change[0]) == 1, change
        text = text.replace(*change)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = tmp_path / "out"
    err = refuses(["--verdict", str(path), "--out", str(out), "--device", "cpu"], capsys)
    for name, folder in names.items():
        message = message.replace(name, folder)
    assert err.startswith(f"error: --verdict {path}: {message}"), err
    assert not out.exists()
    if "max_prompt_len" in text:
        assert "--max_prompt_len 64, arms.beta0.1 with --val_split validation --max_prompt_len 96: every arm" in err


def test_a_gold_model_that_is_the_proxy_is_refused(gold_path, tmp_path):
    proxy = str(gold_path.proxy / "hf")
    cfg = FrontierConfig(frontier_prompts=2, frontier_reward_model=proxy, frontier_gold_model=proxy + "/")
    with pytest.raises(ConfigError, match="--frontier_gold_model .* is the frontier's proxy"):
        cfg.validate_frontier()
    with pytest.raises(ConfigError, match="is the frontier's proxy"):  # dpo.py's --judge is the frontier's proxy
        FrontierConfig(frontier_gold_model=proxy).validate_frontier(stage_proxy=proxy)
    with pytest.raises(ConfigError, match="both give the gold reward"):
        FrontierConfig(
            frontier_gold_model=str(gold_path.gold), frontier_gold_fn="data.synthetic:gold_reward"
        ).validate_frontier()


# ----------------------------------------------------------------------------------------------------
# configs/verdict/tldr.toml


def test_the_tldr_verdicts_arms_are_valid_runs_measured_by_the_gold_model():
    """Each arm's first run of configs/verdict/tldr.toml as verdict.py builds it, parsed by its own script: the stage's
    configs/tldr/ file, [base.<stage>], the arm's options, the measurement from [task]."""
    import grpo

    scripts = {"grpo": grpo, "dpo": dpo}
    spec = read_verdict(str(ROOT / "configs" / "verdict" / "tldr.toml"))
    runs = task_runs(spec, Path("runs"), "disabled")
    assert posts_reading(spec, check_runs(spec, runs)) == ("validation", 512)  # best-of-n reads the posts so too
    first = {run.name: run for run in runs if run.options["seed"] == 0}
    assert set(first) == {"rso", "uniform", "plain8", "dpo"} and len(runs) == 3 * 4
    for arm, run in first.items():
        stage = run.script.removesuffix(".py")
        argv = [f"--{k}={v}" for k, v in run.options.items()]
        cfg = parse_config(scripts[stage].Config, argv)  # every option declared, of its type, and validated
        assert cfg.frontier_gold_model == "runs/gold_rm/hf" and cfg.frontier_reward_model == "runs/proxy_rm/hf", arm
        assert cfg.model == "runs/sft/hf" and cfg.frontier_prompts == 400 and cfg.seed == 0, arm
        assert Path(cfg.out_dir) == Path("runs/verdict_tldr") / arm / "seed0" and cfg.max_prompt_len == 512, arm
        if stage == "grpo":
            assert cfg.reward_model == cfg.frontier_reward_model  # GRPO trains on the proxy the table reads
            assert cfg.steps == 200 and cfg.prompts_per_step == 256  # [base.grpo], then configs/tldr/grpo.toml
        else:
            assert cfg.train_data == "runs/gold_pairs/train.jsonl"  # DPO on the gold model's labels
            assert cfg.steps == 600 and cfg.batch_size == 64
    assert (first["plain8"].options["num_samples"], first["plain8"].options["selection"]) == (8, "all")

"""Config parsing, the learning-rate schedule, and the Logger's wandb modes."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sft
from tests.conftest import ROOT
from utils.config import accumulation_steps, field_docs, parse_config
from utils.logging import Logger
from utils.optim import cosine_with_warmup


def test_every_sft_option_is_documented(capsys):
    docs = field_docs(sft.Config)
    assert set(docs) == {f.name for f in dataclasses.fields(sft.Config)}
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(sft.Config):
        assert f"--{f.name}" in out


def test_overrides_types_and_booleans():
    cfg = parse_config(sft.Config, ["--lr", "1e-4", "--batch_size", "16", "--resume", "false", "--model", "tiny"])
    assert cfg.lr == 1e-4 and cfg.batch_size == 16 and cfg.resume is False and cfg.model == "tiny"


def test_misspelled_option_names_the_closest(capsys):
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--micro_batchsize", "4"])
    assert "did you mean --micro_batch_size" in capsys.readouterr().err


def test_bad_value_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--batch_size", "0"])
    assert "--batch_size must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(sft.Config, ["--resume", "maybe"])
    assert "expected a boolean" in capsys.readouterr().err


def test_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        accumulation_steps(batch_size=10, micro_batch_size=4, world_size=2)
    assert accumulation_steps(64, 8, 2) == 4


def test_cosine_with_warmup_by_hand():
    assert cosine_with_warmup(0, 4, 100, 0.1) == 0.25
    assert cosine_with_warmup(3, 4, 100, 0.1) == 1.0
    assert cosine_with_warmup(4, 4, 100, 0.1) == 1.0
    mid = 4 + 48  # half-way through the decay: cos(pi/2) = 0
    assert math.isclose(cosine_with_warmup(mid, 4, 100, 0.1), 0.1 + 0.9 * 0.5)
    assert math.isclose(cosine_with_warmup(100, 4, 100, 0.1), 0.1)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_logger_writes_metrics_in_every_wandb_mode(tmp_path, mode):
    log = Logger(tmp_path, {"a": 1}, "test", "run", mode, enabled=True)
    log.log({"loss": 1.5, "nan": float("nan")}, step=3)
    log.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 3, "loss": 1.5}]
    assert (tmp_path / "wandb").exists() == (mode == "offline")
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}  # what evaluation/compare.py groups by


def test_wandb_auto_says_which_mode_and_an_offline_run_how_to_sync(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: no login
    log = Logger(tmp_path / "run", {}, "test", "run", "auto", enabled=True)
    log.finish()
    lines = capsys.readouterr().err.splitlines()
    folder = Path(log.run.dir).parent
    assert folder.is_dir() and folder.parent == tmp_path / "run" / "wandb"
    sync = f"wandb: offline run in {folder}; upload it with: wandb sync {folder}"
    assert lines == ["wandb: --wandb_mode auto -> offline (no login in WANDB_API_KEY or ~/.netrc)", sync, sync]


def test_logger_gives_the_wandb_run_its_group_and_tags(tmp_path):
    log = Logger(
        tmp_path, {}, "test", "run", "offline", enabled=True, group="selection=rso", tags="selection=rso, seed=2"
    )
    assert log.run.group == "selection=rso" and tuple(log.run.tags) == ("selection=rso", "seed=2")
    log.finish()


# ----------------------------------------------------------------------------------------------------
# Checkpoints, metrics files and the data position under crashes (the end-to-end kill tests are in
# test_distributed.py, test_grpo.py and test_reward_dpo.py)


def tiny_training_state(seed=0):
    import torch

    from model.gpt2 import GPT2LMHeadModel, GPTConfig
    from utils.optim import build_optimizer, build_scheduler

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPTConfig(vocab_size=64, n_positions=16, n_layer=1, n_head=2, n_embd=8))
    optimizer = build_optimizer(model, 1e-2, 0.0)
    scheduler = build_scheduler(optimizer, 1, 10)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler, {"stage": "test", "model_config": model.cfg.to_dict()}


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import torch

    from utils import checkpoint
    from utils.checkpoint import find_checkpoint, load_checkpoint, newest_intact, save_checkpoint

    model, optimizer, scheduler, meta = tiny_training_state()
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler, meta, extra={"loader": {"epoch": 0}})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    def dies_half_way(obj, path):  # the process "dies" with the shards written and a half-written state.pt
        path.write_bytes(b"\x80\x02half")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_torch_synced", dies_half_way)
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, meta)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / ".step_00000002.tmp").is_dir()  # the debris, never renamed
    assert newest_intact(tmp_path).name == "step_00000001"
    assert find_checkpoint(tmp_path, "", meta) == tmp_path / "checkpoints" / "step_00000001"
    fresh, fresh_optimizer, fresh_scheduler, _ = tiny_training_state(seed=1)
    state = load_checkpoint(newest_intact(tmp_path), fresh, fresh_optimizer, fresh_scheduler, meta)
    assert state["step"] == 1 and state["extra"] == {"loader": {"epoch": 0}}
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, meta)
    assert not list((tmp_path / "checkpoints").glob(".step_*"))  # the next save clears the debris


def test_a_checkpoint_of_an_older_format_is_refused_with_one_line(tmp_path):
    # a state.pt with the full model inside and no digests.json: what this project's code wrote before the sharded,
    # digested format; it is refused, naming the folder, wherever it is met
    import json

    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from utils.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, read_tensors

    model, optimizer, scheduler, meta = tiny_training_state()
    folder = tmp_path / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    torch.save({"step": 1, "meta": meta, "model": get_model_state_dict(model)}, folder / "state.pt")
    for meta_json in (None, {**meta, "step": 1}):  # before meta.json existed, and with a meta.json of that format
        (folder / "meta.json").unlink(missing_ok=True)
        if meta_json is not None:
            (folder / "meta.json").write_text(json.dumps(meta_json))
        for read in (
            lambda: find_checkpoint(tmp_path, "", meta),
            lambda: load_checkpoint(folder, model, optimizer, scheduler, meta),
            lambda: read_tensors(folder),
        ):
            with pytest.raises(CheckpointError) as e:
                read()
            assert str(e.value).startswith(f"checkpoint {folder} is from an older checkpoint format of this project")
            assert "\n" not in str(e.value)


def test_pruning_keeps_the_last_n_and_the_best_and_a_broken_pointer_falls_back(tmp_path, capsys):
    from utils.checkpoint import newest_intact, save_checkpoint
    from utils.run import update_best
    from utils.rundir import read_best

    model, optimizer, scheduler, meta = tiny_training_state()
    best = None
    for step, val_loss in [(1, 3.0), (2, 2.0), (3, 2.5), (4, 2.7), (5, 2.9)]:
        best, improved = update_best(best, {"val/loss": val_loss}, "val/loss", "min", step)
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, meta, keep_last=2, best=best if improved else None)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_00000002", "step_00000004", "step_00000005"]
    assert read_best(tmp_path) == {
        "checkpoint": "step_00000002",
        "step": 2,
        "metric": "val/loss",
        "mode": "min",
        "value": 2.0,
    }
    assert update_best(best, {"train/loss": 1.0}, "val/loss", "min", 6) == (best, False)  # no validation this step
    assert update_best(best, {"val/acc": 1.0}, "val/acc", "max", 6)[1]  # another metric: a new record
    with pytest.raises(
        ValueError, match=r"--best_metric val/los is not logged by this stage; its val/ metrics are \['val/loss'\]"
    ):
        update_best(best, {"val/loss": 1.0}, "val/los", "min", 6)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000009")  # names a folder deleted by hand
    assert newest_intact(tmp_path).name == "step_00000005"
    assert "names 'step_00000009', which is missing; looking for the newest checkpoint" in capsys.readouterr().err


def rewrite_state(folder, state) -> None:
    """Replace a checkpoint's state.pt with `state` and re-record its digests, as someone who edits a checkpoint can:
    digests.json proves that files are whole, not who wrote them."""
    import json

    import torch

    from utils.digests import DIGESTS, file_digests, listing_digest

    torch.save(state, folder / "state.pt")
    files = json.loads((folder / DIGESTS).read_text())["files"] | file_digests(folder, ["state.pt"])
    (folder / DIGESTS).write_text(json.dumps({"files": files, "sha256": listing_digest(files)}))


class RunsCode:
    """Unpickling this runs code: it writes the file it names (what a malicious checkpoint could do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_state_file_carrying_a_pickled_callable_is_refused_in_one_line_and_runs_nothing(tmp_path):
    import torch

    from utils.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint

    model, optimizer, scheduler, meta = tiny_training_state()
    folder = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, meta, extra={"loader": {"epoch": 0}})
    state = torch.load(folder / "state.pt", weights_only=False)  # the test's own file
    marker = tmp_path / "code_ran"
    rewrite_state(folder, state | {"extra": {"loader": {"epoch": 0}, "payload": RunsCode(marker)}})
    assert find_checkpoint(tmp_path, "", meta) == folder  # whole by its digests: only the load can refuse it
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, model, optimizer, scheduler, meta)
    message = str(e.value)
    assert message.startswith(f"checkpoint {folder / 'state.pt'} holds more than tensors and plain values"), message
    assert "exec" in message and "\n" not in message, message
    assert not marker.exists()


def test_a_checkpoint_holding_numpy_rng_state_as_an_array_still_resumes(tmp_path):
    # checkpoints written before utils.dist.rng_state kept plain values hold numpy's state as np.random.get_state()
    # gives it (an array inside a tuple): they resume, numpy's stream included, without pickle's code paths
    import numpy as np
    import torch

    from utils.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer, scheduler, meta = tiny_training_state()
    folder = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, meta, extra={"loader": {"epoch": 0}})
    state = torch.load(folder / "state.pt", weights_only=True)  # this project's state: tensors and plain values
    np.random.seed(5)
    state["rng"][0]["numpy"] = np.random.get_state()
    expected = np.random.rand(3)
    rewrite_state(folder, state)
    np.random.seed(6)
    assert load_checkpoint(folder, model, optimizer, scheduler, meta)["step"] == 1
    assert np.array_equal(np.random.rand(3), expected)


def test_rng_state_round_trips_every_stream():
    import random

    import numpy as np
    import torch

    from utils.dist import rng_state, set_rng_state

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.randn()  # a cached Gaussian in numpy's state
    state = rng_state()
    expected = (random.random(), np.random.randn(2).tolist(), torch.rand(2))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(state)
    assert (random.random(), np.random.randn(2).tolist()) == expected[:2] and torch.equal(torch.rand(2), expected[2])


def test_resumed_logger_drops_what_the_killed_run_logged_after_its_checkpoint(tmp_path):
    lines = [
        {"step": 0, "val/acc": 0.5},
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 1.0},
        {"step": 3, "norm/gain": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 4, "lo')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "rows": []}) + "\n" for s in (1, 2, 3)))
    log = Logger(tmp_path, {}, "test", "run", "disabled", enabled=True, resume_step=2)
    log.log({"loss": 1.5}, step=3)
    log.table("samples", ["a"], [[1]], step=3)
    log.finish()
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == lines[:3] + [{"step": 3, "loss": 1.5}]
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1, 2, 3]
    # the final checkpoint (step 3) was saved before the normalisation logged its line: keep the first line of step 3
    Logger(tmp_path, {}, "test", "run", "disabled", enabled=True, resume_step=3).finish()
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 4
    Logger(tmp_path, {}, "test", "run", "disabled", enabled=True, resume_step=0).finish()  # a fresh start
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_data_position_is_checked_and_converted_between_global_batch_sizes():
    from data.tldr import ShardedLoader

    one = ShardedLoader(40, 4, 0, 1, seed=3, collate=lambda idx: idx)
    for _ in range(4):
        next(one)  # 16 examples into epoch 0
    two_ranks = [ShardedLoader(40, 8, r, 2, seed=3, collate=lambda idx: idx) for r in range(2)]
    for loader in two_ranks:
        loader.load_state_dict(one.state_dict())  # global batch 4 -> 16: the same 16 examples taken
    assert two_ranks[0].state_dict()["batch_in_epoch"] == 1
    assert next(two_ranks[0]) + next(two_ranks[1]) == sum((next(one) for _ in range(4)), [])
    with pytest.raises(ValueError, match="for 40 examples, but this data has 41"):
        ShardedLoader(41, 4, 0, 1, seed=3, collate=lambda idx: idx).load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="not a whole number of this run's global batches of 24"):
        ShardedLoader(40, 24, 0, 1, seed=3, collate=lambda idx: idx).load_state_dict(one.state_dict())


@pytest.mark.parametrize("script", ["sft", "reward_model", "dpo", "grpo", "eval_preferences"])
def test_every_script_help_documents_every_option(script, capsys):
    import importlib

    from utils.config import parse_config

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(module.Config, argv=["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(module.Config):
        assert f"--{field.name}" in text, field.name


def _without_wandb(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))


def test_wandb_auto_without_wandb_installed_logs_to_metrics_only(tmp_path, monkeypatch, capsys):
    from utils.logging import Logger

    _without_wandb(monkeypatch)
    logger = Logger(tmp_path / "run", {"lr": 1.0}, "p", "n", "auto", enabled=True, resume_step=0)
    logger.log({"train/loss": 1.5}, step=1)
    logger.finish()
    assert logger.run is None
    assert (
        capsys.readouterr().err.strip()
        == "wandb: --wandb_mode auto -> disabled (wandb is not installed): metrics.jsonl only"
    )
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {"step": 1, "train/loss": 1.5}


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_wandb_online_or_offline_without_wandb_installed_stops_at_start(tmp_path, monkeypatch, capsys, mode):
    import sft
    from tests.helpers import run_cli

    _without_wandb(monkeypatch)
    out = tmp_path / "run"
    code, message = run_cli(
        sft,
        [
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--train_data",
            "x.jsonl",
            "--wandb_mode",
            mode,
            "--out_dir",
            str(out),
        ],
        capsys,
    )
    assert code == 2
    assert message.startswith(
        f"error: --wandb_mode {mode} needs the wandb package, which is not installed: pip install "
        f"wandb, or --wandb_mode disabled (or auto: no wandb, metrics.jsonl only)"
    )
    assert not out.exists()  # nothing written


FAULTS_OF_REALLOCATIONS = """
import resource, sys
import torch
from utils.host import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(24):  # a 40 MB tensor (above any mmap threshold of glibc) allocated, written and freed, 24 times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(10_000_000).fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, sum(faults[-8:]))  # the last 8: small allocations between cycles split freed blocks at first
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_keep_freed_memory_reuses_freed_tensors_without_page_faults():
    """40 MB tensors allocated, written and freed in a loop, as a training step's logits are: with glibc's defaults
    every one page-faults on each of its 4 KB pages (the memory went back to the kernel at each free); once
    keep_freed_memory has run, none once the heap holds enough freed blocks (after up to ~10 cycles). A user's own
    malloc settings in the environment are left alone."""

    def run(mode: str, **env) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS_OF_REALLOCATIONS, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        ).stdout.split()
        return out[0], int(out[1])

    took, faults = run("default")
    if faults < 40_000:  # e.g. transparent huge pages for every allocation: a fault per 2 MB, nothing to save
        pytest.skip(f"8 allocations of 40 MB page-fault only {faults} times with this system's defaults")
    took, kept = run("keep")
    assert took == "True" and kept < 1_000, (faults, kept)
    took, _ = run("keep", MALLOC_MMAP_MAX_="65536")
    assert took == "False"


HUGE_PAGES_AFTER_SCRIPT_IMPORTS = """
import sys
import dpo, grpo, reward_model, sft  # every training script's imports, as torchrun runs them
from utils.host import huge_pages
took = huge_pages()
import torch
x = torch.ones(2**24)  # 64 MB, written
huge = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")][0]
print(took, huge)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux only")
def test_huge_pages_take_after_every_scripts_imports():
    """PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation: the scripts' imports must
    make no tensor, or huge_pages (called from setup_distributed) would come too late. Then a 64 MB tensor sits on
    huge pages (when the kernel has them to give), and a user's own setting is left alone."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    run = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_AFTER_SCRIPT_IMPORTS], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    took, huge_kb = run.stdout.split()
    assert took == "True", "a script's imports made a CPU tensor before setup_distributed could ask for huge pages"
    assert int(huge_kb) >= 32 * 1024, f"only {huge_kb} kB on huge pages"
    user = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_AFTER_SCRIPT_IMPORTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "THP_MEM_ALLOC_ENABLE": "0"},
    )
    assert user.stdout.split()[0] == "False"

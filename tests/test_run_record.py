"""A run's record is never wrong and nothing saved is lost (docs/errors.md, "The run directory"): one writer per run
folder, options checked on resume, checkpoints verified against their digests, a failed write reported in one line,
metrics.jsonl repaired on resume, and warnings where a run would otherwise go quietly wrong."""

import errno
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import sft
import utils.checkpoint as checkpoint
from rlhf.rewards import RewardSource
from rollouts.sampling import RewardSpec, warn_constant_sources
from tests import helpers
from tests.conftest import ROOT, checkpoint_step, free_port, run_script
from utils.checkpoint import CheckpointError, checkpoint_problem, find_checkpoint, read_tensors, save_checkpoint
from utils.config import ConfigError, parse_config
from utils.logging import Logger
from utils.optim import build_optimizer, build_scheduler
from utils.run import epoch_steps
from utils.rundir import LOCK, check_wandb_login, lock_run_dir, options_record, release_run_dir, write_record


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    rng = random.Random(0)
    words = "cat dog car house job money friend sister brother school game phone rent boss date trip".split()
    lines = []
    for _ in range(16):
        post = " ".join(rng.choice(words) for _ in range(rng.randint(8, 20)))
        prompt = f"SUBREDDIT: r/{rng.choice(words)}\n\nTITLE: {rng.choice(words)}\n\nPOST: {post}\n\nTL;DR:"
        lines.append(json.dumps({"prompt": prompt, "completion": " " + " ".join(rng.sample(words, 3))}) + "\n")
    path = tmp_path_factory.mktemp("rows") / "sft.jsonl"
    path.write_text("".join(lines))
    return path


def sft_args(rows, out, *extra) -> list[str]:
    return [
        "--model",
        "tiny",
        "--random_init",
        "true",
        "--train_data",
        str(rows),
        "--val_data",
        "",
        "--max_prompt_len",
        "64",
        "--max_response_len",
        "16",
        "--batch_size",
        "4",
        "--micro_batch_size",
        "2",
        "--lr",
        "1e-3",
        "--warmup_steps",
        "1",
        "--wandb_mode",
        "disabled",
        "--out_dir",
        str(out),
        *extra,
    ]


def run_sft(rows, out, *extra) -> list[dict]:
    sft.main(parse_config(sft.Config, sft_args(rows, out, *extra)))
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


# ----------------------------------------------------------------------------------------------------
# 1. One writer per run folder


def test_a_second_run_on_a_folder_stops_at_start_and_a_dead_holders_lock_is_taken_over(rows, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from utils.rundir import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(300)",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, message = helpers.run_cli(sft, sft_args(rows, out, "--steps", "1"), capsys)
        assert code == 2
        assert f"--out_dir {out} is in use by another run (pid {holder.pid} on " in message, message
        assert "wait for it to end, or use another --out_dir" in message
        assert sorted(os.listdir(out)) == [LOCK]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    run_sft(rows, out, "--steps", "1")  # the holder died holding the lock: taken over, with one warning
    taken = [w for w in warnings_in(capsys.readouterr().err) if "took over the lock" in w]
    assert len(taken) == 1 and f"pid {holder.pid} on " in taken[0], taken
    assert (out / LOCK).read_text() == ""  # released at the end: the next run starts without a warning


@pytest.mark.slow
def test_two_runs_on_one_folder_lose_nothing(rows, tmp_path, capsys):
    """The case that lost 14 steps of metrics: a second run of the same command while the first is training."""
    out = tmp_path / "run"
    args = sft_args(rows, out, "--steps", "6", "--save_every", "2")
    first = subprocess.Popen(
        [sys.executable, "sft.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        code, message = helpers.run_cli(sft, args, capsys)
        assert code == 2 and f"is in use by another run (pid {first.pid} on " in message, message
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert checkpoint_step(out) == 6 and (out / "hf").is_dir()


def test_the_lock_is_reentrant_in_one_process_and_released_empty(tmp_path):
    lock_run_dir(tmp_path)
    lock_run_dir(tmp_path)  # an earlier run of this process holds it: kept
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    release_run_dir(tmp_path)
    assert (tmp_path / LOCK).read_text() == ""


# ----------------------------------------------------------------------------------------------------
# 2. Options on resume


def test_changed_options_stop_the_resume_and_allow_appends_them_with_their_step(rows, tmp_path, capsys):
    out = tmp_path / "run"
    run_sft(rows, out, "--steps", "2", "--save_every", "1")
    record, metrics = (out / "config.json").read_text(), (out / "metrics.jsonl").read_text()
    changed = ("--steps", "3", "--save_every", "1", "--lr", "1e-2", "--seed", "5")
    code, message = helpers.run_cli(sft, sft_args(rows, out, *changed), capsys)
    assert code == 2
    assert "holds a run started with other options (--lr 0.001 -> 0.01, --seed 1 -> 5)" in message, message
    assert "--resume_changes allow to continue from step 2" in message
    assert (out / "config.json").read_text() == record and (out / "metrics.jsonl").read_text() == metrics
    assert checkpoint_step(out) == 2

    run_sft(rows, out, *changed, "--resume_changes", "allow")
    assert any(
        "continuing from step 2 with changed options (--lr 0.001 -> 0.01, --seed 1 -> 5)" in w
        for w in warnings_in(capsys.readouterr().err)
    )
    saved = json.loads((out / "config.json").read_text())
    assert (saved["lr"], saved["seed"], saved["steps"]) == (1e-3, 1, 2)  # what the run started with
    assert saved["option_changes"] == [{"step": 2, "options": {"steps": [2, 3], "lr": [1e-3, 1e-2], "seed": [1, 5]}}]


def test_free_options_are_recorded_without_asking_and_compared_after_earlier_changes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lr": 1.0, "steps": 2, "seed": 1, "out_dir": "a"}))
    options = {"lr": 1.0, "steps": 5, "seed": 1, "out_dir": "b", "resume_changes": "refuse"}
    declared = {"free": sft_free(), "unrecorded": sft_unrecorded()}  # what sft.py's options declare
    assert {"steps", "keep_last"} <= declared["free"] and "out_dir" in declared["unrecorded"]
    record = options_record(tmp_path, options, 2, allow=False, **declared)
    assert record["option_changes"] == [{"step": 2, "options": {"steps": [2, 5]}}]  # out_dir: where, not what
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert options_record(tmp_path, options, 4, allow=False, **declared) == record  # nothing changed since
    with pytest.raises(ConfigError, match=r"\(--seed 1 -> 2\)"):
        options_record(tmp_path, {**options, "seed": 2}, 4, allow=False, **declared)


def sft_free() -> set[str]:
    from utils.config import declared

    return set(declared(sft.Config, "free"))


def sft_unrecorded() -> set[str]:
    from utils.config import declared

    return set(declared(sft.Config, "recorded"))


def test_the_options_check_holds_with_config_json_deleted_emptied_or_lacking_a_key(rows, tmp_path, capsys):
    # every checkpoint holds the run's record of options: a resume compares against it, whatever config.json says
    first = tmp_path / "first"
    run_sft(rows, first, "--steps", "2", "--save_every", "1")
    for how in ("deleted", "emptied", "lacking"):
        out = tmp_path / how
        shutil.copytree(first, out)
        record_file = out / "config.json"
        if how == "deleted":
            record_file.unlink()
        elif how == "emptied":
            record_file.write_text("")
        else:
            record_file.write_text(
                json.dumps({k: v for k, v in json.loads(record_file.read_text()).items() if k != "lr"})
            )
        code, message = helpers.run_cli(sft, sft_args(rows, out, "--steps", "2", "--lr", "1e-2", "--seed", "5"), capsys)
        assert code == 2 and "holds a run started with other options (--lr 0.001 -> 0.01, --seed 1 -> 5)" in message
    run_sft(rows, tmp_path / "deleted", "--steps", "2", "--save_every", "1")  # the recorded options: written again
    assert any(
        w.endswith("config.json is missing; it is written again from the record of options in the checkpoint of step 2")
        for w in warnings_in(capsys.readouterr().err)
    )
    assert json.loads((tmp_path / "deleted" / "config.json").read_text()) == json.loads(
        (first / "config.json").read_text()
    )


def test_an_option_the_record_lacks_compares_against_its_default_and_joins_the_record(tmp_path):
    saved = {"lr": 1.0, "seed": 1}  # the record of a run started before --judge existed
    defaults = {"lr": 3e-4, "seed": 0, "judge": ""}
    declared = {"free": sft_free(), "unrecorded": sft_unrecorded()}
    record = options_record(tmp_path, {"lr": 1.0, "seed": 1, "judge": ""}, 2, False, saved, defaults, **declared)
    assert record == {"lr": 1.0, "seed": 1, "judge": ""}
    with pytest.raises(ConfigError, match=r"\(--judge  -> rm/hf\)"):
        options_record(tmp_path, {"lr": 1.0, "seed": 1, "judge": "rm/hf"}, 2, False, saved, defaults, **declared)


def test_an_option_the_code_no_longer_has_refuses_the_resume_unless_allowed(tmp_path, capsys):
    saved = {"lr": 1.0, "seed": 1, "scale_by_std": False}  # the record of a run started before --advantage existed
    defaults = {"lr": 3e-4, "seed": 0, "advantage": "grpo"}
    declared = {"free": sft_free(), "unrecorded": sft_unrecorded()}
    options = {"lr": 1.0, "seed": 1, "advantage": "grpo"}
    with pytest.raises(ConfigError, match=r"recorded with options this code no longer has \(--scale_by_std False; "):
        options_record(tmp_path, options, 2, False, saved, defaults, **declared)
    record = options_record(tmp_path, options | {"advantage": "dr_grpo"}, 2, True, saved, defaults, **declared)
    assert record["option_changes"] == [{"step": 2, "options": {"advantage": ["grpo", "dr_grpo"]}}]
    assert "without the recorded options --scale_by_std" in capsys.readouterr().err


def test_config_json_is_written_atomically_and_only_when_it_changes(tmp_path):
    write_record(tmp_path, {"lr": 1.0})
    inode = (tmp_path / "config.json").stat().st_ino
    write_record(tmp_path, {"lr": 1.0})  # the same record: the file is left alone
    assert (tmp_path / "config.json").stat().st_ino == inode
    write_record(tmp_path, {"lr": 1.0, "option_changes": [{"step": 2, "options": {"steps": [2, 3]}}]})
    assert (tmp_path / "config.json").stat().st_ino != inode  # a new file renamed over the old, never cut in place
    assert json.loads((tmp_path / "config.json").read_text())["option_changes"][0]["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# ----------------------------------------------------------------------------------------------------
# 4. Checkpoint integrity: every file kind damaged in turn


META = {"stage": "test", "model_config": {"n": 4}}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run directory with checkpoints after steps 1 and 2 of a small model and AdamW."""
    run = tmp_path_factory.mktemp("ckpts") / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    optimizer = build_optimizer(model, 1e-2, 0.0)
    scheduler = build_scheduler(optimizer, 1, 10)
    for step in (1, 2):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
        save_checkpoint(run, step, model, optimizer, scheduler, META, extra={"loader": {}}, keep_last=2)
    return run


def _damage(file, how: str) -> None:
    data = file.read_bytes()
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:  # one bit flipped, the size unchanged
        file.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1 :])


FILES = ["state.pt", "meta.json", "digests.json", "sharded/.metadata", "sharded/__0_0.distcp"]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_file_is_named_and_the_resume_falls_back_to_the_checkpoint_before(
    two_checkpoints, tmp_path, capsys, name, how
):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    _damage(run / "checkpoints" / "step_00000002" / name, how)
    assert find_checkpoint(run, "", META) == run / "checkpoints" / "step_00000001"
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1, warned
    assert "checkpoint step_00000002 is damaged: " in warned[0] and name.split("/")[-1] in warned[0], warned
    assert "trying the one before it, step_00000001" in warned[0]


def test_an_unreadable_latest_pointer_is_named_and_the_newest_intact_checkpoint_used(two_checkpoints, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    assert find_checkpoint(run, "", META) == run / "checkpoints" / "step_00000002"
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1 and "latest cannot be read (UnicodeDecodeError" in warned[0], warned


def test_no_intact_checkpoint_stops_with_one_line_naming_each(two_checkpoints, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    _damage(run / "checkpoints" / "step_00000002" / "sharded" / "__0_0.distcp", "flip")
    _damage(run / "checkpoints" / "step_00000001" / "state.pt", "truncate")
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(run, "", META)
    message = str(info.value)
    assert "\n" not in message and "no intact checkpoint in" in message
    assert "step_00000002: " in message and "__0_0.distcp was altered" in message
    assert "step_00000001: " in message and "state.pt has " in message


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_bit_exactly(rows, tmp_path, capsys):
    out = tmp_path / "run"
    full = run_sft(rows, out, "--steps", "4", "--save_every", "1", "--keep_last", "4")
    newest = out / "checkpoints" / "step_00000004"
    weights = read_tensors(newest)
    _damage(newest / "sharded" / "__0_0.distcp", "flip")
    assert checkpoint_problem(newest) is not None
    capsys.readouterr()
    resumed = run_sft(rows, out, "--steps", "4", "--save_every", "1", "--keep_last", "4")
    err = capsys.readouterr().err
    assert any("checkpoint step_00000004 is damaged" in w for w in warnings_in(err)), err

    def numbers(rows):
        return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in rows]

    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert numbers(resumed) == numbers(full)  # every step's loss, gradient norm and learning rate, bit for bit
    again = read_tensors(newest)
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)


# ----------------------------------------------------------------------------------------------------
# 5. A full disk while saving


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _zip_writer_failure(*args, **kwargs):  # what torch.save raises when the disk fills under its zip writer
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("where", ["shards", "state"])
def test_a_full_disk_stops_the_save_in_one_line_and_leaves_the_earlier_checkpoints(
    rows, tmp_path, capsys, monkeypatch, where
):
    out = tmp_path / "run"
    run_sft(rows, out, "--steps", "1")
    with monkeypatch.context() as patch:
        if where == "shards":  # inside DCP's writer, as a full disk fails it
            patch.setattr("torch.distributed.checkpoint.filesystem._write_item", _no_space)
        else:
            patch.setattr(torch, "save", _zip_writer_failure)
            patch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 0))
        code, message = helpers.run_cli(sft, sft_args(rows, out, "--steps", "2"), capsys)
    assert code == 4
    assert f"cannot write checkpoint step_00000002 in {out / 'checkpoints'}: no space left on device" in message
    assert "it needs about " in message and "the earlier checkpoints are intact (newest: step_00000001)" in message
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]  # no .tmp left
    assert checkpoint_problem(out / "checkpoints" / "step_00000001") is None
    resumed = run_sft(rows, out, "--steps", "2")  # space again: the same command continues
    assert [m["step"] for m in resumed] == [1, 2]


@pytest.mark.parametrize("where", ["export", "metrics.jsonl", "metrics_declared.json", "samples.jsonl", "summary.json"])
def test_a_full_disk_while_writing_the_run_folder_stops_in_one_line_with_exit_4(
    rows, tmp_path, capsys, monkeypatch, where
):
    import builtins

    import safetensors.torch
    from safetensors import SafetensorError

    from utils import logging as run_logging

    out = tmp_path / "run"
    evaluated = ("--steps", "1", "--val_data", str(rows), "--val_rows", "4", "--eval_samples", "2")
    args = sft_args(rows, out, *evaluated)
    with monkeypatch.context() as patch:
        if where == "export":  # what safetensors' writer raises on a full disk

            def full_disk_save_file(*args, **kwargs):
                raise SafetensorError(
                    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                    'space left on device" })'
                )

            patch.setattr(safetensors.torch, "save_file", full_disk_save_file)
        elif where in ("summary.json", "metrics_declared.json"):  # the files written whole (write_text_atomic)
            write = run_logging.write_text_atomic
            patch.setattr(
                run_logging,
                "write_text_atomic",
                lambda path, *a, **k: _no_space() if Path(path).name == where else write(path, *a, **k),
            )
        else:

            def full_open(path, mode="r", *a, **k):
                file = builtins.open(path, mode, *a, **k)
                return helpers.FullDiskFile(file) if Path(path).name == where else file

            patch.setattr(run_logging, "open", full_open, raising=False)
        code, message = helpers.run_cli(sft, args, capsys)
    assert code == 4, message
    what = f"the export {out / 'hf'}" if where == "export" else str(out / where)
    assert message.startswith(f"error: cannot write {what}: no space left on device; "), message
    assert not (out / "hf.tmp").exists() and not list(out.glob("*.tmp"))
    if where in ("export", "summary.json"):  # the checkpoint of the last step is written: a rerun exports
        assert checkpoint_step(out) == 1
    run_sft(rows, out, *evaluated)  # space again: the same command finishes the run
    assert (out / "hf" / "model.safetensors").is_file() and (out / "summary.json").is_file()


FULL_DISK_CASES = {  # where rank 0's write fails: script, file, the text whose write fails ("": any), a resume
    "step-0 validation row": ("reward_model", "metrics.jsonl", '"step": 0', False),
    "step-0 sample table": ("dpo", "samples.jsonl", "", False),
    "normalisation row": ("reward_model", "metrics.jsonl", "norm/", False),
    "option record": ("dpo", "config.json.tmp", "", False),
    "rows dropped on resume": ("reward_model", "metrics.jsonl.tmp", "", True),
    "TensorBoard event file": ("reward_model", "events.out.tfevents.*", "", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_DISK_CASES)
def test_a_full_disk_at_step_0_or_at_a_resume_stops_both_ranks_together_with_exit_4(tmp_path, case):
    """Rank 0 writes the run folder; its failed write must stop rank 1 too, in the same agreement, before either
    walks into a collective the other never joins (gloo: a connection error and a traceback; NCCL: a hang until
    the process group's timeout)."""
    script, name, trigger, resumed = FULL_DISK_CASES[case]
    data = helpers.write_pref_rows(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    norm = ["--norm_prompts", "2", "--norm_samples_per_prompt", "2", "--norm_batch_size", "2"]
    extra = {"reward_model": norm if case == "normalisation row" else ["--norm_prompts", "0"], "dpo": []}[script]
    args = [f"{script}.py", "--model", "tiny", "--random_init", "true", "--eval_every", "1", "--save_every", "1"]
    args += [*extra, *helpers.pair_run_args(data, out, 1)]
    args[args.index("--val_rows") + 1] = "4"
    if resumed:
        run_script(args, nproc=2, timeout=300)
        args[args.index("--steps") + 1] = "2"
    before = (out / "metrics.jsonl").read_text() if resumed else None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={free_port()}", "tests/scripts/full_disk.py", str(tmp_path), name, trigger, *args]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ended = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    what = out / name.removesuffix(".tmp")
    assert ended[0]["error"] == ended[1]["error"], (ended, done.stderr[-3000:])
    kind, message, code = ended[0]["error"]
    assert code == 4 and message.startswith(f"cannot write {what}: no space left on device; "), message
    assert abs(ended[0]["time"] - ended[1]["time"]) < 10  # together, not one after the other's timeout
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"], done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if f'File "{ROOT}' in line and "site-packages" not in line]
    assert ours == [], done.stderr[-3000:]  # no traceback from our code (torchrun's own only, in a venv maybe in ROOT)
    codes = re.findall(r"exitcode {2}: (-?\d+)", done.stderr)  # torchrun may stop the slower rank once one is out
    assert done.returncode != 0 and "4" in codes and set(codes) <= {"4", "-15"}, done.stderr[-3000:]
    assert not list(out.rglob("*.tmp"))  # nothing torn: no temporary file left, every row whole
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    if resumed:
        assert (out / "metrics.jsonl").read_text() == before and checkpoint_step(out) == 1
        assert checkpoint_problem(out / "checkpoints" / "step_00000001") is None


# ----------------------------------------------------------------------------------------------------
# 6. metrics.jsonl on resume


def test_a_torn_last_line_is_dropped_with_a_warning_and_nothing_before_the_resumed_step_is_lost(tmp_path, capsys):
    lines = [json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 6, "train/lo')
    Logger(tmp_path, {}, "p", "n", "disabled", True, resume_step=4).finish()
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:4])
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 2, warned
    assert "metrics.jsonl: line 6 is not a whole JSON row" in warned[0]
    assert "1 line(s) logged after the checkpoint of step 4 dropped" in warned[1]
    Logger(tmp_path, {}, "p", "n", "disabled", True, resume_step=4).finish()  # a second resume drops nothing more
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:4])
    assert warnings_in(capsys.readouterr().err) == []


# ----------------------------------------------------------------------------------------------------
# 7. Warnings, not silence


def test_a_constant_reward_function_is_named_once_per_run(capsys):
    sources = [
        RewardSource("reward_model", "reward_model", 1.0, None),
        RewardSource("zero_reward", "tests.helpers:zero_reward", 1.0, helpers.zero_reward),
        RewardSource("length", "length", 1.0, lambda p, r: 0.0),
    ]
    spec = RewardSpec(sources, True, None)
    values = torch.tensor([[0.5, 0.0, 1.0], [0.5, 0.0, 2.0], [0.5, 0.0, 2.0]], dtype=torch.float64)  # (N, S)
    applies = torch.ones(3, 3, dtype=torch.bool)
    for step in (1, 2):
        warn_constant_sources(spec, values, applies, step)
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1, warned  # the reward model's constancy is check_rewards' error, not a warning here
    assert (
        "reward source tests.helpers:zero_reward gave every one of its 3 responses the same value (0) at step 1"
        in warned[0]
    )
    warn_constant_sources(RewardSpec(sources, True, None), values, applies, 1)  # a new run says it again
    assert len(warnings_in(capsys.readouterr().err)) == 1


def test_an_epoch_that_repeats_rows_is_named(capsys):
    assert epoch_steps(0, 10, 1, 8, 64) == 1  # 10 rows, a global batch of 64: the one step reads them ~6 times
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1 and "10 rows fill less than one global batch of --batch_size 64" in warned[0]
    assert "repeats rows about 6.4 times" in warned[0]
    assert epoch_steps(0, 100, 12, 8, 64) == 1 and epoch_steps(3, 10, 1, 8, 64) == 3
    assert warnings_in(capsys.readouterr().err) == []


def test_wandb_online_passes_with_a_key_or_a_netrc_entry(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError, match="--wandb_mode online needs a wandb login"):
        check_wandb_login("online")
    check_wandb_login("offline")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    check_wandb_login("online")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "x")
    check_wandb_login("online")


@pytest.mark.slow
def test_a_small_filesystem_that_fills_at_the_second_checkpoint(rows, tmp_path):
    """The same on a real full disk: a 80 MiB tmpfs (mounted in a user namespace of its own) holds the first
    checkpoint of the tiny SFT run (~53 MB) but not the second."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here to mount a small filesystem in")
    disk = tmp_path / "disk"
    disk.mkdir()
    train = " ".join(shlex.quote(a) for a in sft_args(rows, disk / "run", "--steps", "2", "--save_every", "1"))
    ckpts = disk / "run" / "checkpoints"
    check = (
        f"from utils.checkpoint import checkpoint_problem; import os; "
        f"print('left:', sorted(os.listdir('{ckpts}')), checkpoint_problem('{ckpts}/step_00000001'))"
    )
    script = (
        f"mount -t tmpfs -o size=80m tmpfs {disk} && {sys.executable} sft.py {train}; echo exit=$?; "
        f'{sys.executable} -c "{check}"'
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "exit=4" in done.stdout, done.stdout + done.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"cannot write checkpoint step_00000002 in {disk}/run/checkpoints: no space left on device" in errors[0]
    assert "left: ['latest', 'step_00000001'] None" in done.stdout, done.stdout


# ----------------------------------------------------------------------------------------------------
# 3. Model kinds


def test_model_kinds_of_exports_hub_names_and_plain_transformers_folders(tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from transformers import GPT2LMHeadModel as HFGPT2

    from model.gpt2 import PRESETS, GPT2LMHeadModel
    from model.heads import RewardModel
    from model.weights import ModelLoadError, check_kind, model_kind, save_hf

    hf_cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=8, n_layer=1, n_head=2)
    HFGPT2(hf_cfg).save_pretrained(tmp_path / "hf_policy")
    GPT2ForSequenceClassification(GPT2Config(**hf_cfg.to_dict(), num_labels=1)).save_pretrained(tmp_path / "hf_rm")
    save_hf(GPT2LMHeadModel(PRESETS["tiny"]).state_dict(), PRESETS["tiny"], tmp_path / "policy")
    save_hf(RewardModel(PRESETS["tiny"]).state_dict(), PRESETS["tiny"], tmp_path / "rm")
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["model_kind"] == "policy"
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["model_kind"] == "reward_model"
    kinds = {name: model_kind(str(tmp_path / name)) for name in ("hf_policy", "hf_rm", "policy", "rm")}
    assert kinds == {"hf_policy": "policy", "hf_rm": "reward_model", "policy": "policy", "rm": "reward_model"}
    assert model_kind("gpt2") == "policy"  # a hub name: read nowhere
    check_kind(str(tmp_path / "hf_policy"), "policy", "--model")  # a plain transformers GPT-2 is a policy
    check_kind(str(tmp_path / "hf_rm"), "reward_model", "--reward_model", normalized=False)
    with pytest.raises(ModelLoadError, match="hf_rm is a reward model whose reward_normalization.json is missing"):
        check_kind(str(tmp_path / "hf_rm"), "reward_model", "--reward_model")
    (tmp_path / "rm" / "reward_normalization.json").write_text('{"gain": NaN, "bias": 0}')
    with pytest.raises(ModelLoadError, match="reward_normalization.json cannot be read"):
        check_kind(str(tmp_path / "rm"), "reward_model", "--reward_model")


def test_the_docs_name_every_option_that_may_change_on_resume():
    # every option a script declares free on resume, or unrecorded (utils.config.option), is named in docs/errors.md
    import dpo
    import eval_preferences
    import grpo
    import reward_model
    from utils.config import declared

    section = (ROOT / "docs" / "errors.md").read_text().split("## The run directory")[1]
    scripts = (sft, reward_model, dpo, grpo, eval_preferences)
    names = {name for s in scripts for fact in ("free", "recorded") for name in declared(s.Config, fact)}
    assert {"steps", "table_every", "frozen_cpu_offload", "wandb_tags", "out_dir", "resume_changes"} <= names
    missing = sorted(name for name in names if f"`--{name}`" not in section)
    assert not missing, missing

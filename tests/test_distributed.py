"""Two-process FSDP over gloo: loss normalisation, and an end-to-end SFT run killed (SIGKILL) and preempted (SIGTERM)
part-way that resumes exactly."""

import json
import random
import re
import signal

import pytest
import torch

from tests.conftest import assert_same_metrics, checkpoint_step, run_and_interrupt, run_script
from tests.helpers import read_metrics, write_sft_rows

pytestmark = pytest.mark.slow


def test_loss_and_gradients_independent_of_world_size_and_accumulation(tmp_path):
    for nproc in (1, 2):  # one launch per world size computes both accumulations, each from a fresh model
        run_script(["tests/scripts/sft_grads.py", str(tmp_path), "1", "2"], nproc=nproc)
    results = {(n, a): torch.load(tmp_path / f"{n}_{a}.pt") for n in (1, 2) for a in (1, 2)}
    ref = results[(1, 1)]
    for key, r in results.items():
        assert abs(r["loss"] - ref["loss"]) < 1e-5, key
        for name, g in ref["grads"].items():
            assert torch.allclose(r["grads"][name], g, atol=1e-6, rtol=1e-4), (key, name)
    assert ref["loss"] > 5.0  # random tiny model over a 50k vocabulary: near log(50257) = 10.8


def test_two_process_sft_lowers_loss_and_resumes_exactly_after_sigkill_and_sigterm(tmp_path):
    data = write_sft_rows(tmp_path / "rows.jsonl")

    def args(run):
        return [
            "sft.py",
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--train_data",
            str(data),
            "--val_data",
            str(data),
            "--val_rows",
            "16",
            "--steps",
            "6",
            "--batch_size",
            "8",
            "--micro_batch_size",
            "2",
            "--lr",
            "3e-3",
            "--warmup_steps",
            "1",
            "--eval_every",
            "2",
            "--save_every",
            "1",
            "--keep_last",
            "2",
            "--max_prompt_len",
            "64",
            "--wandb_mode",
            "disabled",
            "--out_dir",
            str(run),
        ]

    full_run = tmp_path / "full"
    run_script(args(full_run), nproc=2)
    full = read_metrics(full_run)
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    assert full[-1]["train/loss"] < full[0]["train/loss"] - 0.05
    assert (full_run / "hf" / "model.safetensors").is_file()
    # keep_last 2 plus the best validation loss (which is the newest here: the loss falls)
    assert sorted(p.name for p in (full_run / "checkpoints").glob("step_*")) == ["step_00000005", "step_00000006"]
    assert json.loads((full_run / "checkpoints" / "best.json").read_text())["value"] == full[-1]["val/loss"]

    # 1. SIGKILL every process (torchrun and both workers) once a checkpoint of a random step exists, mid-step or
    #    mid-save; 2. rerun the same command, and SIGTERM torchrun (a preemption: it forwards the signal to the
    #    workers, which finish the step, save and exit); 3. rerun it to the end. The metrics must equal the
    #    uninterrupted run's to the last bit.
    run = tmp_path / "run"
    kill_at = random.randint(1, 3)
    code, _ = run_and_interrupt(args(run), run, kill_at, signal.SIGKILL, nproc=2)
    assert code != 0
    killed_at = checkpoint_step(run)
    assert not (run / "hf").exists()
    code, out = run_and_interrupt(args(run), run, killed_at + 1, signal.SIGTERM, nproc=2, whole_tree=False)
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", out)
    assert stopped and int(stopped.group(1)) == checkpoint_step(run), out[-3000:]
    assert "Traceback" not in out.split("stopped by SIGTERM")[0], out[-3000:]  # torchrun's own report may follow
    run_script(args(run), nproc=2)
    context = f"SIGKILL after checkpoint {killed_at} (asked >= {kill_at}), SIGTERM after step {stopped.group(1)}"
    assert_same_metrics(full, read_metrics(run), ("train/loss", "train/grad_norm", "train/lr", "val/loss"), context)


def test_fsdp_gathers_the_root_once_per_micro_batch(tmp_path):
    # a 2-block GPT-2 has three FSDP units (root, block 0, block 1). Forward gathers all three; backward gathers the
    # blocks again (they resharded after forward) but not the root, whose tied head backward starts with: 5, not 6.
    # A gathered_params block (generation) must hand every unit its own setting back, so the next step is 5 again; a
    # frozen model's root reshards after forward, so each of its forwards gathers every unit. An optimizer step after a
    # forward without backward (which leaves the root gathered) must not leave the next forward the old root.
    out = tmp_path / "gathers.pt"
    run_script(["tests/scripts/fsdp_gathers.py", str(out)], nproc=2)
    counts = torch.load(out)
    assert counts == {
        "first_step": 5,
        "second_step": 5,
        "gathered_block": 3,
        "step_after_gathered_block": 5,
        "frozen_forward": 3,
        "frozen_forward_again": 3,
        "forward_after_step": 3,
    }, counts


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """tests/scripts/ckpt_dist.py's checkpoint, saved by 2 processes, and its resumes: on 2 processes (--seed 0) and on
    1 (--seed 0, 1, 1 and 2, one launch: a launch costs seconds of start-up, and each resume starts from fresh weights
    and loads the same read-only checkpoint). The folder holds run/, save.pt, resume2.pt, resume1.pt, seed{1a,1b,2}.pt
    and the saved checkpoint's shard files as listed right after the save (shards.txt)."""
    base = tmp_path_factory.mktemp("ckpt")
    script, run = "tests/scripts/ckpt_dist.py", str(base / "run")
    run_script([script, "save", run, str(base / "save.pt")], nproc=2)
    shards = sorted(p.name for p in (base / "run" / "checkpoints" / "step_00000002" / "sharded").iterdir())
    (base / "shards.txt").write_text("\n".join(shards))
    run_script([script, "resume", run, str(base / "resume2.pt")], nproc=2)
    seeds = [f"{base / name}.pt:{seed}" for name, seed in (("seed1a", 1), ("seed1b", 1), ("seed2", 2))]
    run_script([script, "resume", run, str(base / "resume1.pt"), *seeds])
    return base


def test_sharded_checkpoint_resumes_exactly_on_two_processes_and_on_one(sharded_checkpoint):
    # two processes train 3 steps and save after step 2, each writing its own shards; a run from other weights loads
    # that checkpoint on 2 processes (and continues bit for bit) and on 1 (the shards are re-cut: the state loaded is
    # the state saved, bit for bit; step 3 then differs only by the order of the gradient reduction)
    files = (sharded_checkpoint / "shards.txt").read_text().split("\n")
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    saved = torch.load(sharded_checkpoint / "save.pt")
    for nproc in (2, 1):
        resumed = torch.load(sharded_checkpoint / f"resume{nproc}.pt")
        for part in ("params", "moments"):
            assert saved["saved"][part].keys() == resumed["loaded"][part].keys()
            for name, t in saved["saved"][part].items():
                assert torch.equal(resumed["loaded"][part][name], t), (nproc, part, name)
                final, final_resumed = saved["final"][part][name], resumed["final"][part][name]
                if nproc == 2:
                    assert torch.equal(final_resumed, final), (part, name)
                else:
                    assert torch.allclose(final_resumed, final, rtol=0, atol=1e-4), (part, name)
                assert not torch.equal(final, t)  # step 3 moved it
        assert all(torch.equal(resumed["loaded_frozen"][n], t) for n, t in saved["saved_frozen"].items())
        assert resumed["lr"] == saved["lr"]  # the schedule resumed at step 3
        assert abs(resumed["loss"] - saved["loss"]) <= (0 if nproc == 2 else 1e-5), (
            nproc,
            resumed["loss"],
            saved["loss"],
        )


def test_a_resume_on_another_world_size_reseeds_every_random_stream_from_the_seed(sharded_checkpoint):
    # saved by 2 processes, resumed on 1: the per-rank RNG states cannot be restored, so torch, numpy and `random`
    # are reseeded from --seed, the step and the rank: the same seed draws the same numbers, another seed others
    # (the three resumes run one after the other in one process: what the draws follow is the seed, not the process)
    draws, stderr = {}, {}
    for name, out in (("seed1a", "a"), ("seed1b", "b"), ("seed2", "c")):
        resumed = torch.load(sharded_checkpoint / f"{name}.pt")
        draws[out], stderr[out] = resumed["draws"][0], resumed["stderr"]
    assert draws["a"] == draws["b"]
    assert all(draws["a"][i] != draws["c"][i] for i in range(3)), draws  # torch, numpy and random each differ
    assert (
        "was written by 2 processes and resumes on 1: the random streams after it are reseeded from --seed 2"
        in (stderr["c"])
    )


@pytest.fixture(scope="module")
def resume_views(tmp_path_factory):
    """tests/scripts/resume_views.py's three cases in one two-process launch (a launch costs seconds of start-up):
    case -> [rank 0's result, rank 1's]."""
    base = tmp_path_factory.mktemp("views")
    cases = ("pointer", "view", "resume_from")
    run_script(["tests/scripts/resume_views.py", str(base), *cases], nproc=2)
    return {case: [(base / f"{case}.txt.{rank}").read_text() for rank in (0, 1)] for case in cases}


def test_rank_0_chooses_the_checkpoint_and_ranks_that_see_it_differently_stop(resume_views):
    # rank 1 reads another `latest` (an NFS attribute cache): rank 0's choice holds on both; rank 1 sees the newest
    # checkpoint's shard missing while rank 0 sees it whole: both stop with the same line naming the file and ranks
    for case in ("pointer", "view"):
        results = resume_views[case]
        if case == "pointer":
            assert results == ["step_00000002", "step_00000002"], results
        else:
            assert results[0] == results[1], results
            assert results[0].startswith("error: the ranks see checkpoint"), results[0]
            assert "rank 0: as written; rank 1: " in results[0] and "is missing" in results[0], results[0]


def test_resume_from_is_chosen_by_rank_0(resume_views):
    # --resume_from a checkpoint folder whose state.pt rank 1 does not see: rank 0 says it is a checkpoint folder, so
    # both ranks run the same collectives and resume from it (before: rank 1 took it for a run directory)
    results = resume_views["resume_from"]
    assert results == ["step_00000002", "step_00000002"], results


def test_dist_timeout_reaches_the_process_group(tmp_path):
    # rank 1 is busy until rank 0 is done (8 s at most); under a 3 s timeout rank 0's barrier fails after 3 s (torch's
    # gloo default: 30 minutes)
    out = tmp_path / "timeout.json"
    run_script(["tests/scripts/dist_timeout.py", str(out), "0.05"], nproc=2)
    result = json.loads(out.read_text())
    assert 2.9 <= result["seconds"] < 6.0 and "Timed out waiting 3000ms" in result["error"], result


def test_out_dir_that_ranks_see_differently_is_refused_on_every_rank(tmp_path):
    # ranks writing checkpoint shards into folders that are not one (nodes without a shared filesystem) would leave
    # checkpoints without the other ranks' shards; every rank stops with the same error, and no marker file remains
    run_script(["tests/scripts/shared_dir.py", str(tmp_path), "same", "per_rank"], nproc=2)  # both cases, one launch
    for mode in ("same", "per_rank"):
        errors = [(tmp_path / f"{mode}.txt.{rank}").read_text() for rank in (0, 1)]
        if mode == "same":
            assert errors == ["", ""], errors
        else:
            assert all(
                "is not the same folder on every rank: ranks [1] do not see the file rank 0 wrote there" in e
                for e in errors
            ), errors
        assert not list((tmp_path / mode).rglob(".shared_check_*"))


def test_sft_validation_with_uneven_rows_finishes_and_matches_one_process(tmp_path):
    """17 validation rows over 2 ranks and micro-batches of 8: rank 0 holds 9 rows (2 batches), rank 1 8 rows (1
    batch). Without padding, rank 1 would wait in the final all-reduce while rank 0 all-gathers for its second
    forward, for ever. The loss must equal the one-process value (padding rows weigh 0)."""
    data = write_sft_rows(tmp_path / "rows.jsonl")

    def args(run):
        return [
            "sft.py",
            "--model",
            "tiny",
            "--random_init",
            "true",
            "--train_data",
            str(data),
            "--val_data",
            str(data),
            "--val_rows",
            "17",
            "--steps",
            "1",
            "--batch_size",
            "16",
            "--micro_batch_size",
            "8",
            "--lr",
            "1e-9",
            "--warmup_steps",
            "0",
            "--max_prompt_len",
            "64",
            "--wandb_mode",
            "disabled",
            "--out_dir",
            str(run),
        ]

    losses = {}
    for nproc in (1, 2):
        run_script(args(tmp_path / f"run{nproc}"), nproc=nproc, timeout=150)
        losses[nproc] = read_metrics(tmp_path / f"run{nproc}")[-1]["val/loss"]
    assert losses[1] > 5.0  # a random tiny model over a 50k vocabulary
    assert abs(losses[2] - losses[1]) < 1e-5 * losses[1], losses


@pytest.mark.slow
def test_compiled_blocks_under_fsdp2_equal_eager_without_graph_breaks(tmp_path):
    """--compile's per-block compilation (shard_model(compile_blocks=True), fullgraph) on 2 gloo processes: losses
    and gradients of padded and packed preference rows as the eager model's (1e-5 of each gradient's scale), graphs
    captured (so the compiled code ran) and no graph break (tests/scripts/compiled_blocks.py; dynamo's aot_eager
    backend: forward and backward captured, no code generated)."""
    out = tmp_path / "record.pt"
    run_script(["tests/scripts/compiled_blocks.py", str(out)], nproc=2)
    record = torch.load(out)
    for shared in (True, False):
        assert record["loss"][("compiled", shared)] == pytest.approx(record["loss"][("eager", shared)], rel=1e-5)
    assert record["grad_gap"] <= 1e-5
    assert record["graphs"] > 0 and record["graph_breaks"] == 0

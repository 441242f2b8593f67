"""Two-process FSDP over gloo: loss normalisation and an end-to-end SFT run that resumes exactly."""

import json

import pytest
import torch

from tests.conftest import run_script

pytestmark = pytest.mark.slow


def test_loss_and_gradients_independent_of_world_size_and_accumulation(tmp_path):
    results = {}
    for nproc, accum in [(1, 1), (1, 2), (2, 1), (2, 2)]:
        out = tmp_path / f"{nproc}_{accum}.pt"
        run_script(["tests/scripts/sft_grads.py", str(out), str(accum)], nproc=nproc)
        results[(nproc, accum)] = torch.load(out)
    ref = results[(1, 1)]
    for key, r in results.items():
        assert abs(r["loss"] - ref["loss"]) < 1e-5, key
        for name, g in ref["grads"].items():
            assert torch.allclose(r["grads"][name], g, atol=1e-6, rtol=1e-4), (key, name)
    assert ref["loss"] > 5.0  # random tiny model over a 50k vocabulary: near log(50257) = 10.8


def write_rows(path, n=64, seed=0):
    """TL;DR-shaped rows made up on the spot, so the test needs no downloaded data."""
    import random

    rng = random.Random(seed)
    words = "cat dog car house job money friend sister brother school game phone rent boss date trip".split()
    with open(path, "w") as f:
        for _ in range(n):
            post = " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
            summary = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            prompt = f"SUBREDDIT: r/{rng.choice(words)}\n\nTITLE: {rng.choice(words)} {rng.choice(words)}\n\nPOST: {post}\n\nTL;DR:"
            f.write(json.dumps({"prompt": prompt, "completion": " " + summary}) + "\n")


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_two_process_sft_lowers_loss_saves_and_resumes_exactly(tmp_path):
    data = tmp_path / "rows.jsonl"
    write_rows(data)
    run = tmp_path / "run"
    args = [
        "sft.py", "--model", "tiny", "--random_init", "true", "--train_data", str(data), "--val_data", str(data),
        "--val_examples", "16", "--steps", "6", "--batch_size", "8", "--micro_batch_size", "2", "--lr", "3e-3",
        "--warmup_steps", "1", "--eval_every", "6", "--save_every", "3", "--keep_last", "5",
        "--max_prompt_len", "64", "--wandb_mode", "disabled", "--out_dir", str(run),
    ]
    run_script(args, nproc=2)
    full = read_metrics(run)
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    assert full[-1]["train/loss"] < full[0]["train/loss"] - 0.05
    assert (run / "hf" / "model.safetensors").is_file()

    # Pretend the run died after step 3: keep only the step-3 checkpoint and the first three metrics lines.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_00000006")
    (run / "checkpoints" / "latest").write_text("step_00000003")
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in full[:3]))
    run_script(args, nproc=2)
    resumed = read_metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full[3:], resumed[3:]):
        assert a["train/loss"] == b["train/loss"], (a, b)  # bit-exact
        assert a["train/grad_norm"] == b["train/grad_norm"]

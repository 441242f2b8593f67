"""Checks only a GPU can make (`pytest -m gpu`, run by bench/gpu_all.sh): --deterministic makes two identical runs
agree bit for bit on CUDA in bf16, and a run resumed from its sharded checkpoint equals the uninterrupted one there;
with two GPUs, the same over NCCL (each rank writing its own checkpoint shards, the process group bound to its GPU).
Each runs a golden configuration (tests/golden/stages.py) moved to the GPU."""

import json
import shutil

import pytest
import torch

from tests.golden.stages import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ON_GPU = ("--device", "cuda", "--dtype", "bf16", "--deterministic", "true")


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo_rso"])
def test_deterministic_runs_agree_bit_for_bit_on_gpu(name, tmp_path):
    first = run(name, tmp_path / "first", ON_GPU)
    second = run(name, tmp_path / "second", ON_GPU)
    assert first == second, (first, second)


def test_resume_from_a_sharded_checkpoint_is_bit_exact_on_gpu(tmp_path):
    # SFT for 3 steps with a checkpoint after every step; then pretend the run died after step 2 and rerun it
    full = run("sft", tmp_path / "full", (*ON_GPU, "--save_every", "1", "--keep_last", "3"))
    out = tmp_path / "full" / "sft"
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    (out / "checkpoints" / "latest").write_text("step_00000002")
    lines = [line for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    resumed = run("sft", tmp_path / "full", (*ON_GPU, "--save_every", "1", "--keep_last", "3"), fresh=False)
    assert resumed == full, (full, resumed)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@two_gpus
def test_two_gpu_nccl_runs_agree_bit_for_bit_and_resume_exactly(tmp_path):
    # GRPO's two-process golden configuration on two GPUs over NCCL, twice: the same numbers bit for bit
    assert run("grpo_rso_2proc", tmp_path / "a", ON_GPU) == run("grpo_rso_2proc", tmp_path / "b", ON_GPU)
    # SFT on two GPUs, each rank writing its own checkpoint shards; a rerun from step 2 equals the uninterrupted run
    args = (*ON_GPU, "--save_every", "1", "--keep_last", "3")
    full = run("sft", tmp_path / "full", args, nproc=2)
    out = tmp_path / "full" / "sft"
    shards = sorted(p.name for p in (out / "checkpoints" / "step_00000002" / "sharded").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    (out / "checkpoints" / "latest").write_text("step_00000002")
    lines = [line for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    assert run("sft", tmp_path / "full", args, fresh=False, nproc=2) == full

"""Checks only a GPU can make (`pytest -m gpu`, run by bench/gpu_all.sh): --deterministic makes two identical runs
agree bit for bit on CUDA in bf16, and a run resumed from its sharded checkpoint equals the uninterrupted one there;
CPU offload of the frozen models and activation checkpointing leave a deterministic run unchanged; the memory
estimate (rollouts/memory.py) bounds the measured peak of the step it estimates; with two GPUs, the same over NCCL
(each rank writing its own checkpoint shards, the process group bound to its GPU). Each run is a golden configuration
(tests/golden/stages.py) moved to the GPU. --compile on CUDA under FSDP2 (NCCL, one process): the decode step's CUDA
graphs recorded once per shape, not per call, and the per-block compiled forward and backward equal to eager. A training
batch copied to the GPU without a stream synchronisation (utils.dist.to_device)."""

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


def test_frozen_cpu_offload_and_activation_checkpointing_leave_a_deterministic_run_unchanged(tmp_path):
    # offload only moves where the frozen models' shards live between uses (the gathered values are the same), and
    # checkpointing recomputes each block's forward in the backward with the same deterministic kernels: GRPO's
    # numbers and final parameters must be the plain run's, bit for bit
    plain = run("grpo_rso", tmp_path / "plain", ON_GPU)
    assert run("grpo_rso", tmp_path / "offload", (*ON_GPU, "--frozen_cpu_offload", "true")) == plain
    assert run("grpo_rso", tmp_path / "checkpointing", (*ON_GPU, "--activation_checkpointing", "true")) == plain


def test_memory_estimate_bounds_the_measured_peak_of_the_step_it_estimates():
    # one GRPO step of GPT-2 124M (random weights) in bf16 with 4 micro-batches per optimizer step: the estimate that
    # decides whether a run may start must be at least what the step allocates (within the check's 10% margin), and
    # not so loose that it refuses runs that fit (at most 3x)
    from bench.grpo_step import GRPOBenchConfig, measure_steps
    from rollouts.memory import MARGIN
    from utils.dist import cleanup_distributed

    cleanup_distributed()
    bcfg = GRPOBenchConfig(
        "gpu-memory-check",
        "gpt2",
        prompts=16,
        num_samples=16,
        num_kept=4,
        selection="rso",
        max_new_tokens=32,
        prompt_len=256,
        min_prompt_len=224,
        gen_prompts=8,
        micro_batch_size=16,
        score_micro_batch_size=64,
        warmup=1,
        repeats=1,
    )
    try:
        m = measure_steps(bcfg, torch.device("cuda"))
    finally:
        cleanup_distributed()
    measured, estimated = m["peak_memory_bytes"], m["estimated_peak_bytes"]
    assert measured <= estimated / MARGIN, (measured, m["estimated_bytes"])
    assert estimated <= 3 * measured, (measured, m["estimated_bytes"])


def test_compiled_decode_records_each_cuda_graph_once_under_fsdp2(tmp_path):
    # sample_responses(compile=True) (each decode step recorded as a CUDA graph, model.sampler.StepGraph) over 9
    # calls of 9 prompt widths and 2 chunk sizes, then the same 9 again: the second pass records no CUDA graph, every
    # call of a shape reuses its buffers and the same copy of the weights, and the tokens are the eager sampler's
    # (tests/scripts/compiled_decode.py)
    from tests.conftest import run_script

    out = tmp_path / "records.pt"
    run_script(["tests/scripts/compiled_decode.py", str(out), "cuda"], timeout=240)
    records = torch.load(out)
    print("\n".join(f"call {i}: graphs {r['graphs']}, CUDA graphs {r['cuda_graphs']}" for i, r in enumerate(records)))
    seen = {}
    for r in records:
        assert r["same_tokens"] and r["logprob_gap"] <= 1e-4, r
        assert r["weights"] == records[0]["weights"]
        for key, addresses in r["buffers"].items():
            assert seen.setdefault(key, addresses) == addresses, key
    warm = records[len(records) // 2 - 1]
    assert (warm["cuda_graphs"], warm["graphs"]) == (records[-1]["cuda_graphs"], records[-1]["graphs"])
    assert warm["cuda_graphs"] > 0 and records[-1]["cudagraph_skips"] == 0 and len(seen) == 4


def test_compiled_blocks_under_fsdp2_equal_eager_on_gpu(tmp_path):
    # --compile's per-block forward (inductor) on CUDA in fp32, padded and packed preference rows of two widths:
    # losses and gradients as the eager model's, no graph break (tests/scripts/compiled_blocks.py)
    from tests.conftest import run_script

    out = tmp_path / "record.pt"
    run_script(["tests/scripts/compiled_blocks.py", str(out), "inductor", "cuda"], timeout=240)
    record = torch.load(out)
    print(record)
    for shared in (True, False):
        assert record["loss"][("compiled", shared)] == pytest.approx(record["loss"][("eager", shared)], rel=1e-5)
    assert record["grad_gap"] <= 1e-5 and record["graphs"] > 0 and record["graph_breaks"] == 0, record


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


def test_to_device_copies_a_batch_without_a_stream_synchronisation():
    # utils.dist.to_device (every training micro-batch's copy): the same values on the GPU, and no
    # cudaStreamSynchronize, which a blocking .to(device) makes (checked too, so the profiler does see one)
    from utils.dist import to_device, true_positions

    batch = torch.randint(0, 50000, (16, 440))
    mask = torch.rand(16, 56) > 0.3

    def syncs(fn) -> int:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name == "cudaStreamSynchronize" for e in prof.events())

    assert syncs(lambda: batch.to("cuda")) > 0
    assert syncs(lambda: (to_device(batch, "cuda"), true_positions(mask, "cuda"))) == 0
    assert torch.equal(to_device(batch, "cuda").cpu(), batch)
    assert torch.equal(true_positions(mask, "cuda").cpu(), mask.reshape(-1).nonzero().squeeze(1))

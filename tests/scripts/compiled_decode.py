"""Run under 2 processes: sample_responses(compile=True) on an FSDP2-sharded policy, called again and again with
prompt batches of different widths (two width buckets, two batch sizes), as a run's evaluations and rollouts call
it; the sequence of widths twice, so the second pass meets only shapes the first one met. Rank 0 saves, per call:
the graphs compiled so far, the addresses of the decode buffers and of the weights' copy the call used, and whether
its tokens equal the eager sampler's on the same draws.

    python tests/scripts/compiled_decode.py OUT.pt [DEVICE]

DEVICE "cpu" (default; gloo): the decode step is compiled with dynamo's "eager" backend (graph capture and guards, no
code generation), so the test counts what a run would capture and recapture in seconds; inductor's code for the step
is checked against eager in tests/test_sampler.py. DEVICE "cuda" (NCCL, one GPU per process; tests/test_gpu.py runs
it as one process): each decode step recorded as a CUDA graph (model.sampler.StepGraph, no dynamo), and each record
also counts the CUDA graphs recorded so far (every torch.cuda.CUDAGraph.capture_begin).
"""

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import model.sampler as sampler  # noqa: E402
from bench.common import cuda_graph_recordings  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from rollouts.sampling import sample_responses  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402

# (prompts, width) per call: widths 9..60 fall in the 64 bucket, 70 and 100 in the 128 one; 3 prompts: a short last
# chunk of 2 prompts per call and a chunk of 1
CALLS = [(4, 20), (4, 9), (4, 60), (3, 33), (4, 70), (4, 100), (3, 45), (4, 12), (3, 90)]


def prompts(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (n, width), generator=g)
    mask = torch.ones(n, width, dtype=torch.bool)
    mask[0, : width // 3] = False  # one left-padded prompt
    return ids, mask


def main(out: str, device: str) -> None:
    info = setup_distributed(device)
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(GPTConfig(vocab_size=300, n_layer=2, n_head=2, n_embd=32, n_positions=256))
    shard_model(policy.to(info.device), torch.float32)
    if device == "cpu":
        sampler.compiled_decode_step = functools.cache(
            lambda device_type: torch.compile(sampler.decode_step, backend="eager")
        )
        records = calls(policy, info.device, recorded=[0])
    else:
        with cuda_graph_recordings() as recorded:
            records = calls(policy, info.device, recorded)
    if info.rank == 0:
        torch.save(records, out)
    cleanup_distributed()


def calls(policy, device, recorded: list[int]) -> list[dict]:
    from torch._dynamo.utils import counters

    records = []
    for i, (n, width) in enumerate(CALLS + CALLS):  # the second pass: every shape met before
        ids, mask = (t.to(device) for t in prompts(n, width, seed=i))  # new prompts at every call
        kw = dict(num_samples=3, max_new_tokens=6, prompts_per_call=2, temperature=1.0)
        eager = sample_responses(policy, ids, mask, generator=torch.Generator(device).manual_seed(i), **kw)
        compiled = sample_responses(
            policy, ids, mask, generator=torch.Generator(device).manual_seed(i), compile=True, **kw
        )
        used = {
            key: [t.data_ptr() for t in b.tensors()]
            for key, b in sampler._DECODE_BUFFERS.items()
            if b.decode is not None
        }
        records.append(
            {
                "graphs": counters["stats"]["unique_graphs"],
                "weights": [w.data_ptr() for w in sampler._DECODE_WEIGHTS[policy].values()],
                "cuda_graphs": recorded[0],
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                "buffers": used,
                "same_tokens": torch.equal(eager.response_ids, compiled.response_ids)
                and torch.equal(eager.response_mask, compiled.response_mask),
                "logprob_gap": float((eager.logprobs - compiled.logprobs).abs().max()),
            }
        )
    return records


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")

"""Run under 2 processes: the forward and backward of an FSDP2-sharded GPT-2 whose blocks run compiled
(shard_model(compile_blocks=True)) against the same model eager, on preference pairs as padded rows and as packed
rows with a shared prompt (evaluation.preference.pair_logprobs, the layouts training uses), two micro-batches
of different widths. Rank 0 saves the losses, the largest gradient difference relative to the gradient's scale, and
dynamo's counts of graphs and graph breaks.

    python tests/scripts/compiled_blocks.py OUT.pt [BACKEND] [DEVICE]

BACKEND: torch.compile's backend for the blocks (default "aot_eager": forward and backward graphs captured, no
code generated, so the check takes seconds; "inductor" compiles them as a run does). DEVICE: "cpu" (default, gloo)
or "cuda" (NCCL, one GPU per process: tests/test_gpu.py runs it as one process with inductor).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.tldr import collate_pairs  # noqa: E402
from evaluation.preference import pair_logprobs  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402

CFG = GPTConfig(vocab_size=300, n_layer=2, n_head=2, n_embd=32, n_positions=128)


def pairs(n: int, width: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def row(lo, hi):
        return torch.randint(0, 300, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()

    return collate_pairs(
        [row(3, width) for _ in range(n)], [row(1, 9) for _ in range(n)], [row(1, 9) for _ in range(n)], pad_id=0
    )


def main(out: str, backend: str, device: str) -> None:
    from torch._dynamo.utils import counters

    info = setup_distributed(device)
    models = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        models[name] = shard_model(
            GPT2LMHeadModel(CFG).to(info.device), torch.float32, compile_blocks=compiled, compile_backend=backend
        )
    batches = [pairs(3, 20, seed=info.rank), pairs(3, 45, seed=10 + info.rank)]
    record = {"loss": {}, "grad_gap": 0.0}
    for shared in (True, False):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            loss = sum(-pair_logprobs(model, b, info.device, prefix_sharing=shared).mean() for b in batches)
            loss.backward()
            record["loss"][(name, shared)] = float(loss)
        for (_, p_eager), (_, p_compiled) in zip(
            models["eager"].named_parameters(), models["compiled"].named_parameters(), strict=True
        ):
            g_eager, g_compiled = p_eager.grad.full_tensor(), p_compiled.grad.full_tensor()
            gap = float((g_eager - g_compiled).abs().max() / g_eager.abs().max().clamp(min=1e-12))
            record["grad_gap"] = max(record["grad_gap"], gap)
    record["graphs"] = counters["stats"]["unique_graphs"]
    record["graph_breaks"] = sum(counters["graph_break"].values())
    if info.rank == 0:
        torch.save(record, out)
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "aot_eager", sys.argv[3] if len(sys.argv) > 3 else "cpu")

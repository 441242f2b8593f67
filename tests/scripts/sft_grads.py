"""Run under 1 or 2 processes: one SFT optimizer step's loss and full gradients, saved by rank 0.

python tests/scripts/sft_grads.py OUT_DIR ACCUM ...

For each ACCUM (micro-batches per rank), in one launch, a fresh model from the same seed:
OUT_DIR/{world size}_{ACCUM}.pt.
"""

import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from data.tldr import collate_sft  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from sft import accumulate_gradients  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402


def fixed_rows(n=8, seed=0):
    """Rows of different prompt and response lengths, so token counts differ between ranks."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 50000, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    responses = [
        torch.randint(0, 50000, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() + [198]
        for _ in range(n)
    ]
    return prompts, responses


def main(out_dir: str, accums: list[int]):
    info = setup_distributed("cpu")
    for accum in accums:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=64))
        shard_model(model)
        prompts, responses = fixed_rows()
        # rank r takes rows r, r+world, ...; then splits them into `accum` micro-batches
        mine = list(range(info.rank, len(prompts), info.world_size))
        size = len(mine) // accum
        micro = [
            collate_sft(
                [prompts[i] for i in mine[k * size : (k + 1) * size]],
                [responses[i] for i in mine[k * size : (k + 1) * size]],
            )
            for k in range(accum)
        ]
        loss = accumulate_gradients(model, micro, info.world_size, info.device)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if info.rank == 0:
            torch.save({"loss": loss, "grads": grads}, f"{out_dir}/{info.world_size}_{accum}.pt")
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]])

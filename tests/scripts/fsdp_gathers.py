"""Run under 2 processes: how many all-gathers FSDP issues in one forward + backward of a 2-block GPT-2, before and
after a gathered_params block (generation's), for a frozen model's forward, and for the forward after an optimizer
step that followed a forward without backward (the root it kept gathered must be gathered again, updated). Rank 0
saves the counts.

    python tests/scripts/fsdp_gathers.py OUT.pt
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from model.weights import freeze  # noqa: E402
from utils.dist import cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import gathered_params, shard_model  # noqa: E402
from utils.optim import build_optimizer, clip_grad_norm  # noqa: E402

calls = []
# FSDP2 gathers each unit's parameters with one collective, which its DefaultAllGather looks up on torch.distributed
# at every call (so a replacement there sees every one): all_gather_single on torch 2.13 and
# 2.14, all_gather_into_tensor on 2.11
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_all_gather = getattr(dist, GATHER)


def counting_all_gather(*args, **kwargs):
    calls.append(1)
    return _all_gather(*args, **kwargs)


def gathers(fn) -> int:
    calls.clear()
    fn()
    return len(calls)


def main(out: str):
    info = setup_distributed("cpu")
    setattr(dist, GATHER, counting_all_gather)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=2, n_embd=32, n_positions=64)
    model = shard_model(GPT2LMHeadModel(cfg))
    frozen = shard_model(freeze(GPT2LMHeadModel(cfg)))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(info.rank))
    pos = torch.arange(16).expand(2, 16)

    def train_step():
        model(ids, pos).float().pow(2).mean().backward()

    def generate_like():
        with gathered_params(model), torch.no_grad():
            model(ids, pos)
            model(ids, pos)

    optimizer = build_optimizer(model, 1e-2, 0.0)

    def step_after_a_forward_without_backward():
        model(ids, pos).float().pow(2).mean().backward()
        with torch.no_grad():
            model(ids, pos)  # an evaluation: the root stays gathered
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def forward():
        with torch.no_grad():
            return model(ids, pos)

    def frozen_forward():
        with torch.no_grad():
            frozen(ids, pos)

    counts = {
        "first_step": gathers(train_step),
        "second_step": gathers(train_step),
        "gathered_block": gathers(generate_like),
        "step_after_gathered_block": gathers(train_step),
        "frozen_forward": gathers(frozen_forward),
        "frozen_forward_again": gathers(frozen_forward),
    }
    gathers(step_after_a_forward_without_backward)
    counts["forward_after_step"] = gathers(forward)
    if info.rank == 0:
        torch.save(counts, out)
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run under 1 or 2 processes: sharded checkpoints (torch.distributed.checkpoint) of an FSDP model, optimizer,
scheduler and a frozen model.

    python tests/scripts/ckpt_dist.py save RUN_DIR OUT.pt  # 3 steps, a checkpoint after step 2
    python tests/scripts/ckpt_dist.py resume RUN_DIR OUT.pt[:SEED] ...  # fresh weights, step 2's checkpoint, step 3

Both save to OUT.pt (rank 0): the full parameters and AdamW moments after step 3, the learning rate of step 3, and
the loss of step 3; `save` also the state it saved, `resume` the state right after loading (with the frozen
model's weights, every rank's first draws of torch, numpy and `random` after the load, the run's --seed being
SEED, default 0, and what the load wrote to stderr). `resume` runs each OUT.pt[:SEED] in turn in one process group
(one launch for several resumes: a launch costs seconds of start-up), each from fresh weights and its own seed.
Every step is one SFT step (sft.accumulate_gradients) on the same global batch of 4 rows, split over the ranks.
"""

import contextlib
import io
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.tldr import collate_sft  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from model.weights import freeze  # noqa: E402
from sft import accumulate_gradients  # noqa: E402
from utils.checkpoint import load_checkpoint, newest_intact, save_checkpoint  # noqa: E402
from utils.dist import cleanup_distributed, gather_objects, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402

CFG = GPTConfig(vocab_size=50257, n_layer=2, n_head=2, n_embd=32, n_positions=64)
META = {"stage": "test", "model_config": CFG.to_dict()}


def batch(step: int, rank: int, world: int) -> dict:
    """This rank's slice of step `step`'s 4 rows (prompts and responses of different lengths)."""
    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(0, 512, (3 + i,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(0, 512, (1 + 2 * i,), generator=g).tolist() + [198] for i in range(4)]
    mine = range(rank * 4 // world, (rank + 1) * 4 // world)
    return collate_sft([prompts[i] for i in mine], [responses[i] for i in mine])


def full(model, optimizer) -> dict:
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].full_tensor().clone() for n, p in model.named_parameters()}
    return {"params": params, "moments": moments}


def run(info, mode: str, run_dir: str, out: str, seed: str = "0"):
    torch.manual_seed(0 if mode == "save" else 1)  # a resumed run starts from other weights: the load must replace them
    model = shard_model(GPT2LMHeadModel(CFG))
    frozen = shard_model(freeze(GPT2LMHeadModel(CFG)))
    optimizer = build_optimizer(model, 1e-2, 0.1)
    scheduler = build_scheduler(optimizer, 1, 10)
    result, step = {}, 0
    if mode == "resume":
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            step = load_checkpoint(
                newest_intact(run_dir, info.rank, info.world_size),
                model,
                optimizer,
                scheduler,
                META,
                info.rank,
                frozen={"reference": frozen},
                seed=int(seed),
            )["step"]
        sys.stderr.write(stderr.getvalue())
        result["stderr"] = stderr.getvalue()
        result["draws"] = gather_objects((torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()))
        result["loaded"] = full(model, optimizer)
        result["loaded_frozen"] = {n: p.full_tensor().clone() for n, p in frozen.named_parameters()}
    while step < 3:
        loss = accumulate_gradients(model, [batch(step, info.rank, info.world_size)], info.world_size, info.device)
        result["lr"] = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if mode == "save" and step == 2:
            with torch.no_grad():  # the frozen model's weights change during a run (a refreshed reference)
                for p in frozen.parameters():
                    p.to_local().mul_(-1.0)
            save_checkpoint(
                run_dir,
                step,
                model,
                optimizer,
                scheduler,
                META,
                extra={"loader": {"position": step}},
                rank=info.rank,
                frozen={"reference": frozen},
            )
            result["saved"] = full(model, optimizer)
            result["saved_frozen"] = {n: p.full_tensor().clone() for n, p in frozen.named_parameters()}
    result["final"], result["loss"] = full(model, optimizer), loss
    if info.rank == 0:
        torch.save(result, out)


def main(mode: str, run_dir: str, *outs: str):
    info = setup_distributed("cpu")
    for case in outs:
        out, _, seed = case.partition(":")
        run(info, mode, run_dir, out, seed or "0")
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])

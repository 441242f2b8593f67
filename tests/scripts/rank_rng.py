"""Run under 2 processes: the global RNG after utils.run.start_run and resume, as sft.py, dpo.py and grpo.py use them.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/rank_rng.py OUT.pt RUN_DIR

Builds a tiny GPT-2 with LoRA (dropout 0.5) between start_run and resume, as the scripts do, then draws a dropout mask
of the same input on every rank. Rank 0 saves whether the models started identical on both ranks (the common seed
before sharding), whether the two ranks' dropout masks differ (the per-rank seed after resume), and whether a
model built later from run.init_rng (reward_model.py's normalisation policy) is the same on both ranks.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.tldr import ShardedLoader  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from model.lora import LoRAConfig, apply_lora, lora_modules  # noqa: E402
from utils.config import RunConfig  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.run import resume, start_run  # noqa: E402

CFG = GPTConfig(vocab_size=512, n_positions=64, n_layer=2, n_head=2, n_embd=32)


def same_on_every_rank(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def main(out: str, run_dir: str):
    cfg = RunConfig(out_dir=run_dir, device="cpu", wandb_mode="disabled", seed=3)
    run = start_run(cfg, {"stage": "rank_rng", "model_config": CFG.to_dict(), "lora": None})
    model = GPT2LMHeadModel(CFG)
    apply_lora(model, LoRAConfig(lora_rank=4, lora_dropout=0.5))
    lora = next(iter(lora_modules(model).values()))
    start_equal = same_on_every_rank(torch.cat([p.detach().flatten() for p in model.parameters()]))
    shard_model(model)
    optimizer = build_optimizer(model, 1e-3, 0.0)
    loader = ShardedLoader(8, 2, run.rank, run.world, cfg.seed, collate=lambda idx: idx)
    resume(run, cfg, model, optimizer, build_scheduler(optimizer, 0, 1), loader, 1)
    lora.dropout.train()
    mask = lora.dropout(torch.ones(64, 32)) > 0  # (64, 32) this rank's dropout mask
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(run.init_rng)
        later = GPT2LMHeadModel(CFG)
    later_equal = same_on_every_rank(torch.cat([p.detach().flatten() for p in later.parameters()]))
    masks_equal = same_on_every_rank(mask)
    run.logger.finish()
    if run.rank == 0:
        torch.save(
            {
                "start_equal": start_equal,
                "masks_equal": masks_equal,
                "later_equal": later_equal,
                "kept_fraction": mask.float().mean().item(),
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

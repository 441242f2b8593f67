"""Run under 1 or 2 processes: GRPO's global advantage normalization and one update's loss and gradients.

    python tests/scripts/grpo_dist.py OUT_DIR MICRO_BATCH_SIZE:shared|unshared ...

The global batch is fixed: 4 prompts x 4 samples. Rank r takes a contiguous slice of whole prompts (group normalization
needs a prompt's samples on one rank) and splits it into micro-batches of MICRO_BATCH_SIZE rows, packed with each prompt
once (shared) or one row per sample with its own copy of the prompt (unshared). Each case runs in turn in one launch (a
launch costs seconds of start-up), from fresh models of the same seed; rank 0 saves
OUT_DIR/{WORLD_SIZE}_{MICRO_BATCH_SIZE}_{shared|unshared}.pt: per loss type, the loss and the full gradients, plus the
globally normalized advantages of an uneven split of a fixed vector (5 values on rank 0, the rest on rank 1) and the
selection diagnostics of an uneven split of fixed groups (5 groups of G scored rewards, the top 3 kept; the first 4 on
rank 0, the last, tied, on rank 1).
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.tldr import pad_prompts  # noqa: E402
from grpo import Config  # noqa: E402
from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from model.sampler import SampleOutput  # noqa: E402
from model.weights import freeze  # noqa: E402
from rlhf.advantages import global_normalize, group_normalize
from rlhf.selection import select_top, selection_diagnostics  # noqa: E402
from rollouts.batches import build_training_batches  # noqa: E402
from rollouts.update import batch_logprobs, policy_update  # noqa: E402
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import shard_model  # noqa: E402

VOCAB, PROMPTS, G, R = 512, 4, 4, 6


class GradRecorder:
    """Stands in for the optimizer: keeps the full gradients instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: p.grad.full_tensor().clone() for n, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


class ConstantLR:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


def fixed_rollout(seed=0):
    """Prompts of different lengths, responses of different lengths (some without an end token), rewards."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(3, 9, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    N = PROMPTS * G
    lengths = torch.randint(1, R + 1, (N,), generator=g)
    mask = torch.arange(R)[None] < lengths[:, None]  # (N, R)
    ids = torch.where(mask, torch.randint(0, VOCAB, (N, R), generator=g), 0)
    samples = SampleOutput(ids, mask, -torch.rand(N, R, generator=g) * mask, lengths < R)
    rewards = torch.randn(N, generator=g)
    return prompts, samples, rewards


def run_case(info, micro: int, shared: bool) -> dict:
    rank, world = info.rank, info.world_size
    results = {}

    # 1. global normalization of an uneven split
    values = torch.randn(16, generator=torch.Generator().manual_seed(1))
    mine = values if world == 1 else (values[:5] if rank == 0 else values[5:])
    parts = [None] * world
    normalized = global_normalize(mine, all_reduce_sum)
    if world > 1:
        dist.all_gather_object(parts, normalized)
    else:
        parts = [normalized]
    results["global_norm"] = torch.cat(parts)

    # 2. the selection diagnostics of an uneven split of groups (all but the last on rank 0), reduced over ranks
    pool = torch.randn(5, G, generator=torch.Generator().manual_seed(2))  # (groups, G)
    pool[-1] = 0.25  # every sample of the last group scored alike
    pool = pool if world == 1 else (pool[:-1] if rank == 0 else pool[-1:])
    kept = pool.gather(1, select_top(pool, 3)[0])  # (groups, 3)
    diagnostics = selection_diagnostics(pool, kept, all_reduce_sum)
    results["selection"] = {k: float(v) for k, v in diagnostics.items()}

    # 3. one update's loss and gradients, per loss type
    torch.manual_seed(0)
    cfg_model = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, n_positions=64)
    policy = GPT2LMHeadModel(cfg_model)
    reference = freeze(GPT2LMHeadModel(cfg_model))  # another random model, so the KL term is not zero
    shard_model(policy)
    shard_model(reference)
    prompts, samples, rewards = fixed_rollout()
    per_rank = PROMPTS // world
    p0 = rank * per_rank
    rows = slice(p0 * G, (p0 + per_rank) * G)
    local = SampleOutput(*(getattr(samples, f)[rows] for f in ("response_ids", "response_mask", "logprobs", "has_end")))
    prompt_ids, prompt_mask = pad_prompts(prompts[p0 : p0 + per_rank], pad_id=0)  # pads inside the small vocabulary
    advantages = global_normalize(group_normalize(rewards[rows].view(per_rank, G)).flatten(), all_reduce_sum)
    # the update alone on these fixed micro-batches (rollouts.step.train_step's stages 5-7 without sampling): the
    # batches and the reference log-probs do not depend on the loss type, the gradients do
    cfg = Config(
        temperature=0.9, beta=0.1, eps_low=0.2, eps_high=0.28, max_new_tokens=R, micro_batch_size=micro, grad_clip=0.0
    )
    batches = build_training_batches(
        prompt_ids, prompt_mask, local, torch.arange(per_rank * G), advantages, G, micro, shared
    )
    refs = batch_logprobs(reference, batches, cfg, gather=True)
    batches = [replace(b, ref_logprobs=r) for b, r in zip(batches, refs, strict=True)]
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        recorder = GradRecorder(policy)
        metrics = policy_update(
            policy, recorder, ConstantLR(), batches, replace(cfg, loss_type=loss_type), world, info.device
        )
        results[loss_type] = {"loss": metrics["train/loss"], "kl": metrics["train/kl"], "grads": recorder.grads}
    assert all(p.grad is None for p in reference.parameters())
    return results


def main(out_dir: str, cases: list[str]):
    info = setup_distributed("cpu")
    for case in cases:
        micro, layout = case.split(":")
        results = run_case(info, int(micro), layout == "shared")
        if info.rank == 0:
            torch.save(results, Path(out_dir) / f"{info.world_size}_{micro}_{layout}.pt")
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

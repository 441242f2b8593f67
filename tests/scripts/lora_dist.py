"""Run under 1 or 2 processes: LoRA under FSDP2 (gloo). Trains the adapters of a tiny GPT-2 for a few steps on fixed
rows split over ranks, then checks what tests/test_lora.py asserts on rank 0's saved results.

    python tests/scripts/lora_dist.py OUT.pt HF_FOLDER

Saved: the global loss, the trained adapters (full tensors), whether the base weights stayed put, whether the
adapters-off log-probs equal those of a separately sharded frozen copy of the base bit for bit (on every rank),
the logits of the adapted model on fixed rows, the error of the in-place merge of sharded parameters against
merged_state_dict of the full state, and whether adapters on and off agree after the merge. The Hugging Face
export (utils/fsdp.py export_model, adapters merged) is written to HF_FOLDER.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.gpt2 import GPT2LMHeadModel, GPTConfig  # noqa: E402
from model.lora import LoRAConfig, adapters_disabled, apply_lora, lora_scalings, merge_adapters_, merged_state_dict  # noqa: E402
from model.weights import save_export  # noqa: E402
from utils.dist import all_reduce_sum, cleanup_distributed, setup_distributed  # noqa: E402
from utils.fsdp import (  # noqa: E402
    export_model,
    full_model_state,
    shard_model,  # noqa: E402
)
from utils.optim import build_optimizer  # noqa: E402

CFG = GPTConfig(vocab_size=512, n_positions=64, n_layer=2, n_head=2, n_embd=32)
ROWS, T = 8, 10


def rows(seed: int, n: int = ROWS):
    """n left-padded rows (ids, positions, mask), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (n, T), generator=g)
    pads = torch.randint(0, 4, (n,), generator=g)
    mask = torch.arange(T)[None] >= pads[:, None]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, pos, mask


def token_logprobs(model, ids, pos, mask):
    logits = model(ids, pos, mask)[:, :-1]
    return torch.gather(F.log_softmax(logits.float(), -1), 2, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


def all_true(flag: bool) -> bool:
    return bool(all_reduce_sum(torch.tensor(float(not flag))) == 0)


def main(out: str, hf_folder: str):
    info = setup_distributed("cpu")
    rank, world = info.rank, info.world_size
    torch.manual_seed(0)
    base = GPT2LMHeadModel(CFG)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    reference = copy.deepcopy(base).requires_grad_(False)
    policy = apply_lora(base, LoRAConfig(lora_rank=4, lora_alpha=8.0))  # same RNG on every rank: same A
    shard_model(policy)
    shard_model(reference)
    optimizer = build_optimizer(policy, 1e-2, 0.0)

    # 1. train: summed NLL of this rank's rows / global token count x world (FSDP averages over ranks)
    ids, pos, mask = rows(seed=1)
    per_rank = ROWS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    ids, pos, mask = ids[mine], pos[mine], mask[mine]
    target_mask = mask[:, 1:]
    n_tokens = all_reduce_sum(target_mask.sum().float())
    loss = torch.zeros(())
    for _ in range(3):
        nll = -(token_logprobs(policy, ids, pos, mask) * target_mask).sum()
        (nll * world / n_tokens).backward()
        assert all(p.grad is None for n, p in policy.named_parameters() if "lora" not in n)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = all_reduce_sum(nll.detach()) / n_tokens

    # 2. the reference: adapters off == a frozen copy of the base, bit for bit, on every rank
    with torch.no_grad():
        with adapters_disabled(policy):
            off = token_logprobs(policy, ids, pos, mask)
        ref = token_logprobs(reference, ids, pos, mask)
        on = token_logprobs(policy, ids, pos, mask)
    ref_equal = all_true(torch.equal(off, ref) and not torch.equal(on, ref))

    # 3. full state: base untouched, adapters trained; logits of the adapted model on fixed rows
    # rank 0 holds it (cpu_offload gathers to rank 0 only); cloned: with one process its tensors are the parameters
    full = {k: v.clone() for k, v in full_model_state(policy).items()}
    eval_ids, eval_pos, eval_mask = rows(seed=3, n=4)
    with torch.no_grad():
        logits = policy(eval_ids, eval_pos, eval_mask)
    export_model(policy, lambda sd: save_export(policy, sd, CFG, hf_folder), rank)

    # 4. merge in place on the sharded parameters; compare with the merge of the full state dict
    expected = merged_state_dict(full, lora_scalings(policy)) if rank == 0 else None
    merge_adapters_(policy)
    merged = full_model_state(policy)
    with torch.no_grad():
        on = token_logprobs(policy, ids, pos, mask)
        with adapters_disabled(policy):
            off = token_logprobs(policy, ids, pos, mask)
    merged_off_equals_on = all_true(torch.equal(on, off))

    if rank == 0:
        torch.save(
            {
                "loss": float(loss),
                "adapters": {k: v for k, v in full.items() if "lora" in k},
                "base_unchanged": all(torch.equal(full[k], v) for k, v in initial.items()),
                "adapters_changed": all(v.abs().max() > 0 for k, v in full.items() if k.endswith("lora_B")),
                "ref_equal": ref_equal,
                "logits": logits,
                "eval_rows": (eval_ids, eval_pos, eval_mask),
                "merge_error": max((merged[k] - v).abs().max().item() for k, v in expected.items()),
                "merged_off_equals_on": merged_off_equals_on
                and all(torch.equal(v, torch.zeros_like(v)) for k, v in merged.items() if k.endswith("lora_B")),
            },
            out,
        )
    if dist.is_initialized():
        dist.barrier()
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

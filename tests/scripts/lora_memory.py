"""Peak host memory of one GRPO step (grpo.train_step: generate, score, select, reference, update) of GPT-2 124M
(random weights, CPU, fp32, one process) on 2 prompts x 8 samples of 128 + 16 tokens, rewarded by the `length`
function: full fine-tuning with a frozen reference copy against LoRA, whose reference is the same weights with the
adapters off.

    python tests/scripts/lora_memory.py 0     # full fine-tuning + reference copy
    python tests/scripts/lora_memory.py 8     # LoRA r=8 on c_attn, c_proj, c_fc

Prints the parameter bytes held by the policy and the reference, the trainable parameters, AdamW's state bytes
after the step, the process's peak resident set size (ru_maxrss: the activations of the update's forward pass,
the same in both, dominate it) and its resident set after the step, freed heap returned to the system (what stays
held between steps). Run each in its own process.
"""

import copy
import ctypes
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpo import Config, train_step  # noqa: E402
from model.gpt2 import PRESETS, GPT2LMHeadModel  # noqa: E402
from model.lora import AdaptersOff, LoRAConfig, apply_lora  # noqa: E402
from model.weights import freeze  # noqa: E402
from rollouts.models import Models  # noqa: E402
from tests.helpers import prompts_and_rewards  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402

PROMPTS, G, P, R = 2, 8, 128, 16


def current_rss_kib() -> int:
    """Resident set now, after glibc hands freed heap pages back (malloc_trim), so it counts what is still held."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main(rank: int) -> None:
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(PRESETS["gpt2"])
    if rank > 0:
        apply_lora(policy, LoRAConfig(lora_rank=rank))
        reference, held = AdaptersOff(policy), bytes_of(policy.parameters())
    else:
        reference = freeze(copy.deepcopy(policy))
        held = bytes_of(policy.parameters()) + bytes_of(reference.parameters())
    g = torch.Generator().manual_seed(0)
    cfg = Config(rewards="length", num_samples=G, selection="all", max_new_tokens=R, prompts_per_step=PROMPTS,
                 micro_batch_size=8, beta=0.04, lr=1e-4, warmup_steps=1)
    prompts, spec = prompts_and_rewards(cfg, prompts=torch.randint(0, 50000, (PROMPTS, P), generator=g).tolist())
    optimizer = build_optimizer(policy, cfg.lr, 0.0)
    result = train_step(Models(policy, reference, None), optimizer, build_scheduler(optimizer, 1, 10), prompts, spec,
                        cfg, step=0)
    metrics = result.update
    state = bytes_of(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    mib = 2**20
    print(
        f"lora_rank {rank}: policy + reference parameters {held / mib:.1f} MiB, trainable {trainable:,}, "
        f"AdamW state {state / mib:.1f} MiB, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
        f"RSS after the step {current_rss_kib() / 1024:.0f} MiB (kl {metrics['train/kl']:.2e})"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))

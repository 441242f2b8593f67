"""Memory held by GRPO's trainable policy and its reference: full fine-tuning with a frozen reference copy
against LoRA, whose reference is the same weights with the adapters off (model/lora.py).

Measured, not computed: both set-ups are built on the device, one optimizer step is taken on a small batch so
AdamW's state exists, and the bytes of every parameter and optimizer-state tensor they hold are counted (on
CUDA also torch.cuda.memory_allocated after the step, activations freed). Parameters in the training dtype:
bf16 on CUDA, fp32 on CPU. Activations are the same in both and are not part of the figure.
"""

import copy
from dataclasses import dataclass

import torch

from bench import common
from model.gpt2 import PRESETS, GPT2LMHeadModel
from model.lora import AdaptersOff, LoRAConfig, apply_lora
from utils.optim import build_optimizer

BENCH = "lora"


@dataclass(frozen=True)
class LoRAMemoryConfig:
    name: str
    preset: str  # a model/gpt2.py PRESETS key
    rank: int  # LoRA rank on the default targets (c_attn, c_proj, c_fc)


def configs(device: torch.device, quick: bool) -> list[LoRAMemoryConfig]:
    return [LoRAMemoryConfig("tiny-r8" if quick else "gpt2-124M-r8", "tiny" if quick else "gpt2", 8)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held(model_name: str, rank: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int, int | None]:
    """(bytes of policy + reference parameters and AdamW state, trainable parameters, CUDA bytes allocated)."""
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(PRESETS[model_name]).to(device=device, dtype=dtype)
    if rank:
        apply_lora(policy, LoRAConfig(lora_rank=rank))
        policy.to(device=device, dtype=dtype)
        reference_params = []  # the same weights, adapters off
        reference = AdaptersOff(policy)
    else:
        reference = copy.deepcopy(policy).requires_grad_(False)
        reference_params = list(reference.parameters())
    optimizer = build_optimizer(policy, 1e-4, 0.0)
    ids = torch.randint(0, 50000, (2, 32), device=device)
    pos = torch.arange(32, device=device).expand(2, 32)
    with torch.no_grad():
        reference(ids, pos)
    policy(ids, pos).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    held = _bytes(policy.parameters()) + _bytes(reference_params) + _bytes(state)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    del policy, reference, optimizer
    return held, trainable, allocated


def run(device: torch.device, quick: bool) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for cfg in configs(device, quick):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        full, full_trainable, full_alloc = _held(cfg.preset, 0, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        lora, lora_trainable, lora_alloc = _held(cfg.preset, cfg.rank, device, dtype)
        mib = 2**20
        what = f"{str(dtype).removeprefix('torch.')} parameters, AdamW"
        rows += [
            common.result(BENCH, "full fine-tune + reference copy: held", full / mib, "MiB", config=cfg,
                          note=f"{what}; trainable {full_trainable:,}"),
            common.result(BENCH, f"LoRA r={cfg.rank}, reference = adapters off: held", lora / mib, "MiB", config=cfg,
                          note=f"{what}; trainable {lora_trainable:,}"),
            common.result(BENCH, "LoRA saves", (full - lora) / mib, "MiB", config=cfg,
                          note=f"{full / lora:.1f}x less held (activations excluded)"),
        ]
        if full_alloc is not None:
            rows.append(common.result(BENCH, "CUDA allocated after the step: full / LoRA", full_alloc / max(lora_alloc, 1),
                                      "x", config=cfg, note=f"{full_alloc / mib:.0f} / {lora_alloc / mib:.0f} MiB"))
    return rows

"""Memory held by GRPO's policy and its reference after one real step (rollouts/step.py on set-ups built as grpo.main()
builds them, bench/grpo_step.py's `build`): full fine-tuning with a frozen copy against LoRA, whose reference is the
policy with its adapters off; parameters and AdamW state counted (activations are the same in both), on CUDA also
memory_allocated. `python -m model.lora` computes the same bytes from the shapes alone.
"""

from dataclasses import dataclass, replace

import torch

from bench import common
from bench.grpo_step import GRPOBenchConfig, build

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


def step_config(cfg: LoRAMemoryConfig) -> GRPOBenchConfig:
    """2 prompts of 96-128 tokens x 8 samples x 16 new tokens, all kept, the `length` reward (no reward model held)."""
    name = f"{cfg.name}-step"
    return GRPOBenchConfig(
        name, cfg.preset, 2, 8, 8, "all", 16, 128, 96, 2, 8, 16, warmup=0, repeats=1, rewards="length"
    )


def held_after_step(bcfg: GRPOBenchConfig, device: torch.device) -> tuple[int, int, int | None]:
    """(bytes of policy + reference parameters and AdamW state after one GRPO step (train_step), trainable parameters,
    CUDA bytes allocated)."""
    from rollouts.step import train_step

    s = build(bcfg, device)
    train_step(s.models, s.optimizer, s.scheduler, s.prompts, s.spec, s.cfg, 1)
    policy, reference = s.models.policy, s.models.reference
    reference_params = [] if reference.__class__.__name__ == "AdaptersOff" else list(reference.parameters())
    state = [t for st in s.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    held = _bytes(policy.parameters()) + _bytes(reference_params) + _bytes(state)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    del s, policy, reference, state
    return held, trainable, allocated


def run(device: torch.device, quick: bool) -> list[dict]:
    dtype = "bf16" if device.type == "cuda" else "fp32"
    rows = []
    for cfg in configs(device, quick):
        step = step_config(cfg)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        full, full_trainable, full_alloc = held_after_step(step, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        lora, lora_trainable, lora_alloc = held_after_step(replace(step, lora_rank=cfg.rank), device)
        mib, what = 2**20, f"{dtype} parameters, AdamW, after one GRPO step (train_step)"
        lora_held = f"LoRA r={cfg.rank}, reference = adapters off: held"
        figures = [
            ("full fine-tune + reference copy: held", full / mib, "MiB", f"{what}; trainable {full_trainable:,}"),
            (lora_held, lora / mib, "MiB", f"{what}; trainable {lora_trainable:,}"),
            ("LoRA saves", (full - lora) / mib, "MiB", f"{full / lora:.1f}x less held (activations excluded)"),
        ]
        if full_alloc is not None:
            allocated = f"{full_alloc / mib:.0f} / {lora_alloc / mib:.0f} MiB"
            ratio = full_alloc / max(lora_alloc, 1)
            figures.append(("CUDA allocated after the step: full / LoRA", ratio, "x", allocated))
        rows += [common.result(BENCH, *f[:3], note=f[3], config=cfg) for f in figures]
    return rows

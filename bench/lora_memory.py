"""Memory held by GRPO's trainable policy and its reference: full fine-tuning with a frozen reference copy
against LoRA, whose reference is the same weights with the adapters off (model/lora.py).

Measured, not computed: each set-up is built as grpo.main() builds it (bench/grpo_step.py's `build`: FSDP-sharded,
bf16 parameters on CUDA, fp32 on CPU), one real GRPO step (rollouts/step.py) is taken (generation, a reward
function, reference log-probs, the update), and the bytes of every parameter of the policy and the reference and of
AdamW's state are counted after it; on CUDA also torch.cuda.memory_allocated after the step (activations freed).
Activations are the same in both and are not part of the figure. model/lora.py's lora_memory_report gives the same
parameter and state bytes from the model's shape alone (`python -m model.lora`), without running anything.
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
    """One small GRPO step: 2 prompts of up to 128 tokens x 8 samples x 16 new tokens, every sample kept, the
    `length` reward function (no reward model, so only the policy and its reference are held)."""
    return GRPOBenchConfig(
        f"{cfg.name}-step",
        cfg.preset,
        prompts=2,
        num_samples=8,
        num_kept=8,
        selection="all",
        max_new_tokens=16,
        prompt_len=128,
        min_prompt_len=96,
        gen_prompts=2,
        micro_batch_size=8,
        score_micro_batch_size=16,
        warmup=0,
        repeats=1,
        rewards="length",
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
        mib = 2**20
        what = f"{dtype} parameters, AdamW, after one GRPO step (train_step)"
        rows += [
            common.result(
                BENCH,
                "full fine-tune + reference copy: held",
                full / mib,
                "MiB",
                config=cfg,
                note=f"{what}; trainable {full_trainable:,}",
            ),
            common.result(
                BENCH,
                f"LoRA r={cfg.rank}, reference = adapters off: held",
                lora / mib,
                "MiB",
                config=cfg,
                note=f"{what}; trainable {lora_trainable:,}",
            ),
            common.result(
                BENCH,
                "LoRA saves",
                (full - lora) / mib,
                "MiB",
                config=cfg,
                note=f"{full / lora:.1f}x less held (activations excluded)",
            ),
        ]
        if full_alloc is not None:
            rows.append(
                common.result(
                    BENCH,
                    "CUDA allocated after the step: full / LoRA",
                    full_alloc / max(lora_alloc, 1),
                    "x",
                    config=cfg,
                    note=f"{full_alloc / mib:.0f} / {lora_alloc / mib:.0f} MiB",
                )
            )
    return rows

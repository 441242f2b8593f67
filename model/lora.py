"""LoRA (Hu et al. 2021, arXiv 2106.09685) on the attention and MLP projections of model/gpt2.py.

A target nn.Linear W (out, in) becomes `LoRALinear`: the same frozen weight and bias plus two trainable matrices,

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T          A: (r, in), B: (out, r)

A starts Kaiming-uniform and B at zero (as PEFT does), so the adapted model starts equal to the base model.
`LoRALinear` *is* an nn.Linear whose `weight` and `bias` are the original parameters, so the base weights keep
their Hugging Face names (`transformer.h.0.attn.c_attn.weight`) and the adapters sit beside them
(`...c_attn.lora_A`, `...c_attn.lora_B`): a state dict with adapters is the base state dict plus 2 keys per
target. Sharding is not done here: utils/fsdp.py puts the frozen base and the trainable adapters of a block in
the same fully_shard unit, which FSDP2 allows (it shards every parameter on its own and reduces gradients only
for the parameters that have them).

Written here rather than taken from PEFT: PEFT wraps the model in a PeftModel whose parameter names gain a
`base_model.model.` prefix and whose layers are its own classes, which our name-based loading, export and
FSDP2 wrap policy (utils/fsdp.py finds `Block`s) would all have to learn about; the whole method is the forward
above, and owning it makes the adapters-off reference and the in-place merge under FSDP2 two small functions.

Three uses beyond training:
- the reference policy of DPO and GRPO is the same model with every adapter switched off (`adapters_disabled`,
  `AdaptersOff`): the frozen base weights *are* the starting policy, so no second copy is kept;
- `merge_adapters_` folds W += (alpha / r) B A into the base weight and zeroes B (the model computes the same
  function, and switching adapters off now gives the merged weights: GRPO's reference refresh);
- `merged_state_dict` does the same on a full state dict, for the Hugging Face-format export.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.gpt2 import GPTConfig

# The projections of a GPT-2 block, by their Hugging Face names. "c_proj" names both attn.c_proj and mlp.c_proj.
TARGETS = ("c_attn", "c_proj", "c_fc")


@dataclass
class LoRAConfig:
    """LoRA options; sft.py, dpo.py and grpo.py's configs inherit them, so each script takes --lora_rank etc."""

    # --- LoRA
    lora_rank: int = 0
    """LoRA rank r on the --lora_targets projections (model/lora.py); 0 disables LoRA and trains every weight.
    With LoRA only the adapters are trained, and DPO/GRPO's reference is the base model with adapters off."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the adapter's output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in training mode (0 in GRPO keeps the mu > 1 ratio exactly 1 at first)."""
    lora_targets: str = "c_attn,c_proj,c_fc"
    """Comma-separated projections to adapt: c_attn, c_proj (both attn.c_proj and mlp.c_proj), c_fc, or a
    dotted suffix such as attn.c_proj."""

    @property
    def lora_enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def lora_target_list(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    def lora_meta(self) -> dict | None:
        """What a checkpoint records about the adapters (None without LoRA): a run refuses a checkpoint whose
        adapters differ from its own, before any model is built. Dropout may change on resume."""
        if not self.lora_enabled:
            return None
        return {"rank": self.lora_rank, "alpha": self.lora_alpha, "targets": list(self.lora_target_list)}

    def validate_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"--lora_rank must be >= 0, got {self.lora_rank}")
        if not self.lora_enabled:
            return
        if not self.lora_alpha > 0 or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(
                f"--lora_alpha must be > 0 and --lora_dropout in [0, 1), got {self.lora_alpha}, {self.lora_dropout}"
            )
        unknown = [t for t in self.lora_target_list if t.split(".")[-1] not in TARGETS]
        if not self.lora_target_list or unknown:
            raise ValueError(
                f"--lora_targets must name some of {TARGETS} (or attn.c_proj / mlp.c_proj), got '{self.lora_targets}'"
            )


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update (see the module docstring). `weight` and `bias` are the wrapped layer's own
    parameters (frozen here); `lora_A` (r, in) and `lora_B` (out, r) are the trainable ones."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate and initialise a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameter objects: names and values unchanged
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scaling = rank, alpha / rank
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's (and nn.Linear's) initialisation
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out), exactly nn.Linear's forward
        if not self.adapter_enabled:
            return y
        return y + self.scaling * F.linear(
            F.linear(self.dropout(x), self.lora_A), self.lora_B
        )  # (..., r) -> (..., out)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def _is_target(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Freeze every parameter of `model` and replace its target nn.Linear layers by LoRALinear, in place.

    The tied embedding / LM head, position embeddings and layer norms stay frozen. Call before sharding, with the
    same RNG state on every rank (the adapters' A is random). Returns the model."""
    model.requires_grad_(False)
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and _is_target(full, cfg.lora_target_list):
                setattr(module, child_name, LoRALinear(child, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout))
                replaced.append(full)
    if not replaced:
        raise ValueError(f"LoRA targets {cfg.lora_target_list} match no nn.Linear layer of {type(model).__name__}")
    return model


def trainable_summary(model: nn.Module) -> str:
    """One line for the start of a run: how many parameters train, and on which layers."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    modules = lora_modules(model)
    where = f"LoRA adapters on {len(modules)} projections" if modules else "every weight"
    return f"{trainable:,} of {total:,} parameters trainable ({100 * trainable / total:.2f}%): {where}"


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


@contextmanager
def adapters_disabled(model: nn.Module):
    """Inside the block the model computes with its base weights only (the reference policy)."""
    modules = list(lora_modules(model).values())
    for m in modules:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m in modules:
            m.adapter_enabled = True


class AdaptersOff(nn.Module):
    """A LoRA model seen with its adapters switched off, usable wherever a frozen reference model is expected.

    It holds the model without registering it as a submodule, so it owns no parameters: nothing can freeze,
    re-shard or optimise the policy through it, and `parameters()` does not count the weights twice."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "base_model", model)  # not a submodule (see above)
        self.cfg = getattr(model, "cfg", None)

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.base_model):
            return self.base_model(*args, **kwargs)


def sharded_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose (FSDP-sharded) parameters compute `model`: the policy itself for its adapters-off view
    (AdaptersOff holds the policy without registering it, so its own modules() hold no FSDP unit to gather)."""
    return model.base_model if isinstance(model, AdaptersOff) else model


@torch.no_grad()
def merge_adapters_(model: nn.Module) -> None:
    """W += (alpha / r) B A and B = 0 in every LoRALinear, in place. The model's function is unchanged (up to
    rounding) and, with adapters off, it now computes with the merged weights.

    Works on FSDP2-sharded parameters too (call it outside forward, when they are sharded): they are DTensors
    sharded on dim 0, and B @ A with B and W sharded alike on their rows gives the update of this rank's rows of W
    (DTensor all-gathers A, a small (r, in) matrix)."""
    for m in lora_modules(model).values():
        m.weight.add_(m.scaling * (m.lora_B @ m.lora_A).to(m.weight.dtype))  # (out, in)
        m.lora_B.zero_()


def merged_state_dict(state_dict: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict with every adapter folded into its base weight and the lora_A / lora_B keys dropped: the
    plain GPT-2 state dict of the adapted model. `scalings`: alpha / r per LoRALinear name (`lora_scalings`)."""
    out = {k: v for k, v in state_dict.items() if not k.endswith((".lora_A", ".lora_B"))}
    for name, scaling in scalings.items():
        A, B = state_dict[f"{name}.lora_A"].float(), state_dict[f"{name}.lora_B"].float()  # (r, in), (out, r)
        weight = state_dict[f"{name}.weight"]
        out[f"{name}.weight"] = (weight.float() + scaling * (B @ A)).to(weight.dtype)
    return out


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """alpha / r of every LoRALinear, by module name (the prefix of its state-dict keys)."""
    return {name: m.scaling for name, m in lora_modules(model).items()}


# ----------------------------------------------------------------------------------------------------
# Memory: what LoRA saves against a full fine-tune with a separate frozen reference copy


def gpt2_param_count(cfg: GPTConfig) -> int:
    """Parameters of GPT2LMHeadModel (tied head counted once)."""
    C, L = cfg.n_embd, cfg.n_layer
    per_block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    return cfg.vocab_size * C + cfg.n_positions * C + L * per_block + 2 * C


def lora_param_count(cfg: GPTConfig, rank: int, targets: str = "c_attn,c_proj,c_fc") -> int:
    """Adapter parameters r * (in + out) summed over the targeted projections of every block."""
    C = cfg.n_embd
    shapes = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}
    wanted = tuple(t.strip() for t in targets.split(",") if t.strip())
    return cfg.n_layer * sum(rank * (i + o) for name, (i, o) in shapes.items() if _is_target(name, wanted))


def lora_memory_report(
    model_cfg: GPTConfig, rank: int, targets: str = "c_attn,c_proj,c_fc", reference_bytes_per_param: int = 2
) -> dict[str, int | float]:
    """Bytes of a full frozen reference copy (bf16 by default, as dpo.py stores it on GPU) against the adapters'
    parameters (fp32), plus what the trainable state costs: fp32 master weights, gradients and AdamW's two
    moments, 16 bytes per trainable parameter, for full fine-tuning and for LoRA. Totals over all ranks (FSDP
    divides each by the world size)."""
    full, adapter = gpt2_param_count(model_cfg), lora_param_count(model_cfg, rank, targets)
    return {
        "params": full,
        "adapter_params": adapter,
        "reference_copy_bytes": full * reference_bytes_per_param,
        "adapter_bytes": adapter * 4,
        "saved_bytes": full * reference_bytes_per_param - adapter * 4,
        "full_finetune_train_state_bytes": 16 * full,
        "lora_train_state_bytes": 16 * adapter,
        "trainable_fraction": adapter / full,
    }


def main() -> None:
    """python -m model.lora [--model gpt2] [--rank 8]: one line of lora_memory_report."""
    import argparse

    from model.gpt2 import PRESETS

    p = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(PRESETS), help="GPT-2 preset")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--targets", default="c_attn,c_proj,c_fc", help="projections to adapt (--lora_targets)")
    args = p.parse_args()
    r = lora_memory_report(PRESETS[args.model], args.rank, args.targets)
    mib = 2**20
    print(
        f"lora {args.model} r={args.rank} ({args.targets}): "
        f"reference copy {r['reference_copy_bytes'] / mib:.1f} MiB (bf16) "
        f"vs adapters {r['adapter_bytes'] / mib:.2f} MiB (fp32), saved {r['saved_bytes'] / mib:.1f} MiB; "
        f"train state {r['full_finetune_train_state_bytes'] / mib:.0f} -> {r['lora_train_state_bytes'] / mib:.1f} MiB; "
        f"{r['adapter_params']:,} of {r['params']:,} parameters trainable ({100 * r['trainable_fraction']:.2f}%)"
    )


if __name__ == "__main__":
    main()

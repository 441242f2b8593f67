"""GRPO's three models (the trained policy, its frozen reference and the frozen reward model), the reference's refresh,
and the checks, before any weight is read, that they hold the run's lengths and that the step fits the device."""

import copy
from dataclasses import dataclass

import torch

from model.lora import AdaptersOff, apply_lora, merge_adapters_
from model.weights import build_policy, build_reward_model, freeze, model_config
from rlhf.rewards import RewardSource
from rollouts.memory import check_memory, free_device_bytes
from rollouts.options import keeps_start
from utils.config import fit_context
from utils.dist import all_reduce_max
from utils.fsdp import copy_params_, shard_model


@dataclass
class Models:
    """The trained policy, its frozen reference (with LoRA: the policy with adapters off) and the frozen reward model
    (None when --rewards does not use it), all FSDP-sharded on the run's device; and `start`, a frozen copy of the
    starting policy kept when the reference is refreshed and the frontier is measured (keeps_start), else None."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    reward_model: torch.nn.Module | None
    start: torch.nn.Module | None = None

    @property
    def starting_policy(self) -> torch.nn.Module:
        """The policy the run started from: the frozen copy when the reference is refreshed, else the reference."""
        return self.start if self.start is not None else self.reference


def build_models(cfg, sources: list[RewardSource], dtype, device) -> Models:
    """Build and shard the three models from grpo.Config's options (model, random_init, reward_model,
    reward_random_init, lora_*, activation_checkpointing, frozen_cpu_offload). The reference is a frozen copy of the
    starting weights (random init included); with LoRA it is the policy itself with adapters off, no copy. The
    reward model is built only when a source needs it. With keeps_start(cfg), a frozen copy of the starting weights
    too (frozen before sharding: shard_model gives a frozen model the hook that empties FSDP2's per-forward records)."""
    policy = build_policy(cfg.model, cfg.random_init)
    reference = None if cfg.lora_enabled else freeze(copy.deepcopy(policy))
    start = freeze(copy.deepcopy(policy)) if keeps_start(cfg) else None  # before LoRA: the base weights as they start
    if cfg.lora_enabled:
        apply_lora(policy, cfg)
    uses_rm = any(s.fn is None for s in sources)
    reward_model = freeze(build_reward_model(cfg.reward_model, cfg.reward_random_init)) if uses_rm else None
    shard_model(policy, dtype, activation_checkpointing=cfg.activation_checkpointing, compile_blocks=cfg.compile)
    policy.to(device)
    for frozen in (reference, reward_model, start):
        if frozen is not None:
            shard_model(frozen, dtype, cpu_offload=cfg.frozen_cpu_offload)
            if not cfg.frozen_cpu_offload:
                frozen.to(device)
    return Models(policy, AdaptersOff(policy) if reference is None else reference, reward_model, start)


@torch.no_grad()
def refresh_reference(models: Models) -> None:
    """The reference becomes the current policy. With LoRA (the reference is the policy with adapters off) the
    adapters are merged into the base weights and B is zeroed; otherwise every parameter shard of the policy is
    copied into the reference's. Outside forward only."""
    if isinstance(models.reference, AdaptersOff):
        merge_adapters_(models.policy)
    else:
        copy_params_(models.policy, models.reference)


def check_models(cfg, sources: list[RewardSource]):
    """The policy's config, after checking each model's kind and fitting the prompt and response lengths to the
    policy's and reward model's positions (utils.config.fit_context; before any weights are read)."""
    model_cfg = model_config(cfg.model, cfg.random_init, kind="policy")
    limits = [(model_cfg, "max_new_tokens", "policy")]
    if cfg.pref_data and cfg.eval_every >= 0:
        limits.append((model_cfg, "pref_max_response_len", "policy"))
    if any(s.fn is None for s in sources):
        rm_cfg = model_config(cfg.reward_model, cfg.reward_random_init, kind="reward_model", option="--reward_model")
        limits.append((rm_cfg, "max_new_tokens", "reward model"))
    limits += cfg.frontier_limits(model_cfg, "max_new_tokens")  # --frontier_prompts' samples and reward model
    fit_context(cfg, *limits)  # lowers a default --max_prompt_len to what fits
    return model_cfg


def check_step_fits(cfg, sources: list[RewardSource], model_cfg, dtype, world: int, device) -> None:
    """On a device that reports its free memory (a GPU), a step that cannot fit stops here, before any weight is
    loaded, with one line naming the option to lower (rollouts/memory.py); the smallest free memory of any rank."""
    free = free_device_bytes(device)
    if free is not None:
        rm_cfg = model_config(cfg.reward_model, cfg.reward_random_init) if any(s.fn is None for s in sources) else None
        dtype_bytes = torch.finfo(dtype or torch.float32).bits // 8
        check_memory(cfg, model_cfg, rm_cfg, world, dtype_bytes, int(-all_reduce_max(-free, device)), str(device))

"""A policy trained against a frozen reference (DPO): the two models built and sharded, and the reference's summed
response log-probs of a step's micro-batches, computed once before the policy's forward passes."""

import copy

import torch

from evaluation.preference import pair_logprobs
from model.lora import AdaptersOff, apply_lora, sharded_module, trainable_summary
from model.weights import build_policy
from utils.fsdp import gathered_params, resolve_dtype, shard_model
from utils.run import Run


def build_policy_and_reference(cfg, run: Run) -> tuple[torch.nn.Module, torch.nn.Module]:
    """DPO's two models from dpo.Config's options (model, random_init, reference, reference_dtype, lora_*,
    activation_checkpointing, frozen_cpu_offload): the policy (with LoRA: frozen, plus trainable adapters) and its
    frozen reference, both FSDP-sharded on the run's device. The reference is --reference, or the starting policy
    copied before sharding (so a random init is shared), or with LoRA the policy itself with its adapters off (no
    copy)."""
    policy = build_policy(cfg.model, cfg.random_init)
    if cfg.reference:
        reference = build_policy(cfg.reference)
    elif cfg.lora_enabled:
        reference = None  # AdaptersOff(policy), once the policy is sharded
    else:
        reference = copy.deepcopy(policy)
    if cfg.lora_enabled:
        apply_lora(policy, cfg)
    run.say(f"dpo: {trainable_summary(policy)}")
    if reference is not None:
        reference.requires_grad_(False)
        reference.eval()
        ref_dtype = run.dtype if cfg.reference_dtype == "auto" else resolve_dtype(cfg.reference_dtype, run.device)
        if ref_dtype is not None:
            reference.to(ref_dtype)  # stored in bf16, not only computed in it: half the memory
        shard_model(reference, None, cpu_offload=cfg.frozen_cpu_offload)
        if not cfg.frozen_cpu_offload:
            reference.to(run.device)
    shard_model(policy, run.dtype, activation_checkpointing=cfg.activation_checkpointing)
    policy.to(run.device)
    return policy, AdaptersOff(policy) if reference is None else reference


@torch.no_grad()  # the reference is frozen: no graph, no gradient
def reference_logps(reference, micro_batches: list[dict], device, prefix_sharing: bool = True) -> list[torch.Tensor]:
    """The frozen reference's summed response log-probs (2B,) of every micro-batch of a step, its FSDP units gathered
    once for all of them (with --frozen_cpu_offload: one host-to-device copy per step, not per micro-batch). Run
    before the policy's micro-batches: with LoRA the reference is the policy's own FSDP modules (adapters off), whose
    no-grad forward should not sit between the policy's forward and its backward."""
    with gathered_params(sharded_module(reference)):
        return [pair_logprobs(reference, batch, device, prefix_sharing) for batch in micro_batches]

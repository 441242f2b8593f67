"""FSDP2 (`fully_shard`) wrapping: one unit per GPT-2 block, the rest (embeddings, tied head, final norm,
any value or reward head) in the root unit, as torchtitan does. The model code holds no distributed code;
sharding is applied to a built model.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """Parameter dtype in forward/backward: "bf16", "fp32", or "auto" (bf16 on GPU, fp32 on CPU, where bf16
    matmuls are slow and exact comparisons are wanted). None means no mixed precision."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return None
    raise ValueError(f"dtype must be one of auto, bf16, fp32; got '{name}'")


def shard_model(
    model: nn.Module,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shard `model` in place over the default process group and return it.

    param_dtype: compute dtype (e.g. bf16); gradients are always reduced in fp32 and the optimizer keeps fp32
    master weights. cpu_offload: keep sharded parameters on the CPU (for frozen reference and reward models;
    needs a GPU). Every submodule whose class sets `fsdp_unit = True` (model.gpt2.Block) becomes a unit of its own,
    whether the GPT-2 is bare or inside a policy or reward wrapper, so tied embedding and head always land together
    in the root unit.

    Blocks reshard after forward (their weights are gathered again in backward, one block at a time). The root of a
    model that trains stays gathered from forward to backward: its backward starts with the tied head, which needs
    the weights forward just used, so resharding them would cost a second all-gather of the largest unit (39M of
    GPT-2's 124M parameters) in every micro-batch for nothing. Backward reshards it. The root of a frozen model
    (no parameter requires a gradient: no backward comes to reshard it) reshards after forward, so it does not stay
    gathered, or on the GPU under cpu_offload, between uses.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    kwargs = dict(mp_policy=mp)
    if cpu_offload:
        if not torch.cuda.is_available():
            raise ValueError("cpu_offload needs a GPU: FSDP offloads parameters from the GPU to the CPU")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for m in model.modules():
        if getattr(type(m), "fsdp_unit", False):
            m.activation_checkpointing = activation_checkpointing
            fully_shard(m, reshard_after_forward=True, **kwargs)
    trains = any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=not trains, **kwargs)
    if not trains:  # frozen: it never runs a backward
        model.register_forward_hook(lambda module, args, output: forget_forward_order(module))
    return model


def forward_order_records(model: nn.Module) -> int:
    """How many forward records FSDP2 holds for `model`: the root's forward-order list plus every unit's indices
    into it (what forget_forward_order clears)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return 0
    states = [m._get_fsdp_state() for m in units]
    groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
    return len(states[0]._comm_ctx.post_forward_order) + sum(len(g._post_forward_indices) for g in groups)


def forget_forward_order(model: nn.Module) -> None:
    """Drop the records FSDP2 keeps of each forward for the next backward's prefetching: every unit appends itself to
    a list on the root at every forward (and its index to a list of its own), and only the end of a backward clears
    them. A frozen model (a reference, a reward model) never runs a backward, so its lists would grow by two entries
    per unit per forward for the whole run. shard_model calls this after every forward of a frozen model.

    These are FSDP2's private attributes (torch 2.11 to 2.13); tests/test_collectives.py checks that the records
    stay empty, so a torch that moves them fails there rather than leaking."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            state._comm_ctx.post_forward_order.clear()
            if state._fsdp_param_group is not None:
                state._fsdp_param_group._post_forward_indices.clear()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the reduce-scatter on all but the last micro-batch of gradient accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether an FSDP unit frees its gathered parameters after forward. FSDP2 has a setter
    (set_reshard_after_forward) but no getter: the setting is whether its parameter groups keep a post-forward mesh."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return any(g.post_forward_mesh_info is not None for g in groups)


@contextmanager
def gathered_params(model: nn.Module):
    """Gather every FSDP unit's parameters once and keep them gathered for the whole block.

    Generation calls the model once per token; without this, FSDP would all-gather and free every block's
    parameters at every step. Inside the block forward passes reuse the gathered weights. On exit every unit is
    resharded and gets back its own reshard-after-forward setting (shard_model's: blocks True, a training root
    False), so the training step after the block gathers exactly what it did before."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    previous = [reshards_after_forward(m) for m in units]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m, setting in zip(units, previous):
            m.reshard()
            m.set_reshard_after_forward(setting, recurse=False)


@torch.no_grad()
def copy_params_(src: nn.Module, dst: nn.Module) -> None:
    """Copy every parameter (this rank's shard, for models FSDP sharded alike: same model, same ranks) of `src` into
    `dst`, matched by name. Outside forward only. Both are resharded first: a training root stays gathered after a
    forward without backward (an evaluation), and its gathered tensors are not the shards."""
    for m in (*src.modules(), *dst.modules()):
        if isinstance(m, FSDPModule):
            m.reshard()
    for (name, p), (dst_name, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        if name != dst_name:
            raise RuntimeError(f"parameter {dst_name} does not match {name}")
        local = p.to_local() if hasattr(p, "to_local") else p
        (q.to_local() if hasattr(q, "to_local") else q).copy_(local)

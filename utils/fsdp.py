"""FSDP2 (`fully_shard`) wrapping: one unit per GPT-2 block, the rest (embeddings, tied head, final norm,
any value or reward head) in the root unit, as torchtitan does. The model code holds no distributed code;
sharding is applied to a built model.
"""

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

# Each unit's reshard-after-forward setting, as shard_model gave it (FSDP2 has a setter and no public getter).
RESHARD_ATTR = "fsdp_reshard_after_forward"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """Parameter dtype in forward/backward: "bf16", "fp32", or "auto" (bf16 on GPU, fp32 on CPU, where exact
    comparisons are wanted and bf16 gains little even with a matrix unit: docs/benchmarks.md). None means no mixed
    precision."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return None
    raise ValueError(f"dtype must be one of auto, bf16, fp32; got '{name}'")


def run_mesh() -> DeviceMesh:
    """A 1-D device mesh over the default process group, of the run's device type: cuda for an NCCL group, cpu for a
    gloo one. fully_shard's own default takes the machine's accelerator instead, so a CPU (gloo) run on a machine with
    a GPU would shard its parameters onto the GPU."""
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs a process group: call utils.dist.setup_distributed first")
    device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard_model(
    model: nn.Module,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    mesh: DeviceMesh | None = None,
    compile_blocks: bool = False,
    compile_backend: str = "inductor",
) -> nn.Module:
    """Shard `model` in place over `mesh` (default: run_mesh(), every rank of the default process group on the run's
    device type) and return it.

    param_dtype: compute dtype (e.g. bf16); gradients are always reduced in fp32 and the optimizer keeps fp32
    master weights. cpu_offload: keep sharded parameters on the CPU (for frozen reference and reward models;
    needs a GPU). Every submodule whose class sets `fsdp_unit = True` (model.gpt2.Block) becomes a unit of its own,
    whether the GPT-2 is bare or inside a policy or reward wrapper, so tied embedding and head always land together
    in the root unit.

    Blocks reshard after forward (their weights are gathered again in backward, one block at a time). The root of a
    model that trains stays gathered from forward to backward: its backward starts with the tied head, which needs
    the weights forward just used, so resharding them would cost a second all-gather of the largest unit (the
    vocabulary x n_embd tied embedding and head) in every micro-batch for nothing. Backward reshards it. The root of a
    frozen model (no parameter requires a gradient: no backward comes to reshard it) reshards after forward, so it
    does not stay gathered, or on the GPU under cpu_offload, between uses.

    compile_blocks (--compile): each unit's math (its `_forward`, without a KV cache) runs under torch.compile with
    fullgraph=True, torchtitan's per-block pattern: one graph per block shape, FSDP's gathers and reduce-scatters
    outside it (they run in the unit's hooks, around `forward`), so compiling changes no collective.
    """
    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else MixedPrecisionPolicy()
    )
    kwargs = dict(mp_policy=mp, mesh=mesh or run_mesh())
    if cpu_offload:
        if not torch.cuda.is_available():
            raise ValueError("cpu_offload needs a GPU: FSDP offloads parameters from the GPU to the CPU")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for m in model.modules():
        if getattr(type(m), "fsdp_unit", False):
            m.activation_checkpointing = activation_checkpointing
            if compile_blocks:
                m.compiled_forward = torch.compile(m._forward, fullgraph=True, backend=compile_backend)
            fully_shard(m, reshard_after_forward=True, **kwargs)
            setattr(m, RESHARD_ATTR, True)
    trains = any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=not trains, **kwargs)
    setattr(model, RESHARD_ATTR, not trains)
    if not trains:  # frozen: it never runs a backward
        model.register_forward_hook(lambda module, args, output: forget_forward_order(module))
    return model


def _forward_order_lists(unit: FSDPModule) -> tuple[list, list]:
    """The two lists FSDP2 appends to at every forward of `unit` for the next backward's prefetching: the root's
    forward-order list (shared by every unit of a model) and the unit's own indices into it. Private FSDP2 state, the
    same on torch 2.11 to 2.14 (tests/test_collectives.py checks they are emptied); the one place this module reads
    FSDP2's internals."""
    try:
        state = unit._get_fsdp_state()
        group = state._fsdp_param_group
        return state._comm_ctx.post_forward_order, (group._post_forward_indices if group is not None else [])
    except AttributeError as e:
        raise RuntimeError(
            f"utils/fsdp.py reads FSDP2's forward-order records, which torch {torch.__version__} keeps "
            f"elsewhere ({e}); the supported torch range is in pyproject.toml"
        ) from None


def forward_order_records(model: nn.Module) -> int:
    """How many forward records FSDP2 holds for `model`: the root's forward-order list plus every unit's indices
    into it (what forget_forward_order clears)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return 0
    lists = [_forward_order_lists(m) for m in units]
    return len(lists[0][0]) + sum(len(indices) for _, indices in lists)


def forget_forward_order(model: nn.Module) -> None:
    """Drop the records FSDP2 keeps of each forward for the next backward's prefetching: every unit appends itself to
    a list on the root at every forward (and its index to a list of its own), and only the end of a backward clears
    them. A frozen model (a reference, a reward model) never runs a backward, so its lists would grow by two entries
    per unit per forward for the whole run. shard_model calls this after every forward of a frozen model."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            order, indices = _forward_order_lists(m)
            order.clear()
            indices.clear()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the reduce-scatter on all but the last micro-batch of gradient accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether an FSDP unit frees its gathered parameters after forward: the setting shard_model gave it (FSDP2 has a
    setter, set_reshard_after_forward, and no public getter)."""
    if not hasattr(unit, RESHARD_ATTR):
        raise RuntimeError(
            f"{type(unit).__name__} was sharded outside utils.fsdp.shard_model: its reshard setting is unknown"
        )
    return getattr(unit, RESHARD_ATTR)


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
        setattr(m, RESHARD_ATTR, False)
        m.unshard()
    try:
        yield model
    finally:
        for m, setting in zip(units, previous, strict=True):
            m.reshard()
            m.set_reshard_after_forward(setting, recurse=False)
            setattr(m, RESHARD_ATTR, setting)


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


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded model state on the CPU (a collective: every rank must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_model(model: nn.Module, write: Callable[[dict[str, torch.Tensor]], None], rank: int = 0) -> None:
    """Gather the full weights (a collective) and hand them to `write` on rank 0 (model.weights.save_export writes a
    Hugging Face-format folder, LoRA adapters merged); every rank waits until it has written."""
    state = full_model_state(model)
    if rank == 0:
        write(state)
    if dist.is_initialized():
        dist.barrier()

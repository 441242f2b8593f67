"""Checkpoints: a resumable training state, written atomically, and Hugging Face-format exports.

Layout under a run directory:
    checkpoints/step_00000100/state.pt   model, optimizer, scheduler, step, data position, per-rank RNG
    checkpoints/latest                   name of the newest complete checkpoint
    hf/                                  full Hugging Face-format export (rank 0)

The model and optimizer states are gathered to full (unsharded) tensors on the CPU, so a run can resume on a
different number of ranks. Every file is written under a temporary name and renamed: a process killed during
a save leaves the previous checkpoint and the `latest` pointer intact.
"""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from model.weights import save_hf

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded model state on the CPU (a collective: every rank must call it)."""
    return get_model_state_dict(model, options=FULL)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    meta: dict,
    extra: dict | None = None,
    keep_last: int = 2,
    rank: int = 0,
) -> Path:
    """Save a resumable checkpoint (a collective). `meta` identifies what was trained (stage, model config)
    so a wrong checkpoint is refused at load; `extra` holds loop state (data position, metrics)."""
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL)
    rngs = _gather_objects(rng_state())
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:08d}"
    if rank == 0:
        state = {
            "step": step,
            "meta": meta,
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rngs,
            "extra": extra or {},
        }
        tmp = ckpt_root / f".step_{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(state, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(ckpt_root / "latest", final.name)
        old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
        for p in old[: max(0, len(old) - keep_last)]:
            shutil.rmtree(p, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: str | Path, model: nn.Module, optimizer, scheduler, meta: dict, rank: int = 0) -> dict:
    """Restore a checkpoint written by save_checkpoint into a sharded model and optimizer; returns the
    state's `step` and `extra`. Refuses a checkpoint whose `meta` (stage, model config) differs."""
    file = Path(path) / "state.pt"
    if not file.is_file():
        raise CheckpointError(f"no checkpoint at {file}")
    state = torch.load(file, map_location="cpu", weights_only=False)
    for key, want in meta.items():
        got = state["meta"].get(key)
        if got != want:
            raise CheckpointError(f"checkpoint {path} has {key}={got!r}, but this run expects {key}={want!r}")
    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    rngs = state["rng"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(rngs) == world:
        set_rng_state(rngs[rank])
    else:  # resumed on another world size: per-rank streams cannot be matched, reseed deterministically
        torch.manual_seed(state["step"] * 1000 + rank)
    return {"step": state["step"], "extra": state["extra"]}


def export_hf(model: nn.Module, cfg, folder: str | Path, rank: int = 0, extra_files: dict | None = None) -> None:
    """Gather the full weights (a collective) and write a Hugging Face-format folder on rank 0."""
    sd = full_model_state(model)
    if rank == 0:
        save_hf(sd, cfg, folder, extra_files)
    if dist.is_initialized():
        dist.barrier()

"""Distributed set-up: torchrun with NCCL on GPUs, gloo on CPU, or a plain single process.

A single process still gets a one-rank process group, so FSDP and the collectives below run the same code in
every case. Nothing here runs at import.
"""

import atexit
import gc
import hashlib
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from utils.config import ConfigError
from utils.host import cpu_memory_settings


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(device: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Initialise the process group. `device`: "auto" (cuda when available, else cpu), "cuda" or "cpu".

    `timeout_minutes` (--dist_timeout_minutes): how long a collective may wait for the slowest rank before the run
    fails, on NCCL and gloo alike (torch's defaults differ: 10 minutes for NCCL, 30 for gloo). Whatever one rank does
    alone while the others wait in a collective must fit in it: the Hugging Face export (rank 0 writes the full
    weights, 6 GB for gpt2-xl in fp32), loading a model from the hub on a cold cache, a slow filesystem under a
    checkpoint. On CUDA the group is bound to this rank's GPU (`device_id`): NCCL creates its communicator at once
    instead of at the first collective, and barriers know which GPU to use."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda was asked for, but no CUDA device is available (torch.cuda.is_available() is False); "
            "use --device auto or cpu"
        )
    if not timeout_minutes > 0:
        raise ConfigError(f"--dist_timeout_minutes must be positive, got {timeout_minutes}")
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        init_method = "env://"
    else:
        rank, world_size, local_rank = 0, 1, 0
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
        cpu_memory_settings()  # freed CPU memory reused, large tensors on huge pages (utils/host.py)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=dev if dev.type == "cuda" else None,
        )
        atexit.register(_release_process_group)
    return DistInfo(rank, world_size, local_rank, dev)


def cleanup_distributed() -> None:
    """Tear the process group down; the barrier keeps a fast rank from closing gloo
    sockets while a slow one still talks (which aborts the slow one)."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()


def _release_process_group() -> None:
    """At exit, while the interpreter is still whole: destroy the group if the script did not, and collect the
    cycles (FSDP modules, device meshes) that keep gloo's worker threads alive. A gloo thread destroyed during
    interpreter finalization aborts the process (SIGABRT, "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (returns a new tensor; the input is left alone)."""
    t = t.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean_dict(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics across ranks (every rank must pass the same keys)."""
    if not metrics:
        return {}
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    t = all_reduce_sum(t) / (dist.get_world_size() if dist.is_initialized() else 1)
    return dict(zip(keys, t.tolist(), strict=True))


def all_reduce_named(sums: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Each dict's scalar tensors summed over ranks, in one collective; names are matched by key (every rank builds
    its dicts with the same keys), never by position in a list."""
    names = list(sums[0])
    table = all_reduce_sum(torch.stack([torch.stack([s[k] for k in names]) for s in sums])).tolist()
    return [dict(zip(names, row, strict=True)) for row in table]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank (a collective); [obj] without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s `obj` (picklable) on every rank (a collective); `obj` itself without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def global_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of x over all ranks (count, sum and sum of squares reduced together in fp64)."""
    x = x.double().flatten()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    n, s, sq = all_reduce_sum(torch.stack([count, x.sum(), (x * x).sum()])).tolist()
    mean = s / n
    return mean, max(sq / n - mean * mean, 0.0) ** 0.5


def all_reduce_max(x: float, device) -> float:
    """The largest of a scalar over ranks."""
    t = torch.tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without making the host wait for the device. A blocking copy from the host to a GPU is followed
    by a synchronisation of the stream (the host waits for every kernel queued before it), and an asynchronous one
    from pageable memory may synchronise too (CUDA's API synchronization behavior): the tensor is first copied into
    page-locked memory (pin_memory, from PyTorch's caching host allocator, which keeps the block until the copy has
    run), then copied asynchronously. The copy holds the same bytes; `t` may change or go at once. `t` itself when it
    is on `device` already (every CPU run)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def true_positions(mask: torch.Tensor, device) -> torch.Tensor:
    """Flat row-major indices (K,) long of `mask`'s True entries, found where the mask is (the host, for a batch's
    mask: no wait for the device, which nonzero on a GPU tensor makes, since the host needs K) and put on `device`:
    rlhf.logprobs.linear_processed_logprobs's positions_K."""
    return to_device(mask.reshape(-1).nonzero().squeeze(1), device)


def stream_seed(*parts) -> int:
    """A 63-bit seed from (seed, step, rank, stream name): independent streams that a resumed run can rebuild."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def stream(*parts, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with stream_seed(*parts)."""
    return torch.Generator(device=device).manual_seed(stream_seed(*parts))


def rng_state() -> dict:
    """This process's random streams (`random`, numpy, torch, CUDA) as tensors and plain values only, so that a
    checkpoint holding them loads with torch.load(weights_only=True): numpy's MT19937 state is its 624 keys as an int64
    tensor and its position and cached Gaussian as numbers."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss)}
    state = {
        "python": random.getstate(),
        "numpy": numpy_state | {"cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned (numpy's state also as the tuple np.random.get_state() gives, as checkpoints
    written before rng_state() kept plain values hold it)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        keys = numpy_state["keys"].numpy().astype(np.uint32)
        numpy_state = ("MT19937", keys, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(*parts) -> None:
    """Seed the global random streams (torch, CUDA included; numpy; `random`) from stream_seed(*parts, ...)."""
    random.seed(stream_seed(*parts, "python"))
    np.random.seed(stream_seed(*parts, "numpy") % 2**32)
    torch.manual_seed(stream_seed(*parts))

"""Where a step's time goes: torch.profiler's events summarised per unit (profile_summary), and the calls that make the
host wait for the device, counted on any device (HostSyncs). Read by train.py's train_profile and decode_profile.py.
"""

import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# CUDA runtime calls that make the host wait (PyTorch's blocking copy_ is a cudaMemcpyAsync + cudaStreamSynchronize)
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them runs."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_summary(prof, count: int, top: int = 12) -> dict:
    """What a torch.profiler run of `count` units (steps, tokens) spent, per unit: on a GPU its kernels' time summed
    (`kernel_ms`) and as the union of their intervals (`busy_ms`), launch calls, SYNC_CALLS and the top kernels; on a
    CPU the ATen ops stand for kernels (self CPU time) and launches. Both: the top ATen ops by self CPU time."""
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    aten = [e for e in cpu_events if e.name.startswith("aten::")]
    kernels, kernel_us = Counter(), Counter()
    if device_events:
        for e in device_events:
            kernels[e.name] += 1
            kernel_us[e.name] += e.device_time_total
        busy = _busy_us([(e.time_range.start, e.time_range.end) for e in device_events])
        launches = Counter(e.name for e in cpu_events if e.name.startswith("cu") and "Launch" in e.name)
        syncs = Counter(e.name for e in cpu_events if e.name in SYNC_CALLS)
    else:
        for e in aten:
            kernels[e.name] += 1
            kernel_us[e.name] += e.self_cpu_time_total
        busy = sum(kernel_us.values())
        launches = Counter({"ATen ops": len(aten)})
        syncs = Counter()
    host_us = Counter()
    for e in aten:
        host_us[e.name] += e.self_cpu_time_total
    return {
        "kernels": sum(kernels.values()) / count,
        "kernel_ms": sum(kernel_us.values()) / count / 1e3,
        "busy_ms": busy / count / 1e3,
        "launches": {k: v / count for k, v in launches.items()},
        "syncs": {k: v / count for k, v in syncs.items()},
        "top": [
            {"kernel": name[:120], "us": t / count, "calls": kernels[name] / count}
            for name, t in kernel_us.most_common(top)
        ],
        "top_host_ops": [{"op": name, "us": t / count} for name, t in host_us.most_common(top)],
    }


# Calls whose result the host reads from a tensor's values: on a GPU each waits for every kernel queued before it
HOST_READS = set(
    "item tolist __float__ __int__ __bool__ __index__ __format__ cpu numpy nonzero argwhere masked_select unique "
    "unique_consecutive".split()
)


def _names_device(a) -> bool:
    return isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda"))


class HostSyncs(TorchFunctionMode):
    """Count (`counts`, by name) the calls inside the block that make the host wait for a GPU: reads of a device
    tensor's values (HOST_READS, indexing with a boolean tensor) and on a GPU blocking copies of host tensors to it.

    On a CPU the block places tensors as a GPU run would: `host_tensors` (a step's batches), what is computed from host
    tensors alone or created without a `device` are on the host; a `.to(device)` of a host tensor returns a new view
    on the device, as are parameters and what is computed from them (a .to("cpu") of a device tensor reads as a
    .to(device): use .cpu())."""

    def __init__(self, device: torch.device, host_tensors=()):
        super().__init__()
        self.counts = Counter()
        self.on_gpu = torch.device(device).type == "cuda"
        self._host = {}  # CPU run: id -> weak reference of every tensor known to be on the host
        for t in host_tensors:
            self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def on_host(self, t: torch.Tensor) -> bool:
        if self.on_gpu or t.device.type != "cpu":
            return t.device.type == "cpu"
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        moves = name == "cuda" or (
            name == "to" and (_names_device(kwargs.get("device")) or any(_names_device(a) for a in args[1:]))
        )
        if source is not None and not self.on_host(source):
            if name in HOST_READS:
                self.counts[name] += 1
            elif name in ("__getitem__", "__setitem__") and len(args) > 1:
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    self.counts[f"{name} with a boolean index"] += 1
        elif source is not None and moves and self.on_gpu and not kwargs.get("non_blocking", False):
            self.counts[f"blocking .{name}(cuda)"] += 1
        out = func(*args, **kwargs)
        if self.on_gpu:
            return out
        if moves and source is not None and self.on_host(source):
            return out.view_as(out)  # a new tensor object: on the device from here on
        if (tensors and all(self.on_host(t) for t in tensors)) or (not tensors and "device" not in kwargs):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

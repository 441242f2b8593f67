"""Timing plumbing shared by the benchmarks: warm-up, repeats and median; CUDA events on GPUs; the machine
description every result file starts with; peak memory; result rows and the final table.

Nothing here imports transformers, datasets or wandb at module level: the GPU image has no datasets/wandb, and every
benchmark module must import there.
"""

import datetime
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# Timing


@contextmanager
def cuda_graph_recordings() -> Iterator[list[int]]:
    """Count the CUDA graphs recorded inside the block (every torch.cuda.CUDAGraph.capture_begin, which cudagraph
    trees call for each recording): yields a one-element list holding the count so far."""
    recorded, begin = [0], torch.cuda.CUDAGraph.capture_begin

    def counted(self, *args, **kwargs):
        recorded[0] += 1
        return begin(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counted
    try:
        yield recorded
    finally:
        torch.cuda.CUDAGraph.capture_begin = begin


# Published peaks of the GPUs lent here (NVIDIA H100 and H200 SXM datasheets): HBM bandwidth and dense bf16
# tensor-core FLOP/s, keyed by a name torch.cuda.get_device_name contains. Measured on those machines (the device
# tool's KINDS.md): a copy ~3.0 TB/s (H100) and ~4.3 TB/s (H200), a large bf16 product ~800 TFLOP/s on both; MFU and
# floors against the published figures are conservative either way.
GPU_PEAKS = {
    "H100": {"bytes_per_s": 3.35e12, "flops_per_s": 989e12},
    "H200": {"bytes_per_s": 4.8e12, "flops_per_s": 989e12},
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds of the timed repeats (warm-up runs excluded): wall-clock (CUDA events on GPU), and this
    process's CPU time, which other processes on the same cores inflate less than wall-clock time."""

    times: list[float]
    cpu_times: list[float] = field(default_factory=list)
    others_cores: list[float] = field(default_factory=list)
    """Cores used by other processes during each call (from /proc/stat): the interference on a shared machine."""
    outputs: list = field(default_factory=list, repr=False)
    """What each timed call returned (for counting tokens)."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    def to_dict(self) -> dict:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "times_s": self.times,
            "cpu_times_s": self.cpu_times,
            "others_cores": self.others_cores,
        }

    @property
    def interference(self) -> str:
        """A note for the table when other processes used the CPU during the timed calls."""
        if not self.others_cores or max(self.others_cores) < 0.1:
            return ""
        return f"; other processes used up to {max(self.others_cores):.1f} cores"


def machine_busy_seconds() -> float | None:
    """CPU-seconds all processes on this machine have used since boot (Linux /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.2, window_s: float = 2.0) -> float:
    """Wait until other processes use less than `threshold_cores` cores over a `window_s` window, at most
    max_wait_s seconds; returns the cores they used in the last window. The CPU figures of a shared
    2-core machine are only worth reporting when nothing else runs."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        b0, t0 = machine_busy_seconds(), time.perf_counter()
        time.sleep(window_s)
        if b0 is None:
            return 0.0
        others = (machine_busy_seconds() - b0) / (time.perf_counter() - t0)
        if others < threshold_cores or time.perf_counter() > deadline:
            return others


def choose_threads(setting: str) -> tuple[int, str]:
    """(torch CPU threads, why) for run_all --threads: a number, "0" (torch's default), or "auto": the cores that
    other processes leave idle over a 2 s window, at least 1. Threads that share a core with another process wait
    for each other at every parallel region: on the shared 2-core machine a tiny-model decode step took 30x longer
    with 2 threads than with 1 while two other processes ran."""
    default = torch.get_num_threads()
    if setting != "auto":
        n = int(setting)
        return (n, "--threads") if n > 0 else (default, "torch's default")
    others = wait_for_quiet(0.0)  # one 2 s window
    n = max(1, min(default, round(default - others)))
    return n, f"auto: other processes used {others:.1f} of {os.cpu_count()} cores"


QUIET_WAIT_S = 0.0
"""Set by run_all --wait_quiet: before every timed call on CPU, wait up to this long for other processes to stop."""


def wait_if_asked(device: torch.device) -> None:
    """On CPU with run_all --wait_quiet: wait (bounded) for other processes to go idle before a timed call."""
    if QUIET_WAIT_S > 0 and device.type == "cpu":
        wait_for_quiet(QUIET_WAIT_S)


def _timed_call(fn: Callable[[], object], device: torch.device, timing: Timing) -> None:
    wait_if_asked(device)
    c0, b0 = time.process_time(), machine_busy_seconds()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        synchronize(device)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        timing.times.append(start.elapsed_time(end) / 1e3)
    else:
        t0 = time.perf_counter()
        out = fn()
        timing.times.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    timing.cpu_times.append(cpu)
    if b0 is not None:  # cores used on average by *other* processes during the call (0 on a quiet machine)
        timing.others_cores.append(max(0.0, (machine_busy_seconds() - b0 - cpu) / timing.times[-1]))
    timing.outputs.append(out)


def measure(fn: Callable[[], object], device: torch.device, warmup: int = 1, repeats: int = 3) -> Timing:
    """Run fn `warmup` times untimed, then `repeats` times timed; return every timed duration.

    On CUDA the interval is read from CUDA events recorded around the call (after a synchronize, so queued
    work from before does not leak in); on CPU from time.perf_counter. The median is what the table shows."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    timing = Timing([])
    for _ in range(repeats):
        _timed_call(fn, device, timing)
    return timing


def measure_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int = 3
) -> dict[str, Timing]:
    """Time several alternatives in turn, repeat after repeat (A B C A B C ...), so that a change in the load of
    a shared machine hits all of them alike; ratios are then taken per repeat. Warm up before calling."""
    timings = {name: Timing([]) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _timed_call(fn, device, timings[name])
    return timings


def median_ratio(a: Timing, b: Timing) -> float:
    """Median over repeats of b's time / a's time: how many times faster a is than b (interleaved runs)."""
    return statistics.median(tb / ta for ta, tb in zip(a.times, b.times, strict=True))


# ----------------------------------------------------------------------------------------------------
# Where the time goes: torch.profiler's events, and the host's waits for the device

# CUDA runtime calls that make the host wait for the device (a blocking copy is a cudaMemcpyAsync followed by a
# cudaStreamSynchronize in PyTorch's copy_)
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
    """What a torch.profiler run of `count` units (steps, tokens) spent, per unit.

    On a GPU: device kernels (events on a CUDA device) and their time summed (`kernel_ms`) and as the union of their
    intervals (`busy_ms`: the time the GPU computes; less than the sum when kernels overlap), the CUDA runtime's
    launch calls (`launches`) and the calls that make the host wait (`syncs`, SYNC_CALLS), the top kernels by time.
    On a CPU there are no device events and nothing to wait for: the "kernels" are the ATen ops that compute (their
    self CPU time, views and wrappers near 0), and `launches` counts the ATen ops dispatched. Both: the top ATen ops by
    self CPU time (the host's side)."""
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


# Tensor methods and functions whose result the host reads from the tensor's values: on a GPU each waits for every
# kernel queued before it (the host stops running ahead of the device)
HOST_READS = {
    "item",
    "tolist",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "__format__",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
}


def _names_device(a) -> bool:
    return isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda"))


class HostSyncs(TorchFunctionMode):
    """Count, by name, the calls inside the block that make the host wait for a GPU: reads of a device tensor's values
    (HOST_READS, and indexing with a boolean tensor, whose result's size the host needs), and on a GPU the copies of
    a host tensor to it without non_blocking=True (PyTorch follows a blocking copy with a stream synchronisation).
    Reads of host tensors cost nothing and are not counted.

    On a GPU a host tensor is one on the CPU. On a CPU, where every tensor is, the block tells them apart by where
    they come from, as a GPU run would place them: `host_tensors` (a step's batches) and what is computed from host
    tensors alone, or created without a `device`, are on the host; a `.to(device)` of a host tensor returns a new
    view (the same values) that is on the device, as are parameters, the model's outputs and what is computed from
    them. So a CPU run counts the reads a GPU run waits for (but not a .to("cpu") of a device tensor, which it cannot
    tell from a .to(device): use .cpu()). `counts`: a Counter of names."""

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


# ----------------------------------------------------------------------------------------------------
# The machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the same cores slow every CPU figure down."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device: torch.device) -> dict:
    """Device name, software versions, date, commit: the header of every result file."""
    transformers_version = None
    if importlib.util.find_spec("transformers") is not None:  # optional, and heavy: imported only when present
        import transformers

        transformers_version = transformers.__version__
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
        "load_average_at_start": load_average(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


# ----------------------------------------------------------------------------------------------------
# Peak memory


def _vm_hwm_bytes() -> int | None:
    """This process's peak resident set size (VmHWM in /proc/self/status, Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window. CUDA: torch.cuda.reset_peak_memory_stats. CPU: writing "5" to
    /proc/self/clear_refs resets the kernel's peak RSS (VmHWM) to the current RSS (Linux >= 4.0). Returns False
    when the window could not be reset (the CPU peak then counts from process start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_memory(device: torch.device, was_reset: bool = True) -> tuple[int, str]:
    """(bytes, what they are) of the peak since reset_peak_memory: on CUDA torch.cuda.max_memory_allocated
    (tensors only, not the caching allocator's reserve or the CUDA context); on CPU the peak resident set size of
    this process (weights, activations, Python and the loaded libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm, "max RSS (VmHWM)" + ("" if was_reset else " since process start")
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS (getrusage) since process start"


# ----------------------------------------------------------------------------------------------------
# Results


def result(bench: str, name: str, value: float | None, unit: str, note: str = "", config=None, **details) -> dict:
    """One figure: the benchmark it belongs to, what it is, its value and unit, a short note, the named
    configuration it was measured at (a dataclass with a `name` field), and details (raw timings, token counts)
    that go to the JSON file only. A non-finite value is an error, not a figure."""
    if value is not None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"[{bench}] {name}: non-finite value {value}")
    row = {"bench": bench, "name": name, "value": value, "unit": unit, "note": note}
    if config is not None:
        row["config_name"] = config.name
        row["config"] = asdict(config)
    return {**row, **details}


def skipped(bench: str, name: str, why: str, config=None) -> dict:
    """A figure that was not measured, with the reason; printed when it is recorded and kept in the table."""
    print(f"[{bench}] not measured: {name}: {why}", flush=True)
    return result(bench, name, None, "", note=f"not measured: {why}", config=config)


def _format_value(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("x", "%"):
        return f"{value:.2f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def format_table(rows: list[dict]) -> str:
    """A plain-text table: benchmark | figure | value | unit | note, a rule between benchmarks."""
    header = ("bench", "figure", "value", "unit", "note")
    cells = [(r["bench"], r["name"], _format_value(r["value"], r["unit"]), r["unit"], r["note"]) for r in rows]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(4)]

    def line(c):
        return f"{c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]:>{widths[2]}}  {c[3]:<{widths[3]}}  {c[4]}".rstrip()

    rule = "-" * (sum(widths) + 8 + 4)
    lines = [line(header), rule]
    for i, c in enumerate(cells):
        if i > 0 and c[0] != cells[i - 1][0]:
            lines.append(rule)
        lines.append(line(c))
    return "\n".join(lines)


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


# ----------------------------------------------------------------------------------------------------
# Inputs


def random_prompts(
    n: int, max_len: int, min_len: int, vocab_size: int, seed: int, pad_id: int = 50256
) -> tuple[torch.Tensor, torch.Tensor]:
    """n prompts of random token ids, lengths uniform in [min_len, max_len], left-padded as data.tldr does:
    (prompt_ids (n, max_len) long, prompt_mask (n, max_len) bool). Random ids need no tokenizer, and
    throughput does not depend on which ids they are. Ids below 50,000 avoid the end and EOS tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    lengths[0] = max_len  # the batch is exactly max_len wide
    ids = torch.randint(0, min(vocab_size, 50000), (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] >= (max_len - lengths)[:, None]  # (n, max_len)
    return ids.masked_fill(~mask, pad_id), mask


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (the tied embedding/head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

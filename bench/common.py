"""The benchmarks' plumbing: timing (warm-up, interleaved repeats, median; CUDA events on GPUs), profiles and host
synchronisations, the machine, peak memory, result rows and the table (docs/benchmarks.md, "How things are measured").
No transformers, datasets or wandb at module level: every benchmark must import on the GPU image, which lacks some."""

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


# Datasheet peaks (H100 / H200 SXM): HBM bytes/s and dense bf16 FLOP/s, keyed by part of torch.cuda.get_device_name.
# Measured there: a copy ~3.0 / ~4.3 TB/s, a large bf16 product ~800 TFLOP/s, so MFU and floors against these are low.
GPU_PEAKS = {
    "H100": {"bytes_per_s": 3.35e12, "flops_per_s": 989e12},
    "H200": {"bytes_per_s": 4.8e12, "flops_per_s": 989e12},
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds of the timed repeats: wall-clock (CUDA events on GPU) and this process's CPU time."""

    times: list[float]
    cpu_times: list[float] = field(default_factory=list)
    others_cores: list[float] = field(default_factory=list)  # cores other processes used during each call
    outputs: list = field(default_factory=list, repr=False)  # what each timed call returned (to count tokens)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_dict(self) -> dict:
        return {
            "median_s": self.median,
            "min_s": min(self.times),
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
    """Wait (at most max_wait_s) until other processes use under `threshold_cores` cores over `window_s`; returns the
    cores they used in the last window."""
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
    """(torch CPU threads, why) for run_all --threads: a number, "0" (torch's default), or "auto": the cores other
    processes leave idle over 2 s, at least 1 (threads sharing a core with another process wait at every barrier)."""
    default = torch.get_num_threads()
    if setting != "auto":
        n = int(setting)
        return (n, "--threads") if n > 0 else (default, "torch's default")
    others = wait_for_quiet(0.0)  # one 2 s window
    n = max(1, min(default, round(default - others)))
    return n, f"auto: other processes used {others:.1f} of {os.cpu_count()} cores"


QUIET_WAIT_S = 0.0  # run_all --wait_quiet: before every timed CPU call, wait up to this long for other processes


def wait_if_asked(device: torch.device) -> None:
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
    """Run fn `warmup` times untimed, then `repeats` times timed (CUDA events after a synchronize on GPU, else
    time.perf_counter)."""
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
    """Time alternatives in turn, repeat after repeat (A B A B ...), so a change in the machine's load hits all alike.
    Warm up before calling."""
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
    """Start a new peak-memory window (CUDA: reset_peak_memory_stats; CPU: "5" to /proc/self/clear_refs resets VmHWM);
    False when it could not be reset (the CPU peak then counts from process start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_memory(device: torch.device, was_reset: bool = True) -> tuple[int, str]:
    """(bytes, what they are) of the peak since reset_peak_memory: max_memory_allocated on CUDA, else the process's
    peak resident set."""
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
    """One figure: benchmark, name, value, unit, note, the named configuration (a dataclass with a `name`) and details
    for the JSON only (timings, counts). A non-finite value is an error, not a figure."""
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
    """n prompts of random ids below 50,000 (no end or EOS token), lengths uniform in [min_len, max_len], the first
    max_len long, left-padded as data.tldr does: (prompt_ids (n, max_len) long, prompt_mask (n, max_len) bool)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    lengths[0] = max_len  # the batch is exactly max_len wide
    ids = torch.randint(0, min(vocab_size, 50000), (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] >= (max_len - lengths)[:, None]  # (n, max_len)
    return ids.masked_fill(~mask, pad_id), mask


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (the tied embedding/head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

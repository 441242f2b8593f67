"""The benchmarks' plumbing: timing (warm-up, interleaved repeats, median; CUDA events on GPUs), the machine, peak
memory, result rows and the table (docs/benchmarks.md, "How things are measured"); profiles: bench/profiling.py.
No transformers, datasets or wandb at module level: every benchmark must import on the GPU image, which lacks some."""

import datetime
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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

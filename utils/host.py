"""Settings of the host process that change no number a run computes, only how fast it runs on a CPU.

Large CPU tensors (the (rows, 50,257) logits, log-probs and probabilities of every decode step and of every
training micro-batch) are allocated and freed many times a second. glibc's malloc serves an allocation above its
mmap threshold (at most 32 MB) with a fresh mmap and returns it to the kernel when it is freed, so every such tensor
page-faults on first touch and the kernel zeroes it, a cost paid before any arithmetic (docs/benchmarks.md measures
it). keep_freed_memory keeps freed memory in the process for the next tensor instead, as
PyTorch's CUDA caching allocator does on a GPU: the process's resident memory then stays near its peak.
"""

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap (no mmap) and never shrink it, on Linux with glibc. Returns whether the
    setting took: False on another system or C library, and when the environment sets malloc's behaviour itself
    (USER_SETTINGS), which is then left as it is. Called once per process, before the first large tensor: by
    utils.dist.setup_distributed for a CPU run, and by the scripts that sample without a process group."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc: other C libraries have no mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

"""Settings of the host process that change no number a run computes, only how fast it runs on a CPU.

Large CPU tensors (the (rows, 50,257) logits, log-probs and probabilities of every decode step and of every
training micro-batch) are allocated and freed many times a second. glibc's malloc serves an allocation above its
mmap threshold (at most 32 MB) with a fresh mmap and returns it to the kernel when it is freed, so every such tensor
page-faults on first touch and the kernel zeroes it, a cost paid before any arithmetic (docs/benchmarks.md measures
it). keep_freed_memory keeps freed memory in the process for the next tensor instead, as
PyTorch's CUDA caching allocator does on a GPU: the process's resident memory then stays near its peak.

Each pass over such a tensor also touches a new 4 KB page every 1,024 floats, and a (128, 50,257) fp32 tensor spans
6,283 of them, more than the processor's TLB maps. huge_pages asks PyTorch's CPU allocator to back every block of
2 MB or more with transparent huge pages (its THP_MEM_ALLOC_ENABLE setting: page-aligned blocks advised
MADV_HUGEPAGE), so one TLB entry maps 512 times as much. The gain is a steady state's: a process's first rounds of
large blocks cost more on huge pages, so a process that runs a few steps (a test) is better off without
(docs/benchmarks.md measures both; tests/conftest.py turns it off for the suite).
"""

import ctypes
import os
import sys

import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
THP_SETTING = "THP_MEM_ALLOC_ENABLE"  # read by PyTorch's CPU allocator (c10/core/alloc_cpu.cpp) at its first allocation
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"  # "always [madvise] never": the bracketed mode is in force
SET_HERE: set[str] = set()  # environment variables this module set, which child processes inherit


def cpu_memory_settings() -> dict[str, bool]:
    """keep_freed_memory and huge_pages, in that order, and whether each took. Called once per process, before the
    first large tensor: by utils.dist.setup_distributed for a CPU run, and by the scripts that sample without a process
    group. Neither changes a number a run computes."""
    return {"keep_freed_memory": keep_freed_memory(), "huge_pages": huge_pages()}


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


def huge_pages() -> bool:
    """Back CPU tensors of 2 MB and more with transparent huge pages, on Linux when the kernel allows them (mode
    "always" or "madvise"). Returns whether it took: False elsewhere, when the environment sets THP_MEM_ALLOC_ENABLE
    itself (left as it is), and when PyTorch's allocator had already read its setting (it reads it once, at the
    process's first CPU allocation, so this must run before any tensor is made; a large block's page alignment
    shows which way it read it)."""
    if not sys.platform.startswith("linux") or THP_SETTING in os.environ:
        return False
    try:
        with open(THP_MODE) as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    os.environ[THP_SETTING] = "1"
    SET_HERE.add(THP_SETTING)
    probes = [torch.empty(2**19) for _ in range(3)]  # 2 MB each: page-aligned only when the setting took
    return all(p.data_ptr() % 4096 == 0 for p in probes)

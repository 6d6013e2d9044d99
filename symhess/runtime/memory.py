"""Process-wide allocator settings for long curvature runs.

The experiments allocate and free the same large temporaries (batch 64 × L × d blocks,
per-direction products) thousands of times. glibc serves each one above its mmap threshold
with a fresh mapping, which the kernel zero-fills page by page and unmaps again on free:
in the paper-configuration sweep that was 70 M page faults and 40 % of the CPU time
(BENCHMARKS.md). ``retain_freed_memory`` asks glibc to keep freed memory in the heap
instead, so later temporaries reuse pages that are already mapped.

This changes the whole process, so the library never calls it on its own. The
``symhess experiment`` and ``symhess spectrum`` commands do, since they own their
process. Call it from an experiment script of your own the same way. Where it does not
apply (not glibc, not Linux), it does nothing and returns False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys


# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30          # allocations below 1 GiB come from the heap
TRIM_NEVER = -1                   # never return free heap memory to the system (mallopt(3))


def retain_freed_memory() -> bool:
    """Keep freed memory mapped for reuse (glibc ``mallopt``); True when both settings took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_NEVER))

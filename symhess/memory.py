"""Process-wide allocator settings for long curvature runs.

The experiments allocate and free the same large temporaries (batch 64 × L × d blocks,
per-direction products) thousands of times. glibc serves each one above its mmap threshold
with a fresh mapping, which the kernel zero-fills page by page and unmaps again on free:
in the paper-configuration sweep that was 70 M page faults and 40 % of the CPU time
(BENCHMARKS.md). ``retain_freed_memory`` asks glibc to keep freed memory in the heap
instead, so later temporaries reuse pages that are already mapped.

This changes the whole process, so the library never calls it on its own. The
``symhess experiment`` command does, since it owns its process. Call it from an experiment
script of your own the same way. Where it does not apply (not glibc, not Linux), it does
nothing and returns False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

import numpy as np

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


class ResultPool:
    """NumPy arrays for a kernel's fresh results, handed out again once nothing references
    them any more.

    A 63 MB Hessian in fresh memory costs its page faults on every call (≈ 8 ms of the
    post-LN kernel's ≈ 25, BENCHMARKS.md). A loop that lets each result go before (or right
    after) the next call can run in the same pages instead: ``take`` returns a pooled array
    of the right shape and dtype whose only references are the pool's own, else a new one.
    A result still held anywhere — the array, a view of it, a tensor sharing its memory, a
    NumPy view of that tensor — keeps a reference to the array and is never handed out again.
    At most ``size`` arrays are kept (two: the one a loop still holds while the next call
    runs, and the one it let go), the least recently used dropped first.
    """

    # references to a free array while ``take`` counts them: the pool's list and
    # sys.getrefcount's own argument
    _FREE = 2

    def __init__(self, size=2):
        self.size = size
        self._arrays = []
        self._lock = threading.Lock()

    def take(self, shape, dtype):
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` that nothing else
        references (every entry is the caller's to overwrite)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            count = getattr(sys, "getrefcount", None)    # CPython; elsewhere nothing is reused
            for i in range(len(self._arrays) if count else 0):   # no loop variable: no reference
                if self._arrays[i].shape == shape and self._arrays[i].dtype == dtype and \
                        count(self._arrays[i]) == self._FREE:
                    self._arrays.append(self._arrays.pop(i))
                    return self._arrays[-1]
            a = np.empty(shape, dtype=dtype)
            self._arrays.append(a)
            if len(self._arrays) > self.size:
                del self._arrays[0]        # still someone's result, or freed with the pool's ref
            return a

    def clear(self):
        """Drop the pooled arrays (results still held by callers stay theirs)."""
        with self._lock:
            self._arrays.clear()

    def __len__(self):
        return len(self._arrays)

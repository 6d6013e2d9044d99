"""Timing on CPU or a CUDA device: the clock is read only after the device has finished."""
from __future__ import annotations

import resource
import time

import torch


def add_device_option(ap):
    """``--device`` for a benchmark's argument parser (torch kernels and autograd run there)."""
    ap.add_argument("--device", default="cpu",
                    help="torch device for the torch kernels and the autograd references "
                         "(e.g. cuda); NumPy parts always run on the CPU")


def check_device(device):
    """The device as a torch.device; a clear exit when CUDA is asked for but absent."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch {torch.__version__} sees no CUDA device")
    return dev


def synchronize(device):
    """Wait for the device's queued kernels (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns, rounds=5, repeat=None, device="cpu"):
    """{name: minimum wall time} of the functions ``fns`` ({name: fn}) timed in turn, round
    after round (``repeat[name]`` calls of each per round, default 1), so that every one is
    measured across the same stretch of the machine's load, not in a window of its own.
    One warm-up call each first."""
    repeat = repeat or {}
    for fn in fns.values():
        fn()
    synchronize(device)
    out = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(repeat.get(name, 1)):
                t = time.perf_counter()
                fn()
                synchronize(device)
                out[name] = min(out[name], time.perf_counter() - t)
    return out


def best(fn, repeat=5, device="cpu"):
    """Minimum wall time of ``repeat`` calls (after one warm-up call); on CUDA each timed
    region ends with a synchronize, so it measures the work and not only the launches."""
    return interleaved({"fn": fn}, rounds=repeat, device=device)["fn"]


def timed(fn, device="cpu"):
    """(result, seconds) of one call, the device synchronized before and after."""
    synchronize(device)
    t = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t


def peak_mb(fn):
    """(result, MB of peak RSS growth) — meaningful when the call sets a new peak."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out, (after - before) / 1024


def device_label(device):
    """'cuda:0 (NVIDIA H200)' or 'cpu'."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"cuda:{idx} ({torch.cuda.get_device_name(idx)})"


def add_memory_option(ap):
    """``--no-retain``: leave glibc's allocator as it is (by default freed memory is kept for
    reuse, ``symhess.runtime.memory.retain_freed_memory``, for both sides of a comparison)."""
    ap.add_argument("--no-retain", action="store_true",
                    help="do not keep freed memory for reuse (glibc mallopt); both sides are "
                         "measured the same way either way")


def apply_memory_option(args):
    """Apply ``--no-retain`` (``add_memory_option``); a line saying what the process does."""
    from symhess.runtime.memory import retain_freed_memory
    if args.no_retain:
        return "freed memory returned to the system (glibc's default)"
    return ("freed memory kept for reuse (retain_freed_memory)" if retain_freed_memory()
            else "freed memory returned to the system (retain_freed_memory does not apply here)")

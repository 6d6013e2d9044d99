"""Memory budget: refuse work whose memory estimate exceeds what the machine can give.

Work that would allocate more than the budget raises ``BudgetError`` *before* allocating,
naming the sizes, the estimate and the budget, instead of ending in a bare ``MemoryError``
(or the operating system killing the process) after minutes of work.

The budget is, in this order:

* ``SYMHESS_MEMORY_BUDGET`` (bytes, or a number with a unit: ``512MiB``, ``8GiB``, ``2TB``;
  ``none`` turns the check off);
* for work on a CUDA device, the device's free memory (``torch.cuda.mem_get_info``);
* the memory available to new processes (``MemAvailable`` in ``/proc/meminfo``), else the
  physical memory.

Estimates count the arrays the work keeps alive at once (for the interpreter: every node of
the expression, since it keeps them all); they are lower bounds of the true peak, so a
refusal is never spurious.
"""
from __future__ import annotations

import math
import os
import re

from ..errors import BudgetError, DeclarationError

ENV = "SYMHESS_MEMORY_BUDGET"
MAX_BYTES = 2 ** 60
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text) -> int:
    """'8GiB' → 8·2³⁰, '500MB' → 5·10⁸, '1e9' → 10⁹; a DeclarationError names bad text."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise DeclarationError(f"{ENV}={text!r} is not a size; use bytes or a number with a "
                               f"unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB), or none")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise DeclarationError(f"{ENV}={text!r} is beyond any machine (more than 1 EiB); give "
                               f"a size such as 64GiB, or none for no limit")
    return int(value)


def format_bytes(n) -> str:
    """Bytes in binary units: 80000000000 → '74.5 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _available_host() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(device=None) -> tuple[int | None, str]:
    """(bytes or None for no limit, where the number comes from) for work on ``device``."""
    text = os.environ.get(ENV)
    if text is not None and text.strip():
        if text.strip().lower() in ("none", "off", "unlimited"):
            return None, ENV
        return parse_bytes(text), ENV
    if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"the free memory of {device}"
    return _available_host(), "the available memory"


def check_budget(estimate, what, sizes="", device=None) -> None:
    """A BudgetError when ``estimate`` bytes exceed the budget: '``what`` needs about …'.

    ``sizes`` names the sizes the estimate follows from (e.g. 'L = 1000, d = 1000')."""
    budget, source = memory_budget(device)
    if budget is None or estimate <= budget:
        return
    at = f" at {sizes}" if sizes else ""
    raise BudgetError(f"{what} would take about {format_bytes(estimate)}{at}, more than the memory "
                      f"budget of {format_bytes(budget)} ({source}; set {ENV} to change it)")

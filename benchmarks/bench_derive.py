"""Time to derive (and simplify) every Hessian block of a layer, per loss, on one core.

    python benchmarks/bench_derive.py [LAYER ...]

Each derivation starts from a fresh process-level cache state (a new Derivation) and is
repeated; the minimum is reported.  Deriving needs no torch and no numerics.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import symhess as sh  # noqa: E402
from symhess.calculus.hessian import PARTS  # noqa: E402


def derive_all(layer_name, loss, options):
    lay = sh.layer(layer_name, **options)
    d = sh.derive(lay, loss)
    n = 0
    for p in lay.param_names:
        for q in lay.param_names:
            for part in PARTS:
                d.block(p, q, part).latex()
                n += 1
    return n


def main(argv):
    layers = argv or ["attention"]
    print(f"{'layer':<28}{'options':<16}{'loss':<6}{'blocks':>7}{'first (s)':>11}{'best of 3 (s)':>15}")
    for name in layers:
        for options in ({}, {"causal": True}) if "causal" in sh.layers.layer_options(name) else ({},):
            for loss in ("mse", "ce"):
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    n = derive_all(name, loss, options)
                    times.append(time.perf_counter() - t0)
                opt = ",".join(f"{k}={v}" for k, v in options.items()) or "-"
                print(f"{name:<28}{opt:<16}{loss:<6}{n:>7}{times[0]:>11.3f}{min(times):>15.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])

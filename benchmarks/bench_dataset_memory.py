"""Memory of a dataset pass against the number of batches.

    python -m benchmarks.bench_dataset_memory [--batches 8 16 64] [--batch 4] [--pairs-up-to 16]

For each number of batches B (of ``--batch`` sequences each, attention at L=32, d=32,
d_K=8, NumPy kernels, float64) the peak of memory allocated during one pass (tracemalloc, which
sees NumPy's arrays) of: 5 products of the W_Q block operator, one Hessian-vector product of
the whole Hessian, the diagonal and trace of H(W_Q, W_Q), and the Frobenius norm of the mean
block H(W_Q, W_K) (dense and by pairs).  ``keep=0`` reads every batch again each pass (memory
independent of B); the default keeps the prepared batches while they fit an eighth of the
memory budget (so at most that much more, whatever B).
"""
from __future__ import annotations

import argparse
import tracemalloc

import numpy as np

import symhess as sh


def peak(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    out = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--pairs-up-to", type=int, default=16,
                    help="the Frobenius norm by pairs (work quadratic in the batches) only up to "
                         "this many batches")
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args(argv)
    L, d, dk = 32, 32, 8
    rng = np.random.default_rng(0)
    W = {n: rng.standard_normal((d, k)) / d ** 0.5 for n, k in (("W_Q", dk), ("W_K", dk), ("W_V", d))}
    k = sh.kernel("attention", backend="numpy", loss="mse")
    print(f"attention, MSE, L={L}, d={d}, d_K={dk}, batches of {a.batch}, NumPy float64; "
          f"peak bytes allocated during the work (tracemalloc)")
    print(f"{'work':<40}" + "".join(f"{f'B={b}, keep=0':>18}{f'B={b}, default':>18}" for b in a.batches))
    rows = {}
    for B in a.batches:
        batches = [(rng.standard_normal((a.batch, L, d)), rng.standard_normal((a.batch, L, d)))
                   for _ in range(B)]
        for keep in (0, None):
            ds = sh.Dataset(k, batches, params=W, keep=keep)
            op = sh.operator(k, ds, "W_Q", "W_Q")
            v = np.ones(op.shape[1])
            vw = np.ones(d * dk * 2 + d * d)
            work = {
                "5 products of H(W_Q, W_Q)": lambda: [op @ v for _ in range(5)],
                "1 hvp of the whole Hessian": lambda: sh.operator(k, ds) @ vw,
                "diag and trace of H(W_Q, W_Q)": lambda: (ds.diag("W_Q"), ds.trace("W_Q")),
                "‖H(W_Q, W_K)‖_F, dense": lambda: ds.frobenius_norm("W_Q", "W_K", "full", "dense"),
            }
            if B <= a.pairs_up_to:
                work["‖H(W_Q, W_K)‖_F, pairs"] = lambda: ds.frobenius_norm("W_Q", "W_K", "full", "pairs")
            for name, fn in work.items():
                rows.setdefault(name, []).append(peak(fn))
            rows.setdefault("‖H(W_Q, W_K)‖_F, pairs", [])
            if B > a.pairs_up_to:
                rows["‖H(W_Q, W_K)‖_F, pairs"].append(None)
    mib = lambda x: "not run" if x is None else f"{x / 2 ** 20:.2f} MiB"  # noqa: E731
    for name, vals in rows.items():
        print(f"{name:<40}" + "".join(f"{mib(v):>18}" for v in vals))


if __name__ == "__main__":
    main()

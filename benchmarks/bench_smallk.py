"""Products with a short inner dimension written into a large array (``symhess.smallk``).

    python -m benchmarks.bench_smallk [--n 2816] [--k 8] [--threads 1] [--rounds 5]

An n×n array (the post-LN block's Hessian at the issue's sizes: n = 2816) written as
(n×K) @ (K×n) products, K = L = 8, the way the slab GEMMs write it: BLAS (``torch.mm``) in one
call and in row chunks, NumPy's BLAS in row chunks, the loop nest of ``symhess.smallk``
(the same products), and ``fill_`` of the array (the write alone), all timed in turn,
round after round. Prints times and ratios to the loop nest.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from symhess import smallk

from .timing import interleaved


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2816)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if smallk.numba is None:
        raise SystemExit("numba is not installed: symhess.smallk falls back to BLAS")
    n, k = a.n, a.k
    rng = np.random.default_rng(0)
    A = torch.tensor(rng.standard_normal((n, k)))
    B = torch.tensor(rng.standard_normal((k, n)))
    H = torch.empty((n, n), dtype=torch.float64)
    An, Bn, Hn = A.numpy(), B.numpy(), H.numpy()

    def chunks(rows, mm):
        return lambda: [mm(i, i + rows) for i in range(0, n, rows)]

    def torch_mm(i, j):
        torch.mm(A[i:j], B, out=H[i:j])

    def numpy_mm(i, j):
        np.matmul(An[i:j], Bn, out=Hn[i:j])

    fns = {"smallk.matmul_into, one call": lambda: smallk.matmul_into(A, B, H),
           "smallk.matmul_into, 16-row chunks": chunks(16, lambda i, j: smallk.matmul_into(A[i:j], B, H[i:j])),
           "torch.mm, one call": lambda: torch.mm(A, B, out=H),
           "torch.mm, 16-row chunks": chunks(16, torch_mm),
           "torch.mm, 64-row chunks": chunks(64, torch_mm),
           "np.matmul, 8-row chunks": chunks(8, numpy_mm),
           "np.matmul, 64-row chunks": chunks(64, numpy_mm),
           "H.fill_ (the write alone)": lambda: H.fill_(1.0)}
    smallk.matmul_into(A, B, H)                     # compile the loop nest first
    err = float((H - A @ B).abs().max() / (A @ B).abs().max())
    t = interleaved(fns, rounds=a.rounds, repeat={v: 5 for v in fns})
    base = t["smallk.matmul_into, one call"]
    print(f"{n}×{n} written as ({n}×{k}) @ ({k}×{n}), float64, torch threads {a.threads} "
          f"(NumPy's BLAS threads: its own default)")
    for name, s in t.items():
        print(f"  {name:36s} {s * 1e3:7.2f} ms   {s / base:5.2f}× the loop nest")
    print(f"  loop nest vs BLAS: max rel. difference {err:.1e}")


if __name__ == "__main__":
    main()

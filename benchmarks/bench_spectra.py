"""Top eigenvalue of every attention block by Lanczos: symhess.operator against curvlinops.

    python -m benchmarks.bench_spectra [--L 256] [--d 256] [--dk 64] [--n 8] [--tol 1e-6]

For each block W ∈ {W_Q, W_K, W_V} and part (H, H_o, H_f) the same ``scipy.sparse.linalg.eigsh``
(k = 1, which = "LA", the same tolerance and start vector) runs on symhess's block operator and
on curvlinops' operator of the same block (``HessianLinearOperator`` / ``GGNLinearOperator`` of
the attention module in that parameter alone; H_f as curvlinops' H − GGN), over one batch of
``--n`` sequences, float64, torch.set_num_threads(1).  Reported: wall time of the whole eigsh
call (symhess's includes deriving the block product and its first forward pass; curvlinops'
set-up product is made before), the number
of products, and the eigenvalues (they must agree).  H_f(W_V, W_V) is a structural zero
(symhess knows; curvlinops' H − GGN is rounding noise): not timed.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
from torch import nn

import symhess as sh


class Attention(nn.Module):
    def __init__(self, W, dk):
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(W[n].clone()) for n in ("W_Q", "W_K", "W_V"))
        self.c = dk ** -0.5

    def forward(self, x):
        a = torch.softmax(self.c * (x @ self.W_Q) @ (x @ self.W_K).transpose(-1, -2), -1)
        return a @ (x @ self.W_V)


class Counted:
    """A SciPy operator that counts its products."""

    def __init__(self, op):
        from scipy.sparse.linalg import LinearOperator
        self.count = 0

        def mv(x):
            self.count += 1
            return op @ x

        self.op = LinearOperator(op.shape, matvec=mv, rmatvec=mv, dtype=np.float64)


def run_eigsh(op, tol, v0):
    from scipy.sparse.linalg import eigsh
    c = Counted(op)
    t = time.perf_counter()
    val = eigsh(c.op, k=1, which="LA", tol=tol, v0=v0, return_eigenvectors=False)[0]
    return time.perf_counter() - t, c.count, float(val)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from curvlinops import GGNLinearOperator, HessianLinearOperator
    g = torch.Generator().manual_seed(0)
    X = torch.randn(a.n, a.L, a.d, generator=g, dtype=torch.float64)
    Y = torch.randn(a.n, a.L, a.d, generator=g, dtype=torch.float64)
    W = {n: torch.randn(a.d, k, generator=g, dtype=torch.float64) / a.d ** 0.5
         for n, k in (("W_Q", a.dk), ("W_K", a.dk), ("W_V", a.d))}
    model = Attention(W, a.dk)
    data = [(X, Y)]
    k = sh.kernel("attention", backend="torch", loss="mse")
    print(f"attention, MSE, L={a.L}, d={a.d}, d_K={a.dk}, {a.n} sequences, float64, "
          f"{a.threads} thread(s), eigsh k=1 LA tol={a.tol}")
    print(f"{'block':<12}{'part':<12}{'symhess s':>10}{'products':>9}{'curvlinops s':>14}"
          f"{'products':>9}{'speed-up':>10}  {'λ_max symhess':>15} {'λ_max curvlinops':>17}")
    ratios = []
    for p in ("W_Q", "W_K", "W_V"):
        param = getattr(model, p)
        v0 = np.random.default_rng(1).standard_normal(param.numel())
        hess = HessianLinearOperator(model, nn.MSELoss(), [param], data, check_deterministic=False)
        ggn = GGNLinearOperator(model, nn.MSELoss(), [param], data, check_deterministic=False)
        theirs = {"full": hess, "outer": ggn, "functional": hess - ggn}
        hess @ torch.as_tensor(v0)               # curvlinops' first product (set-up) not timed
        for part in ("full", "outer", "functional"):
            if p == "W_V" and part == "functional":
                print(f"{p:<12}{part:<12}{'≡0: structural zero, not timed':>40}")
                continue
            ours = sh.operator(k, {"X": X, "Y": Y, **W}, p, p, part)   # fresh: pays its forward
            t1, n1, l1 = run_eigsh(ours, a.tol, v0)
            t2, n2, l2 = run_eigsh(theirs[part].to_scipy(), a.tol, v0)
            ratios.append(t2 / t1)
            print(f"{p:<12}{part:<12}{t1:>10.2f}{n1:>9}{t2:>14.2f}{n2:>9}{t2 / t1:>9.1f}×  "
                  f"{l1:>15.8e} {l2:>17.8e}")
            assert abs(l1 - l2) <= 1e-6 * max(abs(l1), 1e-30) * 10, (p, part, l1, l2)
    print(f"speed-up over curvlinops: min {min(ratios):.1f}×, geometric mean "
          f"{float(np.exp(np.mean(np.log(ratios)))):.1f}×")


if __name__ == "__main__":
    main()

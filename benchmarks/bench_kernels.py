"""Kernel benchmarks (issue 3): ratios against autograd measured in the same run.

Run from the repository root:  python -m benchmarks.bench_kernels   (add --quick for a smoke run)
"""
from __future__ import annotations

import argparse
import math
import time
import tracemalloc

import numpy as np
import torch

import symhess as sh
from symhess import codegen


def best(fn, repeat=5):
    """Minimum wall time of ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def values(L, d_V, d_K, seed=0):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((L, d_V)), "Y": rng.standard_normal((L, d_V)),
            "W_Q": rng.standard_normal((d_V, d_K)) / math.sqrt(d_V),
            "W_K": rng.standard_normal((d_V, d_K)) / math.sqrt(d_V),
            "W_V": rng.standard_normal((d_V, d_V)) / math.sqrt(d_V)}


def torch_loss(X, Y):
    """The forward model only (softmax attention, MSE); autograd differentiates it."""
    def loss(W_Q, W_K, W_V):
        T = X @ W_Q @ W_K.T @ X.T / math.sqrt(W_Q.shape[1])
        F = torch.softmax(T, dim=-1) @ X @ W_V
        return ((F - Y) ** 2).sum() / F.numel()

    return loss


def dense_hessian(L=16, d=32, repeat=5):
    v = values(L, d, d)
    k = sh.kernel("attention", "numpy", "mse")
    kt = sh.kernel("attention", "torch", "mse")
    n = 3 * d * d
    tv = {a: torch.tensor(b) for a, b in v.items()}
    t_np = best(lambda: k.hessian(v, "full"), repeat)
    t_torch = best(lambda: kt.hessian(tv, "full"), repeat)
    t_kernel = min(t_np, t_torch)
    t_ones = best(lambda: np.ones((n, n)), repeat)
    loss = torch_loss(tv["X"], tv["Y"])
    flat = torch.cat([tv[p].reshape(-1) for p in ("W_Q", "W_K", "W_V")])

    def f(w):
        a, b, c = w[:d * d].view(d, d), w[d * d:2 * d * d].view(d, d), w[2 * d * d:].view(d, d)
        return loss(a, b, c)

    t_auto = best(lambda: torch.func.hessian(f)(flat), max(1, repeat // 3))
    H = k.hessian(v, "full")
    Ha = torch.func.hessian(f)(flat).numpy()
    err = np.linalg.norm(H - Ha) / np.linalg.norm(Ha)
    print(f"dense full Hessian MSE f64 L={L} d_V=d_K={d} ({n}x{n}): kernel numpy {t_np*1e3:.1f} ms, "
          f"torch {t_torch*1e3:.1f} ms, "
          f"np.ones {t_ones*1e3:.1f} ms, torch.func.hessian {t_auto*1e3:.1f} ms")
    print(f"  kernel/np.ones = {t_kernel/t_ones:.2f} (target <= 2), "
          f"autograd/kernel = {t_auto/t_kernel:.1f}x (target >= 7), rel. err {err:.1e}")
    return t_kernel, t_ones, t_auto


def hvp(L=128, d_V=256, d_K=64, repeat=10):
    v = values(L, d_V, d_K)
    k = sh.kernel("attention", "torch", "mse")
    tv = {a: torch.tensor(b) for a, b in v.items()}
    n = 2 * d_V * d_K + d_V * d_V
    vec = torch.randn(n, dtype=torch.float64)
    loss = torch_loss(tv["X"], tv["Y"])
    params = (tv["W_Q"], tv["W_K"], tv["W_V"])
    tangents = (vec[:d_V * d_K].view(d_V, d_K), vec[d_V * d_K:2 * d_V * d_K].view(d_V, d_K),
                vec[2 * d_V * d_K:].view(d_V, d_V))
    grad = torch.func.grad(loss, argnums=(0, 1, 2))

    def auto():
        return torch.func.jvp(lambda *p: grad(*p), params, tangents)[1]

    t_kernel = best(lambda: k.hvp(tv, vec, "full"), repeat)
    t_auto = best(auto, repeat)
    got = k.hvp(tv, vec, "full")
    ref = torch.cat([x.reshape(-1) for x in auto()])
    err = float((got - ref).norm() / ref.norm())
    print(f"hvp torch f64 L={L} d_V={d_V} d_K={d_K}: kernel {t_kernel*1e3:.2f} ms, "
          f"jvp(grad) {t_auto*1e3:.2f} ms -> {t_auto/t_kernel:.2f}x (target >= 2), rel. err {err:.1e}")
    return t_kernel, t_auto


def frobenius(L=16, d=64, repeat=5):
    v = values(L, d, d)
    names = ("W_Q", "W_K", "W_V")
    out = {}
    for backend in ("numpy", "torch"):
        k = sh.kernel("attention", backend, "mse")
        vals = v if backend == "numpy" else {a: torch.tensor(b) for a, b in v.items()}
        out[backend] = best(lambda: k.frobenius_norms(vals, "full"), repeat)
        out[backend + " (9 separate calls)"] = best(
            lambda: [k.frobenius_norm(vals, p, q, "full") for p in names for q in names], repeat)
    k = sh.kernel("attention", "numpy", "mse")
    norms = k.frobenius_norms(v, "full")
    tv = {a: torch.tensor(b) for a, b in v.items()}
    loss = torch_loss(tv["X"], tv["Y"])
    t = time.perf_counter()
    H = torch.func.hessian(loss, argnums=(0, 1, 2))(tv["W_Q"], tv["W_K"], tv["W_V"])
    ref = {(p, q): float(H[i][j].norm()) for i, p in enumerate(names) for j, q in enumerate(names)}
    t_auto = time.perf_counter() - t
    err = max(abs(norms[b] - ref[b]) / ref[b] for b in ref)
    tk = min(out["numpy"], out["torch"])
    desc = ", ".join(f"{b} {t*1e3:.2f} ms" for b, t in out.items())
    print(f"Frobenius norms of all 9 full blocks, L={L} d_V=d_K={d}: {desc}; "
          f"dense torch.func.hessian + norms {t_auto:.2f} s")
    print(f"  autograd/kernel = {t_auto/tk:.0f}x (target >= 1000), max rel. err {err:.1e} (target <= 1e-10)")
    return out, t_auto, err


def peak_memory(L=16, d=32):
    v = values(L, d, d)
    k = sh.kernel("attention", "numpy", "mse")
    k.hessian(v, "full")
    tracemalloc.start()
    H = k.hessian(v, "full")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"peak memory of the dense full-Hessian kernel (L={L} d={d}): {peak/2**20:.1f} MiB for a "
          f"{H.nbytes/2**20:.1f} MiB output -> {peak/H.nbytes:.2f}x (target <= 3)")
    return peak / H.nbytes


def generation_time():
    t = time.perf_counter()
    files = codegen.render_all()
    dt = time.perf_counter() - t
    layers = sorted({path.split("/")[1][:-3] for path in files})
    print(f"rendering all generated modules ({len(files)} files, layers: {', '.join(layers)}; "
          f"on demand only: {', '.join(sorted(codegen.ON_DEMAND))}): {dt:.1f} s (target < 60 s)")
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch threads: {a.threads}")
    if a.quick:
        dense_hessian(8, 8, 2)
        hvp(16, 16, 8, 2)
        frobenius(8, 8, 2)
        peak_memory(8, 8)
        return
    dense_hessian()
    hvp()
    frobenius()
    peak_memory()
    generation_time()


if __name__ == "__main__":
    main()

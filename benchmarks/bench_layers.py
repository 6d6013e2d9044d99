"""Kernel ratios against autograd for every declared layer (variants and blocks), one run.

    python -m benchmarks.bench_layers [LAYER ...] [--size small|medium|dense]

(``--size dense``: L = 16, d = d_K = 32, the size of the dense-Hessian comparison in
BENCHMARKS.md.)

For each layer the reference is torch.func applied to the layer's own forward (the
declaration evaluated in torch, float64), measured in the same run as the kernel:
* hvp:        kernel.hvp  vs  torch.func.jvp(torch.func.grad(loss))
* dense:      kernel.hessian  vs  torch.func.hessian(loss)  (and vs writing np.ones of that size)
* frobenius:  kernel.frobenius_norm over all ordered blocks  vs  dense hessian + norms
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import symhess as sh
from symhess.expr.evaluate import evaluate
from symhess.calculus.verify import random_values

from benchmarks.timing import best as _best

SIZES = {"small": {"L": 8, "d_V": 12, "d_K": 10, "d_H": 6, "d_ff": 16},
         "medium": {"L": 16, "d_V": 24, "d_K": 16, "d_H": 12, "d_ff": 48},
         "dense": {"L": 16, "d_V": 32, "d_K": 32, "d_H": 16, "d_ff": 64}}
DEFAULT_LAYERS = ["attention", "linear_attention", "single_matrix_attention", "multihead_attention",
                  "value_output_attention", "ffn", "post_ln_block", "pre_ln_block"]


def best(fn, repeat=3):
    """Minimum wall time of ``repeat`` calls after a warm-up (``benchmarks.timing``)."""
    return _best(fn, repeat)


def bench(name, sizes, loss="mse"):
    d = sh.derive(sh.layer(name), loss)
    vals = random_values(d, seed=0, sizes=sizes)
    names = d.layer.param_names
    tv = {k: torch.as_tensor(v) for k, v in vals.items()}
    kt = sh.kernel(name, "torch", loss)
    t0 = time.perf_counter()
    kt.hessian(tv, "full")  # first call renders/imports
    first = time.perf_counter() - t0

    def loss_fn(*ps):
        return evaluate(d.loss_expr, {**tv, **dict(zip(names, ps))}, backend="torch")[0, 0]

    params = tuple(tv[p] for p in names)
    vec = tuple(torch.randn_like(p) for p in params)
    flat_v = torch.cat([x.reshape(-1) for x in vec])
    argn = tuple(range(len(names)))
    t_hvp = best(lambda: kt.hvp(tv, flat_v, "full"))
    t_hvp_ad = best(lambda: torch.func.jvp(lambda *ps: torch.func.grad(loss_fn, argnums=argn)(*ps), params, vec))
    t_dense = best(lambda: kt.hessian(tv, "full"))
    n = sum(p.numel() for p in params)
    t_ones = best(lambda: np.ones((n, n)))
    t_dense_ad = best(lambda: torch.func.hessian(loss_fn, argnums=argn)(*params), 1)
    t_frob = best(lambda: [kt.frobenius_norm(tv, p, q, "full") for p in names for q in names])
    h_k = kt.hessian(tv, "full").numpy()
    hess = torch.func.hessian(loss_fn, argnums=argn)(*params)
    h_ad = torch.cat([torch.cat([hess[i][j].reshape(params[i].numel(), params[j].numel())
                                 for j in range(len(names))], 1) for i in range(len(names))]).numpy()
    err = np.linalg.norm(h_k - h_ad) / np.linalg.norm(h_ad)
    fro = np.array([kt.frobenius_norm(tv, p, q, "full") for p in names for q in names], dtype=float)
    off = np.cumsum([0] + [params[i].numel() for i in range(len(names))])
    fro_ad = np.array([np.linalg.norm(h_ad[off[i]:off[i + 1], off[j]:off[j + 1]])
                       for i in range(len(names)) for j in range(len(names))])
    ferr = np.max(np.abs(fro - fro_ad) / np.maximum(fro_ad, 1e-300 + fro_ad.max() * 1e-12))
    print(f"| {name} | {n} | {t_hvp_ad / t_hvp:.1f}× | {t_dense_ad / t_dense:.1f}× | {t_dense / t_ones:.1f} "
          f"| {t_dense_ad / t_frob:.1f}× | {err:.1e} | {ferr:.1e} | {first:.1f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("layers", nargs="*", default=DEFAULT_LAYERS)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"sizes: {SIZES[args.size]}, torch threads {args.threads}, MSE, float64, torch kernels")
    print("| layer | Hessian side | hvp: autograd/kernel | dense: autograd/kernel | dense/np.ones "
          "| Frobenius (all blocks): dense autograd/kernel | rel. err dense | rel. err Frobenius | first call (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.layers:
        try:
            bench(name, SIZES[args.size])
        except Exception as exc:  # report and go on: one layer's failure is a finding, not a crash
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |||||||")


if __name__ == "__main__":
    main()

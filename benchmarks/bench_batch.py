"""Batched calls of the post-LN block kernels: loss, gradient and hvp over N sequences.

    python -m benchmarks.bench_batch [--sizes 1 16 64] [--threads 1] [--device cuda]

At L=8, d=16, d_K=16, d_ff=64 (the issue-5 size), for each batch size N the kernel's
``loss``, ``gradient`` and ``hvp`` (torch backend, float64) against autograd of the batch-mean
loss measured in the same run (``torch.func.grad``, ``jvp`` of it), and the kernel's input
validation alone (shapes, dtypes and the LayerNorm zero-variance check of every sequence,
computed for the whole batch by the generated ``check_inputs`` routine). Times are the best
of several calls.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

import symhess as sh

from .bench_full_block import make_loss
from .timing import add_device_option, best, check_device, device_label


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=1)
    add_device_option(ap)
    a = ap.parse_args(argv)
    dev = check_device(a.device)
    torch.set_num_threads(a.threads)
    L, d, dk, dff = 8, 16, 16, 64
    rng = np.random.default_rng(0)
    w = {"W_Q": (d, dk), "W_K": (d, dk), "W_V": (d, d), "W_1": (d, dff), "W_2": (dff, d)}
    params = {n: torch.tensor(rng.standard_normal(s) / math.sqrt(s[0]), device=dev)
              for n, s in w.items()}
    names = tuple(w)
    n = sum(p.numel() for p in params.values())
    k = sh.kernel("post_ln_block", "torch", "mse")
    print(f"post-LN block, MSE, float64, L={L}, d={d}, d_K={dk}, d_ff={dff}; torch threads "
          f"{a.threads}, {device_label(dev)}")
    print(f"{'N':>4} {'validation':>11} {'loss':>17} {'gradient':>17} {'hvp':>17}   (kernel ms, ×autograd)")
    for N in a.sizes:
        X = torch.tensor(rng.standard_normal((N, L, d)), device=dev)
        T = torch.tensor(rng.standard_normal((N, L, d)), device=dev)
        tv = {"X": X, "Y": T, **params}
        loss = make_loss(X, T)
        args = tuple(params[p] for p in names)
        v = torch.tensor(rng.standard_normal(n), device=dev)
        tangents, off = [], 0
        for p in names:
            tangents.append(v[off:off + params[p].numel()].view(params[p].shape))
            off += params[p].numel()
        grad = torch.func.grad(loss, argnums=tuple(range(5)))
        pairs = [(lambda: k.loss(tv), lambda: loss(*args)),
                 (lambda: k.gradient(tv), lambda: grad(*args)),
                 (lambda: k.hvp(tv, v), lambda: torch.func.jvp(grad, args, tuple(tangents))[1])]
        got = k.hvp(tv, v)
        ref = torch.cat([t.reshape(-1) for t in pairs[2][1]()])
        err = float((got - ref).norm() / ref.norm())
        t_val = best(lambda: k._prepare(tv), 5, dev)
        cells = []
        for kern, auto in pairs:
            tk, ta = best(kern, 5, dev), best(auto, 5, dev)
            cells.append(f"{tk * 1e3:8.2f} ({ta / tk:4.1f}×)")
        print(f"{N:>4} {t_val * 1e3:9.2f}ms " + " ".join(f"{c:>17}" for c in cells)
              + f"   hvp rel. err {err:.1e}")


if __name__ == "__main__":
    main()

"""Full post-LN block Hessian (issue 5): the generated kernel against torch.func.hessian.

    python -m benchmarks.bench_full_block [--L 8 --d 16 --d-k 16 --d-ff 64] [--threads 1]
                                          [--quick] [--device cuda] [--retain-freed-memory]

Sizes default to the issue's (L=8, d=16, d_K=16, d_ff=64: a 2816 × 2816 Hessian over
W_Q, W_K, W_V, W_1, W_2).  The reference is an independent plain-torch forward of
Z = LN(Y + relu(Y W_1) W_2), Y = LN(X + softmax(X W_Q W_Kᵀ Xᵀ/√d_K) X W_V) with the MSE loss
‖Z − T‖²/(L d), differentiated by ``torch.func.hessian`` (forward-over-reverse) and, for
the accuracy check, by reverse-over-reverse (LayerNorm's known forward-over-reverse issue).
Every time is the best of several calls in this run, the kernel variants and autograd timed in
turn, round after round, so that all of them see the same stretch of the machine's load
(``--rounds``); the kernel is rendered before timing.
The kernel is timed twice: without ``out`` (each result is let go before the next call, so
``Kernel.hessian`` writes into its memory again: ``symhess.memory.ResultPool``), and writing
into one array the caller reuses (``out=``); and both ways again replayed from a traced graph
(``Kernel.traced()``: no Python layer per statement).
``--device cuda``: the kernel and both autograd references run on CUDA tensors (synchronized
inside each timed region); ``np.ones`` stays on the CPU and ``torch.ones`` on the device is added.
On CUDA the kernel is also timed replayed from CUDA graphs (``Kernel.with_cuda_graphs()``),
against ``torch.func.hessian`` eager and, where it can be captured, replayed from a graph too.
``--quick``: L=4, d=8, d_K=6, d_ff=16 (a smoke run).
``--retain-freed-memory``: ``symhess.memory.retain_freed_memory()`` first, so both sides reuse
mapped pages for their 63 MB results and temporaries instead of faulting fresh ones in on
every call (the steady state of a process that computes many Hessians).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import symhess as sh

from .timing import (add_device_option, best, check_device, device_label, graph_comparison,
                     interleaved, synchronize)


def layer_norm(u):
    m = u - u.mean(-1, keepdim=True)
    return m / torch.sqrt((m * m).mean(-1, keepdim=True))


def make_loss(X, T):
    """The post-LN block's MSE loss of X (L × d, or N × L × d: the mean over sequences)."""
    def loss(W_Q, W_K, W_V, W_1, W_2):
        A = torch.softmax(X @ W_Q @ W_K.T @ X.transpose(-1, -2) / math.sqrt(W_Q.shape[1]), dim=-1)
        Y = layer_norm(X + A @ X @ W_V)
        Z = layer_norm(Y + torch.relu(Y @ W_1) @ W_2)
        return ((Z - T) ** 2).sum() / Z.numel()
    return loss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=8)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--d-k", type=int, default=16)
    ap.add_argument("--d-ff", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the interleaved timing (each: 3 calls of every kernel "
                         "variant, 1 of torch.func.hessian; the best of all rounds is reported)")
    ap.add_argument("--quick", action="store_true", help="L=4, d=8, d_K=6, d_ff=16 (smoke run)")
    ap.add_argument("--retain-freed-memory", action="store_true",
                    help="keep freed memory mapped (glibc mallopt) for kernel and autograd alike")
    add_device_option(ap)
    a = ap.parse_args(argv)
    if a.retain_freed_memory:
        from symhess.memory import retain_freed_memory
        retain_freed_memory()
    dev = check_device(a.device)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    L, d, dk, dff = (4, 8, 6, 16) if a.quick else (a.L, a.d, a.d_k, a.d_ff)
    vals = {"X": rng.standard_normal((L, d)), "Y": rng.standard_normal((L, d)),
            "W_Q": rng.standard_normal((d, dk)) / math.sqrt(d), "W_K": rng.standard_normal((d, dk)) / math.sqrt(d),
            "W_V": rng.standard_normal((d, d)) / math.sqrt(d), "W_1": rng.standard_normal((d, dff)) / math.sqrt(d),
            "W_2": rng.standard_normal((dff, d)) / math.sqrt(dff)}
    tv = {k: torch.tensor(v, device=dev) for k, v in vals.items()}
    names = ("W_Q", "W_K", "W_V", "W_1", "W_2")
    params = tuple(tv[p] for p in names)
    n = sum(p.numel() for p in params)
    t0 = time.perf_counter()
    k = sh.kernel("post_ln_block", "torch", "mse")
    k.hessian(tv, "full")
    synchronize(dev)
    render = time.perf_counter() - t0
    loss = make_loss(tv["X"], tv["Y"])
    argn = tuple(range(len(names)))
    buf = torch.empty((n, n), dtype=torch.float64, device=dev)
    kt = k.traced()
    t0 = time.perf_counter()
    kt.hessian(tv, "full", out=buf)
    synchronize(dev)
    trace_s = time.perf_counter() - t0
    # every variant and autograd in turn, round after round (the machine's load drifts)
    t = interleaved({"kernel": lambda: k.hessian(tv, "full"),
                     "out": lambda: k.hessian(tv, "full", out=buf),
                     "traced": lambda: kt.hessian(tv, "full"),
                     "traced_out": lambda: kt.hessian(tv, "full", out=buf),
                     "autograd": lambda: torch.func.hessian(loss, argnums=argn)(*params)},
                    rounds=a.rounds, repeat={"kernel": 3, "out": 3, "traced": 3, "traced_out": 3},
                    device=dev)
    t_kernel, t_out, t_traced, t_traced_out, t_ad = (
        t[k_] for k_ in ("kernel", "out", "traced", "traced_out", "autograd"))
    t_ones = best(lambda: np.ones((n, n)))
    h = torch.func.jacrev(torch.func.jacrev(loss, argnums=argn), argnums=argn)(*params)
    ref = torch.cat([torch.cat([h[i][j].reshape(params[i].numel(), params[j].numel())
                                for j in range(len(names))], 1) for i in range(len(names))])
    got = k.hessian(tv, "full")
    err = float((got - ref).norm() / ref.norm())
    err_t = float((kt.hessian(tv, "full") - ref).norm() / ref.norm())
    on = "" if dev.type == "cpu" else f", device {device_label(dev)} (kernel and autograd)"
    mem = ", freed memory retained" if a.retain_freed_memory else ""
    print(f"post-LN block, MSE, float64, L={L}, d={d}, d_K={dk}, d_ff={dff}: Hessian {n}×{n}, "
          f"torch threads {a.threads}{on}{mem}")
    print(f"  kernel.hessian (torch)         {t_kernel * 1e3:9.2f} ms   (first call incl. loading or rendering {render:.1f} s)")
    same = "" if dev.type == "cpu" else " (same device)"
    print(f"  torch.func.hessian             {t_ad * 1e3:9.2f} ms   → kernel {t_ad / t_kernel:.1f}× faster{same}   [target ≥ 10]")
    print(f"  kernel.hessian(..., out=H)     {t_out * 1e3:9.2f} ms   → {t_ad / t_out:.1f}× faster "
          f"(the output array reused, as in a loop)")
    print(f"  kernel.traced().hessian        {t_traced * 1e3:9.2f} ms   → {t_ad / t_traced:.1f}× faster "
          f"(replayed from a traced graph; first call incl. tracing {trace_s:.1f} s)")
    print(f"  kernel.traced().hessian(out=H) {t_traced_out * 1e3:9.2f} ms   → {t_ad / t_traced_out:.1f}× faster")
    t_check = best(lambda: k._prepare(tv), 5, dev)
    print(f"  of which input validation     {t_check * 1e3:9.2f} ms   (shapes, dtypes, the LayerNorm "
          f"zero-variance check on the values' device)")
    cpu = "" if dev.type == "cpu" else " (cpu)"
    print(f"  np.ones of the output{cpu:<6}    {t_ones * 1e3:9.2f} ms   → kernel / write {t_kernel / t_ones:.2f}")
    if dev.type != "cpu":
        t_dev_ones = best(lambda: torch.ones((n, n), dtype=torch.float64, device=dev), 5, dev)
        print(f"  torch.ones of the output       {t_dev_ones * 1e3:9.2f} ms   → kernel / write "
              f"{t_kernel / t_dev_ones:.2f} (same device)")
        kg = k.with_cuda_graphs()
        err_g = float((kg.hessian(tv, "full") - ref).norm() / ref.norm())
        graph_comparison(lambda: kg.hessian(tv, "full"),
                         lambda: torch.func.hessian(loss, argnums=argn)(*params), t_ad, dev)
        print(f"  rel. error of the kernel replayed from CUDA graphs: {err_g:.1e}")
    print(f"  rel. error vs reverse-over-reverse autograd: {err:.1e} (eager), {err_t:.1e} (traced)")


if __name__ == "__main__":
    main()

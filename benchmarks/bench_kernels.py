"""Kernel benchmarks (issue 3): ratios against autograd measured in the same run.

Run from the repository root:  python -m benchmarks.bench_kernels   (add --quick for a smoke run)

``--device cuda`` runs the torch kernels and the autograd references on CUDA tensors (timed
with a synchronize inside the timed region) and prints "kernel vs autograd on the same
device"; the NumPy kernels, ``np.ones`` and the memory/generation measurements stay on the CPU.
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

from .timing import add_device_option, best, check_device, device_label, graph_comparison, timed


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


def dense_hessian(L=16, d=32, repeat=5, device="cpu"):
    v = values(L, d, d)
    k = sh.kernel("attention", "numpy", "mse")
    kt = sh.kernel("attention", "torch", "mse")
    n = 3 * d * d
    tv = {a: torch.tensor(b, device=device) for a, b in v.items()}
    t_np = best(lambda: k.hessian(v, "full"), repeat)
    t_torch = best(lambda: kt.hessian(tv, "full"), repeat, device)
    t_kernel = min(t_np, t_torch)
    t_ones = best(lambda: np.ones((n, n)), repeat)
    loss = torch_loss(tv["X"], tv["Y"])
    flat = torch.cat([tv[p].reshape(-1) for p in ("W_Q", "W_K", "W_V")])

    def f(w):
        a, b, c = w[:d * d].view(d, d), w[d * d:2 * d * d].view(d, d), w[2 * d * d:].view(d, d)
        return loss(a, b, c)

    t_auto = best(lambda: torch.func.hessian(f)(flat), max(1, repeat // 3), device)
    H = k.hessian(v, "full")
    Ha = torch.func.hessian(f)(flat).cpu().numpy()
    err = np.linalg.norm(H - Ha) / np.linalg.norm(Ha)
    if device.type != "cpu":
        t_dev_ones = best(lambda: torch.ones((n, n), dtype=torch.float64, device=device), repeat, device)
        err_dev = np.linalg.norm(kt.hessian(tv, "full").cpu().numpy() - Ha) / np.linalg.norm(Ha)
        dev = device_label(device)
        print(f"dense full Hessian MSE f64 L={L} d_V=d_K={d} ({n}x{n}): kernel numpy (cpu) "
              f"{t_np*1e3:.1f} ms, torch ({dev}) {t_torch*1e3:.3f} ms, np.ones (cpu) "
              f"{t_ones*1e3:.1f} ms, torch.ones ({dev}) {t_dev_ones*1e3:.3f} ms, "
              f"torch.func.hessian ({dev}) {t_auto*1e3:.1f} ms")
        print(f"  kernel vs autograd on the same device ({dev}): autograd/kernel = "
              f"{t_auto/t_torch:.1f}x (target >= 7); torch kernel/torch.ones = "
              f"{t_torch/t_dev_ones:.2f}; rel. err torch kernel {err_dev:.1e}, numpy kernel {err:.1e}")
        kg = kt.with_cuda_graphs()
        graph_comparison(lambda: kg.hessian(tv, "full"), lambda: torch.func.hessian(f)(flat),
                         t_auto, device)
        return t_torch, t_dev_ones, t_auto
    ktr = kt.traced()
    ktr.hessian(tv, "full")                     # traced on the first call
    t_traced = best(lambda: ktr.hessian(tv, "full"), repeat)
    print(f"dense full Hessian MSE f64 L={L} d_V=d_K={d} ({n}x{n}): kernel numpy {t_np*1e3:.1f} ms, "
          f"torch {t_torch*1e3:.1f} ms, torch traced {t_traced*1e3:.1f} ms "
          f"(autograd/traced = {t_auto/t_traced:.1f}x), "
          f"np.ones {t_ones*1e3:.1f} ms, torch.func.hessian {t_auto*1e3:.1f} ms")
    print(f"  kernel/np.ones = {t_kernel/t_ones:.2f} (target <= 2), "
          f"autograd/kernel = {t_auto/t_kernel:.1f}x (target >= 7), rel. err {err:.1e}")
    return t_kernel, t_ones, t_auto


def hvp(L=128, d_V=256, d_K=64, repeat=10, device="cpu"):
    v = values(L, d_V, d_K)
    k = sh.kernel("attention", "torch", "mse")
    tv = {a: torch.tensor(b, device=device) for a, b in v.items()}
    n = 2 * d_V * d_K + d_V * d_V
    vec = torch.randn(n, dtype=torch.float64).to(device)
    loss = torch_loss(tv["X"], tv["Y"])
    params = (tv["W_Q"], tv["W_K"], tv["W_V"])
    tangents = (vec[:d_V * d_K].view(d_V, d_K), vec[d_V * d_K:2 * d_V * d_K].view(d_V, d_K),
                vec[2 * d_V * d_K:].view(d_V, d_V))
    grad = torch.func.grad(loss, argnums=(0, 1, 2))

    def auto():
        return torch.func.jvp(lambda *p: grad(*p), params, tangents)[1]

    t_kernel = best(lambda: k.hvp(tv, vec, "full"), repeat, device)
    t_auto = best(auto, repeat, device)
    got = k.hvp(tv, vec, "full")
    ref = torch.cat([x.reshape(-1) for x in auto()])
    err = float((got - ref).norm() / ref.norm())
    on = "" if device.type == "cpu" else f" (kernel vs autograd on the same device, {device_label(device)})"
    print(f"hvp torch f64 L={L} d_V={d_V} d_K={d_K}: kernel {t_kernel*1e3:.2f} ms, "
          f"jvp(grad) {t_auto*1e3:.2f} ms -> {t_auto/t_kernel:.2f}x (target >= 2), rel. err {err:.1e}{on}")
    if device.type != "cpu":
        kg = k.with_cuda_graphs()
        graph_comparison(lambda: kg.hvp(tv, vec, "full"), auto, t_auto, device)
    return t_kernel, t_auto


def frobenius(L=16, d=64, repeat=5, device="cpu"):
    v = values(L, d, d)
    names = ("W_Q", "W_K", "W_V")
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    label = {"numpy": "numpy" if on_cpu else "numpy (cpu)",
             "torch": "torch" if on_cpu else f"torch ({device_label(device)})"}
    out = {}
    for backend in ("numpy", "torch"):
        k = sh.kernel("attention", backend, "mse")
        vals = v if backend == "numpy" else {a: torch.tensor(b, device=device) for a, b in v.items()}
        dev = "cpu" if backend == "numpy" else device
        out[label[backend]] = best(lambda: k.frobenius_norms(vals, "full"), repeat, dev)
        out[label[backend] + " (9 separate calls)"] = best(
            lambda: [k.frobenius_norm(vals, p, q, "full") for p in names for q in names], repeat, dev)
    k = sh.kernel("attention", "numpy", "mse")
    norms = k.frobenius_norms(v, "full")
    tv = {a: torch.tensor(b, device=device) for a, b in v.items()}
    loss = torch_loss(tv["X"], tv["Y"])

    def auto():
        H = torch.func.hessian(loss, argnums=(0, 1, 2))(tv["W_Q"], tv["W_K"], tv["W_V"])
        return {(p, q): float(H[i][j].norm()) for i, p in enumerate(names) for j, q in enumerate(names)}

    if not on_cpu:
        auto()      # warm-up: the first CUDA call pays for kernel loading
    ref, t_auto = timed(auto, device)
    err = max(abs(norms[b] - ref[b]) / ref[b] for b in ref)
    tk = min(out[label["numpy"]], out[label["torch"]])
    desc = ", ".join(f"{b} {t*1e3:.2f} ms" for b, t in out.items())
    print(f"Frobenius norms of all 9 full blocks, L={L} d_V=d_K={d}: {desc}; "
          f"dense torch.func.hessian + norms {t_auto:.2f} s")
    if on_cpu:
        print(f"  autograd/kernel = {t_auto/tk:.0f}x (target >= 1000), max rel. err {err:.1e} (target <= 1e-10)")
        return out, t_auto, err
    kt = sh.kernel("attention", "torch", "mse")
    got = kt.frobenius_norms(tv, "full")
    err_dev = max(abs(float(got[b]) - ref[b]) / ref[b] for b in ref)
    t_dev = out[label["torch"]]
    print(f"  kernel vs autograd on the same device ({device_label(device)}): autograd/kernel = "
          f"{t_auto/t_dev:.0f}x (target >= 1000), max rel. err torch kernel {err_dev:.1e}, "
          f"numpy kernel {err:.1e} (target <= 1e-10)")
    return out, t_auto, max(err, err_dev)


def peak_memory(L=16, d=32, device="cpu"):
    v = values(L, d, d)
    k = sh.kernel("attention", "numpy", "mse")
    k.hessian(v, "full")
    tracemalloc.start()
    H = k.hessian(v, "full")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    where = "" if device.type == "cpu" else "numpy (cpu) "
    print(f"peak memory of the {where}dense full-Hessian kernel (L={L} d={d}): {peak/2**20:.1f} MiB for a "
          f"{H.nbytes/2**20:.1f} MiB output -> {peak/H.nbytes:.2f}x (target <= 3)")
    return peak / H.nbytes


def generation_time(device="cpu"):
    t = time.perf_counter()
    files = codegen.render_all()
    dt = time.perf_counter() - t
    layers = sorted({path.split("/")[1][:-3] for path in files})
    where = "" if device.type == "cpu" else " (cpu)"
    print(f"rendering all generated modules{where} ({len(files)} files, layers: {', '.join(layers)}; "
          f"on demand only: {', '.join(sorted(codegen.ON_DEMAND))}): {dt:.1f} s (target < 60 s)")
    return dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    ap.add_argument("--no-generation", action="store_true",
                    help="skip timing the rendering of generated/ (CPU only, slow)")
    add_device_option(ap)
    a = ap.parse_args(argv)
    dev = check_device(a.device)
    torch.set_num_threads(a.threads)
    print(f"torch threads: {a.threads}")
    if dev.type != "cpu":
        print(f"device: {device_label(dev)} (torch kernels and autograd); NumPy parts on the CPU")
    if a.quick:
        dense_hessian(8, 8, 2, dev)
        hvp(16, 16, 8, 2, dev)
        frobenius(8, 8, 2, dev)
        peak_memory(8, 8, dev)
        return
    dense_hessian(device=dev)
    hvp(device=dev)
    frobenius(device=dev)
    peak_memory(device=dev)
    if not a.no_generation:
        generation_time(dev)


if __name__ == "__main__":
    main()

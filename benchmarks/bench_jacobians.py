"""Jacobian kernels (issue 5): ratios against torch.func.jacrev and against writing the output.

Run from the repository root:  python -m benchmarks.bench_jacobians   (add --quick for a smoke run)

Targets (issue 5): LayerNorm input Jacobian at L=64, d=128 and FFN Jacobian w.r.t. W_1 at
L=32, d=64, d_ff=256, torch float64: the compact/structured form ≥ 1000× faster than jacrev
of the dense Jacobian; the dense output ≤ 2× the time of writing an array of its size
(``torch.ones`` of the output shape).  Every time is the best of several repeats, all
measured in this run.  Kernel times are given twice: the generated function alone, and
through ``Kernel.jacobian`` (input validation, including LayerNorm's zero-variance check).
``--device cuda`` runs the torch kernels, ``torch.ones`` and jacrev on CUDA tensors (a
synchronize inside each timed region); the NumPy rows stay on the CPU and say so.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.func import jacrev

import symhess as sh

from .timing import add_device_option, best as _best, check_device, device_label

DEVICE = torch.device("cpu")      # set by main (--device)


def best(fn, repeat=5):
    """Minimum wall time of ``repeat`` calls (after one warm-up call), synchronized on DEVICE."""
    return _best(fn, repeat, DEVICE)


def ln_forward(X):
    """The forward model only: row-wise LayerNorm, ε = 0, no affine (jacrev differentiates it)."""
    M = X - X.mean(-1, keepdim=True)
    return M / torch.sqrt((M * M).mean(-1, keepdim=True))


def ffn_forward(X, W_2):
    def f(W_1):
        return torch.relu(X @ W_1) @ W_2
    return f


def row(name, t, ref=None, ref_name=""):
    extra = f"   {ref / t:10.1f}× faster than {ref_name}" if ref is not None else ""
    print(f"  {name:<46} {t * 1e3:10.3f} ms{extra}")


def layernorm(L, d, repeat, jac_repeat):
    torch.manual_seed(0)
    X = torch.randn(L, d, dtype=torch.float64).to(DEVICE)
    k = sh.kernel("layernorm", "torch", "mse")
    fns = k._fns
    print(f"LayerNorm input Jacobian, L={L}, d={d} (torch float64; dense {L*d}×{L*d}){_on()}")
    # the small compact kernels are timed first, before the large dense arrays churn memory
    t_c = best(lambda: k.jacobian({"X": X}, "X", compact=True), 4 * repeat)
    t_cf = best(lambda: fns[("jacobian_compact", "X")](X), 4 * repeat)
    t_jac = best(lambda: jacrev(ln_forward)(X), jac_repeat)
    t_d = best(lambda: k.jacobian({"X": X}, "X"), repeat)
    t_df = best(lambda: fns[("jacobian", "X")](X), repeat)
    t_ones = best(lambda: torch.ones(L * d, L * d, dtype=torch.float64, device=DEVICE), repeat)
    t_np_ones = best(lambda: np.ones((L * d, L * d)), repeat)
    kn = sh.kernel("layernorm", "numpy", "mse")
    Xn = X.cpu().numpy()
    t_dn = best(lambda: kn._fns[("jacobian", "X")](Xn), repeat)
    ref = jacrev(ln_forward)(X).reshape(L * d, L * d)
    err = float((k.jacobian({"X": X}, "X") - ref).norm() / ref.norm())
    row("torch.func.jacrev (dense)", t_jac)
    row("compact L×d×d, generated function", t_cf, t_jac, "jacrev")
    row("compact L×d×d, Kernel.jacobian (validated)", t_c, t_jac, "jacrev")
    row("torch.ones of the dense shape (write time)", t_ones)
    row("dense, generated function", t_df)
    row("dense, Kernel.jacobian (validated)", t_d)
    cpu = "" if DEVICE.type == "cpu" else " (cpu)"
    row(f"numpy{cpu}: np.ones of the dense shape", t_np_ones)
    row(f"numpy{cpu}: dense, generated function", t_dn)
    print(f"  dense / write time: torch {t_df / t_ones:.2f} (validated {t_d / t_ones:.2f}), "
          f"numpy {t_dn / t_np_ones:.2f}   [target ≤ 2]")
    print(f"  compact speed-up over jacrev{_same()}: {t_jac / t_cf:.0f}× (validated {t_jac / t_c:.0f}×)"
          f"   [target ≥ 1000]   rel. error of dense vs jacrev {err:.1e}")


def ffn(L, d, d_ff, repeat, jac_repeat):
    torch.manual_seed(1)
    X = torch.randn(L, d, dtype=torch.float64).to(DEVICE)
    W_1 = (torch.randn(d, d_ff, dtype=torch.float64) / d ** 0.5).to(DEVICE)
    W_2 = (torch.randn(d_ff, d, dtype=torch.float64) / d_ff ** 0.5).to(DEVICE)
    v = {"X": X, "W_1": W_1, "W_2": W_2}
    k = sh.kernel("ffn", "torch", "mse")
    fns = k._fns
    n_out, n_in = L * d, d * d_ff
    print(f"FFN Jacobian w.r.t. W_1, L={L}, d={d}, d_ff={d_ff} (torch float64; dense {n_out}×{n_in}){_on()}")
    f = ffn_forward(X, W_2)
    t_c = best(lambda: k.jacobian(v, "W_1", compact=True), 4 * repeat)
    t_cf = best(lambda: fns[("jacobian_compact", "W_1")](X[None], W_1, W_2), 4 * repeat)
    t_jac = best(lambda: jacrev(f)(W_1), jac_repeat)
    t_d = best(lambda: k.jacobian(v, "W_1"), repeat)
    t_df = best(lambda: fns[("jacobian", "W_1")](X[None], W_1, W_2), repeat)
    t_ones = best(lambda: torch.ones(n_out, n_in, dtype=torch.float64, device=DEVICE), repeat)
    ref = jacrev(f)(W_1).reshape(n_out, n_in)
    err = float((k.jacobian(v, "W_1") - ref).norm() / ref.norm())
    C = k.jacobian(v, "W_1", compact=True)
    sizes = " + ".join("×".join(str(s) for s in fac.shape) for fac in C.factors)
    row("torch.func.jacrev (dense)", t_jac)
    row("structured (factors), generated function", t_cf, t_jac, "jacrev")
    row("structured (factors), Kernel.jacobian", t_c, t_jac, "jacrev")
    row("torch.ones of the dense shape (write time)", t_ones)
    row("dense, generated function", t_df)
    row("dense, Kernel.jacobian (validated)", t_d)
    print(f"  factors: {sizes} (compact axes {C.axes} of {C.shape})")
    print(f"  dense / write time: {t_df / t_ones:.2f} (validated {t_d / t_ones:.2f})   [target ≤ 2]")
    print(f"  structured speed-up over jacrev{_same()}: {t_jac / t_cf:.0f}× (validated {t_jac / t_c:.0f}×)"
          f"   [target ≥ 1000]   rel. error of dense vs jacrev {err:.1e}")


def _on():
    """' on cuda:0 (…)' when not on the CPU (the CPU output is unchanged)."""
    return "" if DEVICE.type == "cpu" else f" on {device_label(DEVICE)}"


def _same():
    return "" if DEVICE.type == "cpu" else " (kernel vs autograd on the same device)"


def main(argv=None):
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke run)")
    add_device_option(ap)
    args = ap.parse_args(argv)
    DEVICE = check_device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.quick:
        layernorm(8, 16, 2, 1)
        ffn(4, 8, 16, 2, 1)
    else:
        layernorm(64, 128, 5, 2)
        ffn(32, 64, 256, 5, 2)


if __name__ == "__main__":
    main()

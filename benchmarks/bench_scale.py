"""Exact curvature at the sizes models are trained at, against what a user would run instead.

    python -m benchmarks.bench_scale [--layer attention|post_ln_block|pre_ln_block|modern_block]
                                     [--what hvp,diag,frob,fit]
                                     [--L 512] [--d 512] [--dk 64] [--dff 1024] [--batch 8]
                                     [--loss mse] [--probes 100] [--threads 1] [--device cpu]
                                     [--fit-kinds diag,frob,hvp] [--fit-max-L 512] [--no-retain]

Side by side in one process, float64, interleaved rounds (minimum of ``--rounds``):

* hvp — ``Kernel.hvp`` (stateless: validation, forward and product) against
  ``torch.func.jvp(grad(loss))``; a prepared state's ``hvp`` in a loop of 20 against 20
  ``jvp(grad)`` calls and against ``torch.func.linearize(grad)`` followed by 20 calls;
* diag — the exact diagonal of every parameter's block (``diagonals``: one pass for all
  parameters) and its trace against a ``--probes``-probe Hutchinson estimate (Rademacher
  probes, autograd HVPs), with the peak memory of each (tracemalloc for NumPy, the
  process's peak RSS growth otherwise);
* frob — ``frobenius_split`` of every block (‖H_o‖, ‖H_f‖, ‖H‖, exact) against a
  Hutchinson estimate with ``--probes`` probes per column block (one HVP and one
  Gauss–Newton product per probe);
* fit — the exact routines' cost exponents in L, d and B (log-log least squares over
  L = 64 … 512, d = 64 … 256, B = 1 … 8, the others at L = d = 128, B = 2; ``--fit-max-L``
  cuts the L grid), measured and of the planned flops (``symhess.runtime.cost``) side by side.

The torch reference forward is written out for each layer and checked against the kernel's
loss before anything is timed.  Freed memory is kept for reuse in the whole process, for both
sides (``retain_freed_memory``, as ``symhess experiment`` does; ``--no-retain``: glibc's
default, under which the exact side's large temporaries are page-faulted in afresh each time).
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torch.func import grad, jvp, linearize, vjp

import symhess as sh
from benchmarks.timing import add_memory_option, apply_memory_option, interleaved, peak_mb, timed
from symhess.runtime.cost import counting


# ----------------------------------------------------------------------------- references
def _ln(u, eps=0.0):
    mu = u.mean(-1, keepdim=True)
    c = u - mu
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps)


def _rms(u, eps=1e-6):
    return u * torch.rsqrt((u * u).mean(-1, keepdim=True) + eps)


def _attention(U, WQ, WK, WV):
    T = U @ WQ @ WK.T @ U.transpose(-1, -2) / math.sqrt(WQ.shape[1])
    return torch.softmax(T, -1) @ U @ WV


def rotary_constants(L, dk, device="cpu"):
    """C, S (L × d_K) and the rotate-half signed permutation R (d_K × d_K): q ∘ C + (q R) ∘ S
    rotates coordinate pairs (i, i + d_K/2) of token t by t θ_i, θ_i = 10000^(−2i/d_K)."""
    half = dk // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / dk)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * theta[None, :]
    C = torch.cat([ang.cos(), ang.cos()], -1)
    S = torch.cat([ang.sin(), ang.sin()], -1)
    R = torch.zeros(dk, dk, dtype=torch.float64)
    R[torch.arange(half) + half, torch.arange(half)] = -1.0
    R[torch.arange(half), torch.arange(half) + half] = 1.0
    return C.to(device), S.to(device), R.to(device)


def _rot(q, C, S, R):
    return q * C + (q @ R) * S


def forward(layer, params, X, consts=None):
    if layer == "attention":
        return _attention(X, *params)
    if layer == "modern_block":
        C, S, R = consts
        WQ1, WQ2, WK, WV, WO1, WO2, W1, W3, W2 = params
        N1 = _rms(X)
        K = _rot(N1 @ WK, C, S, R)
        V = N1 @ WV
        Y = X
        for WQ, WO in ((WQ1, WO1), (WQ2, WO2)):
            T = _rot(N1 @ WQ, C, S, R) @ K.transpose(-1, -2) / math.sqrt(WQ.shape[1])
            Y = Y + torch.softmax(T, -1) @ V @ WO
        N2 = _rms(Y)
        return Y + (torch.nn.functional.silu(N2 @ W1) * (N2 @ W3)) @ W2
    WQ, WK, WV, W1, W2 = params
    if layer == "pre_ln_block":
        Y = X + _attention(_ln(X), WQ, WK, WV)
        return Y + torch.relu(_ln(Y) @ W1) @ W2
    Y1 = _ln(X + _attention(X, WQ, WK, WV))
    return _ln(Y1 + torch.relu(Y1 @ W1) @ W2)


def loss_of_output(F, Y, loss):
    L, d = F.shape[-2:]
    if loss == "mse":
        return ((F - Y) ** 2).sum((-2, -1)).mean() / (L * d)
    return -(Y * torch.log_softmax(F, -1)).sum((-2, -1)).mean() / L


def problem(layer, L, d, dk, dff, B, loss, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    X = r(B, L, d)
    Y = r(B, L, d) if loss == "mse" else torch.softmax(r(B, L, d), -1)
    shapes, names = LAYOUTS[layer](d, dk, dff)
    params = tuple(r(*s) / math.sqrt(s[0]) for s in shapes)
    to = lambda t: t.to(device)
    values = {"X": to(X), "Y": to(Y), **{n: to(p) for n, p in zip(names, params)}}
    if layer == "modern_block":
        values.update(zip(("C", "S", "R"), rotary_constants(L, dk, device)))
    return values, tuple(to(p) for p in params), names


def _block_layout(d, dk, dff):
    return [(d, dk), (d, dk), (d, d), (d, dff), (dff, d)], ("W_Q", "W_K", "W_V", "W_1", "W_2")


def _modern_layout(d, dk, dff):
    """Two query heads of width d_K sharing one key and one value head of width d/2."""
    h = d // 2
    return ([(d, dk), (d, dk), (d, dk), (d, h), (h, d), (h, d), (d, dff), (d, dff), (dff, d)],
            ("W_Q1", "W_Q2", "W_K", "W_V", "W_O1", "W_O2", "W_1", "W_3", "W_2"))


# parameter shapes and names in each layer's declared order
LAYOUTS = {"attention": lambda d, dk, dff: ([(d, dk), (d, dk), (d, d)], ("W_Q", "W_K", "W_V")),
           "post_ln_block": _block_layout, "pre_ln_block": _block_layout,
           "modern_block": _modern_layout}


class Autograd:
    """Loss, HVP and Gauss–Newton products by torch.func on the written-out forward."""

    def __init__(self, layer, values, params, loss):
        self.layer, self.loss_name, self.params = layer, loss, params
        self.X, self.Y = values["X"], values["Y"]
        self.consts = tuple(values[n] for n in ("C", "S", "R")) if "R" in values else None
        self.grad = grad(self.loss)

    def loss(self, params):
        return loss_of_output(forward(self.layer, params, self.X, self.consts), self.Y, self.loss_name)

    def hvp(self, v):
        return jvp(self.grad, (self.params,), (v,))[1]

    def ggnvp(self, v):
        f = lambda ps: forward(self.layer, ps, self.X, self.consts)
        F, JV = jvp(f, (self.params,), (v,))
        gF = grad(lambda F_: loss_of_output(F_, self.Y, self.loss_name))
        _, HJV = jvp(gF, (F,), (JV,))
        _, back = vjp(f, self.params)
        return back(HJV)[0]


def split(flat, params):
    out, k = [], 0
    for p in params:
        out.append(flat[k:k + p.numel()].reshape(p.shape))
        k += p.numel()
    return tuple(out)


def rademacher(params, only=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randint(0, 2, p.shape, generator=g, dtype=torch.float64) * 2 - 1).to(p.device)
                 if only is None or i == only else torch.zeros_like(p) for i, p in enumerate(params))


# ----------------------------------------------------------------------------- measurements
def bench_hvp(k, values, ag, rounds, device):
    st = k.prepare(values)
    n = sum(st.numel(p) for p in st.PARAMS)
    v = torch.randn(n, dtype=torch.float64, device=device)
    vs = split(v, ag.params)
    ref = torch.cat([x.reshape(-1) for x in ag.hvp(vs)])
    err = float((st.hvp(v) - ref).norm() / ref.norm())

    def linearized():
        _, fn = linearize(ag.grad, ag.params)
        for _ in range(20):
            fn(vs)

    def prepared20():
        s = k.prepare(values)
        for _ in range(20):
            s.hvp(v)

    t = interleaved({"symhess hvp": lambda: k.hvp(values, v),
                     "jvp(grad)": lambda: ag.hvp(vs),
                     "prepared, 20 hvp": prepared20,
                     "20 jvp(grad)": lambda: [ag.hvp(vs) for _ in range(20)],
                     "linearize + 20 calls": linearized}, rounds=rounds, device=device)
    print(f"  rel. error vs jvp(grad): {err:.1e}")
    print(f"  stateless hvp {t['symhess hvp']:.3f} s  vs jvp(grad) {t['jvp(grad)']:.3f} s  "
          f"→ {t['jvp(grad)'] / t['symhess hvp']:.2f}×")
    print(f"  prepare + 20 hvp {t['prepared, 20 hvp']:.3f} s  vs 20 jvp(grad) {t['20 jvp(grad)']:.3f} s "
          f"→ {t['20 jvp(grad)'] / t['prepared, 20 hvp']:.2f}×;  vs linearize + 20 calls "
          f"{t['linearize + 20 calls']:.3f} s → {t['linearize + 20 calls'] / t['prepared, 20 hvp']:.2f}×")


def bench_diag(k, values, ag, probes, device):
    def exact():
        st = k.prepare(values)
        return {p: (d, st.trace(p)) for p, d in st.diagonals().items()}

    def hutchinson():
        acc = [torch.zeros_like(p) for p in ag.params]
        for s in range(probes):
            v = rademacher(ag.params, seed=s)
            hv = ag.hvp(v)
            for a, x, y in zip(acc, v, hv):
                a += x * y
        return [a / probes for a in acc]

    (ex, t_ex), mb_ex = peak_mb(lambda: timed(exact, device))
    (hu, t_hu), mb_hu = peak_mb(lambda: timed(hutchinson, device))
    st = k.prepare(values)
    names = st.PARAMS
    errs = []
    for p, est in zip(names, hu):
        d_ex = ex[p][0].reshape(est.shape)
        errs.append(float((est - d_ex).norm() / d_ex.norm()))
    print(f"  exact diag + trace of {len(names)} blocks {t_ex:.2f} s (peak +{mb_ex:.0f} MB)  vs "
          f"{probes}-probe Hutchinson {t_hu:.2f} s (peak +{mb_hu:.0f} MB) → {t_hu / t_ex:.1f}×")
    print(f"  Hutchinson diagonal error per block: " + ", ".join(f"{p} {e:.0%}" for p, e in zip(names, errs)))


def bench_frob(k, values, ag, probes, device):
    def exact():
        st = k.prepare(values)
        return {(p, q): st.frobenius_split(p, q) for p in st.PARAMS for q in st.PARAMS}

    def hutchinson():
        out = {}
        names = k.params
        for j, q in enumerate(names):
            acc = {p: [0.0, 0.0, 0.0] for p in names}
            for s in range(probes):
                v = rademacher(ag.params, only=j, seed=s)
                hv, gv = ag.hvp(v), ag.ggnvp(v)
                for i, p in enumerate(names):
                    acc[p][0] += float((gv[i] ** 2).sum())
                    acc[p][1] += float(((hv[i] - gv[i]) ** 2).sum())
                    acc[p][2] += float((hv[i] ** 2).sum())
            for p in names:
                out[(p, q)] = {part: math.sqrt(x / probes) for part, x in
                               zip(("outer", "functional", "full"), acc[p])}
        return out

    (ex, t_ex), mb_ex = peak_mb(lambda: timed(exact, device))
    hu, t_hu = timed(hutchinson, device)
    worst = max(abs(hu[b]["full"] - ex[b]["full"]) / max(ex[b]["full"], 1e-300) for b in ex)
    print(f"  exact frobenius_split of {len(ex)} blocks {t_ex:.2f} s (peak +{mb_ex:.0f} MB)  vs "
          f"{probes}-probe Hutchinson {t_hu:.2f} s → {t_hu / t_ex:.1f}×  (estimate's worst error "
          f"{worst:.1%})")


GRIDS = {"L": [64, 128, 256, 512], "d": [64, 128, 256], "B": [1, 2, 4, 8]}
BASE = {"L": 128, "d": 128, "B": 2}


def fit(args, device):
    """Cost exponents of diag+trace and frobenius_split in L, d and B."""
    grids = dict(GRIDS, L=[x for x in GRIDS["L"] if x <= args.fit_max_L])
    base = BASE
    for kind in args.fit_kinds.split(","):
        for var, grid in grids.items():
            times, flops = [], []
            for x in grid:
                sz = dict(base, **{var: x})
                values, params, _ = problem(args.layer, sz["L"], sz["d"], min(args.dk, sz["d"]),
                                            args.dff, sz["B"], args.loss, device)
                k = sh.kernel(args.layer, "torch", args.loss)
                if kind == "diag":
                    fn = lambda: [(d, s.trace(p)) for s in [k.prepare(values)]
                                  for p, d in s.diagonals().items()]
                elif kind == "frob":
                    fn = lambda: [s.frobenius_split(p, q) for s in [k.prepare(values)]
                                  for p in s.PARAMS for q in s.PARAMS]
                else:
                    n = sum(p.numel() for p in params)
                    v = torch.randn(n, dtype=torch.float64, device=device)
                    fn = lambda: k.hvp(values, v)
                with counting() as c:
                    fn()                               # plans for these sizes
                flops.append(c.flops)
                times.append(min(timed(fn, device)[1] for _ in range(2)))
            slope = np.polyfit(np.log(grid), np.log(times), 1)[0]
            planned = np.polyfit(np.log(grid), np.log(flops), 1)[0]
            print(f"  {kind:5s} in {var}: measured exponent {slope:.2f}, planned flops' {planned:.2f}  "
                  f"({', '.join(f'{t:.3g}' for t in times)} s; "
                  f"{', '.join(f'{f:.2g}' for f in flops)} flops)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", default="attention", choices=sorted(LAYOUTS))
    ap.add_argument("--what", default="hvp,diag,frob")
    ap.add_argument("--L", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--dff", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--loss", default="mse", choices=["mse", "ce"])
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fit-kinds", default="diag,frob,hvp", help="the routines the fit times")
    ap.add_argument("--fit-max-L", type=int, default=512, help="the largest L of the fit's grid")
    add_memory_option(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{args.layer}, {args.loss}: L={args.L}, d={args.d}, d_K={args.dk}"
          + (f", d_ff={args.dff}" if args.layer != "attention" else "")
          + f", B={args.batch}, {args.threads} thread(s), {device}, float64; "
          + apply_memory_option(args))
    values, params, names = problem(args.layer, args.L, args.d, args.dk, args.dff, args.batch,
                                    args.loss, device)
    k = sh.kernel(args.layer, "torch", args.loss)
    ag = Autograd(args.layer, values, params, args.loss)
    want = float(ag.loss(params))
    got = float(k.loss(values))
    assert abs(got - want) <= 1e-10 * abs(want), (got, want)
    what = args.what.split(",")
    if "hvp" in what:
        print("hvp (full part):")
        bench_hvp(k, values, ag, args.rounds, device)
    if "diag" in what:
        print("diagonal and trace (full part), every parameter:")
        bench_diag(k, values, ag, args.probes, device)
    if "frob" in what:
        print("Frobenius norms of every block, outer / functional / full:")
        bench_frob(k, values, ag, args.probes, device)
    if "fit" in what:
        print("cost exponents (torch kernels):")
        fit(args, device)


if __name__ == "__main__":
    main()

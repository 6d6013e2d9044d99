"""Cost of the default scaling sweep (paper config): generated kernel vs dense autograd, one run.

    python benchmarks/bench_experiments.py [--d-model 128 --d-mlp 512 --batch 64 --cols 8]
    python -m benchmarks.bench_experiments

Every route computes the exact ‖H‖_F, ‖H_o‖_F, ‖H_f‖_F of the W_Q and W_V blocks of the
batch-mean loss, as ``symhess experiment scaling`` needs them per (σ, seed):
  * kernel: ``Experiment.frobenius_norms`` (the generated ``frobenius_split`` routine, no
    block built), timed in full per (σ, seed) after a warm-up call that renders the routine;
  * autograd: columns H e_i = ``jvp(grad(loss))`` and H_o e_i = Jᵀ ∇²ℓ J e_i (Gauss–Newton) of
    an independent torch forward, vmapped over batch and columns, H_f = H − H_o; timed on
    ``--cols`` columns and extrapolated to numel(W_Q) + numel(W_V) columns (the dense blocks,
    2 × 16384² float64 = 4.3 GB, are never stored: the norms are reduced column by column);
  * columns: the engine's old route ``Experiment.frobenius_norms_by_columns`` (matrix-view
    block HVPs through the interpreter), timed on ``--cols`` columns and extrapolated.
Sweep totals are per (σ, seed) × ``--points`` (default 20 σ × 3 seeds = 60).  A small
configuration checks that the kernel norms equal the autograd dense-block norms.
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from symhess.cli.experiments import BLOCKS, PARTS, Config, Experiment  # noqa: E402

N_ANSWER = 6


def forward(v, x_o):
    """Z of addition_block (softmax, no LN), written independently of the declaration."""
    X = x_o @ v["W_E"] + v["P"]
    T = X @ v["W_Q"] @ v["W_K"].T @ X.T / math.sqrt(v["W_Q"].shape[1])
    L = T.shape[0]
    A = torch.softmax(T.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf), 1)
    X1 = X + A @ X @ v["W_V"] @ v["W_O"]
    return (X1 + torch.relu(X1 @ v["W_1"]) @ v["W_2"]) @ v["W_U"]


def ce(z, y):
    """ℓ = −(1/6) Σ Y ∘ log softmax(Z) (targets only on the answer rows)."""
    return -(y * torch.log_softmax(z, 1)).sum() / N_ANSWER


def autograd_columns(vals, p, O, Y):
    """f(dirs) → (mean_b H_b dirs, mean_b Jᵀ∇²ℓ J dirs), both (n, r, c), by torch.func."""
    func = torch.func

    def z_of(w, o):
        return forward(dict(vals, **{p: w}), o)

    def h_col(v, o, y):
        return func.jvp(lambda w: func.grad(lambda u: ce(z_of(u, o), y))(w), (vals[p],), (v,))[1]

    def ggn_col(v, o, y):
        z, dz = func.jvp(lambda w: z_of(w, o), (vals[p],), (v,))
        hz = func.jvp(lambda s: func.grad(ce)(s, y), (z,), (dz,))[1]
        return func.vjp(lambda w: z_of(w, o), vals[p])[1](hz)[0]

    def batched(col):
        return func.vmap(func.vmap(col, in_dims=(0, None, None)), in_dims=(None, 0, 0))

    h, g = batched(h_col), batched(ggn_col)
    return lambda dirs: (h(dirs, O, Y).mean(0), g(dirs, O, Y).mean(0))


def basis(shape, k, dtype):
    """The first k basis directions e_i of a (r, c) parameter, as a (k, r, c) tensor."""
    r, c = shape
    return torch.eye(r * c, dtype=dtype)[:k].reshape(k, r, c)


def best(fn, repeats):
    """(wall s, process CPU s) of the fastest of ``repeats`` calls of fn(); CPU time is
    reported too because the shared machine's load inflates wall time unevenly."""
    out = []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        out.append((time.perf_counter() - t, time.process_time() - c))
    return min(out)


def mean2(pairs):
    """Component-wise mean of (wall, cpu) pairs."""
    return tuple(sum(x) / len(pairs) for x in zip(*pairs))


def kernel_route(exp, sigmas, seed, repeats):
    """({p: render s}, {p: first-call s}, {p: steady s per (σ, seed), mean over σ})."""
    render, first = {}, {}
    for p in BLOCKS:
        t = time.perf_counter()
        # looking the routine up renders it (in memory, once); timed apart from its first call
        exp.kernel()._fns[("frobenius_split", p, p)]
        render[p] = time.perf_counter() - t
        t = time.perf_counter()
        exp.frobenius_norms(p, sigmas[0], seed)
        first[p] = time.perf_counter() - t
    steady = {p: mean2([best(lambda: exp.frobenius_norms(p, s, seed), repeats) for s in sigmas])
              for p in BLOCKS}
    return render, first, steady


def autograd_route(exp, sigma, seed, cols, repeats):
    """{p: s per column (H and H_o)} on the first ``cols`` columns."""
    vals, O, Y, _ = exp.tensors(sigma, seed)
    out = {}
    for p in BLOCKS:
        f = autograd_columns(vals, p, O, Y)
        dirs = basis(vals[p].shape, cols, vals[p].dtype)
        f(dirs[:2])                                              # warm-up
        out[p] = tuple(x / cols for x in best(lambda: f(dirs), repeats))
    return out


def column_route(exp, sigma, seed, cols, repeats):
    """{p: s per column of every non-Zero part} of the engine's interpreter column route."""
    vals, O, Y, env = exp.tensors(sigma, seed)
    out = {}
    for p in BLOCKS:
        dirs = basis(vals[p].shape, cols, vals[p].dtype)
        parts = [q for q in ("outer", "functional") if not exp.columns_for(p, q).is_zero]
        for q in parts:
            exp.columns_for(p, q).columns(vals, O, Y, dirs[:2], env)   # warm-up
        run = lambda: [exp.columns_for(p, q).columns(vals, O, Y, dirs, env) for q in parts]  # noqa: E731
        out[p] = tuple(x / cols for x in best(run, repeats))
    return out


def agreement(d_model, d_mlp, batch, sigma, seed):
    """max over blocks and parts of |kernel − autograd| / |autograd| of the Frobenius norms."""
    exp = Experiment(Config(d_model=d_model, d_head=d_model, d_mlp=d_mlp, batch=batch))
    vals, O, Y, _ = exp.tensors(sigma, seed)
    worst, rows = 0.0, []
    for p in BLOCKS:
        n = vals[p].numel()
        H, Ho = autograd_columns(vals, p, O, Y)(basis(vals[p].shape, n, vals[p].dtype))
        ref = {"full": H.norm().item(), "outer": Ho.norm().item(), "functional": (H - Ho).norm().item()}
        got = exp.frobenius_norms(p, sigma, seed)
        for part in PARTS:
            # H_f(W_V) is the structural Zero: the kernel returns 0, autograd only round-off
            scale = ref[part] if ref[part] > 1e-12 * ref["full"] else ref["full"]
            err = abs(got[part] - ref[part]) / scale
            worst = max(worst, err)
            rows.append(f"    {p} {part:>10}: kernel {got[part]:.12e}  autograd {ref[part]:.12e}  rel {err:.1e}")
    return worst, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-mlp", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cols", type=int, default=8, help="columns timed per block (dense routes)")
    ap.add_argument("--sigmas", default="0.01,0.1,1", help="σ values timed for the kernel route")
    ap.add_argument("--points", type=int, default=60, help="(σ, seed) points of the sweep (20 × 3)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check", default="16,64,4", help="d_model,d_mlp,batch of the agreement check")
    a = ap.parse_args()
    sigmas = [float(s) for s in a.sigmas.split(",")]
    cfg = Config(d_model=a.d_model, d_head=a.d_model, d_mlp=a.d_mlp, batch=a.batch, chunk=a.cols)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, float64; "
          f"load average {os.getloadavg()[0]:.2f} (other jobs share the machine: see the CPU ratios)")
    print(f"config: softmax, no LN, d_model = d_head = {a.d_model}, d_mlp = {a.d_mlp}, batch {a.batch}, "
          f"L = 18; sweep of {a.points} (σ, seed) points")

    t = time.perf_counter()
    exp = Experiment(cfg)
    print(f"Experiment(cfg): {time.perf_counter() - t:.1f} s (the derivation is lazy: its cost is in the render)")
    render, first, steady = kernel_route(exp, sigmas, 0, a.repeats)
    for p in BLOCKS:
        print(f"kernel {p}: render frobenius_split {render[p]:.1f} s, first call {first[p]:.2f} s, "
              f"then {steady[p][0]:.2f} s per (σ, seed) (CPU {steady[p][1]:.2f} s)")
    t_kernel = tuple(sum(steady[p][i] for p in BLOCKS) for i in (0, 1))
    print(f"kernel: per (σ, seed) {t_kernel[0]:.2f} s (W_Q + W_V, mean over σ in {sigmas}, best of {a.repeats})")

    n = {p: exp.tensors(0.1, 0)[0][p].numel() for p in BLOCKS}
    t_ag = autograd_route(exp, sigmas[len(sigmas) // 2], 0, a.cols, a.repeats)
    t_col = column_route(exp, sigmas[len(sigmas) // 2], 0, a.cols, a.repeats)
    for p in BLOCKS:
        print(f"{p} ({n[p]} columns): autograd H + H_o {t_ag[p][0] * 1e3:8.1f} ms/column, "
              f"engine columns {t_col[p][0] * 1e3:8.1f} ms/column  (timed on {a.cols})")
    per = {"kernel frobenius_split": t_kernel,
           "autograd jvp(grad) + GGN columns": tuple(sum(t_ag[p][i] * n[p] for p in BLOCKS) for i in (0, 1)),
           "engine interpreter columns": tuple(sum(t_col[p][i] * n[p] for p in BLOCKS) for i in (0, 1))}
    print(f"{'route':>34} {'per (σ, seed)':>14} {'sweep':>10} {'/ kernel':>9} {'CPU / kernel CPU':>17}")
    for name, (s, c) in per.items():
        sweep = s * a.points
        shown = f"{sweep:7.0f} s" if sweep < 3600 else f"{sweep / 3600:7.1f} h"
        print(f"{name:>34} {s:12.2f} s {shown:>10} {s / t_kernel[0]:8.0f}× {c / t_kernel[1]:16.0f}×")

    d, m, b = (int(x) for x in a.check.split(","))
    worst, rows = agreement(d, m, b, 0.3, 0)
    print(f"agreement at d_model = d_head = {d}, d_mlp = {m}, batch {b}, σ = 0.3 "
          f"(kernel vs autograd dense-block norms):")
    print("\n".join(rows))
    print(f"  max rel. error {worst:.1e}  [{'ok' if worst <= 1e-10 else 'FAIL'}: ≤ 1e-10]")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if worst <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Softmax derivatives where the softmax saturates, against mpmath references.

When a softmax row saturates (one probability p_* → 1, the others of size δ ≪ 1), the
textbook forms of its derivatives cancel: e_* − Σ_k p_k e_k and p_* − p_*² are differences
of O(1) numbers whose results are O(δ).  The interpreter evaluates the softmax nodes in a
form without that cancellation (symhess/expr/evaluate.py, module docstring).  These tests use rows
saturated to δ ≈ 1e-20 and attention at input scale σ = 30, where the textbook forms are
wrong by 85 % (nodes) and 170-720 % (blocks), and require the float64 accuracy autograd reaches.
"""
from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest
import torch

import symhess as sh
from symhess import expr as E
from symhess.expr.evaluate import evaluate
from symhess.calculus.verify import autograd_blocks, random_values, relative_error

def _saturated_logits(rows, cols, causal, seed=1):
    """Logits whose every row has one entry ≈ 50 above the others (δ ≈ 1e-21), among the
    entries the causal mask keeps."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((rows, cols))
    top = rng.integers(0, cols, rows)
    if causal:
        top = np.minimum(top, np.arange(rows))
    t[np.arange(rows), top] += 50.0
    return t


def _reference(t, e, f, causal):
    """SoftmaxDiff, SoftmaxDiff2 and the SoftmaxJac/SoftmaxHess matrices at 60 digits, from
    the textbook forms (exact enough at that precision)."""
    mp.mp.dps = 60
    rows, cols = t.shape
    diff, diff2 = np.zeros((rows, cols)), np.zeros((rows, cols))
    jac, hess = np.zeros((rows * cols,) * 2), np.zeros((rows * cols,) * 2)
    for i in range(rows):
        keep = [j for j in range(cols) if not causal or j <= i]
        z = [mp.exp(mp.mpf(t[i, j])) if j in keep else mp.mpf(0) for j in range(cols)]
        p = [x / sum(z) for x in z]
        ec = [mp.mpf(e[i, j]) - sum(p[k] * mp.mpf(e[i, k]) for k in range(cols)) for j in range(cols)]
        fc = [mp.mpf(f[i, j]) - sum(p[k] * mp.mpf(f[i, k]) for k in range(cols)) for j in range(cols)]
        g = [ec[j] * fc[j] for j in range(cols)]
        g_mean = sum(p[k] * g[k] for k in range(cols))
        u = [p[j] * ec[j] for j in range(cols)]
        for j in range(cols):
            diff[i, j] = float(u[j])
            diff2[i, j] = float(p[j] * (g[j] - g_mean))
            for k in range(cols):
                jac[i * cols + j, i * cols + k] = float((p[j] if j == k else 0) - p[j] * p[k])
                hess[i * cols + j, i * cols + k] = float((u[j] if j == k else 0) - u[j] * p[k] - p[j] * u[k])
    return {"diff": diff, "diff2": diff2, "jac": jac, "hess": hess}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_nodes_are_accurate_where_softmax_saturates(backend, causal):
    """Every softmax node within 1e-13 of the reference (the textbook forms: errors ~1e4)."""
    m, k = E.dims("m k")
    shape = (m, m) if causal else (m, k)
    T, Ev, Fv = (E.matrix(name, *shape) for name in ("T", "E", "F"))
    A = E.softmax_rows(T, causal=causal)
    nodes = {"diff": E.softmax_diff(A, Ev), "diff2": E.softmax_diff2(A, Ev, Fv),
             "jac": E.SoftmaxJac(A), "hess": E.SoftmaxHess(A, Ev)}
    t = _saturated_logits(5, 5 if causal else 6, causal)
    rng = np.random.default_rng(2)
    e, f = rng.standard_normal(t.shape), rng.standard_normal(t.shape)
    ref = _reference(t, e, f, causal)
    for name, node in nodes.items():
        got = np.asarray(evaluate(node, {"T": t, "E": e, "F": f}, backend=backend))
        err = np.linalg.norm(got - ref[name]) / np.linalg.norm(ref[name])
        assert err < 1e-13, (name, err)


# ----------------------------------------------------------------------------- attention blocks
NAMES = ("W_Q", "W_K", "W_V")


def _mp_loss(values, loss, causal):
    """θ ↦ ℓ at 200 digits, θ the entries of W_Q, W_K, W_V (row-major, in that order)."""
    X = mp.matrix(values["X"].tolist())
    Y = mp.matrix(values["Y"].tolist())
    n, d_V = values["X"].shape
    d_K = values["W_Q"].shape[1]
    shapes = [values[p].shape for p in NAMES]
    c = 1 / mp.sqrt(d_K)

    def unpack(theta):
        out, i = [], 0
        for r, k in shapes:
            out.append(mp.matrix([[theta[i + a * k + b] for b in range(k)] for a in range(r)]))
            i += r * k
        return out

    def output(theta):
        W_Q, W_K, W_V = unpack(theta)
        T = c * (X * W_Q * W_K.T * X.T)
        A = mp.matrix(n, n)
        for i in range(n):
            keep = [j for j in range(n) if not causal or j <= i]
            top = max(T[i, j] for j in keep)
            z = {j: mp.exp(T[i, j] - top) for j in keep}
            s = sum(z.values())
            for j in keep:
                A[i, j] = z[j] / s
        return A * X * W_V

    def ell(F):
        if loss == "mse":
            return sum((F[i, j] - Y[i, j]) ** 2 for i in range(n) for j in range(d_V)) / (n * d_V)
        total = 0
        for i in range(n):
            top = max(F[i, j] for j in range(d_V))
            lse = top + mp.log(sum(mp.exp(F[i, j] - top) for j in range(d_V)))
            total += sum(Y[i, j] * (F[i, j] - lse) for j in range(d_V))
        return -total / n

    return output, ell


def _mp_blocks(values, loss, causal):
    """Full, outer and functional Hessians by central differences at 200 digits (h = 1e-60:
    truncation ~1e-120, rounding ~1e-80, far below the blocks' ~1e-36 … 1e-3)."""
    mp.mp.dps = 200
    output, ell = _mp_loss(values, loss, causal)
    theta = [mp.mpf(float(v)) for p in NAMES for v in values[p].ravel()]
    n = len(theta)
    h = mp.mpf(10) ** -60

    def at(*shifts):
        t = list(theta)
        for i, s in shifts:
            t[i] += s
        return t

    f = lambda t: ell(output(t))  # noqa: E731
    H = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            H[i][j] = H[j][i] = (f(at((i, h), (j, h))) - f(at((i, h), (j, -h)))
                                 - f(at((i, -h), (j, h))) + f(at((i, -h), (j, -h)))) / (4 * h * h)
    F0 = output(theta)
    r, k = F0.rows, F0.cols
    J = mp.matrix(r * k, n)
    for i in range(n):
        Fp, Fm = output(at((i, h))), output(at((i, -h)))
        for a in range(r * k):
            J[a, i] = (Fp[a // k, a % k] - Fm[a // k, a % k]) / (2 * h)
    flat = [F0[a // k, a % k] for a in range(r * k)]

    def ell_flat(v):
        return ell(mp.matrix([[v[a * k + b] for b in range(k)] for a in range(r)]))

    Hl = mp.matrix(r * k, r * k)
    for a in range(r * k):
        for b in range(a, r * k):
            def g(sa, sb):
                v = list(flat)
                v[a] += sa
                v[b] += sb
                return ell_flat(v)
            Hl[a, b] = Hl[b, a] = (g(h, h) - g(h, -h) - g(-h, h) + g(-h, -h)) / (4 * h * h)
    Ho = J.T * Hl * J
    full = np.array([[float(H[i][j]) for j in range(n)] for i in range(n)])
    outer = np.array([[float(Ho[i, j]) for j in range(n)] for i in range(n)])
    functional = np.array([[float(H[i][j] - Ho[i, j]) for j in range(n)] for i in range(n)])
    edges = np.cumsum([0] + [values[p].size for p in NAMES])
    out = {}
    for a, p in enumerate(NAMES):
        for b, q in enumerate(NAMES):
            sl = (slice(edges[a], edges[a + 1]), slice(edges[b], edges[b + 1]))
            out[(p, q, "full")] = full[sl]
            out[(p, q, "outer")] = outer[sl]
            out[(p, q, "functional")] = functional[sl]
    return out


@pytest.mark.parametrize("loss, causal, seed", [("mse", False, 0), pytest.param("ce", False, 1, marks=pytest.mark.slow),
                                                ("mse", True, 4)])
def test_attention_blocks_at_sigma_30_match_a_200_digit_reference(loss, causal, seed):
    """At σ = 30 the W_Q and W_K blocks are ~1e-30 … 1e-70 of the W_V block; every block is
    within 1e-12 of the reference, as autograd is."""
    d = sh.derive(sh.layer("attention", causal=causal), loss)
    values = random_values(d, seed=seed, sizes={"L": 4, "d_V": 3, "d_K": 2})
    values["X"] = values["X"] * 30.0
    ref = _mp_blocks(values, loss, causal)
    auto = autograd_blocks(d, values)
    for p in NAMES:
        for q in NAMES:
            scale = max(np.linalg.norm(ref[(p, q, part)]) for part in ("outer", "functional", "full"))
            for part in ("outer", "functional", "full"):
                got = d.block(p, q, part).evaluate(values)
                err = relative_error(got, ref[(p, q, part)], scale)
                ag = relative_error(auto[(p, q, part)], ref[(p, q, part)], scale)
                assert err < 1e-12, (p, q, part, err, ag)
                assert err < 100 * max(ag, 1e-15), (p, q, part, err, ag)
    torch_got = d.block("W_Q", "W_K", "functional").evaluate(
        {k: torch.as_tensor(v) for k, v in values.items()}, backend="torch")
    scale = np.linalg.norm(ref[("W_Q", "W_K", "functional")])
    assert relative_error(torch_got.numpy(), ref[("W_Q", "W_K", "functional")], scale) < 1e-12


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_kernels_warn_where_softmax_saturates(backend):
    """The kernels use the textbook forms; rows within √ε of one-hot raise SaturationWarning,
    ordinary rows (and rows that are exactly one-hot, as the first causal row) do not."""
    import warnings
    k = sh.kernel("attention", backend, "mse")
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=3, sizes={"L": 4, "d_V": 3, "d_K": 2})
    conv = (lambda v: torch.as_tensor(v)) if backend == "torch" else (lambda v: v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.hvp({n: conv(v) for n, v in values.items()}, conv(np.ones(sum(values[p].size for p in NAMES))))
        k.prepare({n: conv(v) for n, v in values.items()})
    # scores 1e3 apart in one entry per row: 1 − max a ≈ e^{-22} ≈ 3e-10 < √ε
    t = _saturated_logits(4, 4, False)
    ops = __import__(f"symhess.runtime.{backend}_ops", fromlist=["softmax_rows"])
    with pytest.warns(sh.SaturationWarning):
        ops.softmax_rows(conv(t * 0.45))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.softmax_rows(conv(_saturated_logits(4, 4, True) * 0.0 + np.triu(np.ones((4, 4)), 1)), causal=True)

"""Every kernel method on random declarations, against torch autograd (float64).

Hypothesis draws a well-shaped layer from the documented operations (products, Hadamard
products, sums with residuals, transposes, entrywise functions, row softmax, Kronecker
products) over one input X (L × d) and 1–3 parameters declared in a random order, a loss
and a batch of 1–3 sequences.  The declaration is derived, its kernels rendered for both
backends, and every method — hessian (each part), hessian_block, hvp, diag, trace,
frobenius_norm, frobenius_split, jacobian — is compared with reverse-over-reverse autograd
of the forward declaration, relative to the Hessian's norm.

CI runs the seeded profile (25 examples); ``HYPOTHESIS_PROFILE=symhess-long`` runs 300.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.func import jacrev

import symhess as sh
from symhess import expr as E
from symhess.expr.evaluate import evaluate
from symhess.calculus.verify import autograd_blocks, random_values
from symhess.runtime import contract, gram

TOL = 1e-10
L, D, H = E.dims("L d h")
SIZES = {"L": 3, "d": 4, "h": 2}
FUNCTIONS = ("tanh", "sigmoid", "square", "gelu", "gelu_tanh", "silu")
SHAPES = ((L, D), (L, H), (D, H), (H, D), (L, L), (D, D))


class _Builder:
    """Draws an expression of a given shape; parameters are made on demand (at most 3)."""

    def __init__(self, draw):
        self.draw, self.params, self.softmaxes = draw, {}, 0
        self.X = E.matrix("X", L, D)

    def param(self, rows, cols):
        key = (rows, cols)
        if key not in self.params and len(self.params) < 3:
            self.params[key] = E.param(f"W_{len(self.params) + 1}", rows, cols)
        return self.params.get(key)

    def leaf(self, rows, cols):
        options = []
        if (rows, cols) == (L, D):
            options.append(self.X)
        if (rows, cols) == (D, L):
            options.append(self.X.T)
        p = self.param(rows, cols)
        if p is not None:
            options += [p, p]
        if not options:
            return None
        return self.draw(st.sampled_from(options))

    def expr(self, rows, cols, depth):
        kinds = ["leaf"] if depth == 0 else \
            ["leaf", "matmul", "matmul", "hadamard", "fn", "softmax", "add", "transpose"]
        for _ in range(8):
            kind = self.draw(st.sampled_from(kinds))
            out = getattr(self, "_" + kind)(rows, cols, depth)
            if out is not None:
                return out
        return self._matmul(rows, cols, depth) if depth > 0 else None

    def _leaf(self, rows, cols, depth):
        return self.leaf(rows, cols)

    def _matmul(self, rows, cols, depth):
        mid = self.draw(st.sampled_from((L, D, H)))
        a = self.expr(rows, mid, depth - 1)
        b = self.expr(mid, cols, depth - 1)
        return None if a is None or b is None else a @ b

    def _hadamard(self, rows, cols, depth):
        a, b = self.expr(rows, cols, depth - 1), self.expr(rows, cols, depth - 1)
        return None if a is None or b is None else E.hadamard(a, b)

    def _fn(self, rows, cols, depth):
        a = self.expr(rows, cols, depth - 1)
        return None if a is None else E.elementwise(self.draw(st.sampled_from(FUNCTIONS)), a)

    def _softmax(self, rows, cols, depth):
        if self.softmaxes >= 2:
            return None
        self.softmaxes += 1
        a = self.expr(rows, cols, depth - 1)
        return None if a is None else E.softmax_rows(a)

    def _add(self, rows, cols, depth):
        a, b = self.expr(rows, cols, depth - 1), self.expr(rows, cols, depth - 1)
        return None if a is None or b is None else a + b

    def _transpose(self, rows, cols, depth):
        a = self.expr(cols, rows, depth - 1)
        return None if a is None else a.T


@st.composite
def declarations(draw):
    """(layer, loss, batch size, seed)."""
    b = _Builder(draw)
    rows, cols = draw(st.sampled_from(SHAPES[:3]))
    F = b.expr(rows, cols, draw(st.integers(1, 3)))
    if F is None or not any(p in F.free_vars for p in b.params.values()):
        F = b.X @ E.param("W_0", D, D)
    if draw(st.booleans()) and draw(st.booleans()):        # now and then a Kronecker factor
        G = b.expr(H, H, 1)
        if G is not None:
            F = E.kron(F, G)
    params = sorted((v for v in F.free_vars if v.role == "param"), key=lambda v: v.name)
    order = draw(st.permutations(params))
    lay = sh.Layer("random", F, params=tuple(order), inputs=(b.X,))
    return lay, draw(st.sampled_from(("mse", "ce"))), draw(st.integers(1, 3)), draw(st.integers(0, 99))


def _batch(d, n, seed):
    seqs = [random_values(d, seed=seed + s, sizes=SIZES) for s in range(n)]
    vals = {k: (np.stack([s[k] for s in seqs]) if k in ("X", "Y") else seqs[0][k]) for k in seqs[0]}
    return vals, [{k: (s[k] if k in ("X", "Y") else vals[k]) for k in s} for s in seqs]


def _np(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _check(k, vals, seqs, d, backend, rng):
    names = d.layer.param_names
    refs = [autograd_blocks(d, s) for s in seqs]
    ref = {key: np.mean([r[key] for r in refs], axis=0) for key in refs[0]}
    full = {part: np.block([[ref[(p, q, part)] for q in names] for p in names])
            for part in ("outer", "functional", "full")}
    scale = max(np.linalg.norm(full["full"]), 1e-300)
    conv = (lambda a: torch.tensor(a)) if backend == "torch" else (lambda a: a)
    V = {n: conv(v) for n, v in vals.items()}
    st_ = k.prepare(V)

    def close(got, want, what):
        err = np.linalg.norm(_np(got) - want) / scale
        assert err <= TOL, (what, err)

    for part, H_ in full.items():
        close(k.hessian(V, part), H_, ("hessian", part))
        v = rng.standard_normal(H_.shape[0])
        close(st_.hvp(conv(v), part) / np.linalg.norm(v), H_ @ v / np.linalg.norm(v), ("hvp", part))
        M = rng.standard_normal((H_.shape[0], 3))       # columns vectorised together
        M /= np.linalg.norm(M)
        close(st_.hvp(conv(M), part), H_ @ M, ("hvp of a matrix", part))
        for p, got in k.diagonals(V, part).items():          # every parameter in one pass
            close(got, np.diag(ref[(p, p, part)]), ("diagonals", p, part))
        for p in names:
            close(st_.diag(p, part), np.diag(ref[(p, p, part)]), ("diag", p, part))
            close(np.array([st_.trace(p, part)]), np.array([np.trace(ref[(p, p, part)])]), ("trace", p, part))
        p, q = names[rng.integers(len(names))], names[rng.integers(len(names))]
        close(k.hessian_block(V, p, q, part), ref[(p, q, part)], ("block", p, q, part))
        close(np.array([st_.frobenius_norm(p, q, part)]), np.array([np.linalg.norm(ref[(p, q, part)])]),
              ("frobenius", p, q, part))
    for p in names:
        for q in names:
            split = st_.frobenius_split(p, q)
            for part in ("outer", "functional", "full"):
                close(np.array([split[part]]), np.array([np.linalg.norm(ref[(p, q, part)])]),
                      ("split", p, q, part))
    # every pairing in token form (runtime.gram) where the networks have one, the factors
    # in tiles of one value of the first token label
    tiny = k.prepare(V)
    for p in names:
        for q in names:
            o, f = (tiny.nets(p, q, part) for part in ("outer", "functional"))
            sq = gram.frobenius_split_sq(tiny, o, f, prefer="token", step=1)
            for part, x in zip(("outer", "functional", "full"), sq):
                close(np.array([np.sqrt(max(float(x), 0.0))]),
                      np.array([np.linalg.norm(ref[(p, q, part)])]), ("token split", p, q, part))
    # Jacobians per sequence
    for p in names:
        J = _np(k.jacobian({n: v for n, v in V.items() if n != "Y"}, p))
        for i, s in enumerate(seqs):
            tv = {n: torch.tensor(v) for n, v in s.items()}

            def f(w, p=p, tv=tv):
                return evaluate(d.F, {**tv, p: w}, backend="torch").reshape(-1)
            want = jacrev(f)(tv[p]).reshape(-1, tv[p].numel()).numpy()
            got = J[i] if J.ndim == 3 else J
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
            assert err <= TOL, ("jacobian", p, err)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          max_examples=max(25, settings.default.max_examples))
@given(declarations())
def test_every_kernel_method_on_random_declarations(decl):
    lay, loss, n, seed = decl
    d = sh.derive(lay, loss)
    vals, seqs = _batch(d, n, seed)
    rng = np.random.default_rng(seed)
    with pytest.MonkeyPatch.context() as mp:
        if seed % 2:        # every triangle step of the networks as a loop over its summed label
            mp.setattr(contract, "TRIANGLE_MIN", 1)
        for backend in ("numpy", "torch"):
            _check(sh.kernel(lay, backend, loss), vals, seqs, d, backend, rng)


@pytest.mark.parametrize("order", [("W_3", "W_1", "W_2"), ("W_1", "W_2", "W_3")])
def test_hadamard_ffn_in_any_parameter_order(order):
    """((X W_1) ∘ (X W_3)) W_2 declared in either order: every dense sub-block is right."""
    X = E.matrix("X", L, D)
    W = {"W_1": E.param("W_1", D, H), "W_2": E.param("W_2", H, D), "W_3": E.param("W_3", D, H)}
    F = ((X @ W["W_1"]) * (X @ W["W_3"])) @ W["W_2"]
    lay = sh.Layer("hadamard_ffn", F, params=tuple(W[n] for n in order), inputs=(X,))
    d = sh.derive(lay, "mse")
    for n in (1, 3):
        vals, seqs = _batch(d, n, 7)
        for backend in ("numpy", "torch"):
            _check(sh.kernel(lay, backend, "mse"), vals, seqs, d, backend, np.random.default_rng(0))


def test_swiglu_ffn():
    """(silu(X W_1) ∘ (X W_3)) W_2, silu(x) = x σ(x), in its natural order."""
    X = E.matrix("X", L, D)
    W_1, W_2, W_3 = E.param("W_1", D, H), E.param("W_2", H, D), E.param("W_3", D, H)
    silu = E.hadamard(X @ W_1, E.elementwise("sigmoid", X @ W_1))
    lay = sh.Layer("swiglu", E.hadamard(silu, X @ W_3) @ W_2, params=(W_1, W_2, W_3), inputs=(X,))
    d = sh.derive(lay, "mse")
    vals, seqs = _batch(d, 2, 3)
    for backend in ("numpy", "torch"):
        _check(sh.kernel(lay, backend, "mse"), vals, seqs, d, backend, np.random.default_rng(1))


@pytest.mark.parametrize("fn,inner", [("gelu_tanh", "tanh("), ("gelu", "erf("), ("silu", "sigmoid(")])
def test_entrywise_function_and_its_derivatives_share_their_inner_function(fn, inner, monkeypatch, tmp_path):
    """f(X W_1) W_2, whose kernels hold f, f' and f'' of one operand: every method is right, and
    the rendered module applies f's inner library function (tanh of GELU_tanh, erf of GELU,
    σ of SiLU) once, a leaf that f, f' and f'' read."""
    from symhess.codegen import render
    monkeypatch.setenv("SYMHESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(render, "_LOADED", {})
    X = E.matrix("X", L, D)
    W_1, W_2 = E.param("W_1", D, H), E.param("W_2", H, D)
    lay = sh.Layer(f"shared_{fn}", E.elementwise(fn, X @ W_1) @ W_2, params=(W_1, W_2), inputs=(X,))
    d = sh.derive(lay, "mse")
    vals, seqs = _batch(d, 2, 5)
    for backend in ("numpy", "torch"):
        _check(sh.kernel(lay, backend, "mse"), vals, seqs, d, backend, np.random.default_rng(2))
    (path,) = tmp_path.rglob(f"shared_{fn}-mse-*.py")
    code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith('"')]
    assert sum(ln.count(inner) for ln in code) == 1

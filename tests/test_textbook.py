"""Textbook matrix calculus: the engine is general, not an attention special case.

Every expression below is built with the public expression API and differentiated by
the rule tables.  Each is checked three ways against torch autograd in float64:

(a) the vec_r Jacobian (Kronecker view) against ``torch.func.jacrev`` of the forward;
(b) Hessians of scalar losses: Σ(F∘C) directly, and every block/part of the MSE loss
    through ``derive(Layer(...))``;
(c) the matrix-view gradient (``adjoint``) against ``torch.autograd.grad``.

The forward used by autograd is the interpreter's torch backend; for a handful of
expressions a hand-written torch forward checks the interpreter itself.  Dimensions
get distinct sizes (none is 1), so a swapped commutation subscript cannot pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import given, settings, strategies as st
from torch.func import hessian, jacrev

import symhess
from symhess import expr as E
from symhess.calculus.adjoint import adjoint, adjoints
from symhess.expr.evaluate import bind_dims, evaluate, leaves
from symhess.calculus.kron import vec_jacobian
from symhess.calculus.rules import differential
from symhess.expr.scalarfn import FUNCTIONS, get_function
from symhess.calculus.verify import autograd_blocks

TOL = 1e-10
m, n, p, q, k = E.dims("m n p q k")
SIZES = {m: 3, n: 4, p: 5, q: 2, k: 6}   # distinct, non-square, none equal to 1

ERRORS: dict = {}   # check name -> max relative error measured (printed at the end)


def record(kind, err):
    ERRORS[kind] = max(ERRORS.get(kind, 0.0), err)
    return err


def rel(got, ref):
    """‖got − ref‖ / ‖ref‖; an exactly-zero reference is compared absolutely."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / (den if den > 0 else 1.0)


# ----------------------------------------------------------------------------- the catalogue
@dataclass
class Case:
    """F built from the expression API; ``params[0]`` is the variable of the Jacobian test."""

    name: str
    build: Callable
    positive: bool = False            # inputs drawn from [0.5, 1.5] (log, sqrt, pow …)
    torch_forward: Callable = None    # hand-written forward over a dict of tensors
    loss: str = "mse"
    _built: tuple = field(default=None, repr=False)

    def built(self):
        if self._built is None:
            self._built = self.build()
        return self._built

    @property
    def F(self):
        return self.built()[0]

    @property
    def params(self):
        return self.built()[1]


def X_(r=m, c=n):
    return E.param("X", r, c)


def W_(r=n, c=p):
    return E.param("W", r, c)


def A_(r, c):
    return E.matrix("A", r, c)


def B_(r, c):
    return E.matrix("B", r, c)


def fn_case(fn, positive=False, power=None):
    """f(A W) for an elementwise f, W the parameter."""
    def build():
        A, W = A_(m, n), W_()
        T = A @ W
        F = E.power(T, power) if fn == "pow" else E.elementwise(fn, T)
        return F, (W,)
    label = fn if power is None else f"pow{power}".replace("/", "_").replace("-", "m")
    return Case(f"elementwise_{label}", build, positive=positive)


def _rms():
    """X ∘ rsqrt(rowsum(X∘X)/n + ε): RMS normalisation, X the parameter."""
    X = X_()
    ms = E.scale(1 / n, E.rowsum(X * X)) + E.scale(sp.Rational(1, 10), E.ones(m, n))
    return E.elementwise("rsqrt", ms) * X, (X,)


CASES = [
    Case("AXB", lambda: (A_(m, n) @ X_(n, p) @ B_(p, q), (X_(n, p),)),
         torch_forward=lambda v: v["A"] @ v["X"] @ v["B"]),
    Case("XXt", lambda: (X_() @ X_().T, (X_(),)),
         torch_forward=lambda v: v["X"] @ v["X"].T),
    Case("XtAX", lambda: (X_().T @ A_(m, m) @ X_(), (X_(),)),
         torch_forward=lambda v: v["X"].T @ v["A"] @ v["X"]),
    Case("XWWtXt", lambda: (X_() @ W_() @ W_().T @ X_().T, (W_(), X_())),
         torch_forward=lambda v: v["X"] @ v["W"] @ v["W"].T @ v["X"].T),
    Case("XWXt", lambda: (X_() @ E.param("W", n, n) @ X_().T, (E.param("W", n, n), X_()))),
    Case("scaled_XW", lambda: (E.scale(1 / sp.sqrt(p), A_(m, n) @ W_()), (W_(),))),
    Case("WtAW_minus_B", lambda: (W_().T @ A_(n, n) @ W_() - B_(p, p), (W_(),))),
    Case("X_had_X", lambda: (X_() * X_(), (X_(),)),
         torch_forward=lambda v: v["X"] * v["X"]),
    Case("X_had_AX", lambda: (X_() * (A_(m, m) @ X_()), (X_(),)),
         torch_forward=lambda v: v["X"] * (v["A"] @ v["X"])),
    fn_case("exp"),
    fn_case("log", positive=True),
    fn_case("tanh"),
    fn_case("sigmoid"),
    fn_case("relu"),
    fn_case("gelu"),
    fn_case("gelu_tanh"),
    fn_case("square"),
    fn_case("sqrt", positive=True),
    fn_case("rsqrt", positive=True),
    fn_case("recip", positive=True),
    fn_case("pow", power=3),
    fn_case("pow", positive=True, power=sp.Rational(3, 2)),
    fn_case("pow", positive=True, power=-2),
    Case("kron_X_A", lambda: (E.kron(X_(), A_(q, p)), (X_(),)),
         torch_forward=lambda v: torch.kron(v["X"], v["A"])),
    Case("kron_A_X", lambda: (E.kron(A_(q, p), X_()), (X_(),)),
         torch_forward=lambda v: torch.kron(v["A"], v["X"])),
    Case("kron_X_X", lambda: (E.kron(X_(), X_()), (X_(),))),
    Case("kron_A_X_B", lambda: (E.kron(A_(q, p), X_(), B_(p, q)), (X_(),)),
         torch_forward=lambda v: torch.kron(torch.kron(v["A"], v["X"]), v["B"])),
    Case("kron_AW_Wt", lambda: (E.kron(A_(m, n) @ W_(), W_().T), (W_(),))),
    Case("softmax_AW", lambda: (E.softmax_rows(A_(m, n) @ W_()), (W_(),)),
         torch_forward=lambda v: torch.softmax(v["A"] @ v["W"], dim=1)),
    Case("softmax_causal_AW", lambda: (E.softmax_rows(A_(m, n) @ W_(n, m), causal=True), (W_(n, m),)),
         torch_forward=lambda v: torch.softmax((v["A"] @ v["W"]).masked_fill(
             torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf")), dim=1)),
    Case("log_softmax_AW", lambda: (E.log_softmax_rows(A_(m, n) @ W_()), (W_(),)),
         torch_forward=lambda v: torch.log_softmax(v["A"] @ v["W"], dim=1)),
    Case("log_softmax_ce", lambda: (E.log_softmax_rows(A_(m, n) @ W_()), (W_(),)), loss="ce"),
    Case("diag_Wv", lambda: (E.diag(W_(m, n) @ E.matrix("v", n, 1)), (W_(m, n),)),
         torch_forward=lambda v: torch.diag((v["W"] @ v["v"]).reshape(-1))),
    Case("diag_part_AW", lambda: (E.diag_part(A_(m, n) @ W_(n, m)), (W_(n, m),))),
    Case("vec_r_AWB", lambda: (E.vec_r(A_(m, n) @ W_() @ B_(p, q)), (W_(),))),
    Case("quadratic_vtXv", lambda: (E.matrix("v", m, 1).T @ X_(m, m) @ E.matrix("v", m, 1),
                                    (X_(m, m),))),
    Case("bilinear_utXv", lambda: (E.matrix("u", m, 1).T @ X_() @ E.matrix("v", n, 1), (X_(),))),
    Case("quadratic_wtAw", lambda: (E.param("w", n, 1).T @ A_(n, n) @ E.param("w", n, 1),
                                    (E.param("w", n, 1),))),
    Case("sum_all_X_had_A", lambda: (E.sum_all(X_() * A_(m, n)), (X_(),))),
    Case("trace_AX", lambda: (E.sum_all(E.diag_part(A_(n, m) @ X_())), (X_(),))),
    Case("trace_XtX_sq", lambda: (E.sum_all(E.diag_part(X_().T @ X_())) *
                                  E.sum_all(E.diag_part(X_().T @ X_())), (X_(),))),
    Case("rowsum_AW", lambda: (E.rowsum(A_(m, n) @ W_()), (W_(),))),
    Case("softmax_of_AWB", lambda: (E.softmax_rows(A_(m, n) @ W_() @ B_(p, q)), (W_(),))),
    Case("tanh_XW_V", lambda: (E.elementwise("tanh", A_(m, n) @ W_()) @ E.param("V", p, q),
                               (W_(), E.param("V", p, q))),
         torch_forward=lambda v: torch.tanh(v["A"] @ v["W"]) @ v["V"]),
    Case("mlp_gelu", lambda: (E.elementwise("gelu", A_(m, n) @ W_()) @ E.param("V", p, q),
                              (W_(), E.param("V", p, q)))),
    Case("glu_sigmoid", lambda: (E.elementwise("sigmoid", A_(m, n) @ W_()) * (A_(m, n) @ E.param("U", n, p)),
                                 (W_(), E.param("U", n, p)))),
    Case("self_attention_like", lambda: (E.softmax_rows(X_() @ E.param("W", n, n) @ X_().T) @ X_(),
                                         (E.param("W", n, n), X_()))),
    Case("rms_norm", _rms),
    Case("exp_of_kron_sum", lambda: (E.elementwise("exp", E.kron(X_(), A_(q, p)) * E.scale(sp.Rational(1, 2), E.ones(m * q, n * p))),
                                     (X_(),))),
]

IDS = [c.name for c in CASES]
assert len(set(IDS)) == len(IDS)


# ----------------------------------------------------------------------------- values
def values_for(case, seed=0, loss=None, with_c=True):
    """Random float64 arrays for every variable of F (plus Y and a weight C)."""
    rng = np.random.default_rng(seed)
    vars_ = {v.name: v for v in E.walk(case.F) if isinstance(v, E.Var)}
    out = {}
    for name in sorted(vars_):
        r, c = (int(sp.sympify(d).subs(SIZES)) for d in vars_[name].shape)
        if case.positive:
            out[name] = rng.uniform(0.5, 1.5, (r, c))
        else:
            out[name] = rng.standard_normal((r, c)) * 0.7
    r, c = (int(sp.sympify(d).subs(SIZES)) for d in case.F.shape)
    if (loss or case.loss) == "ce":
        y = rng.random((r, c)) + 0.1
        out["Y"] = y / y.sum(1, keepdims=True)
    else:
        out["Y"] = rng.standard_normal((r, c))
    if with_c:
        out["C"] = rng.standard_normal((r, c))
    return out


def torch_values(values):
    return {k: torch.as_tensor(v, dtype=torch.float64) for k, v in values.items()}


def forward_of(case, values, name, hand=False):
    """w ↦ F(w) in torch, all other variables fixed."""
    tv = torch_values(values)

    def f(w):
        d = dict(tv)
        d[name] = w
        if hand:
            return case.torch_forward(d)
        return evaluate(case.F, d, backend="torch")
    return f, tv[name]


def ev(expr, values, of):
    """Evaluate ``expr`` with the dimensions bound from the variables of ``of`` (a Jacobian
    such as A ⊗ I_p need not mention the variable that fixes p)."""
    arrays = {v.name: np.asarray(values[v.name]) for v in leaves(of)}
    return evaluate(expr, values, env=bind_dims(leaves(of), arrays))


def direction(var, tag="D"):
    return E.Var(f"{tag}_{var.name}", var.rows, var.cols, "direction")


def weight(F):
    return E.const("C", F.rows, F.cols)


# ----------------------------------------------------------------------------- (a) Jacobians
def test_catalogue_is_large():
    """The catalogue covers at least 25 textbook expressions."""
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vec_jacobian(case):
    """vec_r dF = J vec_r D, J from the Kronecker view, equals jacrev of the forward."""
    values = values_for(case)
    for w in case.params:
        D = direction(w)
        J = vec_jacobian(differential(case.F, {w: D}), D)
        got = ev(J, values, case.F)
        f, w0 = forward_of(case, values, w.name)
        ref = jacrev(f)(w0).reshape(got.shape[0], -1).numpy()
        assert record("jacobian", rel(got, ref)) <= TOL, f"{case.name} d/d{w.name}"


HAND = [c for c in CASES if c.torch_forward is not None]


@pytest.mark.parametrize("case", HAND, ids=[c.name for c in HAND])
def test_hand_forward(case):
    """The interpreter's forward and Jacobian agree with a hand-written torch forward."""
    values = values_for(case)
    w = case.params[0]
    f_int, w0 = forward_of(case, values, w.name)
    f_hand, _ = forward_of(case, values, w.name, hand=True)
    assert record("forward", rel(f_int(w0).numpy(), f_hand(w0).numpy())) <= 1e-14
    D = direction(w)
    got = ev(vec_jacobian(differential(case.F, {w: D}), D), values, case.F)
    ref = jacrev(f_hand)(w0).reshape(got.shape[0], -1).numpy()
    assert record("jacobian_hand", rel(got, ref)) <= TOL


# ----------------------------------------------------------------------------- (b) Hessians
def weighted_loss(F):
    """s = Σ_ij F_ij C_ij = 1ᵀ(F∘C)1."""
    return E.sum_all(F * weight(F))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hessian_weighted_sum(case):
    """∂²(Σ F∘C)/∂vec_r W² by adjoint-then-Kronecker equals torch.func.hessian."""
    values = values_for(case)
    w = case.params[0]
    s = weighted_loss(case.F)
    D, D2 = direction(w), direction(w, "D2")
    g = adjoint(differential(s, {w: D}), D, E.identity(1))
    H = vec_jacobian(differential(g, {w: D2}), D2)
    got = ev(H, values, case.F)
    tv = torch_values(values)

    def loss(x):
        return evaluate(s, {**tv, w.name: x}, backend="torch")[0, 0]
    ref = hessian(loss)(tv[w.name]).reshape(got.shape).numpy()
    assert record("hessian_weighted", rel(got, ref)) <= TOL
    assert rel(got, got.T) <= 1e-12, "a Hessian is symmetric"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hessian_blocks_vs_autograd(case):
    """Every (p, q) block and part of the MSE (or CE) Hessian through derive(Layer(...))."""
    inputs = tuple(v for v in E.walk(case.F) if isinstance(v, E.Var) and v not in case.params)
    lay = symhess.Layer(f"textbook_{case.name}", case.F, case.params, inputs)
    der = symhess.derive(lay, case.loss)
    values = values_for(case, seed=1, with_c=False)
    ref = autograd_blocks(der, values)
    names = lay.param_names
    for a in names:
        for b in names:
            scale = max(float(np.linalg.norm(ref[(a, b, part)])) for part in ("full", "outer"))
            for part in ("outer", "functional", "full"):
                blk = der.block(a, b, part)
                got = blk.evaluate(values)
                r = ref[(a, b, part)]
                err = float(np.linalg.norm(got - r)) / max(float(np.linalg.norm(r)), scale, 1e-300)
                assert record("hessian_blocks", err) <= TOL, f"{case.name} H_{part}({a},{b})"
                if blk.is_zero:   # a structural zero must also be a numerical one
                    assert float(np.linalg.norm(r)) <= 1e-12 * max(scale, 1.0)
    # the torch backend evaluates the same blocks
    blk = der.block(names[-1], names[0], "full")
    assert record("torch_backend", rel(blk.evaluate(values, backend="torch").numpy(),
                                       blk.evaluate(values))) <= 1e-12


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hvp_matrix_view_vs_autograd(case):
    """Σ_q H(p, q) V_q from ``hvp_expressions`` (no Kronecker product) for every part."""
    inputs = tuple(v for v in E.walk(case.F) if isinstance(v, E.Var) and v not in case.params)
    der = symhess.derive(symhess.Layer(f"textbook_{case.name}", case.F, case.params, inputs), case.loss)
    values = values_for(case, seed=2, with_c=False)
    ref = autograd_blocks(der, values)
    env = der.dimension_env(values)
    rng = np.random.default_rng(5)
    vs = {q: rng.standard_normal(values[q].shape) for q in der.layer.param_names}
    dirs = {v.name: vs[q] for q, v in der.hvp_directions().items()}
    for part in ("outer", "functional", "full"):
        hv = der.hvp_expressions(part)
        for p_ in der.layer.param_names:
            want = sum(ref[(p_, q_, part)] @ vs[q_].reshape(-1) for q_ in der.layer.param_names)
            got = evaluate(hv[p_], {**values, **dirs}, env=env).reshape(-1)
            full = sum(ref[(p_, q_, "full")] @ vs[q_].reshape(-1) for q_ in der.layer.param_names)
            den = max(np.linalg.norm(want), np.linalg.norm(full), 1e-300)
            assert record("hvp", float(np.linalg.norm(got - want)) / den) <= TOL, (part, p_)


# ----------------------------------------------------------------------------- (c) gradients
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_matrix_view(case):
    """adjoint(dF[D], D, C) — the vector–Jacobian product — equals autograd's grad of Σ F∘C."""
    values = values_for(case)
    tv = torch_values(values)
    for w in case.params:
        D = direction(w)
        grad = adjoint(differential(case.F, {w: D}), D, weight(case.F))
        assert grad.shape == w.shape
        got = ev(grad, values, case.F)
        x = tv[w.name].clone().requires_grad_(True)
        out = evaluate(case.F, {**tv, w.name: x}, backend="torch")
        (ref,) = torch.autograd.grad((out * tv["C"]).sum(), x)
        assert record("gradient", rel(got, ref.numpy())) <= TOL, f"{case.name} d/d{w.name}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_joint_gradients_match_autograd(case):
    """adjoints(dF[D₁, …, D_k], (D₁, …, D_k), C) — every parameter's gradient from one
    reverse pass over the differential in all of them — equals autograd's grads of Σ F∘C."""
    values = values_for(case)
    tv = torch_values(values)
    ds = {w: direction(w) for w in case.params}
    grads = adjoints(differential(case.F, ds), list(ds.values()), weight(case.F))
    xs = {w.name: tv[w.name].clone().requires_grad_(True) for w in case.params}
    out = evaluate(case.F, {**tv, **xs}, backend="torch")
    refs = torch.autograd.grad((out * tv["C"]).sum(), list(xs.values()), allow_unused=True)
    for (w, d), ref in zip(ds.items(), refs):
        got = ev(grads[d], values, case.F)
        ref = np.zeros(got.shape) if ref is None else ref.numpy()
        assert record("gradient", rel(got, ref) if np.abs(ref).max() > 0 else float(np.abs(got).max())) \
            <= TOL, f"{case.name} d/d{w.name}"


# ----------------------------------------------------------------------------- properties
PROFILE = settings(derandomize=True, max_examples=6, deadline=None, database=None)
size = st.integers(min_value=2, max_value=5)


@PROFILE
@given(L=size, d=size, seed=st.integers(0, 2**16))
def test_property_XWXt_jacobian_and_hessian(L, d, seed):
    """F = X W Xᵀ for random shapes: Jacobian in both X and W, and Hessian of Σ F∘C in X."""
    case = Case("XWXt_prop", lambda: (X_(m, n) @ E.param("W", n, n) @ X_(m, n).T,
                                      (X_(m, n), E.param("W", n, n))))
    sizes = {m: L, n: d}
    values = _values_sized(case, sizes, seed)
    for w in case.params:
        D = direction(w)
        got = ev(vec_jacobian(differential(case.F, {w: D}), D), values, case.F)
        f, w0 = forward_of(case, values, w.name)
        ref = jacrev(f)(w0).reshape(got.shape[0], -1).numpy()
        assert record("jacobian", rel(got, ref)) <= TOL
    X = case.params[0]
    s = weighted_loss(case.F)
    D, D2 = direction(X), direction(X, "D2")
    H = vec_jacobian(differential(adjoint(differential(s, {X: D}), D, E.identity(1)), {X: D2}), D2)
    tv = torch_values(values)
    ref = hessian(lambda x: evaluate(s, {**tv, "X": x}, backend="torch")[0, 0])(tv["X"])
    got = ev(H, values, case.F)
    assert record("hessian_weighted", rel(got, ref.reshape(got.shape).numpy())) <= TOL


@PROFILE
@given(L=size, d=size, causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_softmax_jacobian_and_gradient(L, d, causal, seed):
    """softmax_rows(A W) (W d×L so the causal mask applies) for random shapes."""
    case = Case("softmax_prop", lambda: (E.softmax_rows(A_(m, n) @ W_(n, m), causal=causal), (W_(n, m),)))
    values = _values_sized(case, {m: L, n: d}, seed)
    w = case.params[0]
    D = direction(w)
    lin = differential(case.F, {w: D})
    got = ev(vec_jacobian(lin, D), values, case.F)
    f, w0 = forward_of(case, values, w.name)
    ref = jacrev(f)(w0).reshape(got.shape[0], -1)
    assert record("jacobian", rel(got, ref.numpy())) <= TOL
    g = ev(adjoint(lin, D, weight(case.F)), values, case.F)
    c = torch.as_tensor(values["C"]).reshape(-1)
    assert record("gradient", rel(g.reshape(-1), (c @ ref).numpy())) <= TOL


def _values_sized(case, sizes, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for v in sorted({v for v in E.walk(case.F) if isinstance(v, E.Var)}, key=lambda v: v.name):
        r, c = (int(sp.sympify(x).subs(sizes)) for x in v.shape)
        out[v.name] = rng.standard_normal((r, c))
    r, c = (int(sp.sympify(x).subs(sizes)) for x in case.F.shape)
    out["C"] = rng.standard_normal((r, c))
    return out


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    """Print the largest error of each kind once the module has run (see it with -s)."""
    yield
    if ERRORS:
        print("\n[textbook] %d expressions; max relative errors: " % len(CASES)
              + ", ".join(f"{k}={v:.1e}" for k, v in sorted(ERRORS.items())))


# ----------------------------------------------------------------------------- overflow safety
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_library_derivatives_stay_finite(name):
    """f, f', f'' are finite wherever f is (float64 up to |x| = 1e4, float32 up to |x| = 80).

    Guards the derivative forms: sympy's σ'' written with exp gave NaN below x = −44 in float32.
    """
    big = 700.0 if name == "exp" else 1e4
    grid = np.concatenate([np.linspace(-big, big, 801), np.linspace(-80, 80, 321)])
    if name in ("log", "sqrt", "rsqrt", "recip"):
        grid = np.abs(grid) + 1e-3
    f = get_function(name)
    for g in (f, f.derivative(), f.derivative().derivative()):
        v64 = np.broadcast_to(g.numpy()(grid), grid.shape)
        assert np.isfinite(v64).all(), f"{g.name} float64 at {grid[~np.isfinite(v64)][:3]}"
        small = torch.tensor(grid[np.abs(grid) <= 80], dtype=torch.float32)
        v32 = torch.as_tensor(g.torch()(small)).broadcast_to(small.shape)
        assert torch.isfinite(v32).all(), f"{g.name} float32 at {small[~torch.isfinite(v32)][:3]}"

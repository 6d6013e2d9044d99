"""Attention variants: autograd agreement, structural zeros, options, and the W_QK chain rule."""
import numpy as np
import pytest
import sympy as sp

import symhess as sh
from symhess import expr as E
from symhess.calculus.adjoint import adjoint
from symhess.expr.evaluate import evaluate
from symhess.calculus.kron import vec_jacobian
from symhess.calculus.rules import differential
from symhess.calculus.verify import TOLERANCE, autograd_blocks, random_values, verify

VARIANTS = ["linear_attention", "single_matrix_attention", "multihead_attention",
            "value_output_attention"]


@pytest.mark.parametrize("name,causal,loss", [
    pytest.param(n, c, l, id=f"{n}-{c}-{l}",
                 marks=pytest.mark.slow if (n == "multihead_attention" and c) else ())
    for n in VARIANTS for c in (False, True) for l in ("mse", "ce")])   # causal heads: slow profile
def test_every_block_matches_autograd(name, causal, loss):
    checks, _ = verify(sh.derive(sh.layer(name, causal=causal), loss), seed=3)
    worst = max(checks, key=lambda c: c.error)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "multihead_attention" else n
                                  for n in VARIANTS])
def test_non_default_scale_matches_autograd(name):
    checks, _ = verify(sh.derive(sh.layer(name, scale=0.7), "mse"), seed=5)
    assert max(c.error for c in checks) <= TOLERANCE


# ----------------------------------------------------------------------------- the causal mask
def test_causal_mask_is_lower_triangular():
    L = E.dim("L")
    T = E.matrix("T", L, L)
    ones = np.ones((5, 5))
    got = evaluate(E.causal_mask(L) * T, {"T": ones})
    np.testing.assert_array_equal(got, np.tril(ones))
    got_t = evaluate(E.causal_mask(L) * T, {"T": ones}, backend="torch").numpy()
    np.testing.assert_array_equal(got_t, np.tril(ones))


def test_causal_linear_attention_output_is_masked_product():
    d = sh.derive(sh.layer("linear_attention", causal=True))
    v = random_values(d, seed=1)
    X, Wq, Wk, Wv = v["X"], v["W_Q"], v["W_K"], v["W_V"]
    T = X @ Wq @ Wk.T @ X.T / np.sqrt(Wq.shape[1])
    np.testing.assert_allclose(evaluate(d.F, v), np.tril(T) @ X @ Wv, rtol=1e-13)


# ----------------------------------------------------------------------------- structural facts
def _zero(d, p, q, part="functional", **kw):
    return d.block(p, q, part, **kw).is_zero


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_diagonal_functional_blocks_are_zero(causal):
    d = sh.derive(sh.layer("linear_attention", causal=causal))
    for p in ("W_Q", "W_K", "W_V"):
        assert _zero(d, p, p)
        assert not _zero(d, p, p, "outer")
    for p, q in [("W_V", "W_Q"), ("W_V", "W_K"), ("W_Q", "W_K")]:
        assert not _zero(d, p, q)
    # with A = T the whole (Q, K) functional block is its T-functional term
    v = random_values(d, seed=2)
    np.testing.assert_allclose(d.block("W_Q", "W_K", "functional", at="T").evaluate(v),
                               d.block("W_Q", "W_K", "functional").evaluate(v), rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_single_matrix_has_no_T_functional_term(causal):
    d = sh.derive(sh.layer("single_matrix_attention", causal=causal))
    assert _zero(d, "W_QK", "W_QK", at="T")
    assert not _zero(d, "W_QK", "W_QK")        # the softmax's own curvature remains
    two = sh.derive(sh.layer("attention", causal=causal))
    assert not _zero(two, "W_Q", "W_K", at="T")  # the two-matrix form has one


def test_multihead_cross_head_blocks():
    d = sh.derive(sh.layer("multihead_attention", heads=2))
    names = d.layer.param_names
    assert names == ("W_Q1", "W_K1", "W_V1", "W_O1", "W_Q2", "W_K2", "W_V2", "W_O2")
    v = random_values(d, seed=4)
    for p in names[:4]:
        for q in names[4:]:
            assert _zero(d, p, q), (p, q)
            assert not _zero(d, p, q, "outer"), (p, q)
            assert np.linalg.norm(d.block(p, q, "outer").evaluate(v)) > 1e-6
    assert not _zero(d, "W_Q1", "W_K1") and not _zero(d, "W_V2", "W_O2")


def test_value_output_factorisation_blocks():
    d = sh.derive(sh.layer("value_output_attention"))
    assert _zero(d, "W_V", "W_V") and _zero(d, "W_O", "W_O")
    assert not _zero(d, "W_V", "W_O")
    v = random_values(d, seed=6)
    assert np.linalg.norm(d.block("W_V", "W_O").evaluate(v)) > 1e-6


def test_multihead_names_print_as_superscripts():
    d = sh.derive(sh.layer("multihead_attention", heads=3))
    assert len(d.layer.params) == 12
    assert r"\mathbf W_{K}^{3}" in d.block("W_Q3", "W_Q3", "outer").latex()


# ----------------------------------------------------------------------------- chain rule (§11)
def _qk_map(W_Q, W_K, d_K):
    """φ(W_Q, W_K) = W_Q W_Kᵀ/√d_K, the map from two matrices to the single matrix."""
    return (W_Q @ W_K.T) / sp.sqrt(d_K)


@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("causal", [False, True])
def test_two_matrix_blocks_follow_from_single_matrix_by_chain_rule(causal, loss):
    """H(a,b) = D_aᵀ H_QK D_b + (∂ℓ/∂W_QK)·∂²φ/∂a∂b, every piece derived by the engine."""
    two = sh.derive(sh.layer("attention", causal=causal), loss)
    one = sh.derive(sh.layer("single_matrix_attention", causal=causal, scale="1"), loss)
    v = random_values(two, seed=7)
    W_Q, W_K = two.param("W_Q"), two.param("W_K")
    d_K = W_Q.cols
    phi = _qk_map(W_Q, W_K, d_K)
    v1 = {k: v[k] for k in ("X", "W_V", "Y")}
    v1["W_QK"] = evaluate(phi, v)
    H_qk = one.block("W_QK", "W_QK", "full").evaluate(v1)
    G_qk = evaluate(one.gradient("W_QK"), v1)

    dq, dk = E.Var("dQ", *W_Q.shape, "direction"), E.Var("dK", *W_K.shape, "direction")
    D = {"W_Q": evaluate(vec_jacobian(differential(phi, {W_Q: dq}), dq), v),
         "W_K": evaluate(vec_jacobian(differential(phi, {W_K: dk}), dk), v)}
    G = E.const("G_QK", *phi.shape)
    g_q = adjoint(differential(phi, {W_Q: dq}), dq, G)        # (∂φ/∂W_Q)ᵀ G
    second = {("W_Q", "W_K"): vec_jacobian(differential(g_q, {W_K: dk}), dk),
              ("W_Q", "W_Q"): vec_jacobian(differential(g_q, {W_Q: dq}), dq)}
    assert second[("W_Q", "W_Q")].is_zero                     # φ is bilinear
    vg = dict(v, G_QK=G_qk)
    env = two.dimension_env(v)     # G_QK alone does not fix d_K
    for a, b in [("W_Q", "W_Q"), ("W_K", "W_K"), ("W_Q", "W_K"), ("W_K", "W_Q")]:
        want = D[a].T @ H_qk @ D[b]
        if (a, b) == ("W_Q", "W_K"):
            want = want + evaluate(second[(a, b)], vg, env=env)
        elif (a, b) == ("W_K", "W_Q"):
            want = want + evaluate(second[(b, a)], vg, env=env).T
        got = two.block(a, b, "full").evaluate(v)
        assert np.linalg.norm(got - want) <= 1e-10 * np.linalg.norm(got), (a, b)
    # the cross term is exactly the two-matrix T-functional term
    np.testing.assert_allclose(evaluate(second[("W_Q", "W_K")], vg, env=env),
                               two.block("W_Q", "W_K", "functional", at="T").evaluate(v),
                               rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------- options
def test_scale_named_choices():
    d_V, d_K = E.dim("d_V"), E.dim("d_K")

    def coef(layer):
        return next(n.coef for n in E.walk(layer.intermediates.get("T", layer.intermediates.get("T1")))
                    if isinstance(n, E.Scale))

    assert coef(sh.layer("linear_attention")) == 1 / sp.sqrt(d_K)
    assert coef(sh.layer("value_output_attention", scale="1/sqrt(d_model)")) == 1 / sp.sqrt(d_V)
    assert coef(sh.layer("single_matrix_attention", scale="1/sqrt(d_K)", d_K=4)) == sp.Rational(1, 2)
    assert coef(sh.layer("multihead_attention", scale=0.5)) == sp.Float(0.5)
    assert all(not isinstance(n, E.Scale)
               for n in E.walk(sh.layer("single_matrix_attention").intermediates["T"]))


@pytest.mark.parametrize("name, options, match", [
    ("single_matrix_attention", {"scale": "1/sqrt(d_K)"}, "d_K=4"),
    ("linear_attention", {"scale": "1/sqrt(d_ff)"}, "d_ff"),
    ("linear_attention", {"scale": -1}, "positive"),
    ("value_output_attention", {"scale": "1/("}, "not a number"),
    ("multihead_attention", {"heads": 0}, "positive integer"),
    ("multihead_attention", {"causal": "yes"}, "True or False"),
    ("linear_attention", {"temperature": 2}, "unknown option"),
])
def test_bad_options_give_clear_errors(name, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sh.layer(name, **options)


def test_latex_has_no_double_superscripts():
    """W_V^{1}ᵀ and M^{causal}ᵀ must print as {…}^\\top (a second ^ is a TeX error)."""
    import re
    bad = re.compile(r"\^\{[^{}]*\}(_\{[^{}]*\})?\^")
    for name, kw in [("multihead_attention", {}), ("linear_attention", {"causal": True})]:
        d = sh.derive(sh.layer(name, **kw))
        for p in d.layer.param_names[:3]:
            tex = d.block(p, p, "outer").latex()
            assert "^\\top" in tex and not bad.search(tex), tex

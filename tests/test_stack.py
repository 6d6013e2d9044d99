"""Deep models declared as compositions (symhess.layers.stack), verified against torch autograd.

The default run keeps one seeded check of every block × part of two stacked attention
layers; the heavy checks (every block × part × loss of attention_stack at depths 2 and 3
and of two post-LN blocks) are marked slow: ``pytest -m slow``.
"""
from __future__ import annotations

import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.errors import DeclarationError, InputError, ShapeError
from symhess.expr.evaluate import evaluate
from symhess.layers.stack import compose, residual_attention
from symhess.layers.transformer import ffn, feed_forward
from symhess.calculus.verify import TOLERANCE, random_values, verify


def _worst(d, seed):
    checks, _ = verify(d, seed=seed)
    n = len(d.layer.params)
    assert len(checks) == 3 * n * n
    return max(checks, key=lambda c: c.error)


def test_attention_stack_matches_autograd_seeded():
    d = sh.derive(sh.layer("attention_stack", depth=2), "mse")
    worst = _worst(d, seed=0)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


def test_two_stacked_attention_layers_simplify_every_block():
    """All 36 blocks × parts derive and simplify (10 functional blocks used to loop for ever)."""
    d = sh.derive(sh.layer("attention_stack", depth=2), "ce")
    names = d.layer.param_names
    assert names == ("W_Q_1", "W_K_1", "W_V_1", "W_Q_2", "W_K_2", "W_V_2")
    blocks = [d.block(p, q, part) for p in names for q in names for part in ("outer", "functional")]
    assert len(blocks) == 72 and not any(b.is_zero for b in blocks if b.label[0] != b.label[1])


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("name,depth", [("attention_stack", 2), ("attention_stack", 3),
                                        ("post_ln_stack", 2)])
def test_stacked_layers_match_autograd_every_block(name, depth, loss):
    d = sh.derive(sh.layer(name, depth=depth), loss)
    worst = _worst(d, seed=depth)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


@pytest.mark.slow
def test_causal_attention_stack_matches_autograd():
    d = sh.derive(sh.layer("attention_stack", depth=2, causal=True), "ce")
    worst = _worst(d, seed=5)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


def test_composition_of_different_sub_layers_matches_autograd():
    """Residual attention, then a residual FFN: parameters of each indexed by position."""
    lay = compose("attention_then_ffn", [residual_attention(), ffn(residual=True)])
    assert lay.param_names == ("W_Q_1", "W_K_1", "W_V_1", "W_1_2", "W_2_2")
    d = sh.derive(lay, "ce")
    worst = _worst(d, seed=2)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


def test_compose_equals_plain_python_composition():
    """The helpers compose by hand as well: one sub-layer's function applied to another's output."""
    lay = compose("attention_then_ffn", [residual_attention(), ffn(residual=True)])
    att = residual_attention()
    d_V, d_ff = E.dims("d_V d_ff")
    W1, W2 = E.param("W_1_2", d_V, d_ff), E.param("W_2_2", d_ff, d_V)
    renamed = {p: E.param(f"{p.name}_1", p.rows, p.cols) for p in att.params}
    U = E.substitute(att.output, renamed)
    by_hand = feed_forward(U, W1, W2)[0] + U
    values = random_values(sh.derive(lay), seed=4)
    np.testing.assert_allclose(evaluate(lay.output, values), evaluate(by_hand, values), rtol=1e-13)


def test_stacked_names_and_symbols_are_indexed_by_layer():
    lay = sh.layer("post_ln_stack", depth=2)
    assert lay.param("W_Q_2").latex() == r"\mathbf W_{Q}^{(2)}"
    assert [c.label for c in lay.checks] == ["Y^(1)", "Z^(1)", "Y^(2)", "Z^(2)"]
    assert {"A^(1)", "A^(2)", "Y^(2)", "S^(1)"} <= set(lay.intermediates)
    d = sh.derive(lay, "mse")
    tex = d.block("W_Q_2", "W_Q_2", "outer").latex()
    assert r"\mathbf M_2^{(2)}" in tex or r"\mathbf Z_1^{(2)}" in tex
    assert r"\mathbf M_2 " not in tex and r"\mathbf Z_1 " not in tex


def test_stacked_layer_norm_checks_follow_their_inputs():
    d = sh.derive(sh.layer("post_ln_stack", depth=2), "mse")
    values = random_values(d, seed=1)
    values["X"] = np.ones_like(values["X"])
    values["W_V_1"] = np.zeros_like(values["W_V_1"])         # X + SA(X) = X: constant rows
    with pytest.raises(InputError, match=r"LayerNorm Y\^\(1\)"):
        d.dimension_env(values)


def test_attention_stack_depth_one_is_one_residual_attention_layer():
    lay = sh.layer("attention_stack", depth=1)
    values = random_values(sh.derive(lay), seed=3)
    plain = residual_attention()
    plain_values = {k.removesuffix("_1"): v for k, v in values.items()}
    np.testing.assert_allclose(evaluate(lay.output, values), evaluate(plain.output, plain_values),
                               rtol=1e-13)


@pytest.mark.parametrize("depth", [0, -1, True, 2.0])
def test_depth_must_be_a_positive_integer(depth):
    with pytest.raises(DeclarationError, match="depth must be a positive integer"):
        sh.layer("attention_stack", depth=depth)


def test_compose_refuses_sub_layers_that_do_not_chain():
    L, d, h = E.dims("L d h")
    X, Z = E.matrix("X", L, d), E.matrix("Z", L, d)
    W = E.param("W", d, h)
    with pytest.raises(ShapeError, match="needs equal shapes"):
        compose("bad", [sh.Layer("proj", X @ W, (W,), (X,))])
    V = E.param("V", d, d)
    with pytest.raises(DeclarationError, match="exactly one input"):
        compose("bad", [sh.Layer("two", X @ V + Z, (V,), (X, Z))])
    with pytest.raises(DeclarationError, match="non-empty sequence"):
        compose("bad", [])

"""The public surface: a user declares a layer in their own code, without editing symhess."""
import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.expr.evaluate import InputError
from symhess.calculus.verify import TOLERANCE, random_values, verify


def my_gated_layer():
    """A layer symhess does not ship: F = tanh(X W_1) ∘ sigmoid(X W_2), then a projection."""
    L, d, h = E.dims("L d h")
    X = E.matrix("X", L, d)
    W_1, W_2, W_3 = E.param("W_1", d, h), E.param("W_2", d, h), E.param("W_3", h, d)
    gate = E.elementwise("tanh", X @ W_1) * E.elementwise("sigmoid", X @ W_2)
    return sh.Layer("gated", gate @ W_3, (W_1, W_2, W_3), (X,))


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_user_declared_layer_verifies(loss):
    d = sh.derive(my_gated_layer(), loss)
    checks, _ = verify(d, seed=2)
    assert len(checks) == 27 and max(c.error for c in checks) <= TOLERANCE
    assert d.block("W_3", "W_3", "functional").is_zero      # linear in W_3
    assert not d.block("W_1", "W_2", "functional").is_zero


def test_block_evaluate_layout_is_vec_r():
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=1)
    h = d.block("W_Q", "W_V", "outer").evaluate(values)
    assert h.shape == (values["W_Q"].size, values["W_V"].size)


def test_values_are_validated():
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=1)
    b = d.block("W_Q", "W_Q", "outer")
    with pytest.raises(InputError, match="unknown value name"):
        b.evaluate({**values, "W_O": values["W_V"]})
    bad = dict(values, W_V=np.ones((values["W_V"].shape[0] + 1, 2)))
    with pytest.raises(InputError, match="shape mismatch: W_V has shape"):
        d.block("W_V", "W_V", "outer").evaluate(bad)
    nan = dict(values, X=values["X"] * np.nan)
    with pytest.raises(InputError, match="X contains non-finite"):
        b.evaluate(nan)
    with pytest.raises(InputError, match="missing values for"):
        b.evaluate({k: v for k, v in values.items() if k != "X"})


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(KeyError, match="valid: .*attention, "):
        sh.layer("attn")
    d = sh.derive(sh.layer("attention"), "mse")
    with pytest.raises(KeyError, match="valid: W_Q, W_K, W_V"):
        d.block("W_O", "W_Q")
    with pytest.raises(ValueError, match="valid: outer, functional, full"):
        d.block("W_Q", "W_Q", "gauss")
    with pytest.raises(KeyError, match="valid: ce, .*mse"):
        sh.derive(sh.layer("attention"), "hinge")


def test_declaration_shape_errors_name_both_shapes():
    L, d, k = E.dims("L d k")
    X, W = E.matrix("X", L, d), E.param("W", k, d)
    with pytest.raises(sh.ShapeError, match=r"\(L × d\) @ \(k × d\)"):
        X @ W

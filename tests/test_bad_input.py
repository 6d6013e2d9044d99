"""Bad input at evaluation time: a clear InputError naming the problem, never a deep
numpy traceback or a silently wrong number."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symhess
from symhess import expr as E
from symhess.evaluate import InputError, evaluate
from symhess.verify import random_values

m, n, p = E.dims("m n p")
X, W = E.matrix("X", m, n), E.param("W", n, p)
F = E.softmax_rows(X @ W)
rng = np.random.default_rng(0)
x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))


@pytest.fixture(scope="module")
def attention():
    der = symhess.derive(symhess.layer("attention"), "ce")
    return der, random_values(der, seed=3)


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_missing_values_are_named(backend):
    with pytest.raises(InputError, match=r"missing values for W \(needed: W, X\)"):
        evaluate(F, {"X": x}, backend=backend)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_conflicting_shapes_name_both(backend):
    with pytest.raises(InputError) as err:
        evaluate(F, {"X": x, "W": w.T}, backend=backend)
    msg = str(err.value)
    assert "(3, 4)" in msg and "(5, 4)" in msg, msg          # both arrays' shapes
    assert "(m × n)" in msg and "(n × p)" in msg, msg        # both declarations
    assert "n = " in msg


def test_product_dimension_mismatch_is_named():
    """A value whose declared shape is a product (m·n) of dimensions bound elsewhere."""
    V = E.matrix("V", m * n, 1)
    with pytest.raises(InputError, match=r"V has shape \(7, 1\), declared \(m\*n × 1\) = \(12, 1\)"):
        evaluate(E.vec_r(X) + V, {"X": x, "V": np.ones((7, 1))})


@pytest.mark.parametrize("bad, needle", [
    (np.ones(4), "2-D array of shape (m × n), got shape (4,)"),
    (np.ones((1, 3, 4)), "2-D array"),
    (np.ones((0, 4)), "empty"),
])
def test_wrong_rank_or_empty(bad, needle):
    with pytest.raises(InputError) as err:
        evaluate(F, {"X": bad, "W": w})
    assert needle in str(err.value)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_rejected(backend, bad):
    xb = x.copy()
    xb[1, 2] = bad
    with pytest.raises(InputError, match=rf"X contains non-finite entries \(NaN or inf\): {bad} at "
                                         r"index \(1, 2\), 1 of 12 entries"):
        evaluate(F, {"X": xb, "W": w}, backend=backend)
    with pytest.raises(InputError, match="X contains non-finite"):
        evaluate(F, {"X": torch.as_tensor(xb), "W": w}, backend=backend)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_complex_inputs_are_rejected_not_truncated(backend):
    with pytest.raises(InputError, match="X is complex"):
        evaluate(F, {"X": x + 1j, "W": w}, backend=backend)
    with pytest.raises(InputError, match="X is complex"):
        evaluate(F, {"X": torch.as_tensor(x + 1j), "W": w}, backend=backend)


@pytest.mark.parametrize("bad", ["abc", None, [[1.0, 2.0], [3.0]], np.array([[object()]])])
def test_non_numeric_inputs_are_rejected(bad):
    with pytest.raises(InputError, match="X (must be a real numeric array|is not a numeric array)"):
        evaluate(F, {"X": bad, "W": w})


def test_acceptable_inputs_are_used_as_given():
    """float64 lists, float32 arrays and tensors that require grad are fine."""
    ref = evaluate(F, {"X": x, "W": w})
    assert np.allclose(evaluate(F, {"X": x.tolist(), "W": w}), ref, rtol=0, atol=0)
    t = torch.as_tensor(x).requires_grad_(True)
    assert np.array_equal(evaluate(F, {"X": t, "W": w}), ref)
    got32 = evaluate(F, {"X": x.astype(np.float32), "W": w.astype(np.float32)})
    assert got32.dtype == np.float32 and np.allclose(got32, ref, rtol=1e-5, atol=1e-6)
    t32 = evaluate(F, {"X": x.astype(np.float32), "W": w.astype(np.float32)}, backend="torch")
    assert t32.dtype == torch.float32 and np.allclose(t32.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [(x > 0).astype(int), x > 0, x.astype(np.float16),
                                 torch.as_tensor(x).to(torch.bfloat16), torch.as_tensor(x > 0),
                                 [[1, 2, 3, 4]] * 3])
def test_integer_boolean_and_half_inputs_are_refused_not_cast(backend, bad):
    """One dtype policy: float32 and float64 only; the message names the array, its dtype
    and the accepted dtypes."""
    dt = str(bad.dtype).removeprefix("torch.") if hasattr(bad, "dtype") else "int64"
    with pytest.raises(InputError, match=rf"^X has dtype {dt}; symhess computes in float32 or float64"):
        evaluate(F, {"X": bad, "W": w}, backend=backend)


def test_mixed_dtypes_are_refused_naming_each():
    with pytest.raises(InputError, match="all values must share one dtype, got W: float64, X: float32"):
        evaluate(F, {"X": x.astype(np.float32), "W": w})


def test_unknown_backend_lists_valid():
    with pytest.raises(ValueError, match="unknown backend 'jax'; valid: numpy, torch"):
        evaluate(F, {"X": x, "W": w}, backend="jax")


# ----------------------------------------------------------------------------- derived blocks
def test_block_values_unknown_name_lists_valid(attention):
    der, values = attention
    with pytest.raises(InputError, match=r"unknown value name\(s\) Z .*valid: W_K, W_Q, W_V, X, Y"):
        der.block("W_Q", "W_K", "outer").evaluate({**values, "Z": np.ones((2, 2))})


def test_block_missing_value(attention):
    der, values = attention
    v = {k: a for k, a in values.items() if k != "W_V"}
    with pytest.raises(InputError, match="missing values for W_V"):
        der.block("W_V", "W_Q", "full").evaluate(v)


def test_block_shape_mismatch_names_both(attention):
    der, values = attention
    v = dict(values, W_K=values["W_K"][:, :-1])
    with pytest.raises(InputError) as err:
        der.block("W_Q", "W_K", "functional").evaluate(v)
    msg = str(err.value)
    assert "W_K" in msg and "W_Q" in msg and str(tuple(values["W_Q"].shape)) in msg, msg


@pytest.mark.parametrize("name", ["X", "W_Q", "Y"])
def test_block_non_finite_rejected_even_if_unread(attention, name):
    """H_o of CE does not read Y, yet a NaN target is a user error worth reporting."""
    der, values = attention
    bad = values[name].copy()
    bad[0, 0] = np.nan
    with pytest.raises(InputError, match=f"{name} contains non-finite"):
        der.block("W_Q", "W_Q", "outer").evaluate(dict(values, **{name: bad}))


def test_unknown_names_list_the_valid_ones(attention):
    der, _ = attention
    with pytest.raises(KeyError, match="unknown layer 'attn'; valid: .*attention"):
        symhess.layer("attn")
    with pytest.raises(KeyError, match="unknown loss 'l2'; valid: ce, .*mse"):
        symhess.derive(symhess.layer("attention"), "l2")
    with pytest.raises(KeyError, match="unknown block 'W_Z' for layer 'attention'; valid: W_Q, W_K, W_V"):
        der.block("W_Z", "W_Q")
    with pytest.raises(KeyError, match="unknown block 'W_O'"):
        der.block("W_Q", "W_O", "outer")
    with pytest.raises(ValueError, match="unknown part 'both'; valid: outer, functional, full"):
        der.block("W_Q", "W_Q", "both")
    with pytest.raises(KeyError, match="unknown intermediate 'Q'; valid: T, A"):
        der.block("W_Q", "W_K", "functional", at="Q")
    with pytest.raises(TypeError, match="unknown option.*mask.*valid: causal, scale"):
        symhess.layer("attention", mask=True)
    with pytest.raises(ValueError, match="unknown part 'all'"):
        der.hvp_expressions("all")


def test_user_layer_values_validated():
    """A user-declared layer gets the same checks."""
    lay = symhess.Layer("mine", E.elementwise("tanh", X @ W), (W,), (X,))
    der = symhess.derive(lay, "mse")
    y = rng.standard_normal((3, 5))
    blk = der.block("W", "W", "full")
    assert blk.evaluate({"X": x, "W": w, "Y": y}).shape == (20, 20)
    with pytest.raises(InputError, match="shape mismatch"):
        blk.evaluate({"X": x, "W": w, "Y": y.T})
    with pytest.raises(InputError, match="non-finite"):
        blk.evaluate({"X": x, "W": w * np.inf, "Y": y})


def test_bare_evaluate_names_the_node_that_turns_non_finite():
    """evaluate() of a LayerNorm expression on a constant row raises, naming the node (no NaN out)."""
    import numpy as np
    import pytest
    from symhess import expr as E
    from symhess.evaluate import InputError, evaluate
    from symhess.transformer import layer_norm

    L, d = E.dims("L d")
    ln, _ = layer_norm(E.matrix("U", L, d), eps=0)
    u = np.random.default_rng(0).standard_normal((3, 4))
    assert np.all(np.isfinite(evaluate(ln, {"U": u})))
    u[1] = 2.5                                    # row 1 has zero variance
    with pytest.raises(InputError, match=r"non-finite.*rsqrt\(sigma2_Y\)"):
        evaluate(ln, {"U": u})

"""Bad input through the API: a documented symhess.errors exception that names the problem
(never a deep numpy traceback, a bare MemoryError or a silently wrong number)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symhess
from symhess import expr as E
from symhess.errors import BudgetError, DeclarationError, DuplicateNameError, OptionError, ShapeError, SymhessError, UnknownNameError
from symhess.expr.evaluate import InputError, check_values, evaluate
from symhess.calculus.verify import random_values

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
    """Each is a documented symhess.errors type and keeps its built-in base class."""
    der, _ = attention
    with pytest.raises(UnknownNameError, match="unknown layer 'attn'; valid: .*attention") as err:
        symhess.layer("attn")
    assert isinstance(err.value, KeyError) and str(err.value).startswith("unknown layer")
    with pytest.raises(UnknownNameError, match="unknown loss 'l2'; valid: ce, .*mse"):
        symhess.derive(symhess.layer("attention"), "l2")
    with pytest.raises(UnknownNameError, match="unknown block 'W_Z' for layer 'attention'; valid: W_Q, W_K, W_V"):
        der.block("W_Z", "W_Q")
    with pytest.raises(UnknownNameError, match="unknown block 'W_O'"):
        der.block("W_Q", "W_O", "outer")
    with pytest.raises(UnknownNameError, match="unknown part 'both'; valid: outer, functional, full") as err:
        der.block("W_Q", "W_Q", "both")
    assert isinstance(err.value, ValueError)
    with pytest.raises(UnknownNameError, match="unknown intermediate 'Q'; valid: T, A"):
        der.block("W_Q", "W_K", "functional", at="Q")
    with pytest.raises(OptionError, match="unknown option.*'mask'.*valid: causal, scale") as err:
        symhess.layer("attention", mask=True)
    assert isinstance(err.value, TypeError)
    with pytest.raises(UnknownNameError, match="unknown part 'all'"):
        der.hvp_expressions("all")
    with pytest.raises(DeclarationError, match="functional part only"):
        der.block("W_Q", "W_K", "outer", at="T")
    with pytest.raises(UnknownNameError, match="unknown elementwise function 'tan'; valid: exp"):
        E.elementwise("tan", X)
    with pytest.raises(DuplicateNameError, match="layer 'attention' is already registered"):
        symhess.register_layer("attention")(lambda: None)


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
    from symhess.expr import nodes as E
    from symhess.expr.evaluate import InputError, evaluate
    from symhess.layers.transformer import layer_norm

    L, d = E.dims("L d")
    ln, _ = layer_norm(E.matrix("U", L, d), eps=0)
    u = np.random.default_rng(0).standard_normal((3, 4))
    assert np.all(np.isfinite(evaluate(ln, {"U": u})))
    u[1] = 2.5                                    # row 1 has zero variance
    with pytest.raises(InputError, match=r"non-finite.*rsqrt\(sigma2_Y\)"):
        evaluate(ln, {"U": u})


# ----------------------------------------------------------------------------- the value policy
def test_check_values_names_the_first_bad_index_in_any_rank():
    """The kernels take a leading batch axis: the index has as many entries as the array."""
    a = np.zeros((2, 3, 4))
    a[1, 0, 2], a[1, 2, 3] = np.inf, np.nan
    with pytest.raises(InputError, match=r"^X contains non-finite entries \(NaN or inf\): inf at "
                                         r"index \(1, 0, 2\), 2 of 24 entries"):
        check_values({"X": a})
    t = torch.as_tensor(a)
    with pytest.raises(InputError, match=r"inf at index \(1, 0, 2\), 2 of 24"):
        check_values({"W": np.ones(3), "X": t})
    big = np.full((2, 2), 1e308)     # the sum overflows, the entries are finite
    assert check_values({"X": big})["X"] is big
    big_t = torch.as_tensor(big)
    assert check_values({"X": big_t})["X"] is big_t
    with pytest.raises(InputError, match=r"-inf at index \(0, 1\), 1 of 4"):
        check_values({"X": torch.tensor([[1e308, -np.inf], [1e308, 1.0]], dtype=torch.float64)})


def test_check_values_returns_arrays_as_given():
    t = torch.ones(2, 2, dtype=torch.float32)
    out = check_values({"A": x, "B": x.tolist()})
    assert out["A"] is x and isinstance(out["B"], np.ndarray) and out["B"].dtype == np.float64
    assert check_values({"T": t})["T"] is t


@pytest.mark.parametrize("bad, needle", [
    ([1, 2], "values must be a mapping from names to arrays"),
    ({1: x}, "value names must be strings, got 1"),
])
def test_values_must_be_a_mapping_of_names(bad, needle, attention):
    with pytest.raises(InputError, match=needle):
        evaluate(F, bad)
    der, _ = attention
    with pytest.raises(InputError, match=needle):
        der.block("W_Q", "W_Q").evaluate(bad)


def test_check_finite_false_skips_the_scans():
    """The escape hatch: NaN propagates into the result instead of an error."""
    xb = x.copy()
    xb[0, 0] = np.nan
    out = evaluate(F, {"X": xb, "W": w}, check_finite=False)
    assert np.isnan(out[0]).all() and np.isfinite(out[1:]).all()
    lay = symhess.Layer("mine", E.elementwise("tanh", X @ W), (W,), (X,))
    blk = symhess.derive(lay, "mse").block("W", "W", "full")
    got = blk.evaluate({"X": xb, "W": w, "Y": np.zeros((3, 5))}, check_finite=False)
    assert np.isnan(got).any()


def test_evaluate_needs_an_expression():
    with pytest.raises(DeclarationError, match=r"evaluate needs a symhess expression .*got list \[1, 2\]"):
        evaluate([1, 2], {"X": x})


# ----------------------------------------------------------------------------- dimensions in products
def test_a_dimension_inside_a_product_is_solved_from_the_known_factor():
    L, b, d = E.dims("L b d")
    C0, P0 = E.matrix("C0", L * b, d), E.matrix("P0", L, 1)
    Wd = E.param("Wd", d, 1)
    expr = C0 @ Wd + E.kron(P0, E.ones(b, 1))
    c0, p0, wd = rng.standard_normal((6, 3)), rng.standard_normal((2, 1)), rng.standard_normal((3, 1))
    got = evaluate(expr, {"C0": c0, "P0": p0, "Wd": wd})                 # L = 2 from P0: b = 3
    assert np.allclose(got, c0 @ wd + np.kron(p0, np.ones((3, 1))), rtol=0, atol=1e-15)
    assert np.allclose(evaluate(C0 @ Wd, {"C0": c0, "Wd": wd}, env={L: 3}), c0 @ wd)
    with pytest.raises(InputError, match=r"cannot infer L, b from C0 \(shape \(6, 3\), declared "
                                         r"\(L\*b × d\)\): L\*b = 6 has 2 unknown factors"):
        evaluate(C0 @ Wd, {"C0": c0, "Wd": wd})
    with pytest.raises(InputError, match=r"no positive integer b gives L\*b = 6 with L = 4"):
        evaluate(C0 @ Wd, {"C0": c0, "Wd": wd}, env={L: 4})
    S = E.matrix("S", b * b, 1)
    assert evaluate(S, {"S": np.ones((9, 1))}).shape == (9, 1)               # b² = 9: b = 3
    with pytest.raises(InputError, match=r"no positive integer b gives b\*\*2 = 8"):
        evaluate(S, {"S": np.ones((8, 1))})


# ----------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("make, needle", [
    (lambda: E.dims("1a"), r"dimension name '1a' is not an identifier"),
    (lambda: E.dims("L, d"), r"dimension name 'L,' is not an identifier"),
    (lambda: E.dims(""), r"dims expects names separated by spaces"),
    (lambda: E.dim("lambda"), r"dimension name 'lambda' is not an identifier"),
    (lambda: E.kron(X, 3), r"kron: operand 2 is int 3, not a symhess expression \(scale by"),
    (lambda: E.matmul(X, np.ones((4, 5))), r"matmul: operand 2 is ndarray"),
    (lambda: X + 1.5, r"add: operand 2 is float 1.5"),
    (lambda: E.hadamard("X", X), r"hadamard: operand 1 is str 'X'"),
    (lambda: E.elementwise("exp", 2.0), r"elementwise: operand 1 is float 2.0"),
    (lambda: E.softmax_rows(X @ X.T, causal="false"), r"softmax_rows: causal must be True or False, got 'false'"),
    (lambda: X / X, r"divide by an expression"),
    (lambda: symhess.Layer("x", 3.0, (W,)), r"layer 'x': the output must be a symhess expression .*got float 3.0"),
    (lambda: symhess.Layer("x", X @ W, ()), r"layer 'x' needs at least one parameter"),
    (lambda: symhess.Layer("x", X @ W, ("W",)), r"layer 'x': parameter 'W' is not a variable"),
    (lambda: symhess.Layer("x", X @ W, (W,), ("X",)), r"layer 'x': input 'X' is not a variable"),
    (lambda: symhess.Layer("", X @ W, (W,)), r"a layer's name must be a non-empty string"),
    (lambda: symhess.derive(3.0), r"derive needs a symhess Layer or a registered layer's name, got float"),
    (lambda: random_values(symhess.derive("attention"), seed=-1), r"seed must be a non-negative integer, got -1"),
])
def test_bad_declarations_are_declaration_errors(make, needle):
    with pytest.raises(DeclarationError, match=needle):
        make()


def test_a_single_parameter_need_not_be_a_tuple():
    assert symhess.Layer("x", X @ W, W, X).params == (W,)


def _bool_options():
    from symhess.layers.registry import layer_options
    return [(name, key) for name in sorted(symhess.LAYERS)
            for key, default in layer_options(name).items() if isinstance(default, bool)]


@pytest.mark.parametrize("name, key", _bool_options())
@pytest.mark.parametrize("value", ["false", "maybe", 0, 1, None])
def test_bool_options_take_only_true_or_false(name, key, value):
    """causal="false" was truthy: it applied the mask."""
    with pytest.raises(OptionError, match=rf"{key} must be True or False for layer '{name}', got {value!r}"):
        symhess.layer(name, **{key: value})


def test_every_causal_layer_is_covered():
    assert {n for n, k in _bool_options() if k == "causal"} >= {
        "attention", "linear_attention", "single_matrix_attention", "multihead_attention",
        "value_output_attention", "post_ln_block", "pre_ln_block"}


def test_symhess_errors_are_one_family():
    for cls in (DeclarationError, UnknownNameError, OptionError, DuplicateNameError, ShapeError,
                InputError, BudgetError):
        assert issubclass(cls, SymhessError)
    assert issubclass(ShapeError, ValueError) and issubclass(BudgetError, MemoryError)


# ----------------------------------------------------------------------------- memory budget
def test_evaluate_refuses_work_beyond_the_budget_before_allocating(monkeypatch):
    """X ⊗ X at 1000 × 1000 is 7.3 TiB: a BudgetError naming the sizes, not a MemoryError."""
    monkeypatch.delenv("SYMHESS_MEMORY_BUDGET", raising=False)
    m_, n_ = E.dims("m n")
    Xm = E.matrix("X", m_, n_)
    with pytest.raises(BudgetError, match=r"would take about 7\.3 TiB at m = 1000, n = 1000, "
                                          r"more than the memory budget") as err:
        evaluate(E.kron(Xm, Xm), {"X": np.zeros((1000, 1000))})
    assert "Kron of 1000000 × 1000000" in str(err.value)


def test_the_budget_can_be_set(monkeypatch, attention):
    der, values = attention
    monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", "1KiB")
    with pytest.raises(BudgetError, match=r"evaluating the full block \(W_Q, W_K\) .*more than the "
                                          r"memory budget of 1\.0 KiB \(SYMHESS_MEMORY_BUDGET"):
        der.block("W_Q", "W_K").evaluate(values)
    monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", "none")
    assert der.block("W_Q", "W_K").evaluate(values).shape[0] == values["W_Q"].size
    monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", "lots")
    with pytest.raises(DeclarationError, match="SYMHESS_MEMORY_BUDGET='lots' is not a size"):
        der.block("W_Q", "W_K").evaluate(values)


def test_verify_refuses_sizes_beyond_the_budget(monkeypatch):
    from symhess.calculus.verify import verify
    monkeypatch.delenv("SYMHESS_MEMORY_BUDGET", raising=False)
    der = symhess.derive(symhess.layer("attention"), "mse")
    with pytest.raises(BudgetError, match=r"verifying 'attention' against autograd would take about "
                                          r".* at L = 4, d_K = 300, d_V = 300"):
        verify(der, sizes={"L": 4, "d_V": 300, "d_K": 300})
    with pytest.raises(DeclarationError, match="size L must be a positive integer, got 0"):
        verify(der, sizes={"L": 0})


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_kernel_names_a_bad_entry_by_the_index_of_the_array_given(backend):
    """Data without a batch axis get one inside the kernel; the error still indexes the
    caller's array: (row, column) for 2-D data, (sequence, row, column) for 3-D."""
    from symhess.curvature.dataset import Dataset
    k = symhess.kernel("attention", backend, "mse")
    values = symhess.random_values(symhess.derive(symhess.layer("attention"), "mse"), seed=0)
    conv = (lambda a: torch.as_tensor(a)) if backend == "torch" else (lambda a: a)
    x = values["X"].copy()
    x[1, 2] = np.nan
    n = x.size
    with pytest.raises(InputError, match=rf"^X contains non-finite entries \(NaN or inf\): nan at "
                                         rf"index \(1, 2\), 1 of {n} entries"):
        k.prepare({**{k_: conv(v) for k_, v in values.items()}, "X": conv(x)})
    with pytest.raises(InputError, match=rf"nan at index \(1, 2\), 1 of {n} entries"):
        Dataset(k, {**{k_: conv(v) for k_, v in values.items()}, "X": conv(x)}).loss()
    xb = np.stack([values["X"], x])
    yb = np.stack([values["Y"], values["Y"]])
    with pytest.raises(InputError, match=rf"nan at index \(1, 1, 2\), 1 of {2 * n} entries"):
        k.prepare({**{k_: conv(v) for k_, v in values.items()}, "X": conv(xb), "Y": conv(yb)})


def test_a_budget_too_small_to_slice_raises_at_the_floor(monkeypatch):
    """SYMHESS_MEMORY_BUDGET=300 leaves 9 entries per intermediate: keeping to it would cut
    the diagonal's contractions into thousands of pieces (minutes of overhead, even with
    compacts formed a slice of sequences at a time); the slicing floor counts them before
    anything runs and raises."""
    from symhess.runtime import contract as C
    from symhess.runtime.numpy_ops import OPS
    rng = np.random.default_rng(0)
    L_, d_ = 50, 8
    vals = {"X": rng.standard_normal((L_, d_)), "Y": rng.standard_normal((L_, d_)),
            "W_Q": rng.standard_normal((d_, 4)), "W_K": rng.standard_normal((d_, 4)),
            "W_V": rng.standard_normal((d_, d_))}
    monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", "300")
    k = symhess.kernel("attention", "numpy", "mse")
    with pytest.raises(BudgetError, match=r"memory budget of 9 entries would cut a contraction "
                                          r"into .* slices \(the most is 1,024"):
        k.diag(vals, "W_Q")
    monkeypatch.delenv("SYMHESS_MEMORY_BUDGET")
    # the floor is per contraction: a contraction sliced into few pieces still runs exactly
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 40))
    assert np.allclose(C.contract(OPS, [a, b], [(0, 1), (1, 2)], (0, 2), limit=400), a @ b)
    c = rng.standard_normal((40, 40))              # tr(a b c) at one entry: thousands of pieces
    with pytest.raises(BudgetError, match="into more than 2,048 slices"):
        C.contract(OPS, [a, b, c], [(0, 1), (1, 2), (2, 0)], (), limit=1)
    assert np.isclose(C.contract(OPS, [a, b, c], [(0, 1), (1, 2), (2, 0)], (), limit=40),
                      np.trace(a @ b @ c))


def test_a_budget_beyond_any_machine_is_named(monkeypatch, attention):
    der, values = attention
    for text in ("1e400", "1e30TiB"):
        monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", text)
        with pytest.raises(DeclarationError, match=rf"SYMHESS_MEMORY_BUDGET='{text}' is beyond any machine"):
            der.block("W_Q", "W_K").evaluate(values)


def test_verify_and_random_values_check_what_they_are_given(monkeypatch):
    """A layer name instead of a derivation, sizes or scales that are no dicts or no finite
    numbers, and values too large for memory: one line each, before anything is drawn."""
    der = symhess.derive(symhess.layer("attention"), "mse")
    for call in (lambda: symhess.verify("attention"), lambda: random_values("attention")):
        with pytest.raises(DeclarationError, match="takes a derivation .*got str"):
            call()
    with pytest.raises(DeclarationError, match="sizes must be a dict of dimension sizes"):
        random_values(der, sizes="L=3")
    with pytest.raises(DeclarationError, match="scale must be a dict"):
        random_values(der, scale=2.0)
    with pytest.raises(DeclarationError, match=r"scale X must be a finite number >= 0, got nan"):
        random_values(der, scale={"X": float("nan")})
    with pytest.raises(DeclarationError, match=r"scale 'Z': no such value; valid: W_K, W_Q, W_V, X"):
        random_values(der, scale={"Z": 1.0})
    monkeypatch.setenv("SYMHESS_MEMORY_BUDGET", "1GiB")
    with pytest.raises(BudgetError, match="the random values would take about"):
        random_values(der, sizes={"L": 10 ** 12})
    monkeypatch.delenv("SYMHESS_MEMORY_BUDGET")
    assert np.allclose(random_values(der, scale={"X": 2.0})["X"], 2 * random_values(der)["X"])


def test_an_unknown_product_method_is_refused_by_the_operator():
    der = symhess.derive(symhess.layer("attention"), "mse")
    vals = random_values(der)
    k = symhess.kernel("attention", "numpy", "mse")
    with pytest.raises(InputError, match="unknown product method 'bogus'; valid: auto, matview, kernel"):
        symhess.operator(k, vals, method="bogus")

"""Symbolic facts: canonical forms, structural zeros, declaration errors, registries.

These hold as expressions (``==`` is structural equality, ``is_zero`` means the Zero
node), independent of any numbers.
"""
from __future__ import annotations

import pytest
import sympy as sp

import symhess
from symhess import expr as E
from symhess.expr import nodes
from symhess.calculus.adjoint import ADJOINTS, adjoint, adjoint_rule
from symhess.calculus.kron import VECTORISERS, vec_jacobian, vectoriser
from symhess.layers.registry import LAYERS, register_layer
from symhess.expr.layer import Layer
from symhess.calculus.losses import LOSSES, loss
from symhess.calculus.rules import RULES, differential, rule

m, n, p, q = E.dims("m n p q")
A, B = E.matrix("A", m, n), E.matrix("B", n, p)
C, D = E.matrix("C", p, q), E.matrix("D", q, m)
X, W = E.matrix("X", m, n), E.param("W", n, p)


def direction(var, tag="D"):
    return E.Var(f"{tag}_{var.name}", var.rows, var.cols, "direction")


# ----------------------------------------------------------------------------- canonical forms
def test_a_plus_a_is_two_a():
    assert A + A == E.scale(2, A) == 2 * A
    assert A + A + A - A == 2 * A


def test_a_minus_a_is_zero():
    z = A - A
    assert z.is_zero and z.shape == A.shape


def test_double_transpose_is_the_same_node():
    assert A.T.T is A
    assert (A @ B).T.T == A @ B


def test_transpose_of_product_reverses():
    assert (A @ B).T == B.T @ A.T
    assert (A @ B @ C).T == C.T @ B.T @ A.T
    assert (2 * (A @ B)).T == 2 * (B.T @ A.T)


def test_transpose_pushes_through_sums_kron_hadamard():
    assert (A + X).T == A.T + X.T
    assert E.kron(A, B).T == E.kron(A.T, B.T)
    assert (A * X).T == A.T * X.T
    assert E.elementwise("tanh", A).T == E.elementwise("tanh", A.T)


def test_commutative_operands_are_sorted():
    assert A + X == X + A
    assert A * X == X * A
    assert A + (X + A) == (2 * A) + X


def _doubling_dag(depth):
    """x_k = tanh(x_{k-1} S) + x_{k-1}: each level refers to the previous one twice, so the
    expression has depth + 1 distinct levels but 2**depth paths (a derivation's DAGs)."""
    S = E.matrix("S", m, m)
    x = S
    for _ in range(depth):
        x = E.elementwise("tanh", x @ S) + x
    return x


def test_transpose_of_a_shared_dag_is_memoised(monkeypatch):
    calls = []
    real = nodes._transpose
    monkeypatch.setattr(nodes, "_transpose", lambda a: calls.append(a) or real(a))
    x = _doubling_dag(12)
    xt = E.transpose(x)
    assert len(calls) < 20 * 12           # once per distinct node, not once per path (≥ 4096)
    assert E.transpose(x) is xt
    assert E.transpose(xt) == x


def test_sort_keys_of_a_shared_dag_stay_short_and_deterministic():
    x, y = _doubling_dag(16), _doubling_dag(16)
    assert x is not y and x.key == y.key
    assert len(x.key) <= nodes.KEY_MAX        # the spelled-out key would be ≥ 2**16 characters
    assert E.matrix("S", m, m).key in _doubling_dag(2).key    # short keys are spelled out
    assert _doubling_dag(15).key != x.key


def test_identity_elimination():
    assert A @ E.identity(n) == A
    assert E.identity(m) @ A == A
    assert E.identity(m) @ A @ E.identity(n) @ B == A @ B
    assert E.kron(E.identity(1), A) == A
    assert E.kron(E.identity(m), E.identity(n)) == E.identity(m * n)
    assert E.scale(1, A) is A


def test_zero_elimination_keeps_shapes():
    z = A @ E.zero(n, p)
    assert z.is_zero and z.shape == (m, p)
    assert A + E.zero(m, n) == A
    assert (A * E.zero(m, n)).is_zero
    k = E.kron(A, E.zero(p, q))
    assert k.is_zero and k.shape == (m * p, n * q)
    assert E.scale(0, A).is_zero
    assert E.transpose(E.zero(m, n)).shape == (n, m)
    assert E.vec_r(E.zero(m, n)).shape == (m * n, 1)


def test_ones_absorb_in_hadamard_and_products():
    assert A * E.ones(m, n) == A
    assert E.ones(m, n) @ E.ones(n, p) == n * E.ones(m, p)


def test_commutation_algebra():
    k = E.commutation(m, n)
    assert k @ E.commutation(n, m) == E.identity(m * n)
    assert E.transpose(k) == E.commutation(n, m)
    assert E.commutation(m, 1) == E.identity(m)


def test_mixed_product_rule():
    P, Q = E.matrix("P", n, q), E.matrix("Q", p, m)
    assert E.kron(A, B) @ E.kron(P, Q) == E.kron(A @ P, B @ Q)
    # non-conforming factors are left alone (the product is still well defined)
    R = E.matrix("R", n * p, q)
    assert isinstance(E.kron(A, B) @ R, E.MatMul)


def test_scalars_collect_through_products_and_kron():
    assert (2 * A) @ (3 * B) == 6 * (A @ B)
    assert E.kron(2 * A, 3 * B) == 6 * E.kron(A, B)
    c = 1 / sp.sqrt(n)
    assert (c * A) @ B == c * (A @ B)


def test_vec_unvec_diag_roundtrips():
    v = E.matrix("v", m, 1)
    assert E.diag_part(E.diag(v)) == v
    assert E.vec_r(v) == v
    assert E.unvec_r(E.vec_r(A), m, n) == A


def test_elementwise_library_derivatives_are_named():
    assert E.elementwise("exp", A).fn.derivative().name == "exp"
    assert E.elementwise("log", A).fn.derivative().name == "recip"
    assert E.elementwise("relu", A).fn.derivative().name == "step"
    assert E.elementwise("square", A).fn.derivative().derivative().constant == 2
    assert E.power(A, 2) == E.elementwise("square", A)
    assert E.power(A, 1) == A


# ----------------------------------------------------------------------------- structural zeros
@pytest.mark.parametrize("F", [
    A @ W @ C,
    E.kron(W, D) + E.kron(W, D).T.T,
    W.T @ A.T @ X + 3 * E.matrix("P", p, m) @ X,
    E.softmax_rows(A @ B) @ W.T * E.matrix("S", m, n),
    E.sum_all(E.diag_part(W @ E.matrix("S", p, n))),
], ids=["AWC", "kron", "transposes", "hadamard_const", "trace"])
def test_second_derivative_of_linear_map_is_zero(F):
    d1 = differential(F, {W: direction(W)})
    assert not d1.is_zero
    assert differential(d1, {W: direction(W, "D2")}).is_zero


def test_first_derivative_of_constant_is_zero():
    F = E.softmax_rows(A @ B) @ C
    d = differential(F, {W: direction(W)})
    assert d.is_zero and d.shape == F.shape
    assert vec_jacobian(d, direction(W)).is_zero


def test_relu_has_no_second_derivative():
    F = E.elementwise("relu", X @ W)
    d2 = differential(differential(F, {W: direction(W)}), {W: direction(W, "D2")})
    assert d2.is_zero


@pytest.fixture(scope="module")
def attention():
    return symhess.derive(symhess.layer("attention"), "mse")


def test_attention_value_value_functional_block_is_zero(attention):
    assert attention.block("W_V", "W_V", "functional").is_zero
    assert attention.raw_block("W_V", "W_V", "functional").is_zero
    assert not attention.block("W_V", "W_V", "outer").is_zero


def test_attention_t_functional_term_only_in_query_key(attention):
    names = ("W_Q", "W_K", "W_V")
    for a in names:
        for b in names:
            zero = attention.block(a, b, "functional", at="T").is_zero
            assert zero == ({a, b} != {"W_Q", "W_K"}), (a, b)


@pytest.mark.parametrize("loss_name", ["mse", "ce"])
def test_layer_linear_in_a_parameter_has_zero_functional_diagonal(loss_name):
    """F = tanh(X W) V is linear in V: H_f(V, V) is the Zero node, H_f(W, W) is not."""
    V = E.param("V", p, q)
    lay = Layer("tanh_mlp", E.elementwise("tanh", X @ W) @ V, (W, V), (X,))
    der = symhess.derive(lay, loss_name)
    assert der.block("V", "V", "functional").is_zero
    assert not der.block("W", "W", "functional").is_zero
    assert not der.block("W", "V", "functional").is_zero
    assert not der.block("V", "V", "outer").is_zero


def test_mse_outer_part_does_not_read_the_target(attention):
    """H_o for MSE is J_pᵀ (2/(Ld)) J_q: Y must not appear in it, but it appears in H_f."""
    names = lambda e: {v.name for v in E.walk(e) if isinstance(v, E.Var)}  # noqa: E731
    assert "Y" not in names(attention.block("W_Q", "W_K", "outer").expr)
    assert "Y" in names(attention.block("W_Q", "W_K", "functional").expr)


def test_jacobian_of_transpose_uses_the_right_commutation():
    """vec_r(Wᵀ) = K_{p,n} vec_r W for W n×p: K_{a,b} vec_r(B) = vec_r(Bᵀ) for B b×a."""
    d = direction(W)
    assert vec_jacobian(differential(W.T, {W: d}), d) == E.commutation(p, n)
    assert vec_jacobian(differential(W.T, {W: d}), d) != E.commutation(n, p)


def test_adjoint_of_product_is_transposed_product():
    d, g = direction(W), E.matrix("G", m, q)
    assert adjoint(differential(A @ W @ C, {W: d}), d, g) == A.T @ g @ C.T


# ----------------------------------------------------------------------------- declaration errors
@pytest.mark.parametrize("build, kind", [
    (lambda: A @ A, "matmul"),
    (lambda: A @ B @ D, "matmul"),
    (lambda: A + B, "add"),
    (lambda: A * B, "hadamard"),
])
def test_shape_errors_name_both_shapes(build, kind):
    with pytest.raises(symhess.ShapeError) as err:
        build()
    msg = str(err.value)
    assert kind in msg
    assert msg.count("×") >= 2, msg


def test_shape_error_messages_are_specific():
    with pytest.raises(symhess.ShapeError, match=r"\(m × n\) @ \(m × n\)"):
        A @ A
    with pytest.raises(symhess.ShapeError, match=r"\(m × n\) and \(n × p\)"):
        A + B
    with pytest.raises(symhess.ShapeError, match=r"\(m × n\) and \(n × p\)"):
        A * B
    with pytest.raises(symhess.ShapeError, match="square"):
        E.softmax_rows(A, causal=True)
    with pytest.raises(symhess.ShapeError, match="column vector"):
        E.diag(A)
    with pytest.raises(symhess.ShapeError, match="square"):
        E.diag_part(A)


def test_shape_error_is_a_value_error():
    assert issubclass(symhess.ShapeError, ValueError)


def test_unknown_function_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        E.elementwise("swish", A)
    msg = str(err.value)
    assert "swish" in msg
    for name in ("exp", "tanh", "sigmoid", "gelu", "relu", "pow"):
        assert name in msg


def test_power_needs_a_number():
    assert E.power(A, "1/2") == E.elementwise("sqrt", A)
    for bad in (None, "abc", sp.Symbol("t"), 2 + 1j, "1/"):
        with pytest.raises((ValueError, TypeError), match="exponent"):
            E.power(A, bad)


@pytest.mark.parametrize("bad", [0, -2, 2.5, sp.Rational(1, 2)])
def test_dimensions_must_be_positive_integers(bad):
    with pytest.raises(symhess.ShapeError, match="dimension"):
        E.matrix("Q", bad, 3)


def test_empty_products_and_sums_are_refused():
    for fn in (E.matmul, E.add, E.hadamard):
        with pytest.raises(TypeError, match="at least one"):
            fn()


def test_layer_must_depend_on_its_parameters():
    V = E.param("V", p, q)
    with pytest.raises(ValueError, match="does not depend on V"):
        Layer("bad", X @ W, (W, V), (X,))


def test_layer_parameter_names_must_be_unique():
    with pytest.raises(ValueError, match="repeat"):
        Layer("bad", X @ W + X @ E.param("W", n, p), (W, E.param("W", n, p)), (X,))


# ----------------------------------------------------------------------------- registries
@pytest.mark.parametrize("table, register, key", [
    (RULES, rule, E.MatMul),
    (VECTORISERS, vectoriser, E.MatMul),
    (ADJOINTS, adjoint_rule, E.MatMul),
    (LAYERS, register_layer, "attention"),
    (LOSSES, loss, "mse"),
])
def test_duplicate_registration_raises_and_keeps_the_original(table, register, key):
    original = table[key]
    with pytest.raises(KeyError, match="already registered"):
        register(key)(lambda *a, **k: None)
    assert table[key] is original

"""Every rewrite system terminates by construction (symhess.calculus.simplify's module docstring).

The display simplifier rewrites product chains in stages, each strictly decreasing a
natural-number measure.  The regression cases are chains with two softmax Jacobians, where
an unoriented commutation rewrite undid itself for ever; they must simply return.  A
property test draws random chains of commutations, Kronecker products and softmax
Jacobians/Hessians and checks, for every rewrite step, that the stage's measure drops and
that the simplified chain has the same value.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

import symhess as sh
from symhess import expr as E
from symhess.calculus import simplify as S
from symhess.expr.evaluate import evaluate
from symhess.calculus.verify import TOLERANCE, verify


def two_softmax_layer():
    """F = softmax_rows(X W_1) softmax_rows(W_2): two softmax Jacobians in one chain."""
    L, d = E.dims("L d")
    X = E.matrix("X", L, d)
    W_1, W_2 = E.param("W_1", d, L), E.param("W_2", L, d)
    F = E.softmax_rows(X @ W_1) @ E.softmax_rows(W_2)
    return sh.Layer("two_softmax", F, (W_1, W_2), (X,))


def test_two_softmax_jacobians_in_one_chain_simplify_and_match_autograd():
    d = sh.derive(two_softmax_layer(), "mse")
    block = d.block("W_1", "W_2", "functional")
    assert not block.is_zero
    checks, _ = verify(d, seed=3)
    assert max(c.error for c in checks) <= TOLERANCE


def test_commutation_rewrite_never_undoes_itself():
    """S·K·(A⊗B)·S' is left as it is: moving K next to S' would be undone (the old loop)."""
    A, B = E.param("A", 2, 2), E.param("B", 3, 3)
    S1 = E.SoftmaxJac(E.softmax_rows(E.param("T", 2, 3)))
    S2 = E.SoftmaxJac(E.softmax_rows(E.param("U", 2, 3)))
    chain = [S1, E.commutation(3, 2), E.kron(A, B), S2]
    assert S._commutations_outward(chain) is None
    # with no structured operator on the far side the commutation does move outward
    moved = S._commutations_outward([S1, E.commutation(3, 2), E.kron(A, B)])
    assert moved is not None and isinstance(moved[-1], E.Commutation)


# ----------------------------------------------------------------------------- property test
# Square operators of size 6 = 2·3 (every pair conforms), X a 3×3 input so that the moment
# sandwiches (I⊗Xᵀ) ∂A/∂T (I⊗X) and their Z forms can appear.
P2, Q2 = E.param("P", 2, 2), E.param("Q", 2, 2)
R3, X = E.param("R", 3, 3), E.matrix("X", 3, 3)
T23, U23 = E.param("T", 2, 3), E.param("U", 2, 3)
E23 = E.param("E", 2, 3)
A, A2 = E.softmax_rows(T23), E.softmax_rows(U23)

FACTORS = [
    E.commutation(2, 3), E.commutation(3, 2),
    E.kron(P2, R3), E.kron(R3, Q2), E.kron(P2, R3 @ X.T), E.kron(Q2, X @ R3),
    E.kron(E.identity(2), X.T), E.kron(E.identity(2), X),
    E.SoftmaxJac(A), E.SoftmaxJac(A2), E.SoftmaxHess(A, E23 @ X.T),
]


def _values(seed):
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal((int(v.rows), int(v.cols)))
            for v in (P2, Q2, R3, X, T23, U23, E23)}


@given(st.lists(st.sampled_from(range(len(FACTORS))), min_size=2, max_size=9), st.integers(0, 3))
def test_simplify_terminates_with_decreasing_measures_and_keeps_values(idx, seed):
    factors = [FACTORS[i] for i in idx]
    for measure, before, after in S.rewrite_steps(factors):
        assert measure(after) < measure(before)
    chain = E.matmul(*factors)
    simple = S.simplify(chain)
    vals = _values(seed)
    want, got = evaluate(chain, vals), evaluate(simple, vals)
    assert np.linalg.norm(got - want) <= 1e-12 * max(1.0, np.linalg.norm(want))


# ----------------------------------------------------------------------------- canonical products
def _size(e, memo=None):
    """n(e): nodes of e's tree other than MatMul and Scale (the expr/nodes.py measure)."""
    memo = {} if memo is None else memo
    if e not in memo:
        own = 0 if isinstance(e, (E.MatMul, E.Scale)) else 1
        memo[e] = own + sum(_size(a, memo) for a in e.args)
    return memo[e]


B2, C3 = E.param("B", 2, 2), E.param("C", 3, 3)
KRON_FACTORS = [
    E.commutation(2, 3), E.commutation(3, 2), E.kron(P2, R3), E.kron(R3, Q2),
    E.kron(B2, C3), E.kron(C3, B2), E.kron(E.identity(2), C3), E.kron(E.ones(2, 2), E.ones(3, 3)),
    E.identity(6), 2 * E.kron(P2, E.identity(3)),
]


@given(st.lists(st.sampled_from(range(len(KRON_FACTORS))), min_size=1, max_size=10), st.integers(0, 3))
def test_canonical_product_never_grows_the_measure_and_keeps_values(idx, seed):
    """matmul's merges (mixed products, K K = I, 1·1 = k·1) return with n ≤ Σ n(operands)."""
    factors = [KRON_FACTORS[i] for i in idx]
    out = E.matmul(*factors)
    assert _size(out) <= sum(_size(f) for f in factors)
    vals = _values(seed)
    vals.update({"B": vals["P"] + 1.0, "C": vals["R"] - 1.0})
    want = np.eye(6)
    for f in factors:
        want = want @ evaluate(f, vals)
    assert np.linalg.norm(evaluate(out, vals) - want) <= 1e-12 * max(1.0, np.linalg.norm(want))

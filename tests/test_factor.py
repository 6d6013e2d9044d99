"""codegen.factor: sums rewritten onto products a routine forms anyway, and entrywise
products collected by their direction-dependent factors, equal in value to what they
replace and with fewer products or terms."""
from __future__ import annotations

import numpy as np

from symhess.codegen.factor import factor_shared
from symhess.expr import nodes as E
from symhess.expr.evaluate import evaluate


def _count(exprs, kind):
    seen = set()
    for e in exprs:
        seen.update(n for n in E.walk(e) if isinstance(n, kind))
    return len(seen)


def _values(names_shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in names_shapes}


def test_a_spelled_out_product_becomes_the_one_formed_anyway():
    """A F + 2 B F inside a sum is (A + 2B) F when both A + 2B and (A + 2B) F exist: one
    product less, the same values (also on the left, F A + F B)."""
    L, k, m = E.dims("L k m")
    A, B, C = E.matrix("A", L, k), E.matrix("B", L, k), E.matrix("C", L, m)
    F, G = E.param("F", k, m), E.param("G", m, L)
    S = A + 2 * B
    e1 = E.hadamard(S @ F, C)
    e2 = A @ F + 2 * (B @ F) + C
    e3 = G @ A + G @ B
    e4 = G @ (A + B)
    before = [e1, e2, e3, e4, S]
    after = factor_shared(before)
    assert _count(after, E.MatMul) < _count(before, E.MatMul)
    vals = _values([("A", (4, 3)), ("B", (4, 3)), ("C", (4, 5)), ("F", (3, 5)), ("G", (5, 4))])
    for x, y in zip(before, after):
        assert np.abs(evaluate(x, vals) - evaluate(y, vals)).max() <= 1e-12
    assert S @ F in set(E.walk(after[1]))


def test_products_sharing_a_direction_factor_are_collected():
    """V ∘ X ∘ Y + 2 V ∘ Z + W ∘ X − W ∘ Y → V ∘ (X ∘ Y + 2 Z) + W ∘ (X − Y) for directions V,
    W: two entrywise products per call instead of four, the brackets free of directions."""
    L, d = E.dims("L d")
    X, Y, Z = (E.matrix(n, L, d) for n in "XYZ")
    V, W = (E.Var(n, L, d, role="direction") for n in "VW")
    e = E.hadamard(V, X, Y) + 2 * E.hadamard(V, Z) + E.hadamard(W, X) - E.hadamard(W, Y)
    (got,) = factor_shared([e])
    assert isinstance(got, E.Add) and len(got.args) == 2
    for t in got.args:
        dep = [f for f in E._split(t)[1].args if f.free_vars & {V, W}]
        assert len(dep) == 1
    vals = _values([(n, (3, 4)) for n in "XYZVW"], seed=1)
    assert np.abs(evaluate(e, vals) - evaluate(got, vals)).max() <= 1e-12


def test_nothing_to_fold_leaves_the_expressions_as_they_are():
    L, k, m = E.dims("L k m")
    A, B = E.matrix("A", L, k), E.matrix("B", L, k)
    F = E.param("F", k, m)
    e = A @ F + B @ F                    # (A + B) F is formed nowhere: nothing is introduced
    assert factor_shared([e]) == [e]

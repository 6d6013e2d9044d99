"""The index lowering keeps sums inside products: factored sums and compact block-diagonal sums."""
import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.codegen.program import Program
from symhess.expr.evaluate import evaluate
from symhess.codegen.index import factored, grouped, Lowering


def _values(names_shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in names_shapes.items()}


def test_common_prefix_and_suffix_are_pulled_out_of_a_sum():
    m, n = E.dims("m n")
    A, B, C, D = (E.matrix(x, m, m) for x in "ABCD")
    s = A @ B @ C + 3 * (A @ D @ C)
    f = factored(s)
    assert isinstance(f, E.MatMul) and f.args[0] == A and f.args[-1] == C
    assert isinstance(f.args[1], E.Add)
    vals = _values({x: (4, 4) for x in "ABCD"})
    assert np.allclose(evaluate(f, vals), evaluate(s, vals), rtol=1e-13, atol=1e-13)


def test_kronecker_factors_are_peeled_by_the_mixed_product_rule():
    m, n, k = E.dims("m n k")
    X = E.matrix("X", m, n)
    W1, W2, W3 = E.matrix("W1", k, k), E.matrix("W2", k, k), E.matrix("W3", k, k)
    s = E.kron(X, W1 @ W2) + E.kron(X, W3 @ W2)
    f = factored(s)
    assert not f == s and isinstance(f, E.MatMul)
    vals = _values({"X": (3, 2), "W1": (4, 4), "W2": (4, 4), "W3": (4, 4)})
    assert np.allclose(evaluate(f, vals), evaluate(s, vals), rtol=1e-13, atol=1e-13)


def test_a_sum_scaled_as_a_whole_is_recognised_as_the_same_factor():
    m = E.dims("m")[0]
    A, B, J = (E.matrix(x, m, m) for x in "ABJ")
    S = E.matrix("S1", m, m) + E.matrix("S2", m, m)
    s = A @ E.scale(2, S) @ J + B @ S @ J          # 2·S distributes its scalar onto S's terms
    f = factored(s)
    assert isinstance(f, E.MatMul) and f.args[-1] == J
    assert any(isinstance(x, E.Add) and x == S for x in f.args)


def test_terms_sharing_an_end_are_factored_in_groups():
    """(A ⊗ I) X − (1/d)(A ⊗ 1 1ᵀ) X + (B ⊗ I) Y: no factor is common to all three terms, but
    the first two end with X and become (A ⊗ (I − 11ᵀ/d)) X, whose centring is one compact
    factor when lowered (two terms instead of three)."""
    L, d = E.dims("L d")
    A, B = E.matrix("A", L, L), E.matrix("B", L, L)
    X, Y = E.matrix("X", L * d, L * d), E.matrix("Y", L * d, L * d)
    s = E.kron(A, E.identity(d)) @ X + E.scale(-1 / d, E.kron(A, E.ones(d, d)) @ X) + \
        E.kron(B, E.identity(d)) @ Y
    assert factored(s) == s                      # nothing common to every term
    g = grouped(s)
    assert g is not None and len(g) == 2
    vals = _values({"A": (3, 3), "B": (3, 3), "X": (12, 12), "Y": (12, 12)})
    env = {L: 3, d: 4}
    assert np.allclose(sum(evaluate(t, vals, env=env) for t in g), evaluate(s, vals, env=env),
                       rtol=1e-13, atol=1e-13)
    lw = Lowering()
    terms = lw.lower(s, lw.labels.fresh(L * d), lw.labels.fresh(L * d))
    assert len(terms) == 2


def test_post_ln_centring_is_not_distributed():
    """H(W_V, W_1) of the post-LN block: the first LayerNorm's centring stays one factor
    (14 lowered terms before sums were factored in groups, 3 after)."""
    prog = Program.build(sh.derive(sh.layer("post_ln_block"), "mse"), jacobians=False)
    terms = prog.blocks[("W_V", "W_1", "outer")] + prog.blocks[("W_V", "W_1", "functional")]
    assert len(terms) <= 3


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_experiment_blocks_lower_to_one_network(attention):
    """The chain rule through the MLP, residuals and unembedding leaves one network per part."""
    loss = "ce_answer" if attention == "softmax" else "mse_sum"
    d = sh.derive(sh.layer("addition_block", attention=attention), loss)
    prog = Program.build(d, jacobians=False)
    for p in ("W_Q", "W_V"):
        for part in ("outer", "functional"):
            terms = prog.blocks[(p, p, part)]
            assert len(terms) <= 1, (p, part, len(terms))
            assert (len(terms) == 0) == d.block(p, p, part).is_zero


def test_block_diagonal_sum_becomes_a_compact_tensor():
    """I + (I⊗Wᵀ) diag(v) (I⊗U) is one L×d×d factor, not two terms."""
    L, d, k = E.dims("L d k")
    W, U, V = E.matrix("W", k, d), E.matrix("U", d, k), E.matrix("V", L, k)
    s = E.identity(L * d) + E.kron(E.identity(L), W.T) @ E.diag(E.vec_r(V)) @ E.kron(E.identity(L), U.T)
    lw = Lowering()
    rows, cols = lw.labels.fresh(L * d), lw.labels.fresh(L * d)
    terms = lw.lower(s, rows, cols)
    assert len(terms) == 1 and len(terms[0].factors) == 1
    inter = lw.intermediates[s]
    assert inter.axis_sizes == (L, d, d)


def test_an_identity_factor_is_not_carried_by_the_compact_tensor():
    """I_k ⊗ (I − 11ᵀ/d) is a d×d compact tensor with a δ over k, not k copies of it."""
    k, d = E.dims("k d")
    W = E.matrix("W", d, d)
    s = E.kron(E.identity(k), E.identity(d)) + E.kron(E.identity(k), W)
    lw = Lowering()
    rows, cols = lw.labels.fresh(k * d), lw.labels.fresh(k * d)
    terms = lw.lower(s, rows, cols)
    inter = lw.intermediates[s]
    assert inter.axis_sizes == (d, d) and inter.pattern == ((-1, 0), (-1, 1))
    assert len(terms) == 1 and len(terms[0].factors) == 1
    # the δ over k survives as an identification of the row and column labels
    t = terms[0]
    assert lw.resolve(t, rows)[0] == lw.resolve(t, cols)[0]


def test_post_ln_compact_tensors_carry_no_pure_identity_axis():
    """Every compact tensor of the post-LN lowering depends on each of its axes: an axis
    that only identified a row with a column (I_{d_ff} ⊗ C) is left to a δ."""
    prog = Program.build(sh.derive(sh.layer("post_ln_block"), "mse"), jacobians=False)
    lw, seen = prog.lowering, 0
    for inter in lw.intermediates.values():
        if inter is None:
            continue
        seen += 1
        for ax in range(len(inter.axis_sizes)):
            assert any(outs[ax] in lw.resolve(t, f.labels)
                       for t, outs in zip(inter.terms, inter.outputs) for f in t.factors)
    assert seen and any(p < 0 for inter in lw.intermediates.values() if inter
                        for p in inter.pattern[0] + inter.pattern[1])


def test_frobenius_split_matches_the_per_part_norms():
    d = sh.derive(sh.layer("attention", causal=True), "ce")
    from symhess.calculus.verify import random_values
    vals = random_values(d, seed=3, sizes={"L": 5, "d_V": 4, "d_K": 3})
    k = sh.kernel("attention", "numpy", "ce", causal=True)
    for p, q in (("W_Q", "W_Q"), ("W_Q", "W_K"), ("W_V", "W_Q")):
        split = k.frobenius_split(vals, p, q)
        for part in ("outer", "functional", "full"):
            ref = np.linalg.norm(d.block(p, q, part).evaluate(vals))
            assert abs(split[part] - ref) <= 1e-12 * max(1.0, ref), (p, q, part)

"""Variants symhess does not ship, declared here with the public API only, verified vs autograd.

Nothing in symhess knows these layers: their exact Hessians come from the generic engine.
"""
import pytest

import symhess as sh
from symhess import expr as E
from symhess.calculus.verify import TOLERANCE, verify


def sigmoid_attention(causal=False):
    """F = (M ∘ sigmoid(X W_Q W_Kᵀ Xᵀ/√d_K)) X W_V: elementwise gates instead of a softmax."""
    L, d_V, d_K = E.dims("L d_V d_K")
    X = E.matrix("X", L, d_V)
    W_Q, W_K, W_V = E.param("W_Q", d_V, d_K), E.param("W_K", d_V, d_K), E.param("W_V", d_V, d_V)
    T = E.named((X @ W_Q @ W_K.T @ X.T) / E.dim("d_K") ** 0.5, "T")
    A = E.elementwise("sigmoid", T)
    A = E.causal_mask(L) * A if causal else A
    return sh.Layer("sigmoid_attention", A @ X @ W_V, (W_Q, W_K, W_V), (X,), {"T": T})


def cross_attention():
    """F = softmax(X W_Q W_Kᵀ Zᵀ/√d_K) Z W_V with a separate memory Z ∈ R^{S×d_M}."""
    L, S, d_V, d_M, d_K = E.dims("L S d_V d_M d_K")
    X, Z = E.matrix("X", L, d_V), E.matrix("Z", S, d_M)
    W_Q, W_K, W_V = E.param("W_Q", d_V, d_K), E.param("W_K", d_M, d_K), E.param("W_V", d_M, d_V)
    T = (X @ W_Q @ W_K.T @ Z.T) / E.dim("d_K") ** 0.5
    return sh.Layer("cross_attention", E.softmax_rows(T) @ Z @ W_V, (W_Q, W_K, W_V), (X, Z), {"T": T})


def gated_value_attention(causal=False):
    """F = softmax(X W_Q W_Kᵀ Xᵀ/√d_K) (tanh(X W_G) ∘ X W_V): a tanh-gated value path."""
    L, d_V, d_K = E.dims("L d_V d_K")
    X = E.matrix("X", L, d_V)
    W_Q, W_K = E.param("W_Q", d_V, d_K), E.param("W_K", d_V, d_K)
    W_G, W_V = E.param("W_G", d_V, d_V), E.param("W_V", d_V, d_V)
    A = E.softmax_rows((X @ W_Q @ W_K.T @ X.T) / E.dim("d_K") ** 0.5, causal=causal)
    F = A @ (E.elementwise("tanh", X @ W_G) * (X @ W_V))
    return sh.Layer("test_gated_value_attention", F, (W_Q, W_K, W_G, W_V), (X,))


CASES = {
    "sigmoid": lambda: sigmoid_attention(),
    "sigmoid-causal": lambda: sigmoid_attention(causal=True),
    "cross": cross_attention,
    "gated-causal": lambda: registered("test_gated_value_attention", gated_value_attention, causal=True),
}


def registered(name, factory, **options):
    """Register a user layer by name, build it through the registry, then unregister it."""
    sh.register_layer(name)(factory)
    try:
        return sh.layer(name, **options)
    finally:
        del sh.LAYERS[name]


@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_declared_variant_matches_autograd(case, loss):
    d = sh.derive(CASES[case](), loss)
    checks, _ = verify(d, seed=11)
    n = len(d.layer.params)
    assert len(checks) == 3 * n * n
    worst = max(checks, key=lambda c: c.error)
    assert worst.error <= TOLERANCE, (worst.block, worst.part, worst.error)


def test_sigmoid_attention_structure():
    d = sh.derive(sigmoid_attention())
    assert d.block("W_V", "W_V", "functional").is_zero
    assert not d.block("W_Q", "W_Q", "functional").is_zero      # the sigmoid is curved
    assert not d.block("W_Q", "W_K", "functional", at="T").is_zero

"""One-block Transformer for the digit-addition experiments, declared as a composition.

    X  = O W_E + P                                  (one-hot tokens O; W_E, P carry the std σ)
    T  = X_a W_Q W_Kᵀ X_aᵀ / √d_h,  A = softmax_rows(T, causal)   (X_a = X, or LN(X) pre-LN)
    X1 = X + A X_a W_V W_O                          (W_O kept: the experiments have one, §1.2)
    X2 = X1 + relu(X_m W_1) W_2                     (X_m = X1, or LN(X1) pre-LN; no biases)
    Z  = X_u W_U                                    (X_u = X2, or LN(X2) pre-LN: final LN)

Linear attention (§1.4): A = T ∘ M with M the causal 0/1 mask, no residual around the
attention, and the output masked to the answer rows (F = R ∘ Z) for the summed MSE variant.
Biases are left out (they are zero at the experiments' initialisation and are not blocks
under study); LayerNorm has γ = 1, β = 0 (its initial values) and ε = 1e-5.
"""
from __future__ import annotations

import sympy as sp

from ..expr import nodes as E
from ..errors import DeclarationError, OptionError
from ..expr.layer import Layer, check_count
from .registry import register_layer
from ..calculus.losses import loss
from .stack import stack

LN_EPS = sp.Rational(1, 10 ** 5)
N_ANSWER = 6

# the experiments' configuration (experiments.md §1.2): contraction orders are chosen for it
TYPICAL_SIZES = {"L": 18, "V": 12, "d": 128, "d_h": 128, "d_m": 512, "batch": 64}

PARAMS = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "W_U")


def layer_norm(x, eps=LN_EPS):
    """LN(X) = (X − μ) ∘ (σ² + ε)^{-1/2} per row, μ = rowsum(X)/d, σ² = rowsum((X−μ)∘(X−μ))/d."""
    d = x.cols
    centred = x - E.scale(1 / d, E.rowsum(x))
    var = E.scale(1 / d, E.rowsum(E.hadamard(centred, centred)))
    return E.hadamard(centred, E.elementwise("rsqrt", var + E.scale(eps, E.ones(x.rows, x.cols))))


def transformer_block(attention: str = "softmax", norm: str = "none") -> Layer:
    """One block on the residual stream X (L × d): attention with W_O, then the ReLU MLP.

    softmax: X1 = X + A X_a W_V W_O;  linear: X1 = A X_a W_V W_O (skip scaled by 0, §1.4);
    X2 = X1 + relu(X_m W_1) W_2 (X_a, X_m = X, X1, or their LayerNorms pre-LN)."""
    if attention not in ("softmax", "linear"):
        raise OptionError(f"attention must be 'softmax' or 'linear', got {attention!r}")
    if norm not in ("none", "pre"):
        raise OptionError(f"norm must be 'none' or 'pre', got {norm!r}")
    L, d, d_h, d_m = E.dims("L d d_h d_m")
    X = E.matrix("X", L, d)
    W_Q, W_K, W_V = (E.param(n, d, d_h) for n in ("W_Q", "W_K", "W_V"))
    W_O, W_1, W_2 = E.param("W_O", d_h, d), E.param("W_1", d, d_m), E.param("W_2", d_m, d)
    ln = layer_norm if norm == "pre" else (lambda x: x)
    Xa = ln(X)
    T = E.scale(1 / sp.sqrt(d_h), Xa @ W_Q @ W_K.T @ Xa.T)
    inputs = [X]
    if attention == "softmax":
        A = E.softmax_rows(T, causal=True)
        X1 = X + A @ Xa @ W_V @ W_O
    else:
        M = E.const("M", L, L)
        A = E.hadamard(T, M)
        X1 = A @ Xa @ W_V @ W_O          # §1.4: skip connection around attention scaled by 0
        inputs.append(M)
    H = X1 @ W_1 if norm == "none" else ln(X1) @ W_1
    X2 = X1 + E.elementwise("relu", H) @ W_2
    return Layer("transformer_block", X2, (W_Q, W_K, W_V, W_O, W_1, W_2), tuple(inputs),
                 {"T": T, "A": A}, {"attention": attention, "norm": norm},
                 transformer_block.__doc__)


@register_layer("addition_block")
def addition_block(attention: str = "softmax", norm: str = "none", depth: int = 1) -> Layer:
    """Transformer on one-hot tokens: embedding, depth × (attention (+W_O), ReLU MLP), unembedding."""
    block = transformer_block(attention, norm)
    check_count("depth", depth, len(block.params), "addition_block")
    # one block keeps its plain names (W_Q …); a stack indexes them by layer (W_Q_1 …, A^(1) …)
    body = block if depth == 1 else stack("addition_stack", block, depth)
    L, V, d = E.dims("L V d")
    O = E.matrix("O", L, V)
    W_E, P = E.const("W_E", V, d), E.const("P", L, d)
    W_U = E.param("W_U", d, V)
    X = O @ W_E + P
    embed = {body.inputs[0]: X}
    ln = layer_norm if norm == "pre" else (lambda x: x)
    Z = ln(E.substitute(body.output, embed)) @ W_U
    inputs = [O, W_E, P] + list(body.inputs[1:])
    if attention == "linear":
        R = E.const("R", L, V)
        Z = E.hadamard(R, Z)
        inputs.append(R)
    inter = {k: E.substitute(v, embed) for k, v in body.intermediates.items()}
    inter["X"] = X
    return Layer("addition_block", Z, tuple(body.params) + (W_U,), tuple(inputs), inter,
                 {"attention": attention, "norm": norm, "depth": depth},
                 addition_block.__doc__, typical_sizes=TYPICAL_SIZES,
                 moment_inputs=tuple(E.substitute(v, embed) for v in body.moment_inputs))


@loss("ce_answer")
def ce_answer(f, y):
    """ℓ = −(1/6) Σ_ij Y_ij log softmax(F_i)_j: Y holds one-hot targets on the 6 answer rows, 0 elsewhere."""
    return E.scale(sp.Rational(-1, N_ANSWER), E.sum_all(E.hadamard(y, E.log_softmax_rows(f))))


@loss("mse_sum")
def mse_sum(f, y):
    """ℓ = ‖F − Y‖²_F, the plain sum of the experiments' MSE variant (§1.1)."""
    r = f - y
    return E.sum_all(E.hadamard(r, r))

"""Attention variants, each declared with the public API only (``symhess.expr`` + ``Layer``).

Every variant takes ``causal`` (mask the entries j > i of each query row) and ``scale``, the
temperature c in the logits T = c · (…): ``None`` for the variant's default, a named choice
``"1"``, ``"1/sqrt(d_K)"``, ``"1/sqrt(d_model)"`` (d_model = d_V, the token width), any
expression in the layer's dimensions, or a positive number.

Parameter naming of ``multihead_attention(heads=H)``: head h = 1…H owns
W_Q<h>, W_K<h> ∈ R^{d_V×d_K}, W_V<h> ∈ R^{d_V×d_H} and W_O<h> ∈ R^{d_H×d_V} (the h-th row block
of the output projection W_O ∈ R^{H d_H×d_V}), declared head by head; they print as
W_Q^h, W_K^h, W_V^h, W_O^h.  Names stay plain identifiers so kernels can use them as arguments.
"""
from __future__ import annotations

import sympy as sp

from ..expr import nodes as E
from ..errors import OptionError
from ..expr.layer import Layer, check_count
from .registry import register_layer, resolve_scale


# ----------------------------------------------------------------------------- attention
@register_layer("attention")
def attention(causal: bool = False, scale=None) -> Layer:
    """Softmax self-attention F = softmax_rows(c X W_Q W_Kᵀ Xᵀ) X W_V, c = 1/√d_K by default."""
    L, d_V, d_K = E.dims("L d_V d_K")
    X = E.matrix("X", L, d_V)
    W_Q, W_K, W_V = E.param("W_Q", d_V, d_K), E.param("W_K", d_V, d_K), E.param("W_V", d_V, d_V)
    c = resolve_scale(scale, "1/sqrt(d_K)", (L, d_V, d_K))
    T = c * (X @ W_Q @ W_K.T @ X.T)
    A = E.softmax_rows(T, causal=causal)
    F = A @ X @ W_V
    return Layer("attention", F, (W_Q, W_K, W_V), (X,), {"T": T, "A": A},
                 {"causal": causal, "scale": scale}, attention.__doc__)


def _check_causal(causal):
    if not isinstance(causal, bool):
        raise OptionError(f"causal must be True or False, got {causal!r}")


def _logits_qk(X, d_V, d_K, c, tag=""):
    """(W_Q, W_K, T = c X W_Q W_Kᵀ Xᵀ) for one head."""
    tex = (lambda r: rf"\mathbf W_{{{r}}}^{{{tag}}}") if tag else (lambda r: None)
    W_Q, W_K = E.param(f"W_Q{tag}", d_V, d_K, tex("Q")), E.param(f"W_K{tag}", d_V, d_K, tex("K"))
    return W_Q, W_K, c * (X @ W_Q @ W_K.T @ X.T)


# ----------------------------------------------------------------------------- variants
@register_layer("linear_attention")
def linear_attention(causal: bool = False, scale=None) -> Layer:
    """Linear attention F = A X W_V with A = T = c X W_Q W_Kᵀ Xᵀ (A = M_causal ∘ T if causal)."""
    _check_causal(causal)
    L, d_V, d_K = E.dims("L d_V d_K")
    X = E.matrix("X", L, d_V)
    c = resolve_scale(scale, "1/sqrt(d_K)", (L, d_V, d_K))
    W_Q, W_K, T = _logits_qk(X, d_V, d_K, c)
    T = E.named(T, "T", r"\mathbf T")   # keeps T a node of F (a product would absorb it)
    W_V = E.param("W_V", d_V, d_V)
    A = E.causal_mask(L) * T if causal else T
    return Layer("linear_attention", A @ X @ W_V, (W_Q, W_K, W_V), (X,), {"T": T, "A": A},
                 {"causal": causal, "scale": scale}, linear_attention.__doc__)


@register_layer("single_matrix_attention")
def single_matrix_attention(causal: bool = False, scale=None, d_K=None) -> Layer:
    """F = softmax_rows(c X W_QK Xᵀ) X W_V, one query–key matrix W_QK ∈ R^{d_V×d_V}; c = 1 by default."""
    _check_causal(causal)
    L, d_V = E.dims("L d_V")
    X = E.matrix("X", L, d_V)
    c = resolve_scale(scale, "1", (L, d_V), fixed={"d_K": d_K})   # d_K is only a number here
    W_QK, W_V = E.param("W_QK", d_V, d_V), E.param("W_V", d_V, d_V)
    T = c * (X @ W_QK @ X.T)
    A = E.softmax_rows(T, causal=causal)
    return Layer("single_matrix_attention", A @ X @ W_V, (W_QK, W_V), (X,), {"T": T, "A": A},
                 {"causal": causal, "scale": scale, "d_K": d_K}, single_matrix_attention.__doc__)


@register_layer("multihead_attention")
def multihead_attention(heads: int = 2, causal: bool = False, scale=None) -> Layer:
    """F = Σ_h softmax_rows(c X W_Q^h W_K^hᵀ Xᵀ) X W_V^h W_O^h (concatenate heads, project by W_O)."""
    _check_causal(causal)
    check_count("heads", heads, 4, "multihead_attention")
    L, d_V, d_K, d_H = E.dims("L d_V d_K d_H")
    X = E.matrix("X", L, d_V)
    c = resolve_scale(scale, "1/sqrt(d_K)", (L, d_V, d_K, d_H))
    params, inter, terms = [], {}, []
    for h in range(1, heads + 1):
        W_Q, W_K, T = _logits_qk(X, d_V, d_K, c, tag=str(h))
        W_V = E.param(f"W_V{h}", d_V, d_H, rf"\mathbf W_{{V}}^{{{h}}}")
        W_O = E.param(f"W_O{h}", d_H, d_V, rf"\mathbf W_{{O}}^{{{h}}}")
        A = E.softmax_rows(T, causal=causal)
        params += [W_Q, W_K, W_V, W_O]
        inter.update({f"T{h}": T, f"A{h}": A})
        terms.append(A @ X @ W_V @ W_O)
    return Layer("multihead_attention", E.add(*terms), params, (X,), inter,
                 {"heads": heads, "causal": causal, "scale": scale}, multihead_attention.__doc__)


@register_layer("value_output_attention")
def value_output_attention(causal: bool = False, scale=None) -> Layer:
    """F = softmax_rows(c X W_Q W_Kᵀ Xᵀ) X W_V W_O, W_V ∈ R^{d_V×d_H}, W_O ∈ R^{d_H×d_V}."""
    _check_causal(causal)
    L, d_V, d_K, d_H = E.dims("L d_V d_K d_H")
    X = E.matrix("X", L, d_V)
    c = resolve_scale(scale, "1/sqrt(d_K)", (L, d_V, d_K, d_H))
    W_Q, W_K, T = _logits_qk(X, d_V, d_K, c)
    W_V, W_O = E.param("W_V", d_V, d_H), E.param("W_O", d_H, d_V)
    A = E.softmax_rows(T, causal=causal)
    return Layer("value_output_attention", A @ X @ W_V @ W_O, (W_Q, W_K, W_V, W_O), (X,),
                 {"T": T, "A": A}, {"causal": causal, "scale": scale}, value_output_attention.__doc__)

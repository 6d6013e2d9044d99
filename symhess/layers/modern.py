"""The block of current decoder models, declared with the expression API: RMSNorm, rotary
position embeddings, grouped-query attention and a SwiGLU MLP, pre-norm.

* ``rms_norm(U)``   = U ∘ (rowmean(U ∘ U) + ε)^{∘−1/2}
* ``rotary(Q)``     = Q ∘ C + (Q R) ∘ S, with C, S the L × d_K cosines and sines of the token
  positions and R the signed permutation that pairs the coordinates (rotate-half), all three
  constants given with the values;
* grouped-query attention: query heads h = 1 … g share one key and value head,
  Attn(N) = Σ_h softmax_rows(c rot(N W_Q^h) rot(N W_K)ᵀ) N W_V W_O^h (W_O^h the rows of the
  output projection that head h's values meet);
* ``swiglu(N)``     = (silu(N W_1) ∘ N W_3) W_2, silu(x) = x σ(x);
* the block:        Y = X + Attn(RMSNorm(X)),  Z = Y + SwiGLU(RMSNorm(Y)).

Nothing here has a derivative of its own; the engine differentiates the composition.  With
ε > 0 (the default 1e-6) RMSNorm is defined for every row; with ε = 0 a zero row raises
``InputError`` (``ZeroRowCheck``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..expr import nodes as E
from ..errors import InputError, OptionError
from ..expr.layer import Layer
from .registry import register_layer
from .transformer import FFN_TYPICAL_SIZES, _numpy, check_eps
from .variants import resolve_scale


@dataclass(frozen=True)
class ZeroRowCheck:
    """Raise InputError if a row of an RMSNorm input is zero while ε = 0."""

    label: str
    input: E.Expr

    def __call__(self, values):
        if isinstance(self.input, E.Var) and self.input.name in values:
            self.check_batch(_numpy(values[self.input.name])[None])

    def check_batch(self, u):
        bad = (u * u).sum(-1) == 0
        if not bool(bad.any()):
            return
        bad = np.asarray(bad.cpu() if hasattr(bad, "cpu") else bad)
        seq, row = (int(x[0]) for x in np.nonzero(bad))
        raise InputError(f"RMSNorm {self.label}: sequence {seq}, row {row} (0-based) of its input "
                         f"is zero and eps = 0, so RMSNorm is undefined there; use eps > 0")


def rms_norm(U, eps, label):
    """(RMSNorm(U), check): U ∘ (rowmean(U ∘ U) + ε)^{∘−1/2}; the check is None when ε > 0."""
    L, d = U.shape
    ms = E.named((1 / d) * E.rowsum(U * U), f"ms_{label}", rf"\mathbf m_{{{label}}}")
    shifted = ms + eps * E.ones(L, d) if eps != 0 else ms
    R = E.named(E.elementwise("rsqrt", shifted), f"R_{label}", rf"\mathbf R_{{{label}}}")
    out = E.named(U * R, label, rf"\mathbf {label}" if len(label) == 1 else rf"\mathbf {{{label}}}")
    return out, (ZeroRowCheck(label, U) if eps == 0 else None)


def rotary(Q, C, S, R):
    """Q ∘ C + (Q R) ∘ S: each coordinate pair of a row rotated by its token's angle."""
    return Q * C + (Q @ R) * S


def swiglu(N, W1, W3, W2):
    """(silu(N W_1) ∘ N W_3) W_2 with silu(H) = H ∘ σ(H)."""
    H = N @ W1
    return (H * E.elementwise("sigmoid", H) * (N @ W3)) @ W2


@register_layer("modern_block")
def modern_block(group=2, causal=False, eps=1e-6, scale=None) -> Layer:
    """Y = X + GQA(RMSNorm(X)) with rotary q, k; Z = Y + SwiGLU(RMSNorm(Y)); ``group`` query heads share one key/value head."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise OptionError(f"group must be a positive integer (query heads per key/value head), got {group!r}")
    if not isinstance(causal, bool):
        raise OptionError(f"causal must be True or False, got {causal!r}")
    eps = check_eps(eps)
    L, d_V, d_K, d_H, d_ff = E.dims("L d_V d_K d_H d_ff")
    X = E.matrix("X", L, d_V)
    C, S = E.const("C", L, d_K, r"\mathbf C"), E.const("S", L, d_K, r"\mathbf S")
    R = E.const("R", d_K, d_K, r"\mathbf R")
    c = resolve_scale(scale, "1/sqrt(d_K)", (L, d_V, d_K, d_H, d_ff))
    N1, c1 = rms_norm(X, eps, "N_1")
    W_K, W_V = E.param("W_K", d_V, d_K), E.param("W_V", d_V, d_H)
    K = rotary(N1 @ W_K, C, S, R)
    V = N1 @ W_V
    queries, outs, terms, inter = [], [], [], {"N_1": N1}
    for h in range(1, group + 1):
        W_Q = E.param(f"W_Q{h}", d_V, d_K, rf"\mathbf W_{{Q}}^{{{h}}}")
        W_O = E.param(f"W_O{h}", d_H, d_V, rf"\mathbf W_{{O}}^{{{h}}}")
        T = E.named(c * (rotary(N1 @ W_Q, C, S, R) @ K.T), f"T{h}", rf"\mathbf T_{{{h}}}")
        A = E.softmax_rows(T, causal=causal)
        inter.update({f"T{h}": T, f"A{h}": A})
        queries.append(W_Q)
        outs.append(W_O)
        terms.append(A @ V @ W_O)
    Y = E.named(X + E.add(*terms), "Y", r"\mathbf Y")
    N2, c2 = rms_norm(Y, eps, "N_2")
    W1, W3, W2 = E.param("W_1", d_V, d_ff), E.param("W_3", d_V, d_ff), E.param("W_2", d_ff, d_V)
    Z = Y + swiglu(N2, W1, W3, W2)
    inter.update({"Y": Y, "N_2": N2})
    params = (*queries, W_K, W_V, *outs, W1, W3, W2)
    checks = tuple(x for x in (c1, c2) if x is not None)
    return Layer("modern_block", Z, params, (X, C, S, R), inter,
                 {"group": group, "causal": causal, "eps": eps, "scale": scale},
                 modern_block.__doc__, checks, typical_sizes=dict(FFN_TYPICAL_SIZES))

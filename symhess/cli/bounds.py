"""The published Theorem 1 bound of Ormaniec, Dangel & Singh (the appendix version), typed
here as the object under test: per-block terms of a single self-attention
layer's MSE loss Hessian and M = 3·max(terms), every norm spectral.  ``symhess experiment
bounds`` compares it with exact norms; ``symhess spectrum`` and ``symhess experiment
language-model`` print it beside theirs.
"""
from __future__ import annotations

import math

import numpy as np


def theorem1_terms(X, W_Q, W_K, W_V, T):
    """The published Theorem 1 upper bound (the appendix version), typed here.

    This is the object under test (not a derived result): per-block terms and
    M = 3·max(terms).  c = L‖X‖‖W_V‖ + ‖T‖, r = rank(F − T); norms are spectral.
    """
    n2 = lambda a: float(np.linalg.norm(a, 2))  # noqa: E731
    L, d_V = X.shape
    d_K = W_Q.shape[1]
    x, wq, wk, wv = n2(X), n2(W_Q), n2(W_K), n2(W_V)
    A = _softmax(X @ W_Q @ W_K.T @ X.T / math.sqrt(d_K))
    F = A @ X @ W_V
    r = np.linalg.matrix_rank(F - T)
    c = L * x * wv + n2(T)
    sr = math.sqrt(r)
    vv = 2 * L / d_V * x ** 2
    qq = 2 / (L ** 3 * d_V * d_K) * wk ** 2 * wv ** 2 * x ** 6 + 12 / (d_V * d_K) * sr * c * wv * wk ** 2 * x ** 5
    vq = 2 / (L * d_V * math.sqrt(d_K)) * wv * wk * x ** 4 + 2 * sr / (L ** 2 * math.sqrt(d_V * d_K)) * c * wk * x ** 3
    qk = (2 / (L ** 3 * d_V * d_K) * wk * wq * wv ** 2 * x ** 6
          + 2 * sr * c / (L * d_V * math.sqrt(d_V * d_K)) * wv * (3 * L * wk * wq * x ** 5 + d_V / L * x ** 3))
    return {"VV": vv, "QQ": qq, "VQ": vq, "QK": qk, "M": 3 * max(vv, qq, vq, qk)}


def _softmax(t):
    z = np.exp(t - t.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)

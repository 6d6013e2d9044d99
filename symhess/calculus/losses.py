"""Scalar losses of a layer output F against a target Y (1×1 expressions)."""
from __future__ import annotations

import sympy as sp

from ..expr import nodes as E
from ..expr.registry import Registry

LOSSES = Registry("loss")
loss = LOSSES.register          # register a loss ``fn(F, Y) -> 1×1 expression``
get_loss = LOSSES.lookup


@loss("mse")
def mse(f, y):
    """ℓ = ‖F − Y‖²_F / (L d), the papers' normalisation."""
    r = f - y
    return E.scale(1 / (f.rows * f.cols), E.sum_all(E.hadamard(r, r)))


@loss("ce")
def cross_entropy(f, y):
    """ℓ = −(1/L) Σ_i Σ_j Y_ij log softmax(F_i)_j, rows of Y are target distributions."""
    return E.scale(-1 / sp.sympify(f.rows), E.sum_all(E.hadamard(y, E.log_softmax_rows(f))))

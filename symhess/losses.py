"""Scalar losses of a layer output F against a target Y (1×1 expressions)."""
from __future__ import annotations

import sympy as sp

from . import expr as E

LOSSES: dict = {}


def loss(name):
    """Register a loss ``fn(F, Y) -> 1×1 expression``."""

    def deco(fn):
        if name in LOSSES:
            raise KeyError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return deco


def get_loss(name):
    if name not in LOSSES:
        raise KeyError(f"unknown loss {name!r}; valid: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


@loss("mse")
def mse(f, y):
    """ℓ = ‖F − Y‖²_F / (L d), the papers' normalisation."""
    r = f - y
    return E.scale(1 / (f.rows * f.cols), E.sum_all(E.hadamard(r, r)))


@loss("ce")
def cross_entropy(f, y):
    """ℓ = −(1/L) Σ_i Σ_j Y_ij log softmax(F_i)_j, rows of Y are target distributions."""
    return E.scale(-1 / sp.sympify(f.rows), E.sum_all(E.hadamard(y, E.log_softmax_rows(f))))

"""Scalar functions applied entrywise, defined by sympy expressions in one variable.

Derivatives come from sympy (``sympy.diff``); the Dirac delta of a kink (ReLU'' ) is
dropped, i.e. derivatives hold almost everywhere, as for autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from ..errors import DeclarationError, UnknownNameError

x = sp.Symbol("x", real=True)

__all__ = ["ScalarFn", "get_function", "FUNCTIONS", "x"]


def _heaviside(arg):
    return sp.Heaviside(arg, 0)


class Sigmoid(sp.Function):
    """σ(x) = 1/(1 + e^{−x}) as one function, so σ' = σ(1 − σ), σ'' = σ(1 − σ)(1 − 2σ).

    Written with exp, sympy's σ'' = 2e^{−2x}/(1 + e^{−x})³ − … overflows to NaN for
    x < −355 in float64 and x < −44 in float32.
    """

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)

    @classmethod
    def eval(cls, arg):
        if arg.is_Number:
            return 1 / (1 + sp.exp(-arg))
        return None

    def _eval_rewrite_as_exp(self, arg, **kwargs):
        return 1 / (1 + sp.exp(-arg))


# name -> (sympy expression in x, LaTeX operator name)
FUNCTIONS = {
    "exp": (sp.exp(x), r"\exp"),
    "log": (sp.log(x), r"\log"),
    "tanh": (sp.tanh(x), r"\tanh"),
    "sigmoid": (Sigmoid(x), r"\operatorname{sigmoid}"),
    "relu": (x * _heaviside(x), r"\operatorname{ReLU}"),
    "gelu": (x / 2 * (1 + sp.erf(x / sp.sqrt(2))), r"\operatorname{GELU}"),
    "gelu_tanh": (x / 2 * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational(44715, 1000000) * x**3))),
                  r"\operatorname{GELU}_{\tanh}"),
    "silu": (x * Sigmoid(x), r"\operatorname{SiLU}"),
    "square": (x**2, r"(\cdot)^{2}"),
    "sqrt": (sp.sqrt(x), r"\sqrt{\cdot}"),  # \sqrt needs a braced argument in LaTeX
    "rsqrt": (1 / sp.sqrt(x), r"(\cdot)^{-1/2}"),
    "recip": (1 / x, r"(\cdot)^{-1}"),
    "step": (_heaviside(x), r"\mathbb 1_{>0}"),
}


def _clean(expr):
    """Drop Dirac deltas (derivatives hold almost everywhere).

    No ``sp.simplify``: it took 142 s on GELU_tanh'' (5–11 s on tanh/sigmoid), and sympy's
    raw forms (tanh' = 1 − tanh²) are the numerically safer ones (no cosh overflow).
    """
    return expr.replace(sp.DiracDelta, lambda *a: sp.Integer(0))


@dataclass(frozen=True)
class ScalarFn:
    """An entrywise function: ``name`` for printing, ``expr`` a sympy expression in x."""

    name: str
    expr: sp.Expr
    tex: str

    def __repr__(self):
        return self.name

    @property
    def is_zero(self) -> bool:
        return self.expr == 0

    @property
    def is_identity(self) -> bool:
        return self.expr == x

    @property
    def constant(self):
        return None if self.expr.has(x) else self.expr

    def derivative(self) -> "ScalarFn":
        return _derivative(self)

    def numpy(self):
        return _lambdify(self.expr, "numpy")

    def torch(self):
        return _lambdify(self.expr, "torch")


@lru_cache(maxsize=None)
def _derivative(fn: ScalarFn) -> ScalarFn:
    d = _clean(sp.diff(fn.expr, x))
    return _named_for(d, fn.name + "'", "{" + fn.tex + "}'")  # braces: x^{p}' is a double superscript


def _named_for(expr, name, tex) -> ScalarFn:
    """Reuse a library name when the expression is a known function (exp' = exp)."""
    for known, (kexpr, ktex) in FUNCTIONS.items():
        if _differ_numerically(kexpr, expr):
            continue  # cheap rejection: sympy.simplify of e.g. erf/tanh differences takes seconds
        if sp.simplify(kexpr - expr) == 0:
            return ScalarFn(known, kexpr, ktex)
    return ScalarFn(name, expr, tex)


_PROBES = (0.37, 1.3, 2.9)  # positive, away from kinks, inside every library function's domain


def _differ_numerically(a, b) -> bool:
    """True if a(x) ≠ b(x) at some probe point (so they cannot be the same function)."""
    for p in _PROBES:
        try:
            va, vb = complex(a.subs(x, p).evalf()), complex(b.subs(x, p).evalf())
        except (TypeError, ValueError):
            return False  # not numeric here: let sympy decide
        if abs(va - vb) > 1e-9 * (1 + abs(va)):
            return True
    return False


def get_function(name: str, power=None) -> ScalarFn:
    """A library function by name; ``pow`` takes an exponent."""
    if name == "pow":
        try:
            p = sp.sympify(power)
        except (sp.SympifyError, TypeError, ValueError):
            p = None
        if not isinstance(p, sp.Expr) or not p.is_number or not p.is_real:
            raise DeclarationError(f"pow needs a real number as exponent, got {power!r}")
        return _named_for(x**p, f"pow{p}", rf"(\cdot)^{{{sp.latex(p)}}}")
    if name not in FUNCTIONS:
        raise UnknownNameError(f"unknown elementwise function {name!r}; valid: {', '.join(sorted(FUNCTIONS))}, pow")
    expr, tex = FUNCTIONS[name]
    return ScalarFn(name, expr, tex)


@lru_cache(maxsize=None)
def _lambdify(expr, backend):
    if backend == "numpy":
        import numpy as np
        import scipy.special

        mods = [{"Heaviside": lambda a, h0=0.0: np.heaviside(a, h0), "erf": scipy.special.erf,
                 "Sigmoid": scipy.special.expit}, "numpy"]
        return sp.lambdify(x, expr, modules=mods)
    import torch

    def heaviside(a, h0=0.0):
        # comparisons, not torch.heaviside: autograd has no derivative for aten::heaviside,
        # and the step is piecewise constant (derivative 0 a.e.), which this gives
        return (a > 0).to(a.dtype) + float(h0) * (a == 0).to(a.dtype)

    import math

    def either(tfn, mfn):
        # lambdified derivatives hold constants such as sqrt(2) (GELU'): plain numbers go to math
        return lambda a: tfn(a) if isinstance(a, torch.Tensor) else mfn(a)

    mods = [{"Heaviside": heaviside, "erf": either(torch.special.erf, math.erf),
             "exp": either(torch.exp, math.exp), "log": either(torch.log, math.log),
             "tanh": either(torch.tanh, math.tanh), "sqrt": either(torch.sqrt, math.sqrt),
             "sin": either(torch.sin, math.sin), "cos": either(torch.cos, math.cos),
             "sinh": either(torch.sinh, math.sinh), "cosh": either(torch.cosh, math.cosh),
             "Sigmoid": either(torch.sigmoid, lambda a: 1 / (1 + math.exp(-a))),
             "pi": float(sp.pi)}, "math"]
    return sp.lambdify(x, expr, modules=mods)

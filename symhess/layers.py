"""Layer declarations: a registry of named layers built from expressions.

A layer is an output expression F, the parameters the Hessian is taken over (in
declared order), the data inputs, and named intermediates (e.g. the logits T) at
which a Gauss–Newton split can also be taken.  Users build their own ``Layer`` from
``symhess.expr`` without touching this registry.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import sympy as sp

from . import expr as E
from .errors import DeclarationError
from .registry import Registry


@dataclass(frozen=True, eq=False)
class Layer:
    """A declared layer: ``output`` = F(inputs; params)."""

    name: str
    output: E.Expr
    params: tuple
    inputs: tuple = ()
    intermediates: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    description: str = ""
    checks: tuple = ()
    # sizes the layer is typically run at ({"L": 18, "d": 128, "batch": 64}); code generation
    # chooses its contraction orders for them (a Frobenius pairing's cost grows with batch²)
    typical_sizes: dict = field(default_factory=dict)
    # named intermediates that attention moments are taken over besides the input variables
    # (the input of each sub-layer of a composition, symhess.stack); see symhess.simplify
    moment_inputs: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "checks", tuple(self.checks))
        object.__setattr__(self, "moment_inputs", tuple(self.moment_inputs))
        _check_reserved(self.name, (*self.output.free_vars, *self.params, *self.inputs))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"layer {self.name!r}: parameter names repeat: {names}")
        free = self.output.free_vars
        for p in self.params:
            if not isinstance(p, E.Var):
                raise TypeError(f"layer {self.name!r}: parameter {p!r} is not a variable")
            if p not in free:
                raise ValueError(f"layer {self.name!r}: the output does not depend on {p.name}")

    def param(self, name) -> E.Var:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"unknown block {name!r} for layer {self.name!r}; "
                       f"valid: {', '.join(self.param_names)}")

    @property
    def batch_checks(self) -> tuple:
        """The value checks that test an input expression (``input``) for a whole batch at
        once (``check_batch``), in order; the kernels compute those inputs with a generated
        routine (``check_inputs``) instead of interpreting the declaration per sequence."""
        return tuple(c for c in self.checks if hasattr(c, "check_batch") and hasattr(c, "input"))

    def validate(self, values) -> None:
        """Run the layer's value checks (e.g. LayerNorm rows of zero variance); each raises InputError."""
        for check in self.checks:
            check(values)

    @property
    def param_names(self):
        return tuple(p.name for p in self.params)

    @property
    def variables(self):
        """Every variable the output reads, by name."""
        return {v.name: v for v in E.walk(self.output) if isinstance(v, E.Var)}


# the loss target and the output gradient ∂ℓ/∂F of every derivation (symhess.hessian)
RESERVED_NAMES = {"Y": "the loss target", "G": "the output gradient ∂ℓ/∂F"}


def _check_reserved(layer_name, variables):
    """A layer variable may not be called Y or G: a derivation gives those names to the loss
    target and the output gradient, and values are passed by name."""
    for v in variables:
        if isinstance(v, E.Var) and v.name in RESERVED_NAMES:
            raise DeclarationError(
                f"layer {layer_name!r}: variable name {v.name!r} is reserved for "
                f"{RESERVED_NAMES[v.name]}; rename the {v.role} (reserved: "
                f"{', '.join(RESERVED_NAMES)})")


LAYERS = Registry("layer")
register_layer = LAYERS.register   # register a factory ``fn(**options) -> Layer`` under a name


def layer_options(name) -> dict:
    """The options of a registered layer with their defaults."""
    sig = inspect.signature(_factory(name))
    return {k: p.default for k, p in sig.parameters.items()}


def _factory(name):
    return LAYERS.lookup(name)


def layer(name, **options) -> Layer:
    """A declared layer by name, e.g. ``layer("attention", causal=True)``."""
    fn = _factory(name)
    valid = layer_options(name)
    bad = [k for k in options if k not in valid]
    if bad:
        raise TypeError(f"unknown option(s) {', '.join(bad)} for layer {name!r}; "
                        f"valid: {', '.join(valid) or 'none'}")
    return fn(**options)


def scale_constant(scale, default, dims=()):
    """A declared scalar constant: a number or an expression in the layer's dimensions."""
    if scale is None:
        return default
    allowed = {d.name: d for d in dims}
    try:
        value = sp.sympify(scale, locals=allowed)
    except (sp.SympifyError, TypeError, SyntaxError) as exc:
        raise ValueError(f"scale {scale!r} is not a number or an expression: {exc}") from None
    extra = sorted(s.name for s in value.free_symbols if s.name not in allowed or s != allowed[s.name])
    if extra:
        raise ValueError(f"scale {scale!r} uses unknown symbols {', '.join(extra)}; "
                         f"valid dimensions: {', '.join(allowed) or 'none'}")
    if value.is_number and (not value.is_real or value == 0):
        raise ValueError(f"scale {scale!r} must be a non-zero real number")
    return value


# ----------------------------------------------------------------------------- attention
@register_layer("attention")
def attention(causal: bool = False, scale=None) -> Layer:
    """Softmax self-attention F = softmax_rows(c X W_Q W_Kᵀ Xᵀ) X W_V, c = 1/√d_K by default."""
    L, d_V, d_K = E.dims("L d_V d_K")
    X = E.matrix("X", L, d_V)
    W_Q, W_K, W_V = E.param("W_Q", d_V, d_K), E.param("W_K", d_V, d_K), E.param("W_V", d_V, d_V)
    c = scale_constant(scale, 1 / sp.sqrt(d_K), (L, d_V, d_K))
    T = c * (X @ W_Q @ W_K.T @ X.T)
    A = E.softmax_rows(T, causal=causal)
    F = A @ X @ W_V
    return Layer("attention", F, (W_Q, W_K, W_V), (X,), {"T": T, "A": A},
                 {"causal": causal, "scale": scale}, attention.__doc__)

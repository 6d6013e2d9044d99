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
from .errors import DeclarationError, OptionError, UnknownNameError
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
        if not isinstance(self.name, str) or not self.name:
            raise DeclarationError(f"a layer's name must be a non-empty string, got {self.name!r}")
        for field_name in ("params", "inputs"):   # one variable or a sequence of them
            value = getattr(self, field_name)
            object.__setattr__(self, field_name, (value,) if isinstance(value, E.Expr) else tuple(value))
        object.__setattr__(self, "checks", tuple(self.checks))
        if not isinstance(self.output, E.Expr):
            raise DeclarationError(f"layer {self.name!r}: the output must be a symhess expression "
                                   f"(built with symhess.expr), got {type(self.output).__name__} "
                                   f"{self.output!r:.40}")
        if not self.params:
            raise DeclarationError(f"layer {self.name!r} needs at least one parameter")
        for kind, seq in (("parameter", self.params), ("input", self.inputs)):
            for p in seq:
                if not isinstance(p, E.Var):
                    raise DeclarationError(f"layer {self.name!r}: {kind} {p!r:.60} is not a variable "
                                           f"(declare it with symhess.expr.param or matrix)")
        object.__setattr__(self, "moment_inputs", tuple(self.moment_inputs))
        _check_reserved(self.name, (*self.output.free_vars, *self.params, *self.inputs))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise DeclarationError(f"layer {self.name!r}: parameter names repeat: {names}")
        free = self.output.free_vars
        for p in self.params:
            if p not in free:
                raise DeclarationError(f"layer {self.name!r}: the output does not depend on {p.name}")

    def param(self, name) -> E.Var:
        for p in self.params:
            if p.name == name:
                return p
        raise UnknownNameError(f"unknown block {name!r} for layer {self.name!r}; "
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
    """A declared layer by name, e.g. ``layer("attention", causal=True)``.

    Options are checked against the factory's signature (``OptionError``, also a TypeError):
    unknown names are refused, and an option whose default is True or False takes only
    True or False (``causal="false"`` would otherwise be truthy)."""
    fn = _factory(name)
    check_options(f"layer {name!r}", layer_options(name), options)
    return fn(**options)


def check_options(what, valid, options) -> None:
    """An OptionError for options not in ``valid`` ({name: default}) or a non-bool value of
    an option whose default is a bool."""
    bad = [k for k in options if k not in valid]
    if bad:
        raise OptionError(f"unknown option(s) {', '.join(map(repr, bad))} for {what}; "
                          f"valid: {', '.join(valid) or 'none'}")
    for k, v in options.items():
        if isinstance(valid[k], bool) and not isinstance(v, bool):
            raise OptionError(f"{k} must be True or False for {what}, got {v!r}")


def resolve_layer(spec, options=None) -> Layer:
    """The layer a command line names, with ``options`` ({name: value}, e.g. from --set):

    * a registered name: ``"attention"`` (``layer(name, **options)``);
    * a user's declaration: ``"mymodels.py:gated"`` (a file) or ``"mypkg.mymodels:gated"`` (an
      importable module; the current directory is searched too), where the attribute is a
      ``Layer`` or a factory returning one (called with ``options``).

    A missing file, module or attribute, an attribute that is neither, or options a factory
    does not take are one-line ``DeclarationError`` s (see ``symhess.layer_specs``)."""
    from .layer_specs import resolve
    return resolve(spec, options or {})


def spec_options(spec) -> dict:
    """The options of the layer ``spec`` names (``resolve_layer``) with their defaults."""
    from .layer_specs import options_of
    return options_of(spec)


def scale_constant(scale, default, dims=()):
    """A declared scalar constant: a number or an expression in the layer's dimensions."""
    if scale is None:
        return default
    allowed = {d.name: d for d in dims}
    try:
        value = sp.sympify(scale, locals=allowed)
    except (sp.SympifyError, TypeError, SyntaxError) as exc:
        raise OptionError(f"scale {scale!r} is not a number or an expression: {exc}") from None
    extra = sorted(s.name for s in value.free_symbols if s.name not in allowed or s != allowed[s.name])
    if extra:
        raise OptionError(f"scale {scale!r} uses unknown symbols {', '.join(extra)}; "
                         f"valid dimensions: {', '.join(allowed) or 'none'}")
    if value.is_number and (not value.is_real or value == 0):
        raise OptionError(f"scale {scale!r} must be a non-zero real number")
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

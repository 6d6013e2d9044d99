"""A declaration: a layer's output expression, the parameters the Hessian is taken over (in
declared order), its data inputs, and named intermediates (e.g. the logits T) at which a
Gauss–Newton split can also be taken.  Users build their own ``Layer`` from ``symhess.expr``;
registering it by name is ``symhess.layers.register_layer``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DeclarationError, OptionError, UnknownNameError
from . import nodes as E


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


# the most parameters a count option (depth, heads) may give a declaration: its P² ordered
# Hessian blocks are derived symbolically (attention_stack at depth 30, 90 parameters, takes
# about 5 minutes for all of them); a count beyond it is refused before anything is built
MAX_PARAMS = 128


def check_count(option, value, per, what) -> int:
    """``value`` when it is a positive integer giving at most ``MAX_PARAMS`` parameters at
    ``per`` parameters each; else an OptionError naming the option and the largest value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{option} must be a positive integer, got {value!r}")
    most = max(1, MAX_PARAMS // per)
    if value > most:
        raise OptionError(f"{option}={value} for {what} would declare {value * per:,} parameters; "
                          f"at most {MAX_PARAMS} are derived ({option} <= {most}): every "
                          f"ordered pair of them is a Hessian block derived symbolically")
    return value


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

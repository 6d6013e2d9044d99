"""Layers by name: the registry of declared layers, their options, and the layer a command
line names (a registered name, ``FILE.py:ATTR`` or ``MODULE:ATTR``).

A registered layer is a factory ``fn(**options) -> Layer``; ``layer(name, **options)`` checks
the options against the factory's signature before calling it.
"""
from __future__ import annotations

import inspect

import sympy as sp

from ..errors import OptionError
from ..expr import nodes as E
from ..expr.layer import Layer, check_options
from ..expr.registry import Registry


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


def resolve_scale(scale, default, dims, fixed=None):
    """The temperature c of an attention layer's logits as a positive sympy scalar: ``scale``
    (None: ``default``) is a positive number or an expression in the layer's dimensions
    ``dims`` (strings may also name d_model, the token width d_V, and the sizes in ``fixed``).
    Every attention variant reads its ``scale`` option with this one parser."""
    scale = default if scale is None else scale
    names = {str(d): d for d in dims}
    names["d_model"] = E.dim("d_V")
    names.update({k: sp.Integer(v) for k, v in (fixed or {}).items() if v is not None})
    try:
        value = sp.sympify(scale, locals=names) if isinstance(scale, str) else sp.sympify(scale)
    except (sp.SympifyError, TypeError, SyntaxError) as exc:
        raise OptionError(f"scale {scale!r} is not a number or an expression: {exc}") from None
    unknown = value.free_symbols - set(names.values())
    if unknown:
        hint = "; pass it as an option, e.g. d_K=4" if "d_K" in {str(s) for s in unknown} else ""
        raise OptionError(f"scale {scale!r} uses {', '.join(sorted(map(str, unknown)))}, which this "
                         f"layer does not have (valid: {', '.join(sorted(names))}){hint}")
    if value.is_positive is not True:
        raise OptionError(f"scale {scale!r} must be positive")
    return value


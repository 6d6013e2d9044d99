"""Layers by name: the registry of declared layers, their options, and the layer a command
line names (a registered name, ``FILE.py:ATTR`` or ``MODULE:ATTR``).

A registered layer is a factory ``fn(**options) -> Layer``; ``layer(name, **options)`` checks
the options against the factory's signature before calling it.
"""
from __future__ import annotations

import inspect

import sympy as sp

from ..errors import OptionError
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

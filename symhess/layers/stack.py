"""Deep models as compositions of declared layers: ``compose`` and ``stack``.

``compose(name, [L_1, …, L_n])`` applies the layers one after another: the output of L_k is
the input of L_{k+1} (the residual stream),

    X^{(1)} = X,   X^{(k+1)} = L_k(X^{(k)}; θ_k),   F = X^{(n+1)},

and the Hessian is taken over every sub-layer's parameters.  Each sub-layer must have
exactly one input variable (role "input"), shaped like its output.  Everything a sub-layer
declares is indexed by its position k, so equal sub-layers stay apart:

* parameters and constants: ``W_Q`` → ``W_Q_k``, printed \\mathbf W_{Q}^{(k)} (an existing
  superscript is extended: W_Q^1 of head 1 → W_Q^{1,(k)});
* named sub-expressions (LayerNorm's M_Y, P_Y, Y …): ``Y`` → ``Y^(k)``, printed \\mathbf Y^{(k)};
* intermediates: key ``T`` → ``T^(k)`` (so the softmax of sub-layer k prints as A^{(k)} and
  its moments as M_1^{(k)}, M_2^{(k)} …, see ``symhess.calculus.simplify.softmax_labels``);
* value checks with an input expression (LayerNorm's zero-variance check) follow their input.

The input of sub-layer k ≥ 2 is the previous output, named X^{(k)} unless it already is a
named quantity (a LayerNorm output Z^{(k-1)}); it is declared in ``Layer.moment_inputs`` so
the simplifier takes sub-layer k's attention moments over it.  ``stack(name, layer, depth)``
is ``compose`` of ``depth`` copies of one layer.

Registered here (kernels rendered on demand, ``codegen.ON_DEMAND``):

* ``attention_stack(depth=2)``: attention-only Transformer with residuals,
  X^{(k+1)} = X^{(k)} + softmax_rows(c X^{(k)} W_Q^{(k)} W_K^{(k)ᵀ} X^{(k)ᵀ}) X^{(k)} W_V^{(k)};
* ``post_ln_stack(depth=2)``: ``depth`` post-LN blocks (``symhess.layers.transformer.post_ln_block``).
"""
from __future__ import annotations

import dataclasses

from ..expr import nodes as E
from ..errors import DeclarationError, ShapeError
from ..expr.layer import Layer, check_count
from .variants import attention
from .registry import register_layer
from ..expr.latex import bold_name
from ..calculus.simplify import superscript
from .transformer import FFN_TYPICAL_SIZES, post_ln_block


def _stream_input(lay, k):
    """The one input variable of a sub-layer (its residual-stream input)."""
    found = [v for v in lay.inputs if isinstance(v, E.Var) and v.role == "input"]
    found += [v for v in lay.output.free_vars
              if isinstance(v, E.Var) and v.role == "input" and v not in found]
    if len(found) != 1:
        names = ", ".join(v.name for v in found) or "none"
        raise DeclarationError(f"compose: sub-layer {k} ({lay.name!r}) must have exactly one input "
                               f"variable (the stream it transforms), it has: {names}")
    return found[0]


class _Indexer:
    """Rebuilds a sub-layer's expressions with every declared name indexed by its position."""

    def __init__(self, k, stream_in, new_in):
        self.k, self.memo = k, {stream_in: new_in}
        self.label = f"({k})"

    def var(self, v):
        tex = superscript(v.tex or bold_name(v.name), self.label)
        return E.Var(f"{v.name}_{self.k}", v.rows, v.cols, v.role, tex)

    def __call__(self, expr):
        for node in E.walk(expr):
            if node in self.memo:
                continue
            args = tuple(self.memo[a] for a in node.args)
            if isinstance(node, E.Var):
                new = self.var(node) if node.role in ("param", "const") else node
            elif isinstance(node, E.Named) and not node.frozen:
                new = E.named(args[0], f"{node.name}^{self.label}", superscript(node.tex, self.label),
                              symmetric=node.symmetric, shown=args[1:])
            elif args == node.args:
                new = node
            else:
                new = node.rebuild(args)
            self.memo[node] = new
        return self.memo[expr]

    def check(self, c):
        """A value check that declares its input expression follows it; others cannot."""
        if not (dataclasses.is_dataclass(c) and hasattr(c, "input")):
            raise DeclarationError(f"compose: sub-layer {self.k} has a value check ({c!r}) that "
                                   f"declares no input expression, so it cannot be composed")
        changes = {"input": self(c.input)}
        if hasattr(c, "label"):
            changes["label"] = f"{c.label}^{self.label}"
        return dataclasses.replace(c, **changes)


def _key(key, k):
    return f"{key}^({k})"


def compose(name, layers, options=None, description="", typical_sizes=None) -> Layer:
    """The layers applied one after another (see the module docstring); returns a ``Layer``."""
    layers = list(layers)
    if not layers or not all(isinstance(lay, Layer) for lay in layers):
        raise DeclarationError(f"compose {name!r}: give a non-empty sequence of Layer objects")
    stream, x0 = None, None
    params, inputs, inter, checks, moment_inputs = [], [], {}, [], []
    sizes = {}
    for k, lay in enumerate(layers, 1):
        x = _stream_input(lay, k)
        if not (E.same(x.rows, lay.output.rows) and E.same(x.cols, lay.output.cols)):
            raise ShapeError(f"compose {name!r}: sub-layer {k} ({lay.name!r}) maps its input "
                             f"{x.name} ({x.rows} × {x.cols}) to ({lay.output.rows} × "
                             f"{lay.output.cols}); a stack needs equal shapes")
        if stream is None:
            x0 = new_in = x
        else:
            if not (E.same(x.rows, stream.rows) and E.same(x.cols, stream.cols)):
                raise ShapeError(f"compose {name!r}: sub-layer {k} ({lay.name!r}) reads "
                                 f"({x.rows} × {x.cols}), the previous one writes "
                                 f"({stream.rows} × {stream.cols})")
            new_in = stream if isinstance(stream, E.Named) else \
                E.named(stream, f"X^({k})", rf"\mathbf X^{{({k})}}")
            moment_inputs.append(new_in)
            inter[_key("X", k)] = new_in
        index = _Indexer(k, x, new_in)
        stream = index(lay.output)
        params += [index(p) for p in lay.params]
        inputs += [index(v) for v in lay.inputs if v != x]
        inter.update({_key(key, k): index(node) for key, node in lay.intermediates.items()})
        checks += [index.check(c) for c in lay.checks]
        sizes.update(lay.typical_sizes)
    return Layer(name, stream, params, [x0] + inputs, inter, dict(options or {}), description,
                 checks, typical_sizes=dict(typical_sizes or sizes), moment_inputs=moment_inputs)


def stack(name, layer, depth, options=None, description="") -> Layer:
    """``compose`` of ``depth`` copies of ``layer`` (parameters W_Q_1, …, W_Q_depth …)."""
    if not isinstance(layer, Layer):
        raise DeclarationError(f"stack {name!r}: give a Layer to repeat, got {type(layer).__name__}")
    check_count("depth", depth, len(layer.params), f"stack {name!r}")
    return compose(name, [layer] * depth, options, description)


def residual_attention(causal=False, scale=None) -> Layer:
    """X + softmax_rows(c X W_Q W_Kᵀ Xᵀ) X W_V: one attention layer with its skip connection."""
    att = attention(causal=causal, scale=scale)
    X = att.inputs[0]
    return Layer("residual_attention", X + att.output, att.params, att.inputs, att.intermediates,
                 att.options, residual_attention.__doc__)


# ----------------------------------------------------------------------------- registered
@register_layer("attention_stack")
def attention_stack(depth: int = 2, causal: bool = False, scale=None) -> Layer:
    """Attention-only Transformer: depth × (X ← X + softmax_rows(c X W_Q W_Kᵀ Xᵀ) X W_V)."""
    return stack("attention_stack", residual_attention(causal, scale), depth,
                 {"depth": depth, "causal": causal, "scale": scale}, attention_stack.__doc__)


@register_layer("post_ln_stack")
def post_ln_stack(depth: int = 2, causal=False, activation="relu", eps=0, bias=False,
                  affine="none") -> Layer:
    """depth post-LN blocks: X ← LN(Y + FFN(Y)), Y = LN(X + SA(X)), each with its own parameters."""
    block = post_ln_block(causal=causal, activation=activation, eps=eps, bias=bias, affine=affine)
    lay = stack("post_ln_stack", block, depth,
                {"depth": depth, "causal": causal, "activation": activation, "eps": eps,
                 "bias": bias, "affine": affine}, post_ln_stack.__doc__)
    return dataclasses.replace(lay, typical_sizes=dict(FFN_TYPICAL_SIZES))


__all__ = ["compose", "stack", "residual_attention", "attention_stack", "post_ln_stack"]

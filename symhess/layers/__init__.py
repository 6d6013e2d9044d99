"""Declarations: the registry of named layers (``registry``), the attention variants
(``variants``), LayerNorm, FFN and Transformer blocks (``transformer``), the
modern block (``modern``: RMSNorm, rotary, grouped-query attention, SwiGLU), stacks and
compositions (``stack``), the experiments' model (``models``), torch modules (``modules``),
language models on token ids with their own loss (``language``) and layers named on a
command line (``specs``: ``FILE.py:ATTR``, ``MODULE:ATTR``).

Importing this package registers the built-in layers.
"""
from ..calculus.hessian import Derivation, derive as _derive
from ..expr.layer import Layer
from . import modern, models, stack, transformer, variants  # noqa: F401  (register the built-in layers)
from . import language  # noqa: F401  (from_module of language models on token ids, loss ce_weighted)
from .registry import LAYERS, layer, layer_options, register_layer


def derive(layer, loss: str = "mse") -> Derivation:
    """Derive the Hessian of ``loss(layer.output, Y)`` for a ``Layer`` or a registered layer's
    name (blocks are computed on demand, ``symhess.calculus.hessian.Derivation``)."""
    if isinstance(layer, str):
        layer = globals()["layer"](layer)
    return _derive(layer, loss)


__all__ = ["LAYERS", "Layer", "derive", "layer", "layer_options", "register_layer"]

"""symhess: derive exact loss Hessians of Transformer sub-layers symbolically."""
from . import expr
from .expr import ShapeError
from .hessian import Derivation, derive
from .layers import LAYERS, Layer, layer, register_layer
from . import variants, transformer, models  # noqa: F401  (register the built-in layers)
from .stack import compose, stack
from .kernels import kernel

__version__ = "0.1.0"

__all__ = ["expr", "ShapeError", "Derivation", "derive", "Layer", "layer", "register_layer",
           "LAYERS", "kernel", "compose", "stack", "__version__"]

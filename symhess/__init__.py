"""symhess: derive exact loss Hessians of Transformer sub-layers symbolically."""
__version__ = "0.1.0"

from . import expr  # noqa: E402
from .errors import (BudgetError, DeclarationError, InputError, SaturationWarning,  # noqa: E402
                     ShapeError, SymhessError)
from .hessian import Derivation, derive  # noqa: E402
from .layers import LAYERS, Layer, layer, register_layer  # noqa: E402
from . import variants, transformer, models  # noqa: E402,F401  (register the built-in layers)
from .stack import compose, stack  # noqa: E402
from .kernels import kernel  # noqa: E402

__all__ = ["expr", "ShapeError", "SymhessError", "DeclarationError", "InputError", "BudgetError", "SaturationWarning",
           "Derivation", "derive", "Layer", "layer", "register_layer", "LAYERS", "kernel",
           "compose", "stack", "__version__"]

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
           "compose", "stack", "__version__", "operator", "spectrum", "density", "Dataset",
           "from_module"]

_LAZY = {"operator": ("operators", "operator"), "spectrum": ("spectra", "spectrum"),
         "density": ("spectra", "density"), "Dataset": ("dataset", "Dataset"),
         "from_module": ("modules", "from_module")}


def __getattr__(name):
    """The curvature tools load on first use (scipy.sparse.linalg, torch.nn)."""
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    raise AttributeError(f"module 'symhess' has no attribute {name!r}")

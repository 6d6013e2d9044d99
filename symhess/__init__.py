"""symhess: derive exact loss Hessians of Transformer sub-layers symbolically.

The package is a pipeline; each stage imports only from the stages before it:

    expr/       the expression language: nodes, scalar functions, Layer, interpreter
    calculus/   differential rules, matrix and Kronecker views, the Hessian split, moments
    layers/     declarations: built-in layers, stacks, torch modules
    printing/   LaTeX documents of derivations: line breaking, shared sub-expressions, notation
    runtime/    the library generated kernels run on: index networks, planner, executors
    codegen/    lowering to index networks and emission of kernel modules
    curvature/  kernels on data: Hessian-vector products, reductions, operators, spectra
    cli/        the ``symhess`` command, reports and the papers' experiments
"""
from ._version import __version__  # noqa: E402,F401

from . import expr  # noqa: E402
from .errors import (BudgetError, DeclarationError, InputError, ProcessError,  # noqa: E402
                     SaturationWarning, ShapeError, SymhessError)
from .calculus.hessian import Derivation  # noqa: E402
from .expr.layer import Layer  # noqa: E402
from .layers import LAYERS, derive, layer, register_layer  # noqa: E402  (registers the built-in layers)
from .layers.stack import compose, stack  # noqa: E402
from .curvature.kernels import kernel  # noqa: E402

__all__ = ["expr", "ShapeError", "SymhessError", "DeclarationError", "InputError", "BudgetError", "ProcessError",
           "SaturationWarning",
           "Derivation", "derive", "Layer", "layer", "register_layer", "LAYERS", "kernel",
           "compose", "stack", "__version__", "operator", "spectrum", "density", "Dataset",
           "from_module", "submodule_call", "verify", "random_values"]

_LAZY = {"operator": ("curvature.operators", "operator"), "spectrum": ("curvature.spectra", "spectrum"),
         "density": ("curvature.spectra", "density"), "Dataset": ("curvature.dataset", "Dataset"),
         "from_module": ("layers.modules", "from_module"),
         "submodule_call": ("layers.hooks", "submodule_call"),
         "verify": ("calculus.verify", "verify"), "random_values": ("calculus.verify", "random_values")}


def __getattr__(name):
    """The curvature tools and the autograd reference load on first use (scipy.sparse.linalg, torch)."""
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    raise AttributeError(f"module 'symhess' has no attribute {name!r}")

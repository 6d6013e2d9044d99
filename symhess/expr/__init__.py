"""The expression language: immutable matrix nodes with symbolic shapes (``nodes``), entrywise
scalar functions (``scalarfn``), a declared layer (``layer.Layer``), the text and LaTeX
notation of an expression, the NumPy/torch interpreter (``evaluate``) and its memory budget.

    from symhess import expr as E
    L, d = E.dims("L d")
    X, W = E.matrix("X", L, d), E.param("W", d, d)
    F = E.softmax_rows(X @ W @ X.T) @ X

Nothing here knows derivatives: the calculus (``symhess.calculus``) is built on top.
"""
from . import evaluate as interpreter
from .nodes import (  # noqa: F401
    dim, dims, same, size_env, size_at, Expr, Var, Constant, Zero, Identity, Ones, CausalMask,
    Commutation, DiagSelector, MatMul, Add, Scale, Transpose, Kron, Hadamard, Elementwise,
    SoftmaxRows, LogSoftmaxRows, SoftmaxDiff, SoftmaxDiff2, SoftmaxJac, SoftmaxHess, Diag,
    DiagPart, VecR, UnvecR, KronContract, Named, matrix, param, const, zero, identity, ones,
    causal_mask, commutation, diag_selector, scale, matmul, add, transpose, kron, hadamard,
    elementwise, power, softmax_rows, log_softmax_rows, softmax_diff, softmax_diff2, diag,
    diag_part, vec_r, unvec_r, kron_contract, named, rowsum, sum_all, substitute, walk,
    ShapeError,
)
from .nodes import __all__ as _public


def _evaluate(self, values, backend="numpy"):
    """The expression's value at ``values`` ({name: array}), by the interpreter (``symhess.expr.evaluate``)."""
    return interpreter.evaluate(self, values, backend=backend)


Expr.evaluate = _evaluate    # bound here: the interpreter imports the nodes, not the reverse

__all__ = list(_public)

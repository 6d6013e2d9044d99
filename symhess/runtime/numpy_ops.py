"""The NumPy backend: the array operations the generated modules call, and the ones the
contraction engine needs (``OPS``).  Does not import torch.

Arrays carrying data have a leading batch axis (one sequence per entry); parameters do
not, and every operation broadcasts over it.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import scipy.special

from . import chain
from .network import EYE, ONES, Compact, net, refined  # noqa: F401  (used by generated modules)
from .state import Forward, Product, leaf  # noqa: F401
from ..errors import SaturationWarning

__all__ = ["math", "mm", "tr", "softmax_rows", "log_softmax_rows", "softmax_diff", "softmax_diff2",
           "lin", "mul", "sum_last", "sum_rows", "bcast_last", "bcast_rows", "eye", "zeros", "ones",
           "causal_mask", "diag", "diag_part", "vec_r", "unvec_r", "mean0", "unflat",
           "kron", "kron_contract", "commutation", "diag_selector", "refined",
           "exp", "log", "tanh", "sqrt", "sigmoid", "erf", "heaviside", "relu", "cosh", "sinh", "cos",
           "sin", "absolute", "square", "net", "Compact", "ONES", "EYE", "Forward", "leaf", "OPS"]

exp, log, tanh, sqrt, cosh, sinh, cos, sin = np.exp, np.log, np.tanh, np.sqrt, np.cosh, np.sinh, np.cos, np.sin
absolute, square = np.abs, np.square
sigmoid, erf = scipy.special.expit, scipy.special.erf


def heaviside(x, at0):
    return np.heaviside(x, at0)


def relu(x):
    """y H(y) = max(y, 0)."""
    return np.maximum(x, 0)


def mm(*xs):
    """F₁⋯F_k, bracketed for the sizes of the call (``symhess.runtime.chain``)."""
    return chain.multiply(xs, np.matmul, np.shape)


def tr(x):
    return np.swapaxes(x, -1, -2)


def lin(*terms):
    """Σ_k c_k x_k (∘ y_k) for terms (c, x) or (c, x, y), broadcast, x possibly a deferred
    product (``Forward.prod``, formed here), accumulated in place in one fresh array (a term
    spanning the result's shape first)."""
    terms = [tuple(t[:1]) + tuple(a.value() if isinstance(a, Product) else a for a in t[1:])
             for t in terms]
    shape = np.broadcast_shapes(*(np.shape(a) for t in terms for a in t[1:]))
    spans = [np.broadcast_shapes(*(np.shape(a) for a in t[1:])) == shape for t in terms]
    order = sorted(range(len(terms)), key=lambda i: not spans[i])
    acc = None
    for i in order:
        t = terms[i]
        x = t[1] if len(t) == 2 else t[1] * t[2]
        if acc is None:
            acc = np.multiply(x, t[0]) if spans[i] else np.broadcast_to(t[0] * x, shape).copy()
        elif t[0] == 1:
            acc += x
        else:
            acc += t[0] * x
    return acc


def mul(*xs):
    """x₁ ∘ x₂ ∘ ⋯, broadcast: one fresh array, the later factors multiplied in place once it
    spans their shape."""
    acc = np.multiply(xs[0], xs[1])
    for x in xs[2:]:
        if np.broadcast_shapes(acc.shape, np.shape(x)) == acc.shape:
            np.multiply(acc, x, out=acc)
        else:
            acc = np.multiply(acc, x)
    return acc


def sum_last(x):
    return x.sum(-1, keepdims=True)


def sum_rows(x):
    return x.sum(-2, keepdims=True)


def bcast_last(x, n):
    return np.broadcast_to(x, x.shape[:-1] + (n,))


def bcast_rows(x, n):
    return np.broadcast_to(x, x.shape[:-2] + (n, x.shape[-1]))


SATURATED = ("softmax rows within sqrt(eps) of one-hot: the kernel's Hessian terms through "
             "this softmax (diag(a) - a a^T) lose relative accuracy there (the interpreter, "
             "symhess.expr.evaluate, stays accurate)")


def softmax_rows(t, causal=False, mask=None):
    """Row-wise softmax (entries j > i masked to exactly 0 when ``causal``, entries where the
    0/1 ``mask`` is 0 likewise: exp(−∞) = 0 in the forward pass only, the derivatives read A)."""
    if causal:
        t = np.where(np.triu(np.ones(t.shape[-2:], dtype=bool), 1), -np.inf, t)
    if mask is not None:
        t = np.where(mask == 0, -np.inf, t)
    z = np.exp(t - t.max(-1, keepdims=True))
    total = z.sum(-1, keepdims=True)
    rest = (total[..., 0] - 1.0) / total[..., 0]         # 1 − max a (the largest z is 1)
    if np.any((rest > 0) & (rest < math.sqrt(np.finfo(z.dtype).eps))):
        warnings.warn(SATURATED, SaturationWarning, stacklevel=2)
    return z / total


def log_softmax_rows(t):
    z = t - t.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def softmax_diff(a, e):
    """dA[E] = A ∘ (E − rowsum(A ∘ E))."""
    return a * (e - (a * e).sum(-1, keepdims=True))


def softmax_diff2(a, e, f):
    """d²A[E, F] = w − A rowsum(w), w = dA[E] ∘ (F − rowsum(A ∘ F))."""
    w = softmax_diff(a, e) * (f - (a * f).sum(-1, keepdims=True))
    return w - a * w.sum(-1, keepdims=True)


def eye(n, like):
    return np.eye(n, dtype=like.dtype)


def zeros(shape, like):
    return np.zeros(shape, dtype=like.dtype)


def ones(shape, like):
    return np.ones(shape, dtype=like.dtype)


def causal_mask(n, like):
    """M[i, j] = [j ≤ i]."""
    return np.tril(np.ones((n, n), dtype=like.dtype))


def diag(v):
    """diag(v) for column vectors v (..., n, 1)."""
    return v * np.eye(v.shape[-2], dtype=v.dtype)


def diag_part(a):
    return np.diagonal(a, 0, -2, -1)[..., None]


def vec_r(x):
    return np.reshape(x, x.shape[:-2] + (x.shape[-2] * x.shape[-1], 1))


def unvec_r(x, m, n):
    return np.reshape(x, x.shape[:-2] + (m, n))


def unflat(x, rows, cols):
    """The matrix axes of x split into index atoms (C order): (…, R, C) → (…, *rows, *cols)."""
    return np.reshape(x, x.shape[:-2] + tuple(rows) + tuple(cols))


def mean0(x, batched):
    """The batch mean of a per-sequence result (``batched``: it carries the batch axis)."""
    return x.mean(0) if batched else x


def kron(*xs):
    """A ⊗ B ⊗ … of (batched) matrices."""
    out = xs[0]
    for b in xs[1:]:
        a = out
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        t = a[..., :, None, :, None] * b[..., None, :, None, :]
        out = np.reshape(t, lead + (a.shape[-2] * b.shape[-2], a.shape[-1] * b.shape[-1]))
    return out


def kron_contract(g, c, side, rows, cols):
    """Σ_ab C[a,b] G[(a,i),(b,j)] (side "right") or Σ_ab C[a,b] G[(i,a),(j,b)] ("left")."""
    a, b = c.shape[-2:]
    if side == "right":
        g4 = np.reshape(g, g.shape[:-2] + (a, rows, b, cols))
        return np.einsum("...aibj,...ab->...ij", g4, c)
    g4 = np.reshape(g, g.shape[:-2] + (rows, a, cols, b))
    return np.einsum("...iajb,...ab->...ij", g4, c)


def commutation(m, n, like):
    """K_{m,n} (mn × mn): K vec_r(B) = vec_r(Bᵀ) for B of shape n × m."""
    k = np.zeros((m * n, m * n), dtype=like.dtype)
    i, j = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    k[(i * n + j).ravel(), (j * m + i).ravel()] = 1
    return k


def diag_selector(n, like):
    """E_n (n² × n): vec_r(diag v) = E_n v."""
    e = np.zeros((n * n, n), dtype=like.dtype)
    e[np.arange(n) * (n + 1), np.arange(n)] = 1
    return e


class _Ops:
    """What ``symhess.runtime.contract`` and ``network`` need of a backend."""

    name = "numpy"

    @staticmethod
    def shape(a):
        return a.shape

    @staticmethod
    def transpose(a, perm):
        return np.transpose(a, perm)

    @staticmethod
    def reshape(a, shape):
        return np.reshape(a, tuple(shape))

    @staticmethod
    def product(a, b):
        """The broadcast product a * b, laid out in order (not in the operands' strides)."""
        return np.multiply(a, b, order="C")

    @staticmethod
    def scale_(a, b):
        """a *= b in place (b broadcast), returning a (a product when a is a NumPy scalar or
        a read-only view)."""
        if not isinstance(a, np.ndarray) or not a.flags.writeable:
            return a * b
        return np.multiply(a, b, out=a)

    @staticmethod
    def matmul(a, b):
        if a.shape[0] == 1:
            return np.matmul(a[0], b[0])[None]
        return np.matmul(a, b)

    @staticmethod
    def copy(a):
        return np.array(a, copy=True)

    @staticmethod
    def on_host(a):
        """Whether ``a`` lives in host memory (work is tiled for the CPU's caches there)."""
        return True

    @staticmethod
    def expand(a, shape):
        """``a`` repeated along its size-one axes to ``shape`` (a view)."""
        return np.broadcast_to(a, tuple(shape))

    @staticmethod
    def contiguous(a):
        """``a`` laid out in the order of its axes (a copy unless it is)."""
        return np.ascontiguousarray(a)

    @staticmethod
    def sum(a, axes):
        return a.sum(axis=tuple(axes))

    @staticmethod
    def narrow(a, axis, start, n):
        return a[(slice(None),) * axis + (slice(start, start + n),)]

    @staticmethod
    def zeros(shape, like):
        return np.zeros(tuple(shape), dtype=like.dtype)

    @staticmethod
    def diagonal(a, labels):
        """(view, distinct labels): a repeated label becomes one axis (the diagonal)."""
        uniq = tuple(dict.fromkeys(labels))
        return _strided(a, labels, uniq, writeable=False), uniq

    @staticmethod
    def diagonal_view(a, labels):
        """A writeable view of ``a`` over its distinct labels (repeats: the diagonal)."""
        return _strided(a, labels, tuple(dict.fromkeys(labels)), writeable=True)

    @staticmethod
    def expand_dims(r, positions, ndim):
        shape = [1] * ndim
        for p, s in zip(positions, np.shape(r)):
            shape[p] = s
        return np.reshape(r, shape)

    @staticmethod
    def add_scaled(view, r, c):
        if c == 1:
            view += r
        else:
            view += c * r

    @staticmethod
    def add_product(view, x, y, c):
        """view += c · x ∘ y (broadcast)."""
        _add_fresh(view, np.multiply(x, y), c)

    matmul2 = staticmethod(np.matmul)
    lin = staticmethod(lin)               # Σ c x, products accumulated by their GEMMs

    @staticmethod
    def added(acc, r, c):
        """acc + c r, written into acc."""
        acc += c * r
        return acc

    @staticmethod
    def addmm_(acc, a, b, c):
        """acc += c · a b in place (NumPy's GEMM does not accumulate: formed, then added)."""
        return _add_fresh(acc, np.matmul(a, b), c)

    @staticmethod
    def matmul_mean(a, b):
        """mean_n a_n b_n for batched (n, ·, ·) or plain operands (as in ``torch_ops``)."""
        if a.ndim == 3 and b.ndim == 3:
            n, r, k = a.shape
            c = b.shape[-1]
            at = a.transpose(0, 2, 1)
            copies = (0 if at.flags.c_contiguous else a.size) + (0 if b.flags.c_contiguous else b.size)
            if copies <= n * r * c:
                return (at.reshape(n * k, r).T @ b.reshape(n * k, c)) / n
            return np.matmul(a, b).mean(0)
        if a.ndim == 3:
            return a.mean(0) @ b
        if b.ndim == 3:
            return a @ b.mean(0)
        return a @ b

    @staticmethod
    def batch_mean(x):
        return x.mean(0) if x.ndim == 3 else x
    tr = staticmethod(tr)                 # aᵀ over the last two axes (a view)

    @staticmethod
    def columns(f, V, chunk):
        """[f(V[:, 0]), f(V[:, 1]), …] as the columns of one matrix (one call per column)."""
        return np.stack([f(V[:, j]) for j in range(V.shape[1])], axis=1)

    @staticmethod
    def concat(xs):
        return np.concatenate(list(xs))

    @staticmethod
    def scalar(v, like):
        return np.asarray(v, dtype=like.dtype)

    @staticmethod
    def item(v):
        return float(v)

    @staticmethod
    def root(v):
        """√max(v, 0) of a 0-d result (a squared norm that rounding may leave below 0)."""
        return np.sqrt(np.maximum(v, 0.0))


def _strided(a, labels, uniq, writeable):
    strides = [0] * len(uniq)
    shape = [0] * len(uniq)
    for lab, st, s in zip(labels, a.strides, a.shape):
        k = uniq.index(lab)
        strides[k] += st
        shape[k] = s
    return np.lib.stride_tricks.as_strided(a, tuple(shape), tuple(strides), writeable=writeable)


def _add_fresh(acc, r, c):
    """acc += c r for a fresh array r (scaled in place), returning acc."""
    if c != 1:
        r *= c
    acc += r
    return acc


OPS = _Ops()

"""The torch backend: the same operations as ``numpy_ops``, on tensors of any device and
float dtype (``OPS`` for the contraction engine)."""
from __future__ import annotations

import contextvars
import functools
import math
import warnings

import torch

from . import chain
from .network import EYE, ONES, Compact, net, refined  # noqa: F401  (used by generated modules)
from .state import Forward, Product, leaf  # noqa: F401
from .numpy_ops import SATURATED
from ..errors import SaturationWarning

__all__ = ["math", "mm", "tr", "softmax_rows", "log_softmax_rows", "softmax_diff", "softmax_diff2",
           "lin", "mul", "sum_last", "sum_rows", "bcast_last", "bcast_rows", "eye", "zeros", "ones",
           "causal_mask", "diag", "diag_part", "vec_r", "unvec_r", "mean0", "unflat",
           "kron", "kron_contract", "commutation", "diag_selector", "refined",
           "exp", "log", "tanh", "sqrt", "sigmoid", "erf", "heaviside", "relu", "cosh", "sinh", "cos",
           "sin", "absolute", "square", "net", "Compact", "ONES", "EYE", "Forward", "leaf", "OPS"]

exp, log, tanh, sqrt, cosh, sinh, cos, sin = (torch.exp, torch.log, torch.tanh, torch.sqrt,
                                              torch.cosh, torch.sinh, torch.cos, torch.sin)
absolute, sigmoid, erf, square = torch.abs, torch.sigmoid, torch.special.erf, torch.square

# inside ``_Ops.columns`` (``torch.func.vmap`` over a matrix's columns) the accumulations
# below avoid addmm_/baddbmm_/addcmul_ (vmap has no batching rule for them) and go out of
# place where a sum started from a tensor that does not depend on the column takes a term
# that does (``_in_place``)
_VECTORISED = contextvars.ContextVar("symhess_vectorised", default=False)


def _in_place(method, fresh, acc, x, **kw):
    """``acc.method(x)`` in place where vmap allows it; where acc is the same for every
    column and x is not, ``fresh(acc, x)``, which varies over the columns from then on."""
    try:
        return getattr(acc, method)(x, **kw)
    except RuntimeError:
        if not _VECTORISED.get():
            raise
        return fresh(acc, x, **kw)


def _iadd(acc, x, alpha):
    """acc + alpha x, into acc where vmap allows it (``_in_place``)."""
    return _in_place("add_", torch.add, acc, x, alpha=alpha)


def heaviside(x, at0):
    """The step function (comparisons: autograd has no derivative for aten::heaviside)."""
    if at0 == 0:
        return (x > 0).to(x.dtype)
    return (x > 0).to(x.dtype) + float(at0) * (x == 0).to(x.dtype)


relu = torch.relu          # y H(y)


def mm(*xs):
    """F₁⋯F_k, bracketed for the sizes of the call (``symhess.runtime.chain``)."""
    return chain.multiply(xs, torch.matmul, lambda x: tuple(x.shape))


def tr(x):
    return x.transpose(-1, -2)


def lin(*terms):
    """Σ_k c_k x_k (∘ y_k) for terms (c, x) or (c, x, y), broadcast, x possibly a deferred
    product (``Forward.prod``): one fresh array (a product spanning the result's shape taken
    as it is formed, else a term spanning it, a unit one preferred), then one in-place pass
    per term (``add_`` with alpha, ``addcmul_``; a product accumulated by its GEMM,
    ``_Ops.addmm_``); the first coefficient is factored out and put back last when it is not
    1."""
    shapes = [[_shape(a) for a in t[1:]] for t in terms]
    shape = _broadcast(*(s for ss in shapes for s in ss))
    spans = [_broadcast(*ss) == shape for ss in shapes]
    deferred = [len(t) == 2 and isinstance(t[1], Product) for t in terms]
    order = sorted(range(len(terms)), key=lambda i: (not spans[i], not deferred[i], len(terms[i]) != 2,
                                                     terms[i][0] != 1))
    terms = [tuple(t[:1]) + tuple(a.value() if isinstance(a, Product) and (i == order[0] or len(t) > 2)
                                  else a for a in t[1:]) for i, t in enumerate(terms)]
    first, rest = terms[order[0]], [terms[i] for i in order[1:]]
    c0 = first[0]
    if deferred[order[0]]:
        acc = first[1]
    elif len(first) == 3:
        acc = torch.mul(first[1], first[2])
    elif rest and len(rest[0]) == 2 and not isinstance(rest[0][1], Product):
        acc = torch.add(first[1], rest[0][1], alpha=rest[0][0] / c0)
        rest = rest[1:]
    elif rest and len(rest[0]) == 3:
        acc = torch.addcmul(first[1], rest[0][1], rest[0][2], value=rest[0][0] / c0)
        rest = rest[1:]
    else:
        acc = first[1].clone(memory_format=torch.contiguous_format)
    if tuple(acc.shape) != tuple(shape):
        acc = acc.expand(shape).clone()
    if _VECTORISED.get():
        for t in rest:
            term = t[1].value() if isinstance(t[1], Product) else t[1] if len(t) == 2 else t[1] * t[2]
            acc = _iadd(acc, term, t[0] / c0)
        return acc if c0 == 1 else acc.mul_(c0)
    for t in rest:
        if isinstance(t[1], Product):
            t[1].into(acc, t[0] / c0)
        elif len(t) == 2:
            acc.add_(t[1], alpha=t[0] / c0)
        else:
            acc.addcmul_(t[1], t[2], value=t[0] / c0)
    return acc if c0 == 1 else acc.mul_(c0)


def mul(*xs):
    """x₁ ∘ x₂ ∘ ⋯, broadcast: one fresh array, the later factors multiplied in place once it
    spans their shape."""
    acc = torch.mul(xs[0], xs[1])
    for x in xs[2:]:
        if _broadcast(acc.shape, x.shape) == acc.shape:
            acc = _in_place("mul_", torch.mul, acc, x)
        else:
            acc = torch.mul(acc, x)
    return acc


@functools.lru_cache(maxsize=4096)
def _broadcast(*shapes):
    """``torch.broadcast_shapes`` as a tuple, cached: the library's runs as Python (≈ 10 µs a
    call) and a routine asks a few hundred times per call for the same few shapes."""
    return tuple(torch.broadcast_shapes(*shapes))


def _shape(a):
    return a.shape if isinstance(a, Product) else tuple(a.shape)


def sum_last(x):
    return x.sum(-1, keepdim=True)


def sum_rows(x):
    return x.sum(-2, keepdim=True)


def bcast_last(x, n):
    return x.expand(*x.shape[:-1], n)


def bcast_rows(x, n):
    return x.expand(*x.shape[:-2], n, x.shape[-1])


def softmax_rows(t, causal=False, mask=None):
    """Row-wise softmax (entries j > i masked to exactly 0 when ``causal``, entries where the
    0/1 ``mask`` is 0 likewise: exp(−∞) = 0 in the forward pass only, the derivatives read A)."""
    if causal:
        n, m = t.shape[-2:]
        upper = torch.triu(torch.ones((n, m), dtype=torch.bool, device=t.device), 1)
        t = t.masked_fill(upper, -math.inf)
    if mask is not None:
        t = t.masked_fill(mask == 0, -math.inf)
    a = torch.softmax(t, -1)
    rest = 1.0 - a.amax(-1)                                # 1 − max a
    if bool(((rest > 0) & (rest < math.sqrt(torch.finfo(a.dtype).eps))).any()):
        warnings.warn(SATURATED, SaturationWarning, stacklevel=2)
    return a


def log_softmax_rows(t):
    return torch.log_softmax(t, -1)


def softmax_diff(a, e):
    """dA[E] = A ∘ (E − rowsum(A ∘ E)), formed as A ∘ E − A rowsum(A ∘ E): one fresh array."""
    t = torch.mul(a, e)
    return _minus_scaled(t, a, t.sum(-1, keepdim=True))


def softmax_diff2(a, e, f):
    """d²A[E, F] = w − A rowsum(w), w = dA[E] ∘ (F − rowsum(A ∘ F)), formed as
    dA[E] ∘ F − dA[E] rowsum(A ∘ F): two fresh arrays besides A ∘ F's row sums."""
    d = softmax_diff(a, e)
    w = _minus_scaled(torch.mul(d, f), d, (a * f).sum(-1, keepdim=True))
    return _minus_scaled(w, a, w.sum(-1, keepdim=True))


def _minus_scaled(t, a, s):
    """t − a ∘ s (s broadcast) for a fresh t of the result's shape: into t (``addcmul_``),
    out of place inside ``_Ops.columns``' vmap (no batching rule for ``addcmul_``)."""
    if _VECTORISED.get():
        return torch.addcmul(t, a, s, value=-1)
    return t.addcmul_(a, s, value=-1)


def eye(n, like):
    return torch.eye(n, dtype=like.dtype, device=like.device)


def zeros(shape, like):
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def ones(shape, like):
    return torch.ones(shape, dtype=like.dtype, device=like.device)


def causal_mask(n, like):
    """M[i, j] = [j ≤ i]."""
    return torch.tril(torch.ones((n, n), dtype=like.dtype, device=like.device))


def diag(v):
    """diag(v) for column vectors v (..., n, 1)."""
    return v * torch.eye(v.shape[-2], dtype=v.dtype, device=v.device)


def diag_part(a):
    return torch.diagonal(a, 0, -2, -1)[..., None]


def vec_r(x):
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1], 1)


def unvec_r(x, m, n):
    return x.reshape(*x.shape[:-2], m, n)


def unflat(x, rows, cols):
    """The matrix axes of x split into index atoms (C order): (…, R, C) → (…, *rows, *cols)."""
    return x.reshape(*x.shape[:-2], *rows, *cols)


def mean0(x, batched):
    """The batch mean of a per-sequence result (``batched``: it carries the batch axis)."""
    return x.mean(0) if batched else x


def kron(*xs):
    """A ⊗ B ⊗ … of (batched) matrices."""
    out = xs[0]
    for b in xs[1:]:
        a = out
        lead = _broadcast(a.shape[:-2], b.shape[:-2])
        t = a[..., :, None, :, None] * b[..., None, :, None, :]
        out = t.reshape(*lead, a.shape[-2] * b.shape[-2], a.shape[-1] * b.shape[-1])
    return out


def kron_contract(g, c, side, rows, cols):
    """Σ_ab C[a,b] G[(a,i),(b,j)] (side "right") or Σ_ab C[a,b] G[(i,a),(j,b)] ("left")."""
    a, b = c.shape[-2:]
    if side == "right":
        g4 = g.reshape(*g.shape[:-2], a, rows, b, cols)
        return torch.einsum("...aibj,...ab->...ij", g4, c)
    g4 = g.reshape(*g.shape[:-2], rows, a, cols, b)
    return torch.einsum("...iajb,...ab->...ij", g4, c)


def commutation(m, n, like):
    """K_{m,n} (mn × mn): K vec_r(B) = vec_r(Bᵀ) for B of shape n × m."""
    k = torch.zeros((m * n, m * n), dtype=like.dtype, device=like.device)
    i = torch.arange(m, device=like.device)[:, None]
    j = torch.arange(n, device=like.device)[None, :]
    k[(i * n + j).reshape(-1), (j * m + i).reshape(-1)] = 1
    return k


def diag_selector(n, like):
    """E_n (n² × n): vec_r(diag v) = E_n v."""
    e = torch.zeros((n * n, n), dtype=like.dtype, device=like.device)
    r = torch.arange(n, device=like.device)
    e[r * (n + 1), r] = 1
    return e


class _Ops:
    """What ``symhess.runtime.contract`` and ``network`` need of a backend."""

    name = "torch"

    @staticmethod
    def shape(a):
        return tuple(a.shape)

    @staticmethod
    def transpose(a, perm):
        return a.permute(*perm)

    @staticmethod
    def reshape(a, shape):
        return a.reshape(tuple(shape))

    @staticmethod
    def product(a, b):
        """The broadcast product a * b, laid out in order (not in the operands' strides)."""
        shape = _broadcast(a.shape, b.shape)
        return torch.mul(a, b, out=torch.empty(shape, dtype=torch.result_type(a, b), device=a.device))

    @staticmethod
    def scale_(a, b):
        """a *= b in place (b broadcast), returning a."""
        return a.mul_(b)

    @staticmethod
    def matmul(a, b):
        if a.shape[0] == 1:
            return torch.mm(a[0], b[0])[None]
        return torch.bmm(a, b)

    @staticmethod
    def copy(a):
        return a.clone()

    @staticmethod
    def on_host(a):
        """Whether ``a`` lives in host memory (work is tiled for the CPU's caches there)."""
        return a.device.type == "cpu"

    @staticmethod
    def expand(a, shape):
        """``a`` repeated along its size-one axes to ``shape`` (a view)."""
        return a.expand(*shape)

    @staticmethod
    def contiguous(a):
        """``a`` laid out in the order of its axes (a copy unless it is)."""
        return a.contiguous()

    @staticmethod
    def sum(a, axes):
        return a.sum(dim=tuple(axes))

    @staticmethod
    def narrow(a, axis, start, n):
        return a.narrow(axis, start, n)

    @staticmethod
    def zeros(shape, like):
        return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)

    @staticmethod
    def diagonal(a, labels):
        """(view, distinct labels): a repeated label becomes one axis (the diagonal)."""
        uniq = tuple(dict.fromkeys(labels))
        return _strided(a, labels, uniq), uniq

    @staticmethod
    def diagonal_view(a, labels):
        """A writeable view of ``a`` over its distinct labels (repeats: the diagonal)."""
        return _strided(a, labels, tuple(dict.fromkeys(labels)))

    @staticmethod
    def expand_dims(r, positions, ndim):
        shape = [1] * ndim
        for p, s in zip(positions, r.shape):
            shape[p] = s
        return r.reshape(shape)

    @staticmethod
    def add_scaled(view, r, c):
        view.add_(r, alpha=c)

    @staticmethod
    def add_product(view, x, y, c):
        """view += c · x ∘ y (broadcast) in one pass."""
        view.addcmul_(x, y, value=c)

    @staticmethod
    def added(acc, r, c):
        """acc + c r, written into acc (``_iadd``)."""
        return _iadd(acc, r, c)

    matmul2 = staticmethod(torch.matmul)
    lin = staticmethod(lin)               # Σ c x, products accumulated by their GEMMs

    @staticmethod
    def addmm_(acc, a, b, c):
        """acc += c · a b in place, the product accumulated by the GEMM (``addmm_``,
        ``baddbmm_``: beta 1), acc contiguous; otherwise formed and added (a fresh sum when
        vectorised)."""
        if _VECTORISED.get():
            return _iadd(acc, torch.matmul(a, b), c)
        if acc.is_contiguous() and acc.dim() == 3 and b.dim() == 2 and a.dim() == 3 \
                and a.shape[0] == acc.shape[0]:
            acc.view(-1, acc.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), b, alpha=c)
        elif acc.dim() == 3 and a.dim() == 3 and b.dim() == 3 and tuple(acc.shape) == \
                (a.shape[0], a.shape[1], b.shape[2]) and a.shape[0] == b.shape[0]:
            acc.baddbmm_(a, b, alpha=c)
        elif acc.dim() == 2 and a.dim() == 2 and b.dim() == 2:
            acc.addmm_(a, b, alpha=c)
        else:
            acc.add_(torch.matmul(a, b), alpha=c)
        return acc

    @staticmethod
    def matmul_mean(a, b):
        """mean_n a_n b_n for batched (n, ·, ·) or plain operands.  Both batched: the batch
        joins the inner dimension, (R × n·K)(n·K × C), one product and no per-sequence
        results, unless laying the operands out for it copies more than those results
        would take; one batched: its mean first."""
        if a.dim() == 3 and b.dim() == 3:
            n, r, k = a.shape
            c = b.shape[-1]
            copies = (0 if a.transpose(1, 2).is_contiguous() else a.numel()) + \
                (0 if b.is_contiguous() else b.numel())
            if copies <= n * r * c:
                out = torch.mm(a.transpose(1, 2).reshape(n * k, r).T, b.reshape(n * k, c))
                return out.div_(n)
            return torch.matmul(a, b).mean(0)
        if a.dim() == 3:
            return torch.matmul(a.mean(0), b)
        if b.dim() == 3:
            return torch.matmul(a, b.mean(0))
        return torch.matmul(a, b)

    @staticmethod
    def batch_mean(x):
        return x.mean(0) if x.dim() == 3 else x
    tr = staticmethod(tr)                 # aᵀ over the last two axes (a view)

    @staticmethod
    def columns(f, V, chunk):
        """[f(V[:, 0]), f(V[:, 1]), …] as the columns of one matrix: ``torch.func.vmap`` over
        the columns, ``chunk`` of them per call (f must be linear in its argument's values,
        with no control flow on them: a generated Hessian–vector routine)."""
        token = _VECTORISED.set(True)
        try:
            # the columns as the leading axis of contiguous rows: every batched
            # operation then sees its column axis outermost
            return torch.func.vmap(f, chunk_size=chunk)(V.T.contiguous()).T
        finally:
            _VECTORISED.reset(token)

    @staticmethod
    def concat(xs):
        return torch.cat(list(xs))

    @staticmethod
    def scalar(v, like):
        return torch.tensor(v, dtype=like.dtype, device=like.device)

    @staticmethod
    def item(v):
        return float(v)

    @staticmethod
    def root(v):
        """√max(v, 0) of a 0-d result (a squared norm that rounding may leave below 0)."""
        return torch.sqrt(torch.clamp(torch.as_tensor(v), min=0))


def _strided(a, labels, uniq):
    strides = [0] * len(uniq)
    shape = [0] * len(uniq)
    for lab, st, s in zip(labels, a.stride(), a.shape):
        k = uniq.index(lab)
        strides[k] += st
        shape[k] = s
    return a.as_strided(shape, strides, a.storage_offset())


OPS = _Ops()

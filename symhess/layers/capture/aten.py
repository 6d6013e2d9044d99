"""The ATen op table of graph capture: one entry per op a translation meets.

``OPS[name](ctx, node, *args, **kwargs)`` returns the op's value, with ``args`` already
translated: ``Sym`` (a tensor that depends on the module's input), ``Piece`` (a module
parameter's entries), a torch tensor (a constant) or a plain Python value.  An op whose
arguments are all constants never reaches the table: it is run (constant folding).  An op
on parameters alone that only rearranges entries (``VIEWS``) is run on the parameter's index
array.  Everything else without an entry is refused by name.  Each entry's docstring states
what it declares.  This module holds the table, the operand helpers, identities and shape
operations; ``aten_math`` the arithmetic (graph capture imports both).
"""
from __future__ import annotations

import numpy as np

from ...expr.registry import Registry
from . import ops as O
from . import shapes as SH
from . import tensor as S
from .tensor import Piece, Sym

OPS = Registry("ATen op translation for")

# ops that only rearrange entries: on module parameters they act on the index arrays
VIEWS = {"aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
         "aten.reshape.default", "aten._unsafe_view.default", "aten.unflatten.int",
         "aten.flatten.using_ints", "aten.unsqueeze.default", "aten.squeeze.dim",
         "aten.squeeze.dims", "aten.squeeze.default", "aten.select.int", "aten.slice.Tensor",
         "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
         "aten.contiguous.default", "aten.clone.default", "aten.alias.default",
         "aten.expand.default", "aten.unbind.int", "<built-in function getitem>",
         "aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout",
         "aten.lift_fresh_copy.default"}


def op(*names):
    def deco(fn):
        for n in names:
            OPS.register(n)(fn)
        return fn
    return deco


def _sym(ctx, v, like=None, additive=False):
    """Any operand as a ``Sym`` (a constant broadcast to ``like``, a parameter as a row)."""
    if isinstance(v, Sym):
        return v
    if isinstance(v, Piece):
        return piece_row(ctx, v)
    return O.const_sym(ctx, _tensor(v), like, additive)


def _tensor(v):
    import torch
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(v)


def _is_scalar(v):
    import torch
    if isinstance(v, (int, float, bool)):
        return True
    return isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex()


def _value(v):
    return float(v.item()) if hasattr(v, "item") else float(v)


def piece_row(ctx, piece):
    """A parameter used entrywise (γ of a norm, a bias): a row 1 × n broadcast over rows."""
    idx = np.asarray(piece.idx)
    if len([s for s in idx.shape if s != 1]) > 1:
        raise ctx.fail(f"parameter {piece.name} of shape {tuple(idx.shape)} is used entrywise as a "
                       f"matrix; only vectors (γ, β, biases) can be")
    return _row(ctx, piece.name, idx, max(idx.ndim, 1))


def _row(ctx, name, idx, ndim):
    n = int(idx.size)
    col = S.Atom("feat", n) if n > 1 else None
    w = Piece(name, idx.reshape(1, -1), None)
    dims = [[] for _ in range(ndim - 1)] + [[col] if col else []]
    return S.single(S.Lin([S.Term(None, None, w, None, 1.0)]), dims, None, col)


# ----------------------------------------------------------------------------- identities
@op("aten.contiguous.default", "aten.clone.default", "aten.alias.default",
    "aten.lift_fresh_copy.default")
def _identity(ctx, node, x, *a, **k):
    """The same tensor (memory layout is not mathematics)."""
    return x


@op("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.type_as.default")
def _cast(ctx, node, x, *a, **k):
    """A dtype cast: the identity, recorded when it lowers the caller's precision.

    The declaration states the mathematics in the caller's dtype (``Capture.casts``)."""
    ctx.note_cast(node, x, a, k)
    return x


@op("aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default")
def _dropout(ctx, node, x, p=0.5, train=True, *a, **k):
    """Dropout with p = 0 or in eval mode: the identity; otherwise refused (it is random)."""
    if train and p:
        raise ctx.fail(f"dropout {p} in training mode is random; call module.eval() (or set "
                       f"the dropout to 0)")
    if str(node.target) == "aten.native_dropout.default":
        return (x, None)
    return x


@op("aten._assert_tensor_metadata.default", "aten._assert_scalar.default")
def _assert(ctx, node, *a, **k):
    """A runtime assertion of torch.export: nothing to declare."""
    return None


@op("aten.detach.default")
def _detach(ctx, node, x, *a, **k):
    """detach of a tensor that depends on the input: refused (it would cut derivatives)."""
    raise ctx.fail("detach() of a tensor that depends on the input or the parameters stops "
                   "its derivatives; the declaration would differ from the module's Hessian")


# ----------------------------------------------------------------------------- shapes
@op("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
def _view(ctx, node, x, shape):
    """Regroup axes (row-major); a feature axis split into (H, d_h) is a head split."""
    return SH.reshape(ctx, x, shape)


@op("aten.unflatten.int")
def _unflatten(ctx, node, x, dim, sizes):
    """One axis split into several (a head split on the features)."""
    shape = list(x.shape)
    dim = dim % len(shape)
    return SH.reshape(ctx, x, shape[:dim] + list(sizes) + shape[dim + 1:])


@op("aten.flatten.using_ints")
def _flatten(ctx, node, x, start=0, end=-1):
    """Axes start … end merged into one."""
    shape = list(x.shape)
    s, e = start % len(shape), end % len(shape)
    return SH.reshape(ctx, x, shape[:s] + [int(np.prod(shape[s:e + 1]))] + shape[e + 1:])


@op("aten.transpose.int")
def _transpose(ctx, node, x, i, j):
    """Two axes swapped (a block's rows and columns when they are its matrix axes)."""
    return SH.transpose_dims(ctx, x, i, j)


@op("aten.t.default")
def _t(ctx, node, x):
    """The transpose of a 2-D tensor."""
    return SH.transpose_dims(ctx, x, 0, 1)


@op("aten.permute.default")
def _permute(ctx, node, x, perm):
    """Axes reordered."""
    return SH.permute(ctx, x, perm)


@op("aten.unsqueeze.default")
def _unsqueeze(ctx, node, x, dim):
    """A new axis of size 1."""
    return SH.unsqueeze(ctx, x, dim)


@op("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def _squeeze(ctx, node, x, dims=None):
    """Axes of size 1 removed."""
    if dims is not None and not isinstance(dims, (list, tuple)):
        dims = [dims]
    return SH.squeeze(ctx, x, dims)


@op("aten.expand.default")
def _expand(ctx, node, x, sizes, implicit=False):
    """A size-1 axis repeated: shared blocks (repeat_kv of grouped-query attention)."""
    return SH.expand(ctx, x, sizes)


@op("aten.repeat_interleave.self_int")
def _repeat_interleave(ctx, node, x, repeats, dim=None, output_size=None):
    """Each head repeated ``repeats`` times along its axis (shared blocks)."""
    if dim is None:
        raise ctx.fail("repeat_interleave without an axis flattens the tensor")
    return SH.repeat_interleave(ctx, x, int(repeats), dim)


@op("aten.select.int")
def _select(ctx, node, x, dim, index):
    """One head (grid index) or one feature column."""
    return SH.select(ctx, x, dim, index)


@op("aten.slice.Tensor")
def _slice(ctx, node, x, dim=0, start=None, end=None, step=1):
    """A range of heads or feature columns (rotate_half's halves)."""
    n = x.shape[dim]
    start = 0 if start is None else max(-n, min(start, n))
    end = n if end is None else max(-n, min(end, n))
    return SH.slice_(ctx, x, dim, start, end, step)


@op("aten.split.Tensor", "aten.split_with_sizes.default")
def _split(ctx, node, x, sizes, dim=0):
    """Consecutive slices of one axis (q, k, v of a fused projection)."""
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    out, start = [], 0
    for s in sizes:
        out.append(SH.slice_(ctx, x, dim, start, start + s, 1))
        start += s
    return out


@op("aten.chunk.default")
def _chunk(ctx, node, x, chunks, dim=0):
    """``chunks`` equal slices of one axis."""
    n = x.shape[dim]
    size = -(-n // chunks)
    return _split(ctx, node, x, size, dim)


@op("aten.unbind.int")
def _unbind(ctx, node, x, dim=0):
    """Every index of one axis."""
    return [SH.select(ctx, x, dim, i) for i in range(x.shape[dim])]


@op("<built-in function getitem>")
def _getitem(ctx, node, seq, i):
    """One output of a multi-output op."""
    return seq[i]


@op("aten.cat.default")
def _cat(ctx, node, xs, dim=0):
    """Concatenation: of feature columns (placed blocks, rotate_half) or of heads."""
    syms = [v for v in xs if isinstance(v, Sym)]
    return SH.cat(ctx, [_sym(ctx, v, syms[0]) for v in xs], dim)


@op("aten.stack.default")
def _stack(ctx, node, xs, dim=0):
    """Tensors side by side along a new axis (a new grid axis)."""
    syms = [v for v in xs if isinstance(v, Sym)]
    ys = [SH.unsqueeze(ctx, _sym(ctx, v, syms[0]), dim) for v in xs]
    return SH.cat(ctx, ys, dim)

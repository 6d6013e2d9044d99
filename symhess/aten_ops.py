"""The ATen op table of graph capture: one entry per op a translation meets.

``OPS[name](ctx, node, *args, **kwargs)`` returns the op's value, with ``args`` already
translated: ``Sym`` (a tensor that depends on the module's input), ``Piece`` (a module
parameter's entries), a torch tensor (a constant) or a plain Python value.  An op whose
arguments are all constants never reaches the table: it is run (constant folding).  An op
on parameters alone that only rearranges entries (``VIEWS``) is run on the parameter's index
array.  Everything else without an entry is refused by name.  Each entry's docstring states
what it declares.
"""
from __future__ import annotations

import math
import operator

import numpy as np
import sympy as sp

from .expr import nodes as E
from . import symops as O
from . import symtensor as S
from .expr.registry import Registry
from .expr.scalarfn import x as XS
from .symtensor import Sym

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
    from .capture import Piece
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
    from .capture import Piece
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
    return O.reshape(ctx, x, shape)


@op("aten.unflatten.int")
def _unflatten(ctx, node, x, dim, sizes):
    """One axis split into several (a head split on the features)."""
    shape = list(x.shape)
    dim = dim % len(shape)
    return O.reshape(ctx, x, shape[:dim] + list(sizes) + shape[dim + 1:])


@op("aten.flatten.using_ints")
def _flatten(ctx, node, x, start=0, end=-1):
    """Axes start … end merged into one."""
    shape = list(x.shape)
    s, e = start % len(shape), end % len(shape)
    return O.reshape(ctx, x, shape[:s] + [int(np.prod(shape[s:e + 1]))] + shape[e + 1:])


@op("aten.transpose.int")
def _transpose(ctx, node, x, i, j):
    """Two axes swapped (a block's rows and columns when they are its matrix axes)."""
    return O.transpose_dims(ctx, x, i, j)


@op("aten.t.default")
def _t(ctx, node, x):
    """The transpose of a 2-D tensor."""
    return O.transpose_dims(ctx, x, 0, 1)


@op("aten.permute.default")
def _permute(ctx, node, x, perm):
    """Axes reordered."""
    return O.permute(ctx, x, perm)


@op("aten.unsqueeze.default")
def _unsqueeze(ctx, node, x, dim):
    """A new axis of size 1."""
    return O.unsqueeze(ctx, x, dim)


@op("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def _squeeze(ctx, node, x, dims=None):
    """Axes of size 1 removed."""
    if dims is not None and not isinstance(dims, (list, tuple)):
        dims = [dims]
    return O.squeeze(ctx, x, dims)


@op("aten.expand.default")
def _expand(ctx, node, x, sizes, implicit=False):
    """A size-1 axis repeated: shared blocks (repeat_kv of grouped-query attention)."""
    return O.expand(ctx, x, sizes)


@op("aten.repeat_interleave.self_int")
def _repeat_interleave(ctx, node, x, repeats, dim=None, output_size=None):
    """Each head repeated ``repeats`` times along its axis (shared blocks)."""
    if dim is None:
        raise ctx.fail("repeat_interleave without an axis flattens the tensor")
    return O.repeat_interleave(ctx, x, int(repeats), dim)


@op("aten.select.int")
def _select(ctx, node, x, dim, index):
    """One head (grid index) or one feature column."""
    return O.select(ctx, x, dim, index)


@op("aten.slice.Tensor")
def _slice(ctx, node, x, dim=0, start=None, end=None, step=1):
    """A range of heads or feature columns (rotate_half's halves)."""
    n = x.shape[dim]
    start = 0 if start is None else max(-n, min(start, n))
    end = n if end is None else max(-n, min(end, n))
    return O.slice_(ctx, x, dim, start, end, step)


@op("aten.split.Tensor", "aten.split_with_sizes.default")
def _split(ctx, node, x, sizes, dim=0):
    """Consecutive slices of one axis (q, k, v of a fused projection)."""
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    out, start = [], 0
    for s in sizes:
        out.append(O.slice_(ctx, x, dim, start, start + s, 1))
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
    return [O.select(ctx, x, dim, i) for i in range(x.shape[dim])]


@op("<built-in function getitem>")
def _getitem(ctx, node, seq, i):
    """One output of a multi-output op."""
    return seq[i]


@op("aten.cat.default")
def _cat(ctx, node, xs, dim=0):
    """Concatenation: of feature columns (placed blocks, rotate_half) or of heads."""
    syms = [v for v in xs if isinstance(v, Sym)]
    return O.cat(ctx, [_sym(ctx, v, syms[0]) for v in xs], dim)


@op("aten.stack.default")
def _stack(ctx, node, xs, dim=0):
    """Tensors side by side along a new axis (a new grid axis)."""
    syms = [v for v in xs if isinstance(v, Sym)]
    ys = [O.unsqueeze(ctx, _sym(ctx, v, syms[0]), dim) for v in xs]
    return O.cat(ctx, ys, dim)


# ----------------------------------------------------------------------------- arithmetic
def _binary(ctx, a, b, kind):
    from .capture import Piece
    a, b = (piece_row(ctx, v) if isinstance(v, Piece) else v for v in (a, b))
    if isinstance(a, Sym) and _is_scalar(b):
        return O.scalar(ctx, a, kind, _value(b))
    if isinstance(b, Sym) and _is_scalar(a):
        rev = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv", "pow": "rpow"}[kind]
        if kind == "sub":
            return O.scalar(ctx, b, "rsub", _value(a))
        return O.scalar(ctx, b, rev, _value(a))
    like = a if isinstance(a, Sym) else b
    sa, sb = _sym(ctx, a, like, kind == "add"), _sym(ctx, b, like, kind in ("add", "sub"))
    if kind == "add":
        return O.add(ctx, sa, sb)
    if kind == "sub":
        return O.add(ctx, sa, sb, -1.0)
    if kind == "mul":
        return O.mul(ctx, sa, sb)
    if kind == "div":
        return O.mul(ctx, sa, O.apply(ctx, sb, 1 / XS))
    raise ctx.fail(f"an entrywise power of two tensors cannot be declared yet")


@op("aten.add.Tensor", "aten.add.Scalar")
def _add(ctx, node, a, b, alpha=1):
    """a + α b entrywise (broadcast); an additive −∞ / finfo.min constant is a mask."""
    if alpha != 1:
        b = O.scalar(ctx, b, "mul", alpha) if isinstance(b, Sym) else b * alpha
    return _binary(ctx, a, b, "add")


@op("aten.sub.Tensor", "aten.sub.Scalar")
def _sub(ctx, node, a, b, alpha=1):
    """a − α b entrywise."""
    if alpha != 1:
        b = O.scalar(ctx, b, "mul", alpha) if isinstance(b, Sym) else b * alpha
    return _binary(ctx, a, b, "sub")


@op("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(ctx, node, a, b, alpha=1):
    """b − α a entrywise."""
    return _sub(ctx, node, b, a, alpha)


@op("aten.mul.Tensor", "aten.mul.Scalar")
def _mul(ctx, node, a, b):
    """a ∘ b entrywise (broadcast); chains on one operand compose into one function."""
    return _binary(ctx, a, b, "mul")


@op("aten.div.Tensor", "aten.div.Scalar")
def _div(ctx, node, a, b, rounding_mode=None):
    """a ∘ b^{∘−1} entrywise."""
    if rounding_mode is not None:
        raise ctx.fail(f"division with rounding ({rounding_mode}) is piecewise constant")
    return _binary(ctx, a, b, "div")


@op("aten.neg.default")
def _neg(ctx, node, a):
    """−a."""
    return O.scalar(ctx, a, "mul", -1.0)


@op("aten.pow.Tensor_Scalar")
def _pow(ctx, node, a, p):
    """a^{∘p} entrywise."""
    return O.scalar(ctx, _sym(ctx, a), "pow", p)


@op("aten.pow.Scalar")
def _rpow(ctx, node, c, a):
    """c^{∘a} entrywise."""
    return O.scalar(ctx, a, "rpow", c)


@op("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(ctx, node, x, mask, value):
    """x with a constant mask's entries set to v: −∞ masks logits; finite, x∘(1 − m) + v m."""
    if not isinstance(x, Sym) or isinstance(mask, Sym):
        raise ctx.fail("masked_fill with a mask that depends on the input")
    v = _value(value)
    m = _tensor(mask).bool()
    import torch
    if v == -math.inf or (x_dtype_limit(x) and v <= -x_dtype_limit(x)):
        add = torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, -math.inf)
        return O.add(ctx, x, O.const_sym(ctx, add, x, additive=True))
    keep = (~m).double()
    return O.add(ctx, O.mul(ctx, x, O.const_sym(ctx, keep, x)),
                 O.const_sym(ctx, m.double() * v, x))


def x_dtype_limit(x):
    import torch
    from .capture import MASK_FRACTION
    return float(torch.finfo(torch.float64).max) * MASK_FRACTION


@op("aten.where.self")
def _where(ctx, node, cond, a, b):
    """where(c, a, b) with a constant condition: a ∘ c + b ∘ (1 − c); b = −∞ masks logits."""
    if isinstance(cond, Sym):
        raise ctx.fail("where() with a condition that depends on the input is piecewise")
    c = _tensor(cond).bool()
    if isinstance(a, Sym) and not isinstance(b, Sym) and _is_scalar(b):
        return _masked_fill(ctx, node, a, ~c, b)
    if isinstance(b, Sym) and not isinstance(a, Sym) and _is_scalar(a):
        return _masked_fill(ctx, node, b, c, a)
    like = a if isinstance(a, Sym) else b
    ca = O.const_sym(ctx, c.double(), like)
    cb = O.const_sym(ctx, (~c).double(), like)
    return O.add(ctx, O.mul(ctx, _sym(ctx, a, like), ca), O.mul(ctx, _sym(ctx, b, like), cb))


def _unary(f):
    def fn(ctx, node, a, *args, **kwargs):
        return O.apply(ctx, _sym(ctx, a), f)
    return fn


_FN = {
    "aten.exp.default": (sp.exp(XS), "e^a entrywise."),
    "aten.log.default": (sp.log(XS), "log a entrywise."),
    "aten.tanh.default": (sp.tanh(XS), "tanh a entrywise."),
    "aten.sigmoid.default": (S.FUNCTIONS["sigmoid"][0], "σ(a) = 1/(1 + e^{−a}) entrywise."),
    "aten.silu.default": (S.FUNCTIONS["silu"][0], "SiLU(a) = a σ(a) entrywise."),
    "aten.relu.default": (S.FUNCTIONS["relu"][0], "ReLU(a) = max(a, 0) entrywise (ReLU'' = 0 a.e.)."),
    "aten.sqrt.default": (sp.sqrt(XS), "√a entrywise."),
    "aten.rsqrt.default": (1 / sp.sqrt(XS), "a^{−1/2} entrywise."),
    "aten.reciprocal.default": (1 / XS, "1/a entrywise."),
    "aten.square.default": (XS ** 2, "a² entrywise."),
    "aten.erf.default": (sp.erf(XS), "erf a entrywise."),
    "aten.sin.default": (sp.sin(XS), "sin a entrywise."),
    "aten.cos.default": (sp.cos(XS), "cos a entrywise."),
}
for _name, (_f, _doc) in _FN.items():
    _fn = _unary(_f)
    _fn.__doc__ = _doc
    _fn.__name__ = _name.split(".")[1]
    OPS.register(_name)(_fn)


@op("aten.gelu.default")
def _gelu(ctx, node, a, approximate="none"):
    """GELU entrywise: exact (x Φ(x)) or tanh-approximated."""
    name = "gelu_tanh" if approximate == "tanh" else "gelu"
    return O.apply(ctx, a, S.FUNCTIONS[name][0])


# ----------------------------------------------------------------------------- reductions
@op("aten.mean.dim", "aten.mean.default")
def _mean(ctx, node, x, dims=None, keepdim=False, dtype=None):
    """Mean over axes: the columns ((1/n) U 1), the rows or heads."""
    if dims is None:
        raise ctx.fail("a mean over every axis (the batch included) cannot be declared")
    dims = [dims] if isinstance(dims, int) else dims
    return O.reduce(ctx, x, dims, keepdim, True)


@op("aten.sum.dim_IntList")
def _sum(ctx, node, x, dims, keepdim=False, dtype=None):
    """Sum over axes: the columns (U 1), the rows or heads."""
    dims = [dims] if isinstance(dims, int) else dims
    return O.reduce(ctx, x, dims, keepdim, False)


@op("aten.var.dim")
def _var_dim(ctx, node, x, dims=None, unbiased=True, keepdim=False):
    """Variance over the columns, with (unbiased) or without Bessel's correction."""
    return _var(ctx, node, x, dims, 1 if unbiased else 0, keepdim)


@op("aten.var.correction")
def _var(ctx, node, x, dims=None, correction=1, keepdim=False):
    """Variance over the columns: mean((U − mean U)²) · n / (n − correction)."""
    dims = [dims] if isinstance(dims, int) else dims
    n = int(np.prod([x.shape[d] for d in dims]))
    mu = O.reduce(ctx, x, dims, True, True)
    centred = O.add(ctx, x, mu, -1.0)
    sq = O.reduce(ctx, O.scalar(ctx, centred, "pow", 2), dims, keepdim, True)
    c = 1 if correction is None else correction
    return O.scalar(ctx, sq, "mul", n / (n - c)) if c else sq


# ----------------------------------------------------------------------------- products
@op("aten.linear.default")
def _linear(ctx, node, x, w, b=None):
    """x Wᵀ + 1 b: W's used columns are the declared parameter (a head's slice)."""
    wi = np.asarray(w.idx).T
    out = O.times_param(ctx, _sym(ctx, x), wi, w.name)
    if b is not None:
        out = O.add(ctx, out, _row(ctx, b.name, np.asarray(b.idx), 1))
    return out


@op("aten.addmm.default")
def _addmm(ctx, node, b, x, w, beta=1, alpha=1):
    """β b + α x W (Conv1D of GPT-2: W is d_in × d_out)."""
    from .capture import Piece
    if isinstance(w, Piece):
        out = O.times_param(ctx, _sym(ctx, x), np.asarray(w.idx), w.name)
    else:
        out = O.matmul(ctx, _sym(ctx, x), _sym(ctx, w, None))
    if alpha != 1:
        out = O.scalar(ctx, out, "mul", alpha)
    bias = _row(ctx, b.name, np.asarray(b.idx), 1) if isinstance(b, Piece) else _sym(ctx, b, out, True)
    if beta != 1:
        bias = O.scalar(ctx, bias, "mul", beta)
    return O.add(ctx, out, bias)


@op("aten.matmul.default", "aten.mm.default", "aten.bmm.default")
def _matmul(ctx, node, a, b):
    """A B over the last two axes, blocks multiplied pairwise (q kᵀ per head, A v)."""
    from .capture import Piece
    if isinstance(b, Piece):
        return O.times_param(ctx, _sym(ctx, a), np.asarray(b.idx), b.name)
    if isinstance(a, Piece):
        raise ctx.fail(f"parameter {a.name} multiplies from the left (mixing sequence "
                       f"positions); only x W products can be declared")
    if not isinstance(a, Sym) or not isinstance(b, Sym):
        raise ctx.fail("a product of the input with a constant matrix cannot be declared yet")
    return O.matmul(ctx, a, b)


@op("aten.baddbmm.default")
def _baddbmm(ctx, node, c, a, b, beta=1, alpha=1):
    """β C + α A B (attention logits with an additive mask)."""
    out = O.matmul(ctx, a, b)
    if alpha != 1:
        out = O.scalar(ctx, out, "mul", alpha)
    if beta != 0:
        cc = O.scalar(ctx, c, "mul", beta) if isinstance(c, Sym) else c * beta
        out = _binary(ctx, out, cc, "add")
    return out


# ----------------------------------------------------------------------------- softmax, norms
@op("aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default")
def _softmax(ctx, node, x, dim, dtype=None, *a):
    """Row softmax over ``dim`` (masked entries exactly 0)."""
    if dtype is not None and not isinstance(dtype, bool):
        ctx.note_cast(node, x, (dtype,), {})
    return O.softmax(ctx, _sym(ctx, x), dim)


@op("aten.log_softmax.int", "aten._log_softmax.default")
def _log_softmax(ctx, node, x, dim, *a):
    """log softmax over the columns."""
    x = O.to_cols(ctx, _sym(ctx, x), dim)
    R, C = ctx.shape_of(x)
    return x.with_blocks(lambda b: S.of_expr(E.log_softmax_rows(ctx.expr(b, R, C))))


@op("aten.layer_norm.default", "aten.native_layer_norm.default")
def _layer_norm(ctx, node, x, shape, w=None, b=None, eps=1e-5, *a):
    """LayerNorm over the columns: (U − mean) ∘ (var + ε)^{−1/2} ∘ 1γ + 1β."""
    from .layers.transformer import layer_norm
    if len(shape) != 1:
        raise ctx.fail(f"LayerNorm over {tuple(shape)}: only the last axis can be declared")
    x = O.to_cols(ctx, _sym(ctx, x), -1)
    R, C = ctx.shape_of(x)
    g = ctx.piece(w.name, np.asarray(w.idx).reshape(1, -1)) if w is not None else None
    be = ctx.piece(b.name, np.asarray(b.idx).reshape(1, -1)) if b is not None else None
    if be is not None and g is None:
        g = None

    def one(blk):
        ctx.n_norm += 1
        out, check = layer_norm(ctx.expr(blk, R, C), eps, g, be, label=f"N_{ctx.n_norm}")
        if check is not None:
            ctx.checks.append(check)
        return S.of_expr(out)

    out = x.with_blocks(one)
    if str(node.target) == "aten.native_layer_norm.default":
        return (out, None, None)
    return out


@op("aten.rms_norm.default")
def _rms_norm(ctx, node, x, shape, w=None, eps=None):
    """RMSNorm over the columns: U ∘ (mean(U∘U) + ε)^{−1/2} ∘ 1γ (ε default: the dtype's eps)."""
    import torch
    if len(shape) != 1:
        raise ctx.fail(f"RMSNorm over {tuple(shape)}: only the last axis can be declared")
    eps = float(torch.finfo(ctx.dtype).eps) if eps is None else eps
    x = O.to_cols(ctx, _sym(ctx, x), -1)
    ms = O.reduce(ctx, O.scalar(ctx, x, "pow", 2), [-1], True, True)
    r = O.apply(ctx, O.scalar(ctx, ms, "add", eps), 1 / sp.sqrt(XS))
    out = O.mul(ctx, x, r)
    if w is not None:
        out = O.mul(ctx, out, _row(ctx, w.name, np.asarray(w.idx), 1))
    return out


@op("aten.scaled_dot_product_attention.default")
def _sdpa(ctx, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """softmax(c Q Kᵀ + mask) V per head, c = 1/√d_h unless given (GQA: shared K, V)."""
    if dropout_p:
        raise ctx.fail(f"attention dropout {dropout_p} in training mode is random; call "
                       f"module.eval() (or set the dropout to 0)")
    import torch
    d_h = q.shape[-1]
    c = 1 / math.sqrt(d_h) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = O.repeat_interleave(ctx, k, rep, -3), O.repeat_interleave(ctx, v, rep, -3)
    t = O.scalar(ctx, O.matmul(ctx, q, O.transpose_dims(ctx, k, -2, -1)), "mul", c)
    if is_causal:
        n = t.shape[-1]
        upper = torch.triu(torch.full((n, n), -math.inf, dtype=torch.float64), 1)
        t = O.add(ctx, t, O.const_sym(ctx, upper, t, additive=True))
    if attn_mask is not None:
        m = _tensor(attn_mask)
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, -math.inf)
        t = O.add(ctx, t, O.const_sym(ctx, m, t, additive=True))
    return O.matmul(ctx, O.softmax(ctx, t, -1), v)


@op("aten.embedding.default")
def _embedding(ctx, node, *a, **k):
    """Token embeddings: refused (a block takes hidden states)."""
    raise ctx.fail("aten.embedding (token ids) cannot be declared; capture the block that takes "
                   "the hidden states")


PYTHON_OPS = {operator.getitem: "<built-in function getitem>"}


def op_name(target) -> str:
    return PYTHON_OPS.get(target, str(target))

"""The ATen op table's arithmetic: entrywise operations, functions, reductions, products,
softmax, norms and attention (entries of ``aten.OPS``; importing this module registers them).

Entrywise chains on one operand compose into one scalar function (tanh-GELU's eight ops are
one GELU_tanh, x · rsqrt(mean(x²) + ε) one RMSNorm factor); an additive −∞ (or finfo.min)
constant or a masked_fill / where to −∞ is an attention mask, which only a softmax may
consume.  Each entry's docstring states what it declares.
"""
from __future__ import annotations

import math

import numpy as np
import sympy as sp

from ...expr import nodes as E
from ...expr.scalarfn import x as XS
from ..transformer import layer_norm
from . import ops as O
from . import shapes as SH
from . import tensor as S
from .aten import OPS, _is_scalar, _row, _sym, _tensor, _value, op, piece_row
from .tensor import MASK_FRACTION, Piece, Sym


# ----------------------------------------------------------------------------- arithmetic
def _binary(ctx, a, b, kind):
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
    raise ctx.fail("an entrywise power of two tensors cannot be declared yet")


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
    return SH.reduce(ctx, x, dims, keepdim, True)


@op("aten.sum.dim_IntList")
def _sum(ctx, node, x, dims, keepdim=False, dtype=None):
    """Sum over axes: the columns (U 1), the rows or heads."""
    dims = [dims] if isinstance(dims, int) else dims
    return SH.reduce(ctx, x, dims, keepdim, False)


@op("aten.var.dim")
def _var_dim(ctx, node, x, dims=None, unbiased=True, keepdim=False):
    """Variance over the columns, with (unbiased) or without Bessel's correction."""
    return _var(ctx, node, x, dims, 1 if unbiased else 0, keepdim)


@op("aten.var.correction")
def _var(ctx, node, x, dims=None, correction=1, keepdim=False):
    """Variance over the columns: mean((U − mean U)²) · n / (n − correction)."""
    dims = [dims] if isinstance(dims, int) else dims
    n = int(np.prod([x.shape[d] for d in dims]))
    mu = SH.reduce(ctx, x, dims, True, True)
    centred = O.add(ctx, x, mu, -1.0)
    sq = SH.reduce(ctx, O.scalar(ctx, centred, "pow", 2), dims, keepdim, True)
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
    ms = SH.reduce(ctx, O.scalar(ctx, x, "pow", 2), [-1], True, True)
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
        k, v = SH.repeat_interleave(ctx, k, rep, -3), SH.repeat_interleave(ctx, v, rep, -3)
    t = O.scalar(ctx, O.matmul(ctx, q, SH.transpose_dims(ctx, k, -2, -1)), "mul", c)
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
def _embedding(ctx, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Rows of an embedding table W (V × d): token ids are the one-hot data X, so their
    embedding is X W (W the whole table, one declared parameter); constant indices p_1 …
    p_L, one per token position (position ids), are the L × d parameter W[p_1 … p_L]
    (a piece of W, added row by row)."""
    if not isinstance(weight, Piece):
        raise ctx.fail("an embedding of a table that is not a module parameter cannot be declared")
    if isinstance(indices, S.Ids):
        if tuple(indices.value.shape) != tuple(indices.original.shape):
            raise ctx.fail(f"an embedding of token ids reshaped to {tuple(indices.value.shape)} "
                           f"(the data's ids are {tuple(indices.original.shape)})")
        return O.times_param(ctx, indices.onehot, np.asarray(weight.idx), weight.name)
    if isinstance(indices, (Sym, Piece)):
        raise ctx.fail("an embedding indexed by a tensor that depends on the input or the "
                       "parameters cannot be declared")
    t = _tensor(indices).long()
    rows = t.reshape(-1, t.shape[-1]) if t.ndim else t.reshape(1, 1)
    xs = ctx.xsym
    L = xs.row.size if xs is not None and xs.row is not None else None
    if ctx.ids is None or rows.shape[-1] != L or not bool((rows == rows[:1]).all()):
        raise ctx.fail("an embedding of constant indices that are not one row per token position "
                       "(the same for every sequence) cannot be declared; only token ids (the "
                       "data) and position ids can")
    idx = np.asarray(weight.idx)[rows[0].numpy()]
    w = Piece(weight.name, idx, None, pos=True)
    feat = S.Atom("feat", idx.shape[1], "d")
    dims = [[] for _ in range(t.ndim - 1)] + [[xs.row], [feat]]
    return S.single(S.Lin([S.Term(None, None, w, None, 1.0)]), dims, xs.row, feat)


@op("aten.cross_entropy_loss.default")
def _cross_entropy(ctx, node, logits, target, weight=None, reduction=1, ignore_index=-100,
                   label_smoothing=0.0):
    """A language model's own loss, the mean next-token cross-entropy: with the logits F
    (L × V per sequence) the declaration's output, ℓ = −Σ_ij Y_ij log softmax(F_i)_j, Y_i
    the one-hot label of token i + 1 times the batch's N/T (0 where ignored, and in the last
    row): the loss ``ce_weighted`` (``symhess.layers.language``)."""
    import torch
    if not isinstance(logits, Sym) or not isinstance(target, S.Ids):
        raise ctx.fail("cross_entropy is declared only as a language model's loss: logits of "
                       "the model against its shifted token ids (call it with labels=input_ids, "
                       "the same tensor)")
    if ignore_index != -100:
        raise ctx.fail(f"cross_entropy with ignore_index={ignore_index} cannot be declared; the "
                       f"labels' ignored entries are -100 (transformers' ignore_index)")
    if weight is not None or label_smoothing or reduction != 1:
        raise ctx.fail("cross_entropy with class weights, label smoothing or a reduction other "
                       "than the mean cannot be declared yet")
    ids = torch.as_tensor(ctx.ids).reshape(-1, ctx.ids.shape[-1])
    want = torch.nn.functional.pad(ids, (0, 1), value=ignore_index)[:, 1:].reshape(-1)
    if tuple(target.value.reshape(-1).shape) != tuple(want.shape) or \
            not bool((target.value.reshape(-1) == want).all()):
        raise ctx.fail("the loss's targets are not the next tokens of the input ids (capture "
                       "the model with labels=input_ids, the same tensor: the data's labels, "
                       "-100 entries included, are given with its batches)")
    if logits.row is None or logits.row.kind != "pos":
        raise ctx.fail("the logits of the loss are not one row per token")
    return S.LossOut(O.to_cols(ctx, logits, -1), "ce_weighted")

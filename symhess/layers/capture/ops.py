"""Operations on symbolic tensors (``tensor.Sym``): broadcasting, entrywise arithmetic,
matrix products, reshapes and the column bookkeeping of heads.

Every function takes the translation ``Context`` (``context.Context``) first.  Shapes follow
torch's rules (broadcasting from the right, ``matmul`` over the last two axes); what a 2-D
declaration cannot state (mixing sequence positions, reducing over the batch, operands in
different orientations) raises the context's ``DeclarationError``.
"""
from __future__ import annotations

import numpy as np

from ...expr import nodes as E
from ...expr.scalarfn import x as XS
from . import tensor as S
from .tensor import MASK_FRACTION, Atom, Fn, Lin, Masked, Piece, Sym, Term


# ----------------------------------------------------------------------------- conversions
def as_lin(ctx, block, rows, cols):
    """A block as a ``Lin`` (Fn materialised)."""
    if isinstance(block, Lin):
        return block
    return S.of_expr(ctx.expr(block, rows, cols))


def transposed(ctx, sym):
    """The same tensor with its blocks transposed (rows ↔ columns)."""
    R, C = ctx.shape_of(sym)
    out = sym.with_blocks(lambda b: S.of_expr(E.transpose(ctx.expr(b, R, C))))
    out.row, out.col = sym.col, sym.row
    return out


def to_cols(ctx, sym, dim):
    """``sym`` with axis ``dim`` as its blocks' columns: transposed when it holds the rows; its
    grid atoms merged into one feature atom (heads concatenated: Σ_h B_h P_h, P_h placing
    head h's columns) when it holds them beside the columns."""
    dim = dim % len(sym.dims)
    atoms = sym.dims[dim]
    if (sym.col is not None and atoms == [sym.col]) or (not atoms and sym.col is None):
        return sym
    if sym.row is not None and atoms == [sym.row]:
        return transposed(ctx, sym)
    feats = [a for a in atoms if a.kind != "grid"]
    if len(feats) != 1 or feats[0] is not sym.col:
        raise ctx.fail(f"axis {dim} ({_desc(atoms)}) cannot be the columns of a matrix")
    grids = [a for a in atoms if a.kind == "grid"]
    f = sym.col
    total = S._prod(atoms)
    new = Atom("feat", total, "d")
    R, C = ctx.shape_of(sym)
    shape = list(sym.blocks.shape)
    shape[dim] = 1
    sizes = [a.size for a in atoms]
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        terms = []
        for g, combo in enumerate(np.ndindex(*[a.size for a in grids])):
            full = list(idx)
            full[dim] = g
            values = iter(combo)
            at = [None if a.kind != "grid" else next(values) for a in atoms]
            cols = [int(np.ravel_multi_index([j if v is None else v for v in at], sizes))
                    for j in range(f.size)]
            place = np.zeros((f.size, total))
            place[np.arange(f.size), cols] = 1.0
            lin = as_lin(ctx, sym.blocks[tuple(full)], R, C)
            terms += [t.then(place) for t in lin.terms]
        out[idx] = Lin(terms)
    dims = [list(d) for d in sym.dims]
    dims[dim] = [new]
    return Sym(dims, out, sym.row, new)


def to_rows(ctx, sym, dim):
    """``sym`` with axis ``dim`` as its blocks' rows (transposed when it holds the columns)."""
    dim = dim % len(sym.dims)
    atoms = sym.dims[dim]
    if (sym.row is not None and atoms == [sym.row]) or (not atoms and sym.row is None):
        return sym
    if sym.col is not None and atoms == [sym.col]:
        return transposed(ctx, sym)
    raise ctx.fail(f"axis {dim} ({_desc(atoms)}) cannot be the rows of a matrix")


def _desc(atoms):
    return "×".join(f"{a.kind} {a.size}" for a in atoms) or "size 1"


# ----------------------------------------------------------------------------- broadcasting
def align(ctx, a, b):
    """(dims, row, col, blocks_a, blocks_b): two tensors broadcast against each other."""
    n = max(len(a.dims), len(b.dims))
    pa, pb = n - len(a.dims), n - len(b.dims)
    da = [[]] * pa + a.dims
    db = [[]] * pb + b.dims
    dims = []
    for x, y in zip(da, db):
        sx, sy = S._prod(x), S._prod(y)
        if sx == sy:
            kx = [t.kind for t in x if t.size > 1 and t.kind != "grid"]
            ky = [t.kind for t in y if t.size > 1 and t.kind != "grid"]
            if kx != ky and kx and ky:
                raise ctx.fail(f"operands meet with axes of equal size but different meaning "
                               f"({_desc(x)} against {_desc(y)})")
            dims.append(x if x else y)
        elif sx == 1:
            dims.append(y)
        elif sy == 1:
            dims.append(x)
        else:
            raise ctx.fail(f"shapes {a.shape} and {b.shape} do not broadcast")
    row = _pick(a.row, b.row, dims, da, db, ctx, "rows")
    col = _pick(a.col, b.col, dims, da, db, ctx, "columns")
    ext = tuple(S._extent(d) for d in dims)
    ba = np.broadcast_to(a.blocks.reshape((1,) * pa + a.blocks.shape), ext)
    bb = np.broadcast_to(b.blocks.reshape((1,) * pb + b.blocks.shape), ext)
    return dims, row, col, ba, bb


def _pick(ra, rb, dims, da, db, ctx, what):
    pos = [next((i for i, d in enumerate(ds) if any(t is r for t in d)), None) if r is not None else None
           for r, ds in ((ra, da), (rb, db))]
    if pos[0] is not None and pos[1] is not None and pos[0] != pos[1]:
        raise ctx.fail(f"operands hold their {what} on different axes (one is transposed "
                       f"against the other)")
    for r, p in zip((ra, rb), pos):
        if p is not None and any(t is r for t in dims[p]):
            return r
    for r, p in zip((ra, rb), pos):
        if p is not None:                       # equal-size axis taken from the other side
            return next(t for t in dims[p] if t.kind == r.kind and t.size == r.size)
    return None


def combine(ctx, a, b, fn):
    """Broadcast a, b and combine their blocks pairwise with fn(block_a, block_b, R, C)."""
    dims, row, col, ba, bb = align(ctx, a, b)
    R, C = ctx.atom_size(row), ctx.atom_size(col)
    ra = _full(ctx, a, row, col)
    rb = _full(ctx, b, row, col)
    out = S.objects(ba.shape, lambda i: fn(ba[i], bb[i], R, C, ra, rb))
    return Sym(dims, out, row, col)


def _full(ctx, sym, row, col):
    """Whether sym's blocks already have the result's row and column sizes."""
    return (sym.row is None) == (row is None), (sym.col is None) == (col is None)


# ----------------------------------------------------------------------------- arithmetic
def add(ctx, a, b, k=1.0):
    """a + k·b entrywise (broadcasting)."""
    return combine(ctx, a, b, lambda x, y, R, C, fa, fb: _add(ctx, x, y, k, R, C, fa, fb))


def _add(ctx, x, y, k, R, C, fa, fb):
    if isinstance(x, Masked) or isinstance(y, Masked):
        return _add_masked(ctx, x, y, k, R, C)
    full = fa == (True, True) and fb == (True, True)
    if full and isinstance(x, Fn) and isinstance(y, Fn) and x.base == y.base:
        return Fn(x.base, x.f + _n(k) * y.f)
    for u, v, ku, kv in ((x, y, 1, k), (y, x, k, 1)):
        if full and isinstance(u, Fn) and isinstance(v, Lin):
            hit = ctx.memo.get(id(v))
            if hit is not None and hit[0] is v and hit[1] == u.base:
                return Fn(u.base, _n(ku) * u.f + _n(kv) * XS)
    lx = x if isinstance(x, Lin) and fa[1] else S.of_expr(ctx.expr(x, R, C))
    ly = y if isinstance(y, Lin) and fb[1] else S.of_expr(ctx.expr(y, R, C))
    return Lin(list(lx.terms) + [t.scaled(k) for t in ly.terms])


def _add_masked(ctx, x, y, k, R, C):
    keep, parts = None, []
    for u, ku in ((x, 1.0), (y, k)):
        if isinstance(u, Masked):
            keep = u.keep if keep is None else (keep & u.keep)
            u = u.inner
        if u is not None:
            parts.append(S.of_expr(E.scale(_n(ku), ctx.expr(u, R, C))))
    inner = Lin([t for p in parts for t in p.terms]) if parts else None
    return Masked(inner, keep)


def mul(ctx, a, b):
    """a ∘ b entrywise (broadcasting); chains on one operand compose into one function."""
    return combine(ctx, a, b, lambda x, y, R, C, fa, fb: _mul(ctx, x, y, R, C, fa, fb))


def _fn_form(ctx, block, R, C):
    """(base, f) with block = f(base); a scaled expression c·U is f = c·x of U (GPT-2's
    0.5·u·(1 + tanh(…u…)) is then one function of u: GELU_tanh)."""
    if isinstance(block, Fn):
        return block.base, block.f
    e = ctx.expr(block, R, C)
    first = e.args[0] if isinstance(e, E.Add) else e        # a scaled sum is a sum of scaled terms
    if isinstance(first, E.Scale) and first.coef != 1:
        return E.scale(1 / first.coef, e), first.coef * XS
    return e, XS


def _mul(ctx, x, y, R, C, fa, fb):
    if isinstance(x, Masked) or isinstance(y, Masked):
        raise ctx.fail("masked attention logits are multiplied by a tensor; only a positive "
                       "scalar can scale them before the softmax")
    if fa == (True, True) and fb == (True, True):
        bx, fx = _fn_form(ctx, x, R, C)
        by, fy = _fn_form(ctx, y, R, C)
        if bx == by:
            return Fn(bx, fx * fy)
        return S.of_expr(E.hadamard(S.apply_fn(fx, bx), S.apply_fn(fy, by)))
    return S.of_expr(E.hadamard(ctx.expr(x, R, C), ctx.expr(y, R, C)))


def scalar(ctx, sym, op, c):
    """An entrywise operation with a number: ``op`` in add, mul, rsub, div, rdiv, pow."""
    R, C = ctx.shape_of(sym)

    def one(b):
        if isinstance(b, Masked):
            if op == "mul" and c > 0:
                return Masked(None if b.inner is None else one(b.inner), b.keep)
            if op == "div" and c > 0:
                return Masked(None if b.inner is None else one(b.inner), b.keep)
            if op == "add":
                inner = S.of_expr(E.scale(_n(c), E.ones(R, C))) if b.inner is None else one(b.inner)
                return Masked(inner, b.keep) if c != 0 else b
            raise ctx.fail(f"masked attention logits go through '{op} {c}' before the softmax")
        if op == "mul" and isinstance(b, Lin):
            return Lin([t.scaled(c) for t in b.terms]) if c != 0 else Fn(ctx.expr(b, R, C), 0 * XS)
        if op == "div" and isinstance(b, Lin):
            return Lin([t.scaled(1.0 / c) for t in b.terms])
        base, f = _fn_form(ctx, b, R, C)
        g = {"add": lambda: f + _n(c), "mul": lambda: _n(c) * f, "rsub": lambda: _n(c) - f,
             "div": lambda: f / _n(c), "rdiv": lambda: _n(c) / f, "pow": lambda: f ** _n(c),
             "rpow": lambda: _n(c) ** f}[op]()
        return Fn(base, g)

    return sym.with_blocks(one)


def _n(c):
    """A Python number as a sympy number (``tensor.nice``)."""
    return S.nice(float(c))


def apply(ctx, sym, f):
    """f(sym) entrywise, f a sympy function of ``scalarfn.x``."""
    R, C = ctx.shape_of(sym)

    def one(b):
        if isinstance(b, Masked):
            raise ctx.fail("masked attention logits go through an entrywise function before "
                           "the softmax")
        base, g = _fn_form(ctx, b, R, C)
        return Fn(base, f.subs(XS, g))

    return sym.with_blocks(one)


# ----------------------------------------------------------------------------- products
def matmul(ctx, a, b):
    """torch.matmul of two symbolic tensors: blocks multiplied pairwise over the leading axes."""
    if len(a.dims) < 2 or len(b.dims) < 2:
        raise ctx.fail("a matrix–vector product of symbolic tensors cannot be declared yet")
    a, b = to_cols(ctx, a, -1), to_rows(ctx, b, -2)
    if a.dims[-2] and a.dims[-2] != [a.row] and not (a.row is not None and a.row in a.dims[-2]):
        raise ctx.fail("the rows of a matrix product are not the operand's rows")
    lead_a = Sym(a.dims[:-2] + [[], []], a.blocks, None, None)
    lead_b = Sym(b.dims[:-2] + [[], []], b.blocks, None, None)
    dims, _, _, ba, bb = align(ctx, lead_a, lead_b)
    Ra, Ca = ctx.shape_of(a)
    Rb, Cb = ctx.shape_of(b)
    if not E.same(Ca, Rb):
        raise ctx.fail(f"matrix product of {Ca} and {Rb} columns/rows")
    out = S.objects(ba.shape, lambda i: S.of_expr(ctx.expr(ba[i], Ra, Ca) @ ctx.expr(bb[i], Rb, Cb)))
    col, last = b.col, b.dims[-1]
    if col is not None and col is a.row:          # q kᵀ: the key positions are another axis
        col = Atom(col.kind, col.size, col.hint)
        last = [col]
    return Sym(dims[:-2] + [a.dims[-2], last], out, a.row, col)


def times_param(ctx, a, piece_idx, name):
    """a @ W for a module-parameter piece W (k × m index array): lazy terms."""
    a = to_cols(ctx, a, -1)
    k = piece_idx.shape[0]
    if S._prod(a.dims[-1]) != k:
        raise ctx.fail(f"matrix product of {S._prod(a.dims[-1])} columns with a {k}-row parameter")
    w = Piece(name, piece_idx, None)
    new = Atom("feat", piece_idx.shape[1])
    R, C = ctx.shape_of(a)

    def one(b):
        lin = as_lin(ctx, b, R, C)
        terms = []
        for t in lin.terms:
            if t.w is None and t.left is not None:
                terms.append(Term(t.left, t.c, w, None, t.k))
            else:
                terms.append(Term(ctx.expr(Lin([t]), R, C), None, w, None, 1.0))
        return Lin(terms)

    out = a.with_blocks(one)
    dims = [list(d) for d in a.dims]
    dims[-1] = [new] if new.size > 1 else []
    return Sym(dims, out.blocks, a.row, new if new.size > 1 else None)


def bias_row(ctx, like, piece_idx, name):
    """A bias (a 1 × m piece) broadcast over rows, shaped like ``like`` but for the last axis."""
    w = Piece(name, piece_idx.reshape(1, -1), None)
    col = like.col
    return S.single(Lin([Term(None, None, w, None, 1.0)]), [[col] if col is not None else []],
                    None, col)


# ----------------------------------------------------------------------------- constants
def const_sym(ctx, t, like, additive=False):
    """A constant tensor broadcast to ``like``'s axes, one constant block per grid block;
    ``additive``: entries ≤ −MASK_FRACTION·max of the dtype (or −∞) become a ``Masked`` keep
    mask (the rest an additive constant).  A constant that differs between the sequences of
    the batch is a per-sequence input."""
    v = t.detach()
    limit = float(_finfo(v).max) * MASK_FRACTION if v.is_floating_point() else None
    v = v.double().cpu().numpy() if v.dtype != _bool() else v.cpu().numpy().astype(np.float64)
    n = len(like.dims)
    if v.ndim > n:
        raise ctx.fail(f"a constant of shape {tuple(v.shape)} meets a tensor of shape {like.shape}")
    v = v.reshape((1,) * (n - v.ndim) + v.shape)
    shape, axes = [], []
    for i, d in enumerate(like.dims):
        if v.shape[i] == 1:
            shape.append(1)
            axes.append(None)
        elif v.shape[i] == S._prod(d):
            shape += [a.size for a in d]
            axes += list(d)
        else:
            raise ctx.fail(f"a constant of shape {tuple(t.shape)} does not broadcast to {like.shape}")
    v = v.reshape(shape)
    R, C = ctx.shape_of(like)
    grid_pos = [[k for k, a in enumerate(axes) if a is not None and a.kind == "grid" and
                 any(a is x for x in d)] for d in like.dims]
    kb = next((k for k, a in enumerate(axes) if a is not None and a.kind == "batch"), None)
    kr = next((k for k, a in enumerate(axes) if a is like.row), None) if like.row else None
    kc = next((k for k, a in enumerate(axes) if a is like.col), None) if like.col else None
    for k, a in enumerate(axes):
        if a is not None and a.kind != "grid" and k not in (kb, kr, kc) and a.size > 1:
            raise ctx.fail(f"a constant varies along an axis ({a.kind} {a.size}) that is not "
                           f"the rows, columns, batch or heads of the tensor it meets")
    kept = [k for k in (kb, kr, kc) if k is not None]
    order = sorted(kept)

    def block(idx):
        sl = [0] * len(shape)
        for d, positions in enumerate(grid_pos):
            if positions:
                for k, j in zip(positions, np.unravel_index(idx[d], [shape[k] for k in positions])):
                    sl[k] = int(j)
        for k in kept:
            sl[k] = slice(None)
        part = v[tuple(sl)].transpose([order.index(k) for k in kept])
        full = part.reshape([shape[k] if k is not None else 1 for k in (kb, kr, kc)])
        if full.shape[0] == 1 or np.all(full == full[:1]):
            full = full[0]
        if additive and limit is not None and (full <= -limit).any():
            keep = full > -limit
            finite = np.where(keep, full, 0.0)
            inner = S.of_expr(ctx.const_expr(finite, "B", R, C)) if finite.any() else None
            shape2 = keep.shape[:-2] + (_n_int(like.row), _n_int(like.col))
            return Masked(inner, np.broadcast_to(keep, shape2).copy())
        return S.of_expr(ctx.const_expr(full, "C", R, C))

    blocks = S.objects(like.blocks.shape, block)
    return Sym(like.dims, blocks, like.row, like.col)


def _n_int(atom):
    return 1 if atom is None else atom.size


def _finfo(v):
    import torch
    return torch.finfo(v.dtype)


def _bool():
    import torch
    return torch.bool


def mask_of(ctx, keep):
    """(causal, mask expression or None) for a keep array (rows × cols or B × rows × cols)."""
    if keep.ndim == 3 and np.all(keep == keep[:1]):
        keep = keep[0]
    if (~keep).all(axis=-1).any():
        row = int(np.argwhere((~keep).all(axis=-1))[0][-1])
        raise ctx.fail(f"row {row} of an attention mask masks every key; the softmax of that "
                       f"row is undefined (0/0) and cannot be declared")
    if keep.all():
        return False, None
    n, m = keep.shape[-2:]
    if keep.ndim == 2 and n == m and np.array_equal(keep, np.tril(np.ones((n, n), dtype=bool))):
        return True, None
    vals = keep.astype(np.float64)
    if keep.ndim == 3:
        return False, ctx.seq_const(vals, "M", ctx.L, ctx.L)
    return False, ctx.const(vals, "M", ctx.L, ctx.L)


def softmax(ctx, sym, dim):
    """Row softmax over ``dim`` (the columns), masked logits with their mask."""
    sym = to_cols(ctx, sym, dim)
    R, C = ctx.shape_of(sym)
    k = ctx.n_attn

    def one(b):
        ctx.n_attn += 1
        if isinstance(b, Masked):
            causal, mask = mask_of(ctx, b.keep)
            T = ctx.expr(b.inner, R, C) if b.inner is not None else E.zero(R, C)
            A = E.softmax_rows(T, causal=causal, mask=mask)
        else:
            T = ctx.expr(b, R, C)
            A = E.softmax_rows(T)
        ctx.softmaxes.append((T, A))
        return S.of_expr(A)

    out = sym.with_blocks(one)
    del k
    return out

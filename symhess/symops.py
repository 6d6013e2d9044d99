"""Operations on symbolic tensors (``symtensor.Sym``): broadcasting, entrywise arithmetic,
matrix products, reshapes and the column bookkeeping of heads.

Every function takes the translation ``Context`` (``capture.Context``) first.  Shapes follow
torch's rules (broadcasting from the right, ``matmul`` over the last two axes); what a 2-D
declaration cannot state (mixing sequence positions, reducing over the batch, operands in
different orientations) raises the context's ``DeclarationError``.
"""
from __future__ import annotations

import numpy as np
import sympy as sp

from .expr import nodes as E
from . import symtensor as S
from .expr.scalarfn import x as XS
from .symtensor import Atom, Fn, Lin, Masked, Sym, Term


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
    """(base, f) with block = f(base)."""
    if isinstance(block, Fn):
        return block.base, block.f
    return ctx.expr(block, R, C), XS


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
    """A Python number as a sympy number (``symtensor.nice``)."""
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
    from .capture import Piece
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
    from .capture import Piece
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
    from .capture import MASK_FRACTION
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


# ----------------------------------------------------------------------------- shapes
def reshape(ctx, sym, shape):
    """torch's view/reshape: atoms regrouped in row-major order; a feature atom that a new
    axis boundary splits becomes (grid, feature) — a head split, each head a column slice."""
    shape = _resolve_shape(ctx, sym.shape, shape)
    flat = [a for d in sym.dims for a in d]
    grids = [a for a in flat if a.kind == "grid"]
    blocks = sym.blocks.reshape([a.size for a in grids]) if grids else sym.blocks.reshape(())
    col, queue, dims = sym.col, list(flat), []
    R, C = ctx.shape_of(sym)
    for n in shape:
        dim, have = [], 1
        while have < n or (n == 1 and queue and queue[0].size == 1 and not dim):
            a = queue.pop(0)
            if n % (have * a.size) == 0:
                dim.append(a)
                have *= a.size
                continue
            need = n // have
            if a.size % need:
                raise ctx.fail(f"a reshape to {tuple(shape)} cuts a {a.kind} axis of size {a.size}")
            if a.kind == "grid":
                g1, g2 = Atom("grid", need), Atom("grid", a.size // need)
                pos = _index(grids, a)
                grids[pos:pos + 1] = [g1, g2]
                flat[_index(flat, a):_index(flat, a) + 1] = [g1, g2]
                blocks = blocks.reshape(blocks.shape[:pos] + (need, a.size // need) + blocks.shape[pos + 1:])
            elif a.kind == "feat" and a is col:
                g, f = Atom("grid", need), Atom("feat", a.size // need, "d_h")
                pos = sum(1 for x in flat[:_index(flat, a)] if x.kind == "grid")
                blocks = _split_cols(ctx, blocks, pos, need, f.size, R, C)
                grids.insert(pos, g)
                flat[_index(flat, a):_index(flat, a) + 1] = [g, f]
                col, C = f, ctx.atom_size(f)
                g1, g2 = g, f
            else:
                raise ctx.fail(f"a reshape to {tuple(shape)} cuts the {a.kind} axis (size {a.size}); "
                               f"only feature axes split into heads")
            dim.append(g1)
            have *= need
            queue.insert(0, g2)
        dims.append(dim)
    if queue:
        if any(a.size > 1 for a in queue):                     # pragma: no cover - torch checks
            raise ctx.fail(f"reshape to {tuple(shape)} leaves axes over")
        dims[-1] += queue
    ext = tuple(S._extent(d) for d in dims)
    return Sym(dims, blocks.reshape(ext), sym.row, col)


def _index(seq, atom):
    return next(i for i, a in enumerate(seq) if a is atom)


def _split_cols(ctx, blocks, pos, heads, width, R, C):
    """Each block B → heads blocks B S_h (S_h picks columns h·width … (h+1)·width − 1)."""
    out = np.empty(blocks.shape[:pos] + (heads,) + blocks.shape[pos:], dtype=object)
    n = heads * width
    for idx in np.ndindex(blocks.shape):
        lin = as_lin(ctx, blocks[idx], R, C)
        for h in range(heads):
            sel = S.select(n, range(h * width, (h + 1) * width))
            out[idx[:pos] + (h,) + idx[pos:]] = Lin([t.then(sel) for t in lin.terms])
    return out


def _resolve_shape(ctx, old, shape):
    shape = [int(s) for s in shape]
    total = int(np.prod(old))
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        shape[shape.index(-1)] = total // known
    if int(np.prod(shape)) != total:                         # pragma: no cover - torch checks
        raise ctx.fail(f"reshape of {old} to {tuple(shape)}")
    return shape


def permute(ctx, sym, perm):
    perm = [p % len(sym.dims) for p in perm]
    return Sym([sym.dims[p] for p in perm], sym.blocks.transpose(perm), sym.row, sym.col)


def transpose_dims(ctx, sym, i, j):
    perm = list(range(len(sym.dims)))
    i, j = i % len(perm), j % len(perm)
    perm[i], perm[j] = perm[j], perm[i]
    return permute(ctx, sym, perm)


def unsqueeze(ctx, sym, dim):
    dim = dim % (len(sym.dims) + 1)
    dims = sym.dims[:dim] + [[]] + sym.dims[dim:]
    return Sym(dims, np.expand_dims(sym.blocks, dim), sym.row, sym.col)


def squeeze(ctx, sym, which=None):
    n = len(sym.dims)
    which = range(n) if which is None else [w % n for w in which]
    drop = [i for i in which if S._prod(sym.dims[i]) == 1]
    if any(a is sym.row or a is sym.col for i in drop for a in sym.dims[i]):
        raise ctx.fail("squeeze drops a matrix axis")           # pragma: no cover
    keep = [i for i in range(n) if i not in drop]
    blocks = sym.blocks.reshape([sym.blocks.shape[i] for i in keep]) if keep else sym.blocks.reshape(())
    return Sym([sym.dims[i] for i in keep], blocks, sym.row, sym.col)


def expand(ctx, sym, sizes):
    """torch's expand: a size-1 axis repeated — a new grid atom whose blocks are the same
    block (grouped-query attention's repeat_kv), or a broadcast of the columns/rows."""
    sizes = [int(s) for s in sizes]
    while len(sym.dims) < len(sizes):
        sym = unsqueeze(ctx, sym, 0)
    R, C = ctx.shape_of(sym)
    dims, blocks, row, col = [list(d) for d in sym.dims], sym.blocks, sym.row, sym.col
    last = len(dims) - 1
    for i, n in enumerate(sizes):
        cur = S._prod(dims[i])
        if n == -1 or n == cur:
            continue
        if cur != 1:                                             # pragma: no cover - torch checks
            raise ctx.fail(f"expand of an axis of size {cur} to {n}")
        if col is None and i == last:
            col = Atom("feat", n)
            dims[i] = [col]
            blocks = _each(blocks, lambda b: S.of_expr(ctx.expr(b, R, C) @ E.ones(1, n)))
        else:
            g = Atom("grid", n)
            dims[i] = dims[i] + [g]
            blocks = np.repeat(blocks, n, axis=i)
    return Sym(dims, blocks, row, col)


def _each(blocks, fn):
    return S.objects(blocks.shape, lambda i: fn(blocks[i]))


def repeat_interleave(ctx, sym, reps, dim):
    """Each index of a grid axis repeated ``reps`` times (shared blocks)."""
    dim = dim % len(sym.dims)
    if any(a.kind != "grid" for a in sym.dims[dim] if a.size > 1):
        raise ctx.fail("repeat_interleave of an axis that is not a grid (heads) axis")
    g = Atom("grid", S._prod(sym.dims[dim]) * reps)
    dims = [list(d) for d in sym.dims]
    dims[dim] = [g]
    return Sym(dims, np.repeat(sym.blocks, reps, axis=dim), sym.row, sym.col)


def select(ctx, sym, dim, i):
    """x.select(dim, i): one grid index (a head, a q/k/v chunk) or one column."""
    dim = dim % len(sym.dims)
    atoms = sym.dims[dim]
    n = S._prod(atoms)
    i = i % n
    if all(a.kind == "grid" for a in atoms):
        blocks = np.take(sym.blocks, i, axis=dim)
        return Sym(sym.dims[:dim] + sym.dims[dim + 1:], blocks, sym.row, sym.col)
    if atoms == [sym.col]:
        out = _cols(ctx, sym, S.select(n, [i]), None)
        return Sym(out.dims[:dim] + out.dims[dim + 1:], out.blocks, sym.row, None)
    raise ctx.fail(f"select on a {_desc(atoms)} axis (only heads or feature columns)")


def slice_(ctx, sym, dim, start, end, step):
    """x[..., start:end:step] along one axis: grid indices or feature columns."""
    dim = dim % len(sym.dims)
    atoms = sym.dims[dim]
    n = S._prod(atoms)
    keep = list(range(n))[slice(start, end, step)]
    if keep == list(range(n)):
        return sym
    if all(a.kind == "grid" for a in atoms):
        g = Atom("grid", len(keep))
        dims = [list(d) for d in sym.dims]
        dims[dim] = [g]
        return Sym(dims, np.take(sym.blocks, keep, axis=dim), sym.row, sym.col)
    if atoms == [sym.col]:
        new = Atom("feat", len(keep), sym.col.hint)
        return _cols(ctx, sym, S.select(n, keep), new, dim)
    raise ctx.fail(f"a slice of the {_desc(atoms)} axis (only heads or feature columns); "
                   f"slicing sequence positions or the batch cannot be declared")


def _cols(ctx, sym, c, new, dim=None):
    """Every block times the numeric matrix c on the right; the column atom becomes ``new``."""
    R, C = ctx.shape_of(sym)
    out = sym.with_blocks(lambda b: Lin([t.then(c) for t in as_lin(ctx, b, R, C).terms]))
    dims = [list(d) for d in sym.dims]
    if dim is not None:
        dims[dim] = [new] if new is not None else []
    return Sym(dims, out.blocks, sym.row, new)


def cat(ctx, syms, dim):
    """torch.cat: along the columns a sum of placed blocks (Σ_k B_k P_k); along a grid axis
    or axes of size 1 the blocks side by side (a new grid atom)."""
    dim = dim % len(syms[0].dims)
    if all(s.dims[dim] == [s.col] for s in syms):
        sizes = [s.col.size for s in syms]
        total = sum(sizes)
        new = Atom("feat", total, syms[0].col.hint)
        parts, off = [], 0
        for s, n in zip(syms, sizes):
            parts.append(_cols(ctx, s, S.placement(total, off, n), new, dim))
            off += n
        out = parts[0]
        for p in parts[1:]:
            out = add(ctx, out, p)
        dims = [list(d) for d in out.dims]
        dims[dim] = [new]
        return Sym(dims, out.blocks, out.row, new)
    if all(all(a.kind == "grid" for a in s.dims[dim]) for s in syms):
        g = Atom("grid", sum(S._prod(s.dims[dim]) for s in syms))
        dims = [list(d) for d in syms[0].dims]
        dims[dim] = [g]
        return Sym(dims, np.concatenate([s.blocks for s in syms], axis=dim), syms[0].row, syms[0].col)
    raise ctx.fail(f"concatenation along a {_desc(syms[0].dims[dim])} axis (only feature columns "
                   f"or heads)")


def reduce(ctx, sym, dims, keepdim, mean):
    """Sum (or mean) over axes: the columns (U 1), the rows (1ᵀ U) or grid axes (Σ of blocks)."""
    n = len(sym.dims)
    dims = sorted({d % n for d in dims})
    for d in reversed(dims):
        atoms = sym.dims[d]
        size = S._prod(atoms)
        R, C = ctx.shape_of(sym)
        k = 1.0 / size if mean else 1.0
        if atoms == [sym.col]:
            out = sym.with_blocks(lambda b: S.of_expr(E.scale(_n(k), ctx.expr(b, R, C) @ E.ones(C, 1))))
            sym = Sym(sym.dims, out.blocks, sym.row, None)
        elif sym.row is not None and atoms == [sym.row]:
            out = sym.with_blocks(lambda b: S.of_expr(E.scale(_n(k) if not mean else 1 / ctx.L,
                                                              E.ones(1, R) @ ctx.expr(b, R, C))))
            sym = Sym(sym.dims, out.blocks, None, sym.col)
        elif all(a.kind == "grid" for a in atoms):
            summed = np.empty(sym.blocks.shape[:d] + (1,) + sym.blocks.shape[d + 1:], dtype=object)
            for idx in np.ndindex(summed.shape):
                acc = None
                for j in range(sym.blocks.shape[d]):
                    b = sym.blocks[idx[:d] + (j,) + idx[d + 1:]]
                    b = Lin([t.scaled(k) for t in as_lin(ctx, b, R, C).terms])
                    acc = b if acc is None else Lin(list(acc.terms) + list(b.terms))
                summed[idx] = acc
            sym = Sym(sym.dims[:d] + [[]] + sym.dims[d + 1:], summed, sym.row, sym.col)
        else:
            raise ctx.fail(f"a reduction over the {_desc(atoms)} axis cannot be declared")
        dd = [list(x) for x in sym.dims]
        dd[d] = []
        sym = Sym(dd, sym.blocks, sym.row, sym.col)
        if not keepdim:
            sym = squeeze(ctx, sym, [d])
    return sym

"""Shape operations on symbolic tensors: views, permutations, broadcasts, slices,
concatenation and reductions — the head bookkeeping of attention.

A view that cuts a feature axis makes it (grid, feature): a head split, each head's block a
column slice of the projection's block (``reshape``); a size-1 axis expanded is a grid whose
blocks are one shared block (grouped-query ``repeat_kv``, ``expand``); a slice or select of a
grid takes blocks, of the features takes columns (a numeric selection that later becomes the
declared parameter's piece, never a d × d projector).  What mixes sequence positions or the
batch (slicing positions, reducing over the batch) raises the context's ``DeclarationError``.
"""
from __future__ import annotations

import numpy as np

from ...expr import nodes as E
from . import tensor as S
from .ops import _desc, _n, add, as_lin
from .tensor import Atom, Lin, Sym


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

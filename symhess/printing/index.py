"""Lowering of Kronecker-view expressions to sums of index (einsum) networks.

An expression of shape (R × C) is lowered against a list of row labels and a list of
column labels (each label is an index with a symbolic size; the product of the sizes is
R, resp. C, in C order).  Structured operators never become arrays:

* ``Kron`` splits the row/column labels between its factors;
* ``Identity``, ``Commutation``, ``DiagSelector`` and ``Diag`` identify labels (deltas);
* ``SoftmaxJac(A)`` = blockdiag_i(diag(a_i) − a_i a_iᵀ) and ``SoftmaxHess(A, E)`` =
  blockdiag_i(diag(u_i) − u_i a_iᵀ − a_i u_iᵀ), u = dA[E], become two/three per-row terms;
* plain matrix sub-expressions (no structured operator inside) are *leaves*: they are
  computed once as ordinary matrices by the matrix printer and enter as einsum operands;
* structured ``Named`` operators whose labels collapse (block-diagonal ones such as M_2,
  M_3[E]) are computed once as compact tensors (M_2 as an L×d×d array), others are inlined.

When a label list must be split at a size that falls inside a label (rows L·d_V against
a label of size L·d_V), the label is refined into two; every term keeps its own
refinements and identifications (``Term.subst``), so sums of differently-structured
terms stay exact.
"""
from __future__ import annotations

import itertools
from functools import lru_cache
from dataclasses import dataclass, field

import sympy as sp

from .. import expr as E

STRUCTURED = (E.Kron, E.Commutation, E.DiagSelector, E.SoftmaxJac, E.SoftmaxHess, E.Diag,
              E.VecR, E.UnvecR, E.KronContract, E.Identity)


class Labels:
    """A source of fresh labels with their symbolic sizes."""

    def __init__(self):
        self.size = {}
        self._count = itertools.count()

    def new(self, size):
        lab = next(self._count)
        self.size[lab] = sp.sympify(size)
        return lab

    def fresh(self, size):
        """[label] for a size, [] for size 1 (a vector's column)."""
        return [] if sp.sympify(size) == 1 else [self.new(size)]


@dataclass(frozen=True)
class Factor:
    """An einsum operand: ``ref`` (a leaf expression or an intermediate key) over ``labels``."""

    ref: object
    labels: tuple
    side: int = 0       # which copy of the batch index (two in a Frobenius pairing)


@dataclass
class Term:
    """coef · Π factors, with label identifications/refinements ``subst`` (label → labels)."""

    coef: sp.Expr = sp.Integer(1)
    factors: tuple = ()
    subst: dict = field(default_factory=dict)

    def copy(self, **kw):
        t = Term(self.coef, self.factors, dict(self.subst))
        for k, v in kw.items():
            setattr(t, k, v)
        return t


@lru_cache(maxsize=None)
def _divides(a, b):
    """b / a as a monomial in the dimensions, or None when a does not divide b."""
    if a == b:
        return sp.Integer(1)
    q = sp.cancel(sp.sympify(b) / sp.sympify(a))
    num, den = q.as_numer_denom()
    if den != 1 or not (q.is_Integer or q.is_Symbol or q.is_Mul or q.is_Pow):
        return None
    if q.is_Number and q < 1:
        return None
    return q


class Lowering:
    """Lower expressions to lists of ``Term``; shares labels and intermediates."""

    def __init__(self, labels=None, compact=True):
        self.labels = labels or Labels()
        self.compact = compact
        self.intermediates = {}   # Named node -> Intermediate or None (inline)

    # -- label algebra ---------------------------------------------------------------
    def resolve(self, term, labels):
        """The atoms (unrefined, unaliased labels) of a label list."""
        out = []
        for lab in labels:
            seen = term.subst.get(lab)
            if seen is None:
                out.append(lab)
            else:
                out.extend(self.resolve(term, seen))
        return out

    def split(self, term, labels, sizes):
        """Partition ``labels`` into groups of the given sizes, refining labels as needed."""
        atoms = list(self.resolve(term, labels))
        groups = []
        for s in sizes:
            group, rem = [], sp.sympify(s)
            while rem != 1:
                if not atoms:
                    raise NotImplementedError(f"index sizes do not add up (need {rem} more)")
                a = atoms.pop(0)
                da = self.labels.size[a]
                q = _divides(da, rem)
                if q is not None:
                    group.append(a)
                    rem = q
                    continue
                r = _divides(rem, da)
                if r is None:
                    raise NotImplementedError(f"cannot align an index of size {da} with a "
                                              f"factor of size {rem}")
                a1, a2 = self.labels.new(rem), self.labels.new(r)
                term.subst[a] = (a1, a2)
                group.append(a1)
                atoms.insert(0, a2)
                rem = sp.Integer(1)
            groups.append(group)
        if atoms:
            raise NotImplementedError("index sizes do not add up (labels left over)")
        return groups

    def unify(self, term, left, right):
        """Identify two label lists of equal total size (a product of deltas)."""
        a_list, b_list = list(left), list(right)
        while a_list or b_list:
            if not (a_list and b_list):
                raise NotImplementedError("cannot identify index lists of different sizes")
            a = self.resolve(term, [a_list.pop(0)])
            b = self.resolve(term, [b_list.pop(0)])
            if len(a) > 1 or len(b) > 1:
                a_list[:0], b_list[:0] = a, b
                continue
            a, b = a[0], b[0]
            if a == b:
                continue
            da, db = self.labels.size[a], self.labels.size[b]
            if da == db or sp.expand(da - db) == 0:
                term.subst[b] = (a,)
            elif _divides(db, da) is not None:
                a1, a2 = self.labels.new(db), self.labels.new(_divides(db, da))
                term.subst[a] = (a1, a2)
                term.subst[b] = (a1,)
                a_list.insert(0, a2)
            elif _divides(da, db) is not None:
                b1, b2 = self.labels.new(da), self.labels.new(_divides(da, db))
                term.subst[b] = (b1, b2)
                term.subst[b1] = (a,)
                b_list.insert(0, b2)
            else:
                raise NotImplementedError(f"cannot identify indices of sizes {da} and {db}")

    # -- lowering ----------------------------------------------------------------------
    def lower(self, expr, rows, cols, term=None):
        """Terms whose sum is expr[rows, cols]."""
        term = Term() if term is None else term
        return self._lower(expr, list(rows), list(cols), term)

    def _lower(self, n, rows, cols, t):
        if isinstance(n, E.Zero):
            return []
        if is_leaf(n):
            return [t.copy(factors=t.factors + (Factor(n, tuple(rows) + tuple(cols)),))]
        fn = _LOWER.get(type(n))
        if fn is None:
            raise NotImplementedError(f"index lowering has no rule for {type(n).__name__}")
        return fn(self, n, rows, cols, t)

    def thread(self, parts, t):
        """Lower ``[(expr, rows, cols), …]`` one after the other (a product)."""
        terms = [t]
        for e, r, c in parts:
            terms = [out for s in terms for out in self._lower(e, r, c, s)]
        return terms


_LEAF = {}


def is_leaf(n) -> bool:
    """A plain matrix: no structured operator inside (computed by the matrix printer)."""
    if n not in _LEAF:
        _LEAF[n] = not isinstance(n, STRUCTURED) and all(is_leaf(a) for a in n.args)
    return _LEAF[n]


_LOWER = {}


def _rule(t):
    def deco(fn):
        _LOWER[t] = fn
        return fn
    return deco


@_rule(E.Scale)
def _scale(lw, n, rows, cols, t):
    """c·A: the coefficient multiplies the term."""
    return lw._lower(n.args[0], rows, cols, t.copy(coef=t.coef * n.coef))


@_rule(E.Add)
def _add(lw, n, rows, cols, t):
    """A + B: the terms of both (each with its own identifications)."""
    return [out for a in n.args for out in lw._lower(a, rows, cols, t.copy())]


@_rule(E.Transpose)
def _transpose(lw, n, rows, cols, t):
    """Aᵀ[r, c] = A[c, r]."""
    return lw._lower(n.args[0], cols, rows, t)


@_rule(E.MatMul)
def _matmul(lw, n, rows, cols, t):
    """(F₁⋯F_k)[r, c] = Σ F₁[r, k₁] F₂[k₁, k₂] ⋯ F_k[k_{k−1}, c]."""
    f = n.args
    inner = [lw.labels.fresh(x.cols) for x in f[:-1]]
    bounds = [rows] + inner + [cols]
    return lw.thread([(x, bounds[i], bounds[i + 1]) for i, x in enumerate(f)], t)


@_rule(E.Hadamard)
def _hadamard(lw, n, rows, cols, t):
    """(A∘B)[r, c] = A[r, c] B[r, c]."""
    return lw.thread([(x, rows, cols) for x in n.args], t)


@_rule(E.Kron)
def _kron(lw, n, rows, cols, t):
    """(A⊗B)[(i,k),(j,l)] = A[i,j] B[k,l]."""
    t = t.copy()
    rg = lw.split(t, rows, [x.rows for x in n.args])
    cg = lw.split(t, cols, [x.cols for x in n.args])
    return lw.thread([(x, rg[i], cg[i]) for i, x in enumerate(n.args)], t)


@_rule(E.Identity)
def _identity(lw, n, rows, cols, t):
    """I[r, c] = δ_rc."""
    t = t.copy()
    lw.unify(t, rows, cols)
    return [t]


@_rule(E.Ones)
def _ones(lw, n, rows, cols, t):
    """1[r, c] = 1: an explicit ones operand keeps broadcast labels visible to einsum."""
    return [t.copy(factors=t.factors + (Factor(("ones",), tuple(rows) + tuple(cols)),))]


@_rule(E.Commutation)
def _commutation(lw, n, rows, cols, t):
    """K_{m,n}[(i,j),(j',i')] = δ_ii' δ_jj'."""
    m, k = n.params
    t = t.copy()
    r1, r2 = lw.split(t, rows, [m, k])
    c1, c2 = lw.split(t, cols, [k, m])
    lw.unify(t, r1, c2)
    lw.unify(t, r2, c1)
    return [t]


@_rule(E.DiagSelector)
def _diag_selector(lw, n, rows, cols, t):
    """E_n[(i,j), k] = δ_ij δ_jk."""
    t = t.copy()
    r1, r2 = lw.split(t, rows, [n.params[0], n.params[0]])
    lw.unify(t, r1, cols)
    lw.unify(t, r2, cols)
    return [t]


@_rule(E.Diag)
def _diag(lw, n, rows, cols, t):
    """diag(v)[r, c] = δ_rc v[r]."""
    t = t.copy()
    lw.unify(t, rows, cols)
    return lw._lower(n.args[0], rows, [], t)


@_rule(E.DiagPart)
def _diag_part(lw, n, rows, cols, t):
    """diagpart(A)[r] = A[r, r]."""
    return lw._lower(n.args[0], rows, rows, t)


@_rule(E.VecR)
def _vec_r(lw, n, rows, cols, t):
    """vec_r(A)[(i,j)] = A[i, j]."""
    a = n.args[0]
    t = t.copy()
    r1, r2 = lw.split(t, rows, [a.rows, a.cols])
    return lw._lower(a, r1, r2, t)


@_rule(E.UnvecR)
def _unvec_r(lw, n, rows, cols, t):
    """unvec(v)[i, j] = v[(i,j)]."""
    return lw._lower(n.args[0], list(rows) + list(cols), [], t)


@_rule(E.KronContract)
def _kron_contract(lw, n, rows, cols, t):
    """KC(G, C)[i,j] = Σ_ab C[a,b] G[(a,i),(b,j)] (right) or G[(i,a),(j,b)] (left)."""
    g, c = n.args
    side = n.params[0]
    a, b = lw.labels.fresh(c.rows), lw.labels.fresh(c.cols)
    gr, gc = (a + list(rows), b + list(cols)) if side == "right" else (list(rows) + a, list(cols) + b)
    return lw.thread([(c, a, b), (g, gr, gc)], t)


def _row_blocks(lw, a, rows, cols, t):
    """Split the L²-sized labels of a row-wise block-diagonal: rows (i, j), cols (i, k)."""
    t = t.copy()
    i, j = lw.split(t, rows, [a.rows, a.cols])
    i2, k = lw.split(t, cols, [a.rows, a.cols])
    lw.unify(t, i, i2)
    return t, i, j, k


@_rule(E.SoftmaxJac)
def _softmax_jac(lw, n, rows, cols, t):
    """blockdiag_i(diag(a_i) − a_i a_iᵀ): δ_jk A[i,j] − A[i,j] A[i,k]."""
    a = n.args[0]
    t, i, j, k = _row_blocks(lw, a, rows, cols, t)
    diag_term = t.copy()
    lw.unify(diag_term, j, k)
    out = lw._lower(a, i, j, diag_term)
    return out + lw.thread([(a, i, j), (a, i, k)], t.copy(coef=-t.coef))


@_rule(E.SoftmaxHess)
def _softmax_hess(lw, n, rows, cols, t):
    """blockdiag_i(diag(u_i) − u_i a_iᵀ − a_i u_iᵀ), u = dA[E] = A∘(E − rowsum(A∘E))."""
    a, e = n.args
    u = E.softmax_diff(a, e)
    t, i, j, k = _row_blocks(lw, a, rows, cols, t)
    diag_term = t.copy()
    lw.unify(diag_term, j, k)
    out = lw._lower(u, i, j, diag_term)
    neg = t.copy(coef=-t.coef)
    out += lw.thread([(u, i, j), (a, i, k)], neg.copy())
    out += lw.thread([(a, i, j), (u, i, k)], neg.copy())
    return out


@dataclass
class Intermediate:
    """A structured Named operator computed once as a compact tensor.

    ``pattern`` gives, for each of its row and column atoms, the position of that atom's
    axis in the compact tensor; ``terms``/``atoms`` define it as a sum of networks.
    """

    node: E.Expr
    row_sizes: tuple
    col_sizes: tuple
    pattern: tuple      # (row positions, col positions)
    axis_sizes: tuple
    terms: list
    outputs: list       # per term: the atoms of the compact axes


@_rule(E.Named)
def _named(lw, n, rows, cols, t):
    """Compact block-diagonal names (M_2 as L×d×d); inline the others."""
    inter = lw.intermediate(n)
    if inter is None:
        return lw._lower(n.inner, rows, cols, t)
    t = t.copy()
    rg = lw.split(t, rows, inter.row_sizes)
    cg = lw.split(t, cols, inter.col_sizes)
    axes = [lw.labels.new(s) for s in inter.axis_sizes]
    for pos, group in zip(inter.pattern[0] + inter.pattern[1], rg + cg):
        lw.unify(t, [axes[pos]], group)
    return [t.copy(factors=t.factors + (Factor(("inter", n), tuple(axes)),))]


def _intermediate(lw, n):
    """Analyse a structured Named: compact when all its terms share a collapsing pattern."""
    if n in lw.intermediates:
        return lw.intermediates[n]
    lw.intermediates[n] = None       # inline while analysing (and if anything fails)
    if not lw.compact:
        return None
    rows, cols = lw.labels.fresh(n.rows), lw.labels.fresh(n.cols)
    terms = lw._lower(n.inner, rows, cols, Term())
    if not terms:
        return None
    shapes = set()
    outputs = []
    for term in terms:
        ra, ca = lw.resolve(term, rows), lw.resolve(term, cols)
        order = list(dict.fromkeys(ra + ca))
        pos = (tuple(order.index(a) for a in ra), tuple(order.index(a) for a in ca))
        sizes = (tuple(lw.labels.size[a] for a in ra), tuple(lw.labels.size[a] for a in ca))
        shapes.add((pos, sizes))
        outputs.append(order)
    if len(shapes) != 1:
        return None
    (pos, sizes), = shapes
    if len(outputs[0]) == len(pos[0]) + len(pos[1]):
        return None                  # nothing collapses: inlining is as cheap
    axis_sizes = tuple(lw.labels.size[a] for a in outputs[0])
    inter = Intermediate(n, sizes[0], sizes[1], pos, axis_sizes, terms, outputs)
    lw.intermediates[n] = inter
    return inter


Lowering.intermediate = _intermediate

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

Lowering does not use the Python stack per level of nesting: each rule is a generator that
*yields* the sub-lowerings it needs, ``(expr, rows, cols, term)``, and receives their terms;
``Lowering._lower`` runs them with an explicit stack (exceptions are thrown back into the
rule that asked), so deep expressions do not meet Python's recursion limit.
"""
from __future__ import annotations

import itertools
from functools import lru_cache
from dataclasses import dataclass, field

import sympy as sp

from ..expr import nodes as E
from ..expr.stackwalk import run_rules

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
        self.budget = None        # distribute every sum, up to this many terms (lower_small)

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
            if E.same(da, db):
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
        """The terms of n[rows, cols] (times ``t``): the rules' generators run on an
        explicit stack (module docstring)."""
        return run_rules(self._step(n, rows, cols, t), self._step)

    def _step(self, n, rows, cols, t):
        """One node's terms, or the generator of its rule (which yields sub-lowerings)."""
        if isinstance(n, E.Zero):
            return []
        if isinstance(n, E.Ones):
            return _ones(self, n, rows, cols, t)
        if is_leaf(n):
            return [t.copy(factors=t.factors + (Factor(n, tuple(rows) + tuple(cols)),))]
        fn = _LOWER.get(type(n))
        if fn is None and not isinstance(n, STRUCTURED):
            # a plain operation (softmax, an entrywise function …) of structured arguments
            # (a Kronecker product inside a softmax): computed as a matrix, an operand
            return [t.copy(factors=t.factors + (Factor(n, tuple(rows) + tuple(cols)),))]
        if fn is None:
            raise NotImplementedError(f"index lowering has no rule for {type(n).__name__}")
        return fn(self, n, rows, cols, t)

    def thread(self, parts, t):
        """Lower ``[(expr, rows, cols), …]`` one after the other (a product); a generator
        for the rules (``yield from``)."""
        terms = [t]
        for e, r, c in parts:
            new = []
            for s in terms:
                new += yield e, r, c, s
            terms = new
            if self.budget is not None and len(terms) > self.budget:
                raise _OverBudget
        return terms

    def lower_small(self, expr, rows, cols, max_terms):
        """Every sum distributed (each term one plain network) when that gives at most
        ``max_terms`` terms, else None: a few elementwise terms beat a compact factor that
        must then be multiplied out (e.g. a LayerNorm Jacobian times I − 11ᵀ/d)."""
        self.budget = max_terms
        try:
            terms = self.lower(expr, rows, cols)
        except _OverBudget:
            return None
        finally:
            self.budget = None
        return terms if len(terms) <= max_terms else None


class _OverBudget(Exception):
    """Distributing the sums would give more terms than ``Lowering.budget``."""


_LEAF = {}


def is_leaf(n) -> bool:
    """A plain matrix: no structured operator inside (computed by the matrix printer);
    children first over the nodes not yet known."""
    if n not in _LEAF:
        for m in E.walk(n, descend=lambda x: x not in _LEAF):
            if m not in _LEAF:
                _LEAF[m] = not isinstance(m, STRUCTURED) and all(_LEAF[a] for a in m.args)
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
    return (yield n.args[0], rows, cols, t.copy(coef=t.coef * n.coef))


@_rule(E.Add)
def _add(lw, n, rows, cols, t):
    """A + B: common outer factors pulled out (P A Q + P B Q = P (A + B) Q), then one compact
    factor when the remaining sum collapses, else the terms of both."""
    if lw.budget is not None:
        return (yield from _add_terms(lw, n, rows, cols, t))
    f = factored(n)
    if not f == n:
        return (yield f, rows, cols, t)
    return (yield from _compactable(lw, n, rows, cols, t, _grouped_terms))


def _grouped_terms(lw, n, rows, cols, t):
    """The terms of a sum that is not one compact factor, its summands grouped by shared
    end factors first (``grouped``)."""
    g = grouped(n)
    if g is None:
        return (yield from _add_terms(lw, n, rows, cols, t))
    out = []
    for a in g:
        out += yield a, rows, cols, t.copy()
    return out


@lru_cache(maxsize=None)
def grouped(n):
    """The summands of a sum that ``factored`` cannot factor as a whole, with the terms
    that end (or start) with the same factor factored among themselves:
    Σ_t c_t F_t X_t = Σ_X (Σ_{t: X_t = X} c_t F_t) X.  E.g. LayerNorm's centring
    (I − 11ᵀ/d) distributed into two terms per downstream factor becomes one compact
    factor again.  None when no two terms share an end."""
    chains = [_chain(a)[1] for a in n.args]
    for end in (-1, 0):
        groups = {}
        for a, f in zip(n.args, chains):
            groups.setdefault(f[end] if f else None, []).append(a)
        if len(groups) < len(n.args) and None not in groups:
            out = []
            for members in groups.values():
                if len(members) == 1:
                    out.append(members[0])
                    continue
                s = E.add(*members)
                f = factored(s) if isinstance(s, E.Add) else s
                out.append(f)
            if any(not isinstance(o, E.Add) for o, m in zip(out, groups.values()) if len(m) > 1):
                return tuple(out)
    return None


def _chain(n):
    """(coefficient, factors) of a scaled product; any other node is a one-factor chain.

    A sum among the factors is normalised to a leading coefficient of 1 (the expression
    algebra keeps scalars on the terms of sums, so c·J and J would otherwise not match).
    """
    coef = sp.Integer(1)
    while isinstance(n, E.Scale):
        coef, n = coef * n.coef, n.args[0]
    factors = []
    for f in (list(n.args) if isinstance(n, E.MatMul) else [n]):
        c, f = _monic(f)
        coef *= c
        g = factored(f) if isinstance(f, E.Add) and f not in _FACTORING else f
        if g == f:
            factors.append(f)
        else:                     # a sum with common factors: splice P (Σ) Q into the chain
            c, sub = _chain(g)
            coef *= c
            factors.extend(sub)
    return coef, factors


_FACTORING = set()     # sums being factored (a sum's chain never splices the sum itself)


@lru_cache(maxsize=None)
def _monic(f):
    """(c, S) with f = c·S and S's first term unscaled, for a sum f; (1, f) otherwise."""
    if not isinstance(f, E.Add):
        return sp.Integer(1), f
    c0 = f.args[0].coef if isinstance(f.args[0], E.Scale) else sp.Integer(1)
    if c0 == 1:
        return c0, f
    return c0, E.add(*(E.scale(1 / c0, t) for t in f.args))


_FACTORED = {}
_CHAINED = (E.Add, E.Scale, E.MatMul, E.Kron)      # the nodes ``_chain`` looks into


def factored(n):
    """Σ_t c_t P F_t Q as P (Σ_t c_t F_t) Q with the longest common prefix P and suffix Q.

    Distributivity read backwards: the sum is then lowered once, between its shared factors,
    instead of once per term through the whole product (and it may become a compact factor).
    Kronecker factors are peeled by the mixed-product rule, (A ⊗ B C) = (I ⊗ B)(A ⊗ C), so a
    common part inside them moves out too.

    Kept per sum; the sums below (through the nodes ``_chain`` looks into) are factored
    first, children first, so the nested calls find them done (no recursion per level).
    """
    got = _FACTORED.get(n)
    if got is None:
        for m in E.walk(n, descend=lambda x: x not in _FACTORED and isinstance(x, _CHAINED)):
            if isinstance(m, E.Add) and m not in _FACTORED:
                _FACTORED[m] = _factored(m)
        got = _FACTORED[n]
    return got


def _factored(n):
    _FACTORING.add(n)
    try:
        chains = [list(_chain(a)) for a in n.args]
    finally:
        _FACTORING.discard(n)
    pre, suf = [], []
    while True:
        if _peel_whole(chains, pre, suf) | _peel_kron(chains, pre, front=True) | \
                _peel_kron(chains, suf, front=False):
            continue
        break
    if not pre and not suf:
        return n
    size = suf[0].rows if suf else pre[-1].cols
    mids = [E.scale(c, E.matmul(*f) if f else E.identity(size)) for c, f in chains]
    return E.matmul(*pre, E.add(*mids), *suf)


def _peel_whole(chains, pre, suf):
    """Move factors every chain starts (ends) with into ``pre`` (``suf``)."""
    moved = False
    while all(c and c[0] == chains[0][1][0] for _, c in chains) and \
            sum(len(c) for _, c in chains) > len(chains):
        pre.append(chains[0][1][0])
        for ch in chains:
            ch[1] = ch[1][1:]
        moved = True
    while all(c and c[-1] == chains[0][1][-1] for _, c in chains) and \
            sum(len(c) for _, c in chains) > len(chains):
        suf.insert(0, chains[0][1][-1])
        for ch in chains:
            ch[1] = ch[1][:-1]
        moved = True
    return moved


def _peel_kron(chains, out, front):
    """(A ⊗ B_t C) for all t → (A ⊗ B_t)(I ⊗ C): the common slot tails (heads) move to ``out``."""
    if not all(c for _, c in chains):
        return False
    ends = [c[0] if front else c[-1] for _, c in chains]
    if not all(isinstance(k, E.Kron) and len(k.args) == len(ends[0].args) for k in ends):
        return False
    side = (lambda a: a.rows) if front else (lambda a: a.cols)
    if any(side(a) != side(b) for k in ends for a, b in zip(k.args, ends[0].args)):
        return False
    slots = [[_chain(k.args[s]) for k in ends] for s in range(len(ends[0].args))]
    common, parts = [], []
    for slot in slots:
        lists = [f for _, f in slot]
        m = 0
        while all(len(f) > m for f in lists) and \
                all((f[m] if front else f[-1 - m]) == (lists[0][m] if front else lists[0][-1 - m])
                    for f in lists):
            m += 1
        common.append(m)
        parts.append(lists[0][:m] if front else lists[0][len(lists[0]) - m:])
    if all(isinstance(x, E.Identity) for part in parts for x in part):
        return False                  # only identities in common: nothing to move
    shared, rests = [], [[] for _ in chains]
    for s, (slot, m, part) in enumerate(zip(slots, common, parts)):
        arg = ends[0].args[s]
        shared.append(E.matmul(*part) if part else E.identity(arg.rows if front else arg.cols))
        for t, (c, f) in enumerate(slot):
            rest = f[m:] if front else f[:len(f) - m]
            size = (part[-1].cols if front else part[0].rows) if part else (arg.cols if front else arg.rows)
            rests[t].append(E.matmul(*rest) if rest else E.identity(size))
            chains[t][0] = chains[t][0] * c
    head = E.kron(*shared)
    if front:
        out.append(head)
    else:
        out.insert(0, head)
    for t, ch in enumerate(chains):
        new = E.kron(*rests[t])
        c0, new = _chain(new)
        ch[0] = ch[0] * c0
        body = [x for x in new if not isinstance(x, E.Identity)]
        ch[1] = (body + ch[1][1:]) if front else (ch[1][:-1] + body)
    return True


def _add_terms(lw, n, rows, cols, t):
    """The terms of every summand (each with its own identifications)."""
    out = []
    for a in n.args:
        out += yield a, rows, cols, t.copy()
    return out


@_rule(E.Transpose)
def _transpose(lw, n, rows, cols, t):
    """Aᵀ[r, c] = A[c, r]."""
    return (yield n.args[0], cols, rows, t)


@_rule(E.MatMul)
def _matmul(lw, n, rows, cols, t):
    """(F₁⋯F_k)[r, c] = Σ F₁[r, k₁] F₂[k₁, k₂] ⋯ F_k[k_{k−1}, c]."""
    f = n.args
    inner = [lw.labels.fresh(x.cols) for x in f[:-1]]
    bounds = [rows] + inner + [cols]
    return (yield from lw.thread([(x, bounds[i], bounds[i + 1]) for i, x in enumerate(f)], t))


@_rule(E.Hadamard)
def _hadamard(lw, n, rows, cols, t):
    """(A∘B)[r, c] = A[r, c] B[r, c]."""
    return (yield from lw.thread([(x, rows, cols) for x in n.args], t))


@_rule(E.Kron)
def _kron(lw, n, rows, cols, t):
    """(A⊗B)[(i,k),(j,l)] = A[i,j] B[k,l]."""
    t = t.copy()
    rg = lw.split(t, rows, [x.rows for x in n.args])
    cg = lw.split(t, cols, [x.cols for x in n.args])
    return (yield from lw.thread([(x, rg[i], cg[i]) for i, x in enumerate(n.args)], t))


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
    return (yield n.args[0], rows, [], t)


@_rule(E.DiagPart)
def _diag_part(lw, n, rows, cols, t):
    """diagpart(A)[r] = A[r, r]."""
    return (yield n.args[0], rows, rows, t)


@_rule(E.VecR)
def _vec_r(lw, n, rows, cols, t):
    """vec_r(A)[(i,j)] = A[i, j]."""
    a = n.args[0]
    t = t.copy()
    r1, r2 = lw.split(t, rows, [a.rows, a.cols])
    return (yield a, r1, r2, t)


@_rule(E.UnvecR)
def _unvec_r(lw, n, rows, cols, t):
    """unvec(v)[i, j] = v[(i,j)]."""
    return (yield n.args[0], list(rows) + list(cols), [], t)


@_rule(E.KronContract)
def _kron_contract(lw, n, rows, cols, t):
    """KC(G, C)[i,j] = Σ_ab C[a,b] G[(a,i),(b,j)] (right) or G[(i,a),(j,b)] (left)."""
    g, c = n.args
    side = n.params[0]
    a, b = lw.labels.fresh(c.rows), lw.labels.fresh(c.cols)
    gr, gc = (a + list(rows), b + list(cols)) if side == "right" else (list(rows) + a, list(cols) + b)
    return (yield from lw.thread([(c, a, b), (g, gr, gc)], t))


def _row_blocks(lw, a, rows, cols, t):
    """Split the L²-sized labels of a row-wise block-diagonal: rows (i, j), cols (i, k)."""
    t = t.copy()
    i, j = lw.split(t, rows, [a.rows, a.cols])
    i2, k = lw.split(t, cols, [a.rows, a.cols])
    lw.unify(t, i, i2)
    return t, i, j, k


@_rule(E.SoftmaxJac)
def _softmax_jac(lw, n, rows, cols, t):
    """∂A/∂T as one compact L×L×L factor (see ``_softmax_jac_terms``)."""
    return (yield from _compactable(lw, n, rows, cols, t, _softmax_jac_terms))


def _softmax_jac_terms(lw, n, rows, cols, t):
    """blockdiag_i(diag(a_i) − a_i a_iᵀ): δ_jk A[i,j] − A[i,j] A[i,k]."""
    a = n.args[0]
    t, i, j, k = _row_blocks(lw, a, rows, cols, t)
    diag_term = t.copy()
    lw.unify(diag_term, j, k)
    out = yield a, i, j, diag_term
    return out + (yield from lw.thread([(a, i, j), (a, i, k)], t.copy(coef=-t.coef)))


@_rule(E.SoftmaxHess)
def _softmax_hess(lw, n, rows, cols, t):
    """∂²A/∂T²[E] as one compact L×L×L factor (see ``_softmax_hess_terms``)."""
    return (yield from _compactable(lw, n, rows, cols, t, _softmax_hess_terms))


def _softmax_hess_terms(lw, n, rows, cols, t):
    """blockdiag_i(diag(u_i) − u_i a_iᵀ − a_i u_iᵀ), u = dA[E] = A∘(E − rowsum(A∘E))."""
    a, e = n.args
    u = E.softmax_diff(a, e)
    t, i, j, k = _row_blocks(lw, a, rows, cols, t)
    diag_term = t.copy()
    lw.unify(diag_term, j, k)
    out = yield u, i, j, diag_term
    neg = t.copy(coef=-t.coef)
    out += yield from lw.thread([(u, i, j), (a, i, k)], neg.copy())
    out += yield from lw.thread([(a, i, j), (u, i, k)], neg.copy())
    return out


@dataclass
class Intermediate:
    """A structured Named operator computed once as a compact tensor.

    ``pattern`` gives, for each of its row and column atoms, the position of that atom's
    axis in the compact tensor (negative: an identity over atoms the tensor does not carry);
    ``terms``/``atoms`` define it as a sum of networks.
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
    return (yield from _compactable(lw, n, rows, cols, t, _inline))


def _inline(lw, n, rows, cols, t):
    """A name's definition, lowered in place."""
    return (yield n.inner, rows, cols, t)


def _use_intermediate(lw, n, inter, rows, cols, t):
    """One factor over the compact tensor's axes, identified with the caller's labels."""
    t = t.copy()
    rg = lw.split(t, rows, inter.row_sizes)
    cg = lw.split(t, cols, inter.col_sizes)
    axes = [lw.labels.new(s) for s in inter.axis_sizes]
    free = {}
    for pos, group in zip(inter.pattern[0] + inter.pattern[1], rg + cg):
        if pos >= 0:
            lw.unify(t, [axes[pos]], group)
        elif pos in free:            # an identity the compact tensor does not carry
            lw.unify(t, free[pos], group)
        else:
            free[pos] = group
    return [t.copy(factors=t.factors + (Factor(("inter", n), tuple(axes)),))]


def _compactable(lw, n, rows, cols, t, rule):
    """A multi-term node (a sum, ∂A/∂T, ∂²A/∂T²[E]) kept as one compact factor when its terms
    share identifications (a block-diagonal sum stays an L×d×d tensor instead of being
    distributed through every product it sits in); otherwise its terms, via ``rule``."""
    inter = (yield from lw.intermediate(n)) if lw.budget is None else None
    if inter is None:
        return (yield from rule(lw, n, rows, cols, t))
    return _use_intermediate(lw, n, inter, rows, cols, t)


def _merge_sizes(a, b):
    """The finest common refinement of two factorisations of one size, or None."""
    a, b, out = list(a), list(b), []
    while a and b:
        x, y = sp.sympify(a.pop(0)), sp.sympify(b.pop(0))
        if E.same(x, y):
            out.append(x)
        elif _divides(y, x) is not None:
            out.append(y)
            a.insert(0, _divides(y, x))
        elif _divides(x, y) is not None:
            out.append(x)
            b.insert(0, _divides(x, y))
        else:
            return None
    return out if not (a or b) else None


def _inner_terms(lw, n, rows, cols):
    inner = n.inner if isinstance(n, E.Named) else n
    return (yield inner, list(rows), list(cols), Term())


def _intermediate(lw, n):
    """Analyse a structured node: compact when its terms share at least one identification.

    Each term's row/column atoms are brought to one common refinement (re-lowering with
    pre-split labels); two positions share a compact axis when every term identifies them
    (the meet of the terms' patterns).  A term that identifies more (an identity term next
    to a product term) gets an explicit identity operand for the extra identification.
    """
    if n in lw.intermediates:
        return lw.intermediates[n]
    lw.intermediates[n] = None       # inline while analysing (and if anything fails)
    if not lw.compact:
        return None
    row_sizes, col_sizes = [n.rows], [n.cols]
    for _ in range(4):
        rows = [lab for s in row_sizes for lab in lw.labels.fresh(s)]
        cols = [lab for s in col_sizes for lab in lw.labels.fresh(s)]
        try:
            terms = yield from _inner_terms(lw, n, rows, cols)
        except NotImplementedError:
            return None
        if not terms or (len(terms) == 1 and not isinstance(n, E.Named)):
            return None
        atoms = [(lw.resolve(t, rows), lw.resolve(t, cols)) for t in terms]
        sizes = [([lw.labels.size[a] for a in ra], [lw.labels.size[a] for a in ca]) for ra, ca in atoms]
        new_r, new_c = sizes[0][0], sizes[0][1]
        for sr, sc in sizes[1:]:
            new_r, new_c = _merge_sizes(new_r, sr), _merge_sizes(new_c, sc)
            if new_r is None or new_c is None:
                return None
        if all(len(sr) == len(new_r) and len(sc) == len(new_c) for sr, sc in sizes):
            break
        row_sizes, col_sizes = new_r, new_c
    else:
        return None
    if any(len(sr) != len(new_r) or len(sc) != len(new_c) for sr, sc in sizes):
        return None
    n_row = len(new_r)
    positions = [ra + ca for ra, ca in atoms]
    keys = [tuple(p[k] for p in positions) for k in range(len(positions[0]))]
    classes = list(dict.fromkeys(keys))
    if len(classes) == len(keys):
        return None                  # nothing collapses: distributing is as cheap
    pos = [classes.index(k) for k in keys]
    axis_sizes = tuple((list(new_r) + list(new_c))[keys.index(k)] for k in classes)
    outputs, out_terms = [], []
    for ti, term in enumerate(terms):
        term = term.copy()
        seen, outs = set(), []
        for k in classes:
            a = k[ti]
            if a in seen:            # this term identifies two compact axes: δ as an operand
                b = lw.labels.new(lw.labels.size[a])
                term.factors = term.factors + (Factor(("eye",), (a, b)),)
                a = b
            seen.add(a)
            outs.append(a)
        outputs.append(outs)
        out_terms.append(term)
    pos, axis_sizes, outputs = _drop_free_axes(lw, pos, axis_sizes, out_terms, outputs)
    inter = Intermediate(n, tuple(new_r), tuple(new_c), (tuple(pos[:n_row]), tuple(pos[n_row:])),
                         axis_sizes, out_terms, outputs)
    lw.intermediates[n] = inter
    return inter


def _drop_free_axes(lw, pos, axis_sizes, terms, outputs):
    """Leave out of the compact tensor each axis that only identifies positions: one whose
    atom no factor of any term carries (I_{d_ff} ⊗ C stays C with a δ over d_ff, instead of
    d_ff copies of C that every product then carries as a batch axis).  Its positions get
    a negative class (−1, −2, …) that ``_use_intermediate`` identifies directly."""
    def carried(term, atom):
        return any(atom in lw.resolve(term, f.labels) for f in term.factors)
    free = [k for k in range(len(axis_sizes)) if pos.count(k) > 1
            and not any(carried(t, outs[k]) for t, outs in zip(terms, outputs))]
    if not free or len(free) == len(axis_sizes):
        return pos, axis_sizes, outputs
    kept = [k for k in range(len(axis_sizes)) if k not in free]
    new = {k: (kept.index(k) if k in kept else -1 - free.index(k)) for k in range(len(axis_sizes))}
    return ([new[k] for k in pos], tuple(axis_sizes[k] for k in kept),
            [[outs[k] for k in kept] for outs in outputs])


Lowering.intermediate = _intermediate

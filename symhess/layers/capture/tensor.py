"""Symbolic tensors: what a captured graph's tensors are while it is translated.

The engine is 2-D (every node a matrix); a module's tensors are not.  A tensor that depends
on the module's input is a ``Sym``: its axes (``dims``, one list of *atoms* per tensor axis,
row-major inside an axis) and an object array of 2-D *blocks*, one per index of its grid
atoms.  Atoms are

* ``batch`` — the sequences of a batch (kernels carry that axis themselves),
* ``pos``   — token positions, the rows of the block matrices (size L, the symbol L),
* ``feat``  — features, the columns (or rows, for a transposed block),
* ``grid``  — an enumerated axis: heads, the q/k/v chunks of a fused projection, …

so hidden states (B, L, d) are one L × d block and per-head tensors (B, H, L, d_h) are H
blocks of L × d_h.  ``Sym.row``/``Sym.col`` are the atoms a block's rows and columns index
(None: size 1).  An empty atom list is an axis of size 1.

Blocks are kept lazy where laziness saves work:

* ``Lin`` — Σ_t k_t · U_t · a_t · W_t · c_t with U_t an expression (None: a column of ones,
  a broadcast bias row), W_t a piece of a module parameter (an index array into it, ``Piece``)
  and a_t, c_t numeric matrices from column bookkeeping (head slices, concatenations,
  rotate_half's signed permutation).  Only when a block is needed as an expression
  (``to_expr``) are the constants pushed into the parameter: the columns of W that c reads
  become the declared parameter (W_Q[:, head h] is a d × d_h parameter, never a d × d
  projector), and what remains of a and c (a signed permutation, nothing for a slice)
  becomes a constant of the declaration.
* ``Fn`` — f(U) entrywise, f a sympy function of x: chains of entrywise operations on one
  operand (tanh-GELU's eight ATen ops, x·rsqrt(m + ε)) compose into one function.
* ``Masked`` — attention logits with a constant boolean *keep* mask: an additive −∞ (or
  ≤ −max/2 of the dtype, transformers' finfo.min) mask or ``masked_fill`` never enters the
  arithmetic; ``softmax`` consumes it as ``softmax_rows(T, mask=M)`` (masked entries exactly 0).

Cost of head bookkeeping: a head's query, key and value are column pieces of the
projections (d × d_h parameters), so a block's networks and the Hessian–vector product's
products are per head (H products of L d d_h, the same flops as one L d² product); the
grouped-query ``repeat_kv`` is a replication of block references (no copy, no operator).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from ...expr import nodes as E
from ...errors import DeclarationError
from ...expr.scalarfn import ScalarFn, x as X_SYM, get_function, FUNCTIONS


MASK_FRACTION = 0.5      # additive entries ≤ −MASK_FRACTION · max(dtype) (or −∞) mask


@dataclass
class Piece:
    """Entries of module parameter ``name``: ``idx`` (an int tensor of any shape) holds flat
    positions inside it, ``value`` the entries (for constant folding of view operations);
    ``pos``: one row per token position (a position embedding's rows 0 … L − 1, an L × n
    parameter added to the hidden states rather than a row broadcast over them)."""

    name: str
    idx: object
    value: object
    pos: bool = False


@dataclass
class Ids:
    """Token ids (an integer tensor of the data): ``value`` the example's, after the
    rearrangements applied so far (views, casts, the loss's shift and padding); ``onehot``
    the one-hot data X as a symbolic tensor of the original ids' shape + (V,)."""

    value: object
    onehot: object
    original: object


@dataclass
class LossOut:
    """A loss the model computes itself: ``logits`` (a ``Sym``, one row per token) and the
    registered loss name that states it on the declaration's output."""

    logits: object
    loss: str


class Atom:
    """One axis factor: ``kind`` (batch, pos, feat, grid) and its concrete ``size``."""

    __slots__ = ("kind", "size", "hint")

    def __init__(self, kind, size, hint=None):
        self.kind, self.size, self.hint = kind, int(size), hint

    def __repr__(self):
        return f"{self.kind}{self.size}"


def _prod(atoms):
    out = 1
    for a in atoms:
        out *= a.size
    return out


def _extent(atoms):
    return _prod([a for a in atoms if a.kind == "grid"])


# ----------------------------------------------------------------------------- blocks
class Term:
    """k · U · a · W · c (see the module docstring); ``left`` None is a ones column."""

    __slots__ = ("left", "a", "w", "c", "k")

    def __init__(self, left=None, a=None, w=None, c=None, k=1.0):
        self.left, self.a, self.w, self.c, self.k = left, a, w, c, k

    def then(self, c):
        """This term times the numeric matrix c on the right."""
        return Term(self.left, self.a, self.w, c if self.c is None else self.c @ c, self.k)

    def scaled(self, k):
        return Term(self.left, self.a, self.w, self.c, self.k * k)


class Lin:
    """A sum of ``Term`` s (lazy column bookkeeping and parameter pieces)."""

    __slots__ = ("terms", "__weakref__")

    def __init__(self, terms):
        self.terms = tuple(terms)


class Fn:
    """f(base) entrywise; f a sympy expression in ``scalarfn.x``."""

    __slots__ = ("base", "f")

    def __init__(self, base, f):
        self.base, self.f = base, f


class Masked:
    """Logits ``inner`` (a block, or None for 0) whose entries where ``keep`` is False are
    −∞: a (rows × cols) or per-sequence (B × rows × cols) boolean array."""

    __slots__ = ("inner", "keep")

    def __init__(self, inner, keep):
        self.inner, self.keep = inner, keep


def of_expr(e):
    return Lin([Term(left=e)])


# ----------------------------------------------------------------------------- Sym
class Sym:
    """A symbolic tensor (module docstring): ``dims``, ``blocks`` (object array, one axis per
    dim, extent = the product of that dim's grid atoms), ``row``/``col`` atoms or None."""

    __slots__ = ("dims", "blocks", "row", "col")

    def __init__(self, dims, blocks, row, col):
        self.dims = [list(d) for d in dims]
        self.blocks = blocks
        self.row, self.col = row, col
        want = tuple(_extent(d) for d in self.dims)
        if self.blocks.shape != want:                                # pragma: no cover - internal
            raise RuntimeError(f"blocks {self.blocks.shape} for dims {self.dims}")

    @property
    def shape(self):
        return tuple(_prod(d) for d in self.dims)

    def dim_of(self, atom):
        for i, d in enumerate(self.dims):
            if any(a is atom for a in d):
                return i
        return None

    def with_blocks(self, fn):
        out = np.empty(self.blocks.shape, dtype=object)
        for idx in np.ndindex(self.blocks.shape):
            out[idx] = fn(self.blocks[idx])
        return Sym(self.dims, out, self.row, self.col)

    def __repr__(self):
        return f"<Sym {self.dims} row={self.row} col={self.col}>"


def single(block, dims, row, col):
    arr = np.empty(tuple(_extent(d) for d in dims), dtype=object)
    for idx in np.ndindex(arr.shape):
        arr[idx] = block
    return Sym(dims, arr, row, col)


def objects(shape, fn):
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(shape):
        out[idx] = fn(idx)
    return out


# ----------------------------------------------------------------------------- numeric helpers
def select(n, cols):
    """The n × len(cols) 0/1 matrix picking ``cols``."""
    s = np.zeros((n, len(cols)))
    s[np.asarray(cols, dtype=int), np.arange(len(cols))] = 1.0
    return s


def placement(n_total, start, n):
    """The n × n_total matrix placing n columns at ``start``."""
    p = np.zeros((n, n_total))
    p[np.arange(n), start + np.arange(n)] = 1.0
    return p


def is_identity(m):
    return m.shape[0] == m.shape[1] and np.array_equal(m, np.eye(m.shape[0]))


@lru_cache(maxsize=None)
def scalar_fn(f):
    """A ``ScalarFn`` for f(x): a library function when f is one (numerically equal at probe
    points to float64 rounding of its constants: tanh-GELU's √(2/π) = 0.7978845608028654),
    else a function named by its formula."""
    f = sp.sympify(f)
    if f == X_SYM:
        return None
    for name, (g, _) in FUNCTIONS.items():
        if _same_fn(f, g):
            return get_function(name)
    from ...expr.latex import _explicit_tex
    return ScalarFn(f"[{sp.sstr(f)}]", f, _explicit_tex(f))


_PROBES = (-2.7, -1.1, -0.3, 0.2, 0.9, 1.7, 3.1)


def _same_fn(f, g):
    try:
        for p in _PROBES:
            a, b = complex(f.subs(X_SYM, p).evalf(30)), complex(g.subs(X_SYM, p).evalf(30))
            if not (abs(a - b) <= 4e-16 * max(1.0, abs(b))):
                return False
    except (TypeError, ValueError, ZeroDivisionError):
        return False
    return True


@lru_cache(maxsize=None)
def nice(k):
    """A float as a readable exact number when one is within 2 ulp of it (0.5 → 1/2,
    1/√32 → √2/8, 1e-5 → 1/100000), else the float itself."""
    k = float(k)
    if k.is_integer():
        return sp.Integer(int(k))
    try:
        n = sp.nsimplify(k)
    except (TypeError, ValueError):                          # pragma: no cover
        return sp.Float(k)
    small = all(abs(int(q)) < 10 ** 7 for q in n.atoms(sp.Integer)) and sp.count_ops(n) <= 6
    if small and abs(float(n) - k) <= 2 * np.spacing(abs(k)):
        return n
    return sp.Float(k)


def apply_fn(f, e):
    """f(e) entrywise as an expression (identity: e itself)."""
    fn = scalar_fn(f)
    return e if fn is None else E.elementwise(fn, e)


def error(msg):
    return DeclarationError(msg)

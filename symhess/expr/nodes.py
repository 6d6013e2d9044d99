"""Immutable matrix-expression nodes with symbolic shapes.

Every node is a 2-D matrix (vectors are n×1, scalars 1×1).  Nodes hold a tuple of
child expressions (``args``) and a tuple of hashable parameters (``params``); they
compare and hash structurally.  Use the factory functions (``matmul``, ``add``,
``kron`` …) or the Python operators: they canonicalise (flatten, drop zeros and
identities, collect like terms, sort commutative operands) and check shapes, so an
error points at the declaration that caused it.

Termination of the canonical constructors (no cap anywhere).  ``add``, ``kron``,
``hadamard``, ``scale`` and the other factories make one pass over their flattened operands;
``transpose`` recurses on strictly smaller nodes.  ``matmul`` merges neighbours with a work
list (nested products flattened, identities dropped, (A⊗B)(C⊗D) → AC⊗BD,
K_{m,n}K_{n,m} → I, 1·1 → k·1).  Let n(e) count the nodes of e's tree other than
``MatMul`` and ``Scale``.  A call's result has n ≤ the sum over its operands (induction on n:
the mixed-product rule replaces two Kron nodes by one over recursive products of strictly
smaller operands, K K by nothing, 1·1 by one node), and every step of the loop strictly
decreases (n of the work list and output, the number of MatMul nodes on the work list, the
length of the work list) lexicographically: a merge lowers the first, flattening a product the
second without raising the first, moving an operand to the output the third.

This module imports nothing from the calculus; its text and LaTeX forms are ``text.py`` and
``latex.py`` (which dispatch on class names and import no node).  ``Expr.evaluate`` is bound
by the package (``symhess.expr``), since the interpreter imports the nodes.
"""
from __future__ import annotations

import hashlib
import keyword
import operator
from functools import lru_cache

import sympy as sp

from ..errors import DeclarationError, ShapeError
from .latex import latex
from .scalarfn import ScalarFn, get_function
from .stackwalk import children_first
from .text import text

__all__ = [
    "ShapeError", "Expr", "dim", "dims", "matrix", "param", "const",
    "zero", "identity", "ones", "causal_mask", "commutation", "diag_selector",
    "matmul", "add", "scale", "transpose", "kron", "hadamard", "elementwise",
    "softmax_rows", "log_softmax_rows", "diag", "diag_part", "vec_r",
    "named", "rowsum", "sum_all", "power",
]


def dim(name: str) -> sp.Symbol:
    """A symbolic dimension (positive integer); ``name`` is a Python identifier (L, d_V)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise DeclarationError(f"dimension name {name!r} is not an identifier (letters, digits "
                               f"and _, not starting with a digit), e.g. dims('L d_V')")
    return sp.Symbol(name, positive=True, integer=True)


def dims(names: str):
    """Several symbolic dimensions: ``L, d_V = dims("L d_V")`` (names separated by spaces)."""
    if not isinstance(names, str) or not names.split():
        raise DeclarationError(f"dims expects names separated by spaces, e.g. dims('L d_V'), "
                               f"got {names!r}")
    return tuple(dim(n) for n in names.split())


def _operands(op, items):
    """A DeclarationError unless every operand of ``op`` is an expression (``kron(X, 3)``)."""
    for i, x in enumerate(items, 1):
        if not isinstance(x, Expr):
            hint = " (scale by a number with 3 * A)" if isinstance(x, (int, float, sp.Number)) else ""
            raise DeclarationError(f"{op}: operand {i} is {type(x).__name__} {x!r:.40}, not a "
                                   f"symhess expression{hint}")


# structural sort keys longer than this keep a prefix and a digest (Expr.key)
KEY_MAX = 512
KEY_PREFIX = 256


def _params_repr(params) -> str:
    """repr of a node's params, cached (sympy's printer is slow and the same shapes,
    coefficients and names recur across a derivation's nodes); keyed with the types too,
    so params that compare equal but print differently (1 and 1.0) keep their own text."""
    return _typed_repr(params, tuple(map(type, params)))


@lru_cache(maxsize=65536)
def _typed_repr(params, _types) -> str:
    return repr(params)


def _d(x) -> sp.Expr:
    return x if isinstance(x, sp.Basic) else sp.sympify(x)


def _fmt(shape) -> str:
    return f"({shape[0]} × {shape[1]})"


def same(a, b) -> bool:
    """Structural equality of two dimension expressions."""
    return a == b or _same_expanded(a, b)


@lru_cache(maxsize=None)
def _same_expanded(a, b) -> bool:
    """Equality up to expansion (cached: shapes and index sizes are compared over and over
    while deriving and printing, and sympy's expand is slow)."""
    return sp.expand(sp.sympify(a) - sp.sympify(b)) == 0


def size_env(env) -> tuple:
    """A hashable key of a {symbol: size} binding, for ``size_at``."""
    return tuple(sorted(env.items(), key=lambda kv: str(kv[0])))


@lru_cache(maxsize=16384)
def size_at(d, env):
    """A dimension expression at the sizes of ``env`` (a ``size_env`` key), or None when one
    of its symbols is unbound; cached, since sympy's subs is slow and every evaluated node
    and every printed statement asks for its sizes."""
    v = sp.sympify(d).subs(dict(env))
    return int(v) if v.is_number else None


class Expr:
    """Base node: ``args`` (child expressions), ``params`` (hashable data), ``shape``."""

    __slots__ = ("args", "params", "shape", "_hash", "_key", "_free", "_t")
    precedence = 100

    def __init__(self, args=(), params=(), shape=None):
        self.args = tuple(args)
        self.params = tuple(params)
        self.shape = (_d(shape[0]), _d(shape[1]))
        self._hash = None
        self._key = None
        self._free = None
        self._t = None        # the transpose, once asked for (DAGs share it across parents)

    # -- structure ---------------------------------------------------------------
    def rebuild(self, args):
        """The same node type and params over new args (canonicalising)."""
        return type(self)(*args, *self.params) if args else self

    # The structural properties below (equality, hash, key, free variables) are computed
    # without recursion: a DAG's height (hundreds of levels in a deep stack) never meets
    # Python's recursion limit.  Each is cached on the node and filled children-first
    # (``_fill``) over the nodes that lack it.

    def __eq__(self, other):
        if self is other:
            return True
        if not (type(self) is type(other) and hash(self) == hash(other)
                and self.params == other.params and self.shape == other.shape
                and len(self.args) == len(other.args)):
            return False
        if all(map(operator.is_, self.args, other.args)):
            other.args = self.args
            return True
        pairs, seen, equal = [(self, other)], set(), []
        while pairs:
            a, b = pairs.pop()
            if a is b or (id(a), id(b)) in seen:
                continue
            if not (type(a) is type(b) and hash(a) == hash(b) and a.params == b.params
                    and a.shape == b.shape and len(a.args) == len(b.args)):
                return False
            seen.add((id(a), id(b)))
            equal.append((a, b))
            pairs.extend(zip(a.args, b.args))
        # equal DAGs built separately: share the children so that comparing them again
        # is an identity check (without this, comparing DAGs is exponential in depth)
        for a, b in equal:
            b.args = a.args
        return True

    def __hash__(self):
        if self._hash is None:
            _fill(self, "_hash", lambda n: hash((type(n).__name__, n.params, n.args, n.shape)))
        return self._hash

    @property
    def key(self) -> str:
        """A deterministic structural string, used to sort commutative operands. Past
        ``KEY_MAX`` characters it keeps its first ``KEY_PREFIX`` and a digest of the rest:
        the full strings of a derivation's DAGs grow exponentially with depth (gigabytes
        for the post-LN block), the bounded ones stay short and sort the same way unless
        two keys agree on their whole prefix."""
        if self._key is None:
            _fill(self, "_key", _make_key)
        return self._key

    @property
    def free_vars(self) -> frozenset:
        """The variables this expression depends on (frozen names hide theirs)."""
        if self._free is None:
            if all(a._free is not None or not a.args for a in self.args):   # the usual case
                self._free = frozenset().union(*(a.free_vars for a in self.args))
            else:
                _fill(self, "_free", lambda n: n.free_vars if type(n).free_vars.fget is not
                      Expr.free_vars.fget else frozenset().union(*(a.free_vars for a in n.args)))
        return self._free

    def depends_on(self, var) -> bool:
        return var in self.free_vars

    @property
    def is_zero(self) -> bool:
        return isinstance(self, Zero)

    @property
    def rows(self):
        return self.shape[0]

    @property
    def cols(self):
        return self.shape[1]

    def __repr__(self):
        return text(self)

    # -- operators ---------------------------------------------------------------
    def __matmul__(self, other):
        return matmul(self, other)

    def __add__(self, other):
        return add(self, other)

    def __sub__(self, other):
        return add(self, scale(-1, other))

    def __neg__(self):
        return scale(-1, self)

    def __mul__(self, other):
        if isinstance(other, Expr):
            return hadamard(self, other)
        return scale(other, self)

    def __rmul__(self, other):
        return scale(other, self)

    def __truediv__(self, other):
        if isinstance(other, Expr):
            raise DeclarationError("divide by an expression with power(expr, -1) and hadamard")
        return scale(1 / _d(other), self)

    @property
    def T(self):
        return transpose(self)

    def latex(self, names=None) -> str:
        return latex(self, names)


def _fill(root, slot, compute):
    """Set ``slot`` (a cached property's slot) on ``root`` and every descendant lacking it,
    children first, with an explicit stack; ``compute(node)`` reads only its children's."""
    if None not in map(operator.attrgetter(slot), root.args):
        setattr(root, slot, compute(root))          # the usual case: children known
        return
    stack = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if getattr(node, slot, None) is not None:
            continue
        if ready:
            setattr(node, slot, compute(node))
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in node.args if getattr(a, slot, None) is None)


def _make_key(n):
    inner = ",".join(a._key for a in n.args)
    key = f"{type(n).__name__}[{_params_repr(n.params)}]({inner})"
    if len(key) > KEY_MAX:
        digest = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
        key = f"{key[:KEY_PREFIX]}#{digest}"
    return key


# ----------------------------------------------------------------------------- leaves
def _check_dim(name, d):
    """A declared dimension is a positive integer or a symbolic expression."""
    try:
        v = _d(d)
    except (sp.SympifyError, TypeError):
        v = None
    if v is None or not isinstance(v, sp.Expr) or (v.is_number and not (v.is_integer and v > 0)):
        raise ShapeError(f"{name}: dimension {d!r} must be a positive integer or a symbol "
                         f"(see symhess.expr.dims)")


class Var(Expr):
    """A named matrix: role is 'input', 'param', 'const', 'direction' or 'placeholder'."""

    __slots__ = ()

    def __init__(self, name, rows, cols, role="input", tex=None):
        for d in (rows, cols):
            _check_dim(name, d)
        super().__init__((), (name, _d(rows), _d(cols), role, tex), (rows, cols))

    @property
    def name(self):
        return self.params[0]

    @property
    def role(self):
        return self.params[3]

    @property
    def tex(self):
        return self.params[4]

    @property
    def free_vars(self):
        return frozenset((self,))


class Constant(Expr):
    """A leaf with a known value given by its parameters."""

    __slots__ = ()

    @property
    def free_vars(self):
        return frozenset()


class Zero(Constant):
    __slots__ = ()

    def __init__(self, rows, cols):
        super().__init__((), (_d(rows), _d(cols)), (rows, cols))


class Identity(Constant):
    __slots__ = ()

    def __init__(self, n):
        super().__init__((), (_d(n),), (n, n))


class Ones(Constant):
    __slots__ = ()

    def __init__(self, rows, cols):
        super().__init__((), (_d(rows), _d(cols)), (rows, cols))


class CausalMask(Constant):
    """The n×n lower-triangular 0/1 mask: M[i, j] = 1 if j ≤ i else 0."""

    __slots__ = ()

    def __init__(self, n):
        super().__init__((), (_d(n),), (n, n))


class Commutation(Constant):
    """K_{m,n}: K_{m,n} vec(A) = vec(Aᵀ) for A m×n; K[i*n + j, j*m + i] = 1."""

    __slots__ = ()

    def __init__(self, m, n):
        super().__init__((), (_d(m), _d(n)), (_d(m) * _d(n), _d(m) * _d(n)))


class DiagSelector(Constant):
    """E_n = (e_1⊗e_1, …, e_n⊗e_n) ∈ R^{n²×n}: vec_r(diag v) = E_n v."""

    __slots__ = ()

    def __init__(self, n):
        super().__init__((), (_d(n),), (_d(n) ** 2, n))


# ----------------------------------------------------------------------------- algebra
class MatMul(Expr):
    __slots__ = ()
    precedence = 50

    def __init__(self, *factors):
        for a, b in zip(factors, factors[1:]):
            if not same(a.cols, b.rows):
                raise ShapeError(f"matmul: {_fmt(a.shape)} @ {_fmt(b.shape)} do not conform "
                                 f"(in {a!r} @ {b!r})")
        super().__init__(factors, (), (factors[0].rows, factors[-1].cols))

    def rebuild(self, args):
        return matmul(*args)


class Add(Expr):
    __slots__ = ()
    precedence = 10

    def __init__(self, *terms):
        for t in terms[1:]:
            if not (same(t.rows, terms[0].rows) and same(t.cols, terms[0].cols)):
                raise ShapeError(f"add: shapes {_fmt(terms[0].shape)} and {_fmt(t.shape)} differ "
                                 f"(in {terms[0]!r} + {t!r})")
        super().__init__(terms, (), terms[0].shape)

    def rebuild(self, args):
        return add(*args)


class Scale(Expr):
    """coef · A with coef a sympy scalar (in the symbolic dimensions)."""

    __slots__ = ()
    precedence = 50

    def __init__(self, a, coef):
        super().__init__((a,), (_d(coef),), a.shape)

    @property
    def coef(self):
        return self.params[0]

    def rebuild(self, args):
        return scale(self.coef, args[0])


class Transpose(Expr):
    __slots__ = ()
    precedence = 90

    def __init__(self, a):
        super().__init__((a,), (), (a.cols, a.rows))

    def rebuild(self, args):
        return transpose(args[0])


class Kron(Expr):
    __slots__ = ()
    precedence = 40

    def __init__(self, *factors):
        r, c = sp.Integer(1), sp.Integer(1)
        for f in factors:
            r, c = r * f.rows, c * f.cols
        super().__init__(factors, (), (r, c))

    def rebuild(self, args):
        return kron(*args)


class Hadamard(Expr):
    __slots__ = ()
    precedence = 45

    def __init__(self, *factors):
        for f in factors[1:]:
            if not (same(f.rows, factors[0].rows) and same(f.cols, factors[0].cols)):
                raise ShapeError(f"hadamard: shapes {_fmt(factors[0].shape)} and "
                                 f"{_fmt(f.shape)} differ")
        super().__init__(factors, (), factors[0].shape)

    def rebuild(self, args):
        return hadamard(*args)


class Elementwise(Expr):
    """f(A) applied entrywise, f a ScalarFn."""

    __slots__ = ()

    def __init__(self, a, fn):
        super().__init__((a,), (fn,), a.shape)

    @property
    def fn(self) -> ScalarFn:
        return self.params[0]

    def rebuild(self, args):
        return elementwise(self.fn, args[0])


class SoftmaxRows(Expr):
    """Row-wise softmax; with ``causal`` entries j > i are masked (exactly 0); with a
    ``mask`` (a constant 0/1 matrix of T's shape, ``args[1]``) the entries where it is 0 are
    masked (exactly 0): a_ij = m_ij e^{t_ij} / Σ_k m_ik e^{t_ik}."""

    __slots__ = ()

    def __init__(self, t, causal=False, mask=None):
        if causal and not same(t.rows, t.cols):
            raise ShapeError(f"causal softmax needs a square input, got {_fmt(t.shape)}")
        if mask is not None and not (same(mask.rows, t.rows) and same(mask.cols, t.cols)):
            raise ShapeError(f"softmax mask {_fmt(mask.shape)} differs from its input {_fmt(t.shape)}")
        super().__init__((t,) if mask is None else (t, mask), (bool(causal),), t.shape)

    @property
    def causal(self):
        return self.params[0]

    @property
    def mask(self):
        """The 0/1 mask (a constant expression), or None."""
        return self.args[1] if len(self.args) > 1 else None

    def rebuild(self, args):
        return SoftmaxRows(args[0], self.causal, args[1] if len(args) > 1 else None)


class LogSoftmaxRows(Expr):
    __slots__ = ()

    def __init__(self, t):
        super().__init__((t,), (), t.shape)


class SoftmaxDiff(Expr):
    """First differential of A = softmax_rows(T) along E: A ∘ (E − rowsum(A∘E) 1ᵀ)."""

    __slots__ = ()

    def __init__(self, a, e):
        if not isinstance(a, SoftmaxRows):
            raise TypeError("SoftmaxDiff needs a softmax_rows node")
        if a.shape != e.shape:
            raise ShapeError(f"softmax differential: {_fmt(a.shape)} vs {_fmt(e.shape)}")
        super().__init__((a, e), (), a.shape)

    def rebuild(self, args):
        return softmax_diff(*args)


class SoftmaxDiff2(Expr):
    """Second differential d²A[E, F] of A = softmax_rows(T) (symmetric in E, F).

    Row i, with a = a_i, e' = e − (aᵀe), f' = f − (aᵀf):  a∘e'∘f' − a (aᵀ(e'∘f')).
    """

    __slots__ = ()

    def __init__(self, a, e, f):
        if not isinstance(a, SoftmaxRows):
            raise TypeError("SoftmaxDiff2 needs a softmax_rows node")
        super().__init__((a, e, f), (), a.shape)

    def rebuild(self, args):
        return softmax_diff2(*args)


class SoftmaxJac(Expr):
    """∂vec_r A/∂vec_r T = blockdiag_i(diag(a_i) − a_i a_iᵀ), an L²×L² operator."""

    __slots__ = ()

    def __init__(self, a):
        n = a.rows * a.cols
        super().__init__((a,), (), (n, n))


class SoftmaxHess(Expr):
    """The Jacobian of vec_r d²A[E, ·]: blockdiag_i(diag(a∘e') − (a∘e')aᵀ − a(a∘e')ᵀ)."""

    __slots__ = ()

    def __init__(self, a, e):
        n = a.rows * a.cols
        super().__init__((a, e), (), (n, n))


class Diag(Expr):
    """diag(v) for a column vector v."""

    __slots__ = ()

    def __init__(self, v):
        if not same(v.cols, 1):
            raise ShapeError(f"diag needs a column vector, got {_fmt(v.shape)}")
        super().__init__((v,), (), (v.rows, v.rows))

    def rebuild(self, args):
        return diag(args[0])


class DiagPart(Expr):
    """The diagonal of a square matrix as a column vector."""

    __slots__ = ()

    def __init__(self, a):
        if not same(a.rows, a.cols):
            raise ShapeError(f"diag_part needs a square matrix, got {_fmt(a.shape)}")
        super().__init__((a,), (), (a.rows, 1))

    def rebuild(self, args):
        return diag_part(args[0])


class VecR(Expr):
    """vec_r(A): the rows of A stacked into a column (C order)."""

    __slots__ = ()

    def __init__(self, a):
        super().__init__((a,), (), (a.rows * a.cols, 1))

    def rebuild(self, args):
        return vec_r(args[0])


class UnvecR(Expr):
    """The inverse of vec_r: a column of length m·n reshaped (C order) to m×n."""

    __slots__ = ()

    def __init__(self, v, rows, cols):
        super().__init__((v,), (_d(rows), _d(cols)), (rows, cols))

    def rebuild(self, args):
        return UnvecR(args[0], *self.params)


class KronContract(Expr):
    """The adjoint of D ↦ C ⊗ D (side='right') or D ↦ D ⊗ C (side='left') applied to G.

    side='right': out[i,j] = Σ_ab C[a,b] G[(a,i),(b,j)];  side='left': Σ_ab C[a,b] G[(i,a),(j,b)].
    """

    __slots__ = ()

    def __init__(self, g, c, side, rows, cols):
        super().__init__((g, c), (side, _d(rows), _d(cols)), (rows, cols))

    def rebuild(self, args):
        return KronContract(*args, *self.params)


class Named(Expr):
    """A named sub-expression: prints as its name, evaluates as ``args[0]``.

    ``frozen`` names are held constant by the differentiator (e.g. the output gradient
    in the functional Hessian).  ``args[1:]`` are shown inside the name's brackets.
    """

    __slots__ = ()

    def __init__(self, inner, name, tex, frozen=False, symmetric=False, shown=()):
        super().__init__((inner,) + tuple(shown), (name, tex, bool(frozen), bool(symmetric)),
                         inner.shape)

    @property
    def inner(self):
        return self.args[0]

    @property
    def name(self):
        return self.params[0]

    @property
    def tex(self):
        return self.params[1]

    @property
    def frozen(self):
        return self.params[2]

    @property
    def symmetric(self):
        return self.params[3]

    def rebuild(self, args):
        return Named(args[0], *self.params, shown=args[1:])


# ----------------------------------------------------------------------------- factories
def matrix(name, rows, cols, tex=None) -> Var:
    """An input matrix (data), e.g. X ∈ R^{L×d_V}."""
    return Var(name, rows, cols, "input", tex)


def param(name, rows, cols, tex=None) -> Var:
    """A parameter matrix; Hessian blocks are taken with respect to parameters."""
    return Var(name, rows, cols, "param", tex)


def const(name, rows, cols, tex=None) -> Var:
    """A constant matrix supplied at evaluation time (a mask, a fixed γ …)."""
    return Var(name, rows, cols, "const", tex)


def zero(rows, cols=None) -> Expr:
    return Zero(rows, rows if cols is None else cols)


def identity(n) -> Expr:
    return Identity(n)


def ones(rows, cols) -> Expr:
    if _d(rows) == 1 and _d(cols) == 1:
        return Identity(1)
    return Ones(rows, cols)


def causal_mask(n) -> Expr:
    """The causal mask M ∈ {0,1}^{n×n}, M[i, j] = [j ≤ i]; use as M ∘ T (e.g. linear attention)."""
    return Identity(1) if _d(n) == 1 else CausalMask(n)


def commutation(m, n) -> Expr:
    m, n = _d(m), _d(n)
    if m == 1 or n == 1:
        return Identity(m * n)
    return Commutation(m, n)


def diag_selector(n) -> Expr:
    return DiagSelector(n)


def _split(e):
    """(coef, core) with e = coef · core."""
    if isinstance(e, Scale):
        return e.coef, e.args[0]
    return ONE, e


ONE = sp.Integer(1)


def _times(a, b):
    """a·b for sympy scalars, without sympy's arithmetic when one of them is 1."""
    if b is ONE or b == 1:
        return a
    if a is ONE or a == 1:
        return b
    return a * b


def scale(coef, a) -> Expr:
    coef = _d(coef)
    if coef == 0 or isinstance(a, Zero):
        return Zero(*a.shape)
    c0, core = _split(a)
    coef = _times(coef, c0)
    if coef == 1:
        return core
    if isinstance(core, Add):  # canonical: scalars sit on the terms of a sum
        return Add(*(scale(coef, t) for t in core.args))
    return Scale(core, coef)


def _mixed(a, b):
    """Kronecker mixed-product rule (A⊗B)(C⊗D) = AC⊗BD when the factors conform."""
    if isinstance(a, Kron) and isinstance(b, Kron) and len(a.args) == len(b.args):
        if all(same(x.cols, y.rows) for x, y in zip(a.args, b.args)):
            return [kron(*(matmul(x, y) for x, y in zip(a.args, b.args)))]
    return None


def _commute(a, b):
    """Commutation algebra K_{m,n}K_{n,m} = I, and 1_{m×k}1_{k×n} = k·1_{m×n}."""
    if isinstance(a, Commutation) and isinstance(b, Commutation):
        if a.params[0] == b.params[1] and a.params[1] == b.params[0]:
            return []
    if isinstance(a, Ones) and isinstance(b, Ones):
        return [scale(a.cols, ones(a.rows, b.cols))]
    return None


def matmul(*factors) -> Expr:
    if not factors:
        raise TypeError("matmul needs at least one factor")
    _operands("matmul", factors)
    coef = sp.Integer(1)
    flat = []
    for f in factors:
        c, f = _split(f)
        coef = _times(coef, c)
        flat.extend(f.args if isinstance(f, MatMul) else (f,))
    for a, b in zip(flat, flat[1:]):
        if not same(a.cols, b.rows):
            raise ShapeError(f"matmul: {_fmt(a.shape)} @ {_fmt(b.shape)} do not conform "
                             f"(in {a!r} @ {b!r})")
    rows, cols = flat[0].rows, flat[-1].cols
    if any(isinstance(f, Zero) for f in flat):
        return Zero(rows, cols)
    out, todo = [], list(reversed(flat))
    while todo:
        f = todo.pop()
        c, f = _split(f)
        coef = _times(coef, c)
        if isinstance(f, Zero):
            return Zero(rows, cols)
        if isinstance(f, Identity):
            continue
        if isinstance(f, MatMul):
            todo.extend(reversed(f.args))
            continue
        if out:
            merged = _mixed(out[-1], f)
            if merged is None:
                merged = _commute(out[-1], f)
            if merged is not None:
                out.pop()
                todo.extend(reversed(merged))
                continue
        out.append(f)
    if not out:
        core = Identity(rows)
    elif len(out) == 1:
        core = out[0]
    else:
        core = MatMul(*out)
    return scale(coef, core)


def add(*terms) -> Expr:
    if not terms:
        raise TypeError("add needs at least one term")
    _operands("add", terms)
    flat = []
    for t in terms:
        flat.extend(t.args if isinstance(t, Add) else (t,))
    shape = flat[0].shape
    for t in flat[1:]:
        if not (same(t.rows, shape[0]) and same(t.cols, shape[1])):
            raise ShapeError(f"add: shapes {_fmt(shape)} and {_fmt(t.shape)} differ "
                             f"(in {flat[0]!r} + {t!r})")
    coefs = {}
    for t in flat:
        c, core = _split(t)
        if isinstance(core, Zero):
            continue
        coefs[core] = coefs.get(core, 0) + c
    items = [(core, c) for core, c in coefs.items() if sp.expand(c) != 0]
    if not items:
        return Zero(*shape)
    items.sort(key=lambda it: it[0].key)
    parts = [scale(c, core) for core, c in items]
    return parts[0] if len(parts) == 1 else Add(*parts)


def transpose(a) -> Expr:
    """Push transposes to the leaves: (AB)ᵀ = BᵀAᵀ, (A⊗B)ᵀ = Aᵀ⊗Bᵀ, K_{m,n}ᵀ = K_{n,m}.
    Memoised on the node: a derivation's expressions are DAGs whose shared subexpressions
    would otherwise be transposed once per path to them (exponential in depth)."""
    _operands("transpose", (a,))
    if a._t is None:
        a._t = _transpose(a)
    return a._t


def _transpose(a) -> Expr:
    if isinstance(a, Transpose):
        return a.args[0]
    if isinstance(a, (Zero, Ones)):
        return type(a)(a.cols, a.rows)
    if isinstance(a, (Identity, Diag, SoftmaxJac, SoftmaxHess)):
        return a
    if isinstance(a, Commutation):
        return Commutation(a.params[1], a.params[0])
    if isinstance(a, MatMul):
        return matmul(*(transpose(f) for f in reversed(a.args)))
    if isinstance(a, Add):
        return add(*(transpose(t) for t in a.args))
    if isinstance(a, Scale):
        return scale(a.coef, transpose(a.args[0]))
    if isinstance(a, Kron):
        return kron(*(transpose(f) for f in a.args))
    if isinstance(a, Hadamard):
        return hadamard(*(transpose(f) for f in a.args))
    if isinstance(a, Elementwise):
        return elementwise(a.fn, transpose(a.args[0]))
    if isinstance(a, Named) and a.symmetric:
        return a
    if isinstance(a, Var) and a.rows == 1 and a.cols == 1:
        return a
    return Transpose(a)


def kron(*factors) -> Expr:
    if not factors:
        raise TypeError("kron needs at least one factor")
    _operands("kron", factors)
    coef = sp.Integer(1)
    flat = []
    for f in factors:
        c, f = _split(f)
        coef = _times(coef, c)
        flat.extend(f.args if isinstance(f, Kron) else (f,))
    if any(isinstance(f, Zero) for f in flat):
        r, c = sp.Integer(1), sp.Integer(1)
        for f in flat:
            r, c = r * f.rows, c * f.cols
        return Zero(r, c)
    # merge neighbouring identities and drop 1×1 identities
    out = []
    for f in flat:
        if isinstance(f, Identity) and f.rows == 1:
            continue
        if out and isinstance(f, Identity) and isinstance(out[-1], Identity):
            out[-1] = Identity(out[-1].rows * f.rows)
        else:
            out.append(f)
    if not out:
        core = Identity(1)
    elif len(out) == 1:
        core = out[0]
    else:
        core = Kron(*out)
    return scale(coef, core)


def hadamard(*factors) -> Expr:
    if not factors:
        raise TypeError("hadamard needs at least one factor")
    _operands("hadamard", factors)
    coef = sp.Integer(1)
    flat = []
    for f in factors:
        c, f = _split(f)
        coef = _times(coef, c)
        flat.extend(f.args if isinstance(f, Hadamard) else (f,))
    shape = flat[0].shape
    for f in flat[1:]:
        if not (same(f.rows, shape[0]) and same(f.cols, shape[1])):
            raise ShapeError(f"hadamard: shapes {_fmt(shape)} and {_fmt(f.shape)} differ")
    if any(isinstance(f, Zero) for f in flat):
        return Zero(*shape)
    flat = [f for f in flat if not isinstance(f, Ones)]
    if not flat:
        return scale(coef, Ones(*shape))
    flat.sort(key=lambda f: f.key)
    core = flat[0] if len(flat) == 1 else Hadamard(*flat)
    return scale(coef, core)


def elementwise(fn, a) -> Expr:
    _operands("elementwise", (a,))
    fn = get_function(fn) if isinstance(fn, str) else fn
    if fn.is_zero:
        return Zero(*a.shape)
    if fn.constant is not None:
        return scale(fn.constant, Ones(*a.shape))
    if fn.is_identity:
        return a
    return Elementwise(a, fn)


def power(a, p) -> Expr:
    """Entrywise power A^{∘p}."""
    return elementwise(get_function("pow", p), a)


def softmax_rows(t, causal=False, mask=None) -> Expr:
    """Row softmax of T; ``mask``: a constant 0/1 matrix (entries where it is 0 are exactly 0)."""
    _operands("softmax_rows", (t,) if mask is None else (t, mask))
    if not isinstance(causal, bool):
        raise DeclarationError(f"softmax_rows: causal must be True or False, got {causal!r}")
    if mask is not None and mask.free_vars and any(v.role == "param" for v in mask.free_vars):
        raise DeclarationError("softmax_rows: the mask must be a constant (not a parameter)")
    return SoftmaxRows(t, causal, mask)


def log_softmax_rows(t) -> Expr:
    _operands("log_softmax_rows", (t,))
    return LogSoftmaxRows(t)


def softmax_diff(a, e) -> Expr:
    if isinstance(e, Zero):
        return e
    c, core = _split(e)
    return scale(c, SoftmaxDiff(a, core))


def softmax_diff2(a, e, f) -> Expr:
    if isinstance(e, Zero) or isinstance(f, Zero):
        return Zero(*a.shape)
    c1, e = _split(e)
    c2, f = _split(f)
    if f.key < e.key:
        e, f = f, e
    return scale(c1 * c2, SoftmaxDiff2(a, e, f))


def diag(v) -> Expr:
    _operands("diag", (v,))
    if isinstance(v, Zero):
        return Zero(v.rows, v.rows)
    c, core = _split(v)
    return scale(c, Diag(core))


def diag_part(a) -> Expr:
    _operands("diag_part", (a,))
    if isinstance(a, Zero):
        return Zero(a.rows, 1)
    c, core = _split(a)
    if isinstance(core, Diag):
        return scale(c, core.args[0])
    return scale(c, DiagPart(core))


def vec_r(a) -> Expr:
    _operands("vec_r", (a,))
    if isinstance(a, Zero):
        return Zero(a.rows * a.cols, 1)
    if same(a.cols, 1):
        return a
    c, core = _split(a)
    return scale(c, VecR(core))


def unvec_r(v, rows, cols) -> Expr:
    if isinstance(v, Zero):
        return Zero(rows, cols)
    if same(_d(cols), 1):
        return v
    c, core = _split(v)
    if isinstance(core, VecR) and core.args[0].shape == (_d(rows), _d(cols)):
        return scale(c, core.args[0])
    return scale(c, UnvecR(core, rows, cols))


def kron_contract(g, c, side, rows, cols) -> Expr:
    if isinstance(g, Zero) or isinstance(c, Zero):
        return Zero(rows, cols)
    k1, g = _split(g)
    k2, c = _split(c)
    return scale(k1 * k2, KronContract(g, c, side, rows, cols))


def named(inner, name, tex=None, frozen=False, symmetric=False, shown=()) -> Expr:
    """Give a sub-expression a name for printing (and, if frozen, for differentiation)."""
    _operands("named", (inner,))
    if isinstance(inner, Zero):
        return inner
    return Named(inner, name, tex or name, frozen, symmetric, tuple(shown))


def rowsum(a) -> Expr:
    """A 1 1ᵀ: every entry replaced by its row's sum (shape kept)."""
    _operands("rowsum", (a,))
    return matmul(a, Ones(a.cols, a.cols))


def sum_all(a) -> Expr:
    """1ᵀ A 1 as a 1×1 matrix."""
    _operands("sum_all", (a,))
    return matmul(Ones(1, a.rows), a, Ones(a.cols, 1))


def substitute(expr, mapping: dict, _memo=None):
    """Replace sub-expressions (usually variables) structurally (children first, no
    recursion: deep DAGs do not meet Python's recursion limit)."""
    memo = {} if _memo is None else _memo
    only_vars = all(isinstance(k, Var) for k in mapping)
    keys = mapping.keys()
    stack = [(expr, False)]
    while stack:
        node, ready = stack.pop()
        if node in memo:
            continue
        if node in mapping:
            memo[node] = mapping[node]
        elif not node.args or (only_vars and not (node.free_vars & keys)):
            memo[node] = node
        elif ready:
            memo[node] = node.rebuild(tuple(memo[a] for a in node.args))
        else:
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if a not in memo)
    return memo[expr]


def walk(expr, descend=None, children=None, skip=()):
    """Every distinct node of the DAG once, children before parents; ``descend(node)``
    False keeps a node's children out (unless another path reaches them), ``children(node)``
    (default: its args) names the children to visit; nodes in ``skip`` (and what lies below
    them only) are left out.

    Recursive rules over a DAG (a node's result from its children's, memoised) are run
    along this order first (``bottom_up``), so each call finds its children done and the
    recursion depth does not grow with the DAG's height."""
    def kids(node):
        if descend is not None and not descend(node):
            return ()
        return node.args if children is None else children(node)
    return children_first(expr, kids, skip)


def bottom_up(fn, expr, descend=None, children=None):
    """``fn(expr)`` for a memoised recursive ``fn``, called first on every node below
    (``walk`` order, children first) so that no call recurses more than one level deep:
    deep expressions do not depend on Python's recursion limit."""
    out = None
    for node in walk(expr, descend, children):
        out = fn(node)
    return out

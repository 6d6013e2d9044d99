"""The order of a matrix chain at the sizes of the call, with shared sub-products.

``order(shapes)`` brackets F₁F₂⋯F_k by dynamic programming over split points, the cost of a
product of an (m × k) by a (k × n) block being b·m·k·n, b the number of sequences when
either side carries the batch axis (the classical O(k³) matrix-chain recursion).

Sub-products are priced by what happens to them beyond this chain:

* ``free`` intervals (i, j) cost nothing: their product F_i⋯F_j is already at hand (formed by
  an earlier chain of the same prepared state), or it is kept across the calls of a prepared
  state, where it costs nothing per call;
* ``shared`` intervals (i, j, n) are used by n chains of the routine, so each pays 1/n of
  their cost (the first one to form it pays in fact, the others find it at hand).

Counting a shared product at 1/n makes every chain choose the bracketing that forms it: in
attention's Hessian–vector product, X W_V enters F = A X W_V, t W_Vᵀ Xᵀ and t′ X W_V; formed
once, it saves two products of size B L d² (the single-chain orders would tie).

Cost of planning: O(k³) per distinct (shapes, prices), cached.
"""
from __future__ import annotations

from functools import lru_cache

from . import cost


def transposed(tokens):
    """The names of (F₁⋯F_k)ᵀ = F_kᵀ⋯F₁ᵀ for the factor names of F₁⋯F_k ("X W_V" → "W_V' X'")."""
    return tuple(t[:-1] if t.endswith("'") else t + "'" for t in reversed(tokens))


@lru_cache(maxsize=4096)
def runs(key):
    """(number of factors, {(i, j): (name of F_i⋯F_j, whether it is the transpose of the
    named product)}) for a chain key: one name per factor, "_" for a factor without one
    (it depends on the routine's arguments and is no local of it), "@name" for a routine's
    local; the intervals are the runs of ≥ 2 named factors, each named in the orientation of
    ``canonical``."""
    toks = tuple(key.split())
    out = {}
    for i in range(len(toks)):
        for j in range(i + 1, len(toks)):
            if "_" in toks[i:j + 1]:
                break
            out[i, j] = canonical(toks[i:j + 1])
    return len(toks), out


def canonical(tokens):
    """(name, flipped): a product and its transpose get one name, the smaller of the two."""
    fwd, back = " ".join(tokens), " ".join(transposed(tokens))
    return (fwd, False) if fwd <= back else (back, True)


def order(shapes, free=(), shared=()):
    """A nested tuple of factor positions, ((0, 1), 2) = (F₀F₁)F₂.  ``shapes``: tuples (rows,
    cols) or (batch, rows, cols)."""
    splits = _solve(tuple(shapes), tuple(free), tuple(shared))[1]

    def tree(i, j):
        return i if i == j else (tree(i, splits[i, j]), tree(splits[i, j] + 1, j))
    return tree(0, len(shapes) - 1)


def chain_cost(shapes, free=(), shared=()):
    """The multiply-adds of forming the chain now in ``order``'s bracketing (a free interval
    costs nothing, a shared one its part)."""
    return _solve(tuple(shapes), tuple(free), tuple(shared))[0]


@lru_cache(maxsize=16384)
def _solve(shapes, free=(), shared=()):
    """(cost of the whole chain, {(i, j): split point}); sub-intervals priced as above."""
    k = len(shapes)
    dims = [s[-2] for s in shapes] + [shapes[-1][-1]]
    batch = [s[0] if len(s) == 3 else 1 for s in shapes]
    share = {(i, j): n for i, j, n in shared}
    free = set(free)
    real, price, split = {}, {}, {}
    for i in range(k):
        real[i, i] = price[i, i] = 0
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            b = max(batch[i:j + 1])
            best = None
            for s in range(i, j):
                c = price[i, s] + price[s + 1, j] + b * dims[i] * dims[s + 1] * dims[j + 1]
                if best is None or c < best:
                    best, split[i, j] = c, s
            real[i, j] = best
            price[i, j] = 0 if (i, j) in free else best / share.get((i, j), 1)
    whole = (0, k - 1)
    return (0 if whole in free else real[whole]), split


def multiply(xs, matmul, shape, free=(), shared=(), fetch=None, store=None, fold=None):
    """F₁⋯F_k in the order ``order`` chooses (``matmul`` multiplies two, ``shape`` reads one).
    ``fetch(i, j)`` returns the product of F_i⋯F_j when it is at hand (or None), ``store(i, j,
    P)`` is told of every product formed over a free or shared interval.  ``fold``: (pair,
    single) — the last product is ``pair(A, B)`` instead (the batch mean of A B), a chain
    that needs no product is ``single(F)``."""
    if fold is not None:
        pair, single = fold
        if cost._ACTIVE:
            def pair(a, b, inner=pair):
                cost.add_matmul(tuple(shape(a)), tuple(shape(b)))
                return inner(a, b)
    if len(xs) == 1:
        return xs[0] if fold is None else single(xs[0])
    if cost._ACTIVE and not getattr(matmul, "counted", False):   # count (runtime.cost)
        inner = matmul

        def matmul(a, b):
            cost.add_matmul(tuple(shape(a)), tuple(shape(b)))
            return inner(a, b)
        matmul.counted = True
    if len(xs) == 2 and (fetch is None or not (free or shared)):   # nothing to look up
        return matmul(xs[0], xs[1]) if fold is None else pair(xs[0], xs[1])
    splits = _solve(tuple(tuple(shape(x)) for x in xs), tuple(free), tuple(shared))[1]
    remembered = set(free) | {(i, j) for i, j, _ in shared}

    root = (0, len(xs) - 1)

    def run(i, j):
        if i == j:
            return xs[i]
        if fetch is not None and (i, j) in remembered:
            got = fetch(i, j)
            if got is not None:
                return got if fold is None or (i, j) != root else single(got)
        s = splits[i, j]
        if fold is not None and (i, j) == root:
            return pair(run(i, s), run(s + 1, j))
        out = matmul(run(i, s), run(s + 1, j))
        if store is not None and (i, j) in remembered:
            store(i, j, out)
        return out

    return run(0, len(xs) - 1)

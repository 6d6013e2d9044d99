"""The order of a matrix chain at the sizes of the call.

``order(shapes, fixed)`` brackets F₁F₂⋯F_k by dynamic programming over split points, the
cost of a product of an (m × k) by a (k × n) block being b·m·k·n, b the number of sequences
when either side carries the batch axis (the classical O(k³) matrix-chain recursion).
Factors marked ``fixed`` do not change between the calls of a prepared state (everything
but the directions of a Hessian–vector product): a product of consecutive fixed factors is
computed once and kept (``multiply``'s ``memo``), so the recursion counts it as free, which
is what makes a prepared state's products cheaper than a fresh forward-over-reverse pass.
Orders are cached by the shapes.
"""
from __future__ import annotations

from functools import lru_cache

from . import cost


def order(shapes, fixed=None):
    """A nested tuple of factor positions, ((0, 1), 2) = (F₀F₁)F₂; a kept product of fixed
    factors i … j appears as ("kept", i, j).  ``shapes``: tuples (rows, cols) or
    (batch, rows, cols); ``fixed``: a tuple of booleans, or None."""
    return _solve(tuple(shapes), fixed)[1]


def chain_cost(shapes, fixed=None):
    """The multiply-adds of the chain in ``order``'s bracketing (kept products free)."""
    return _solve(tuple(shapes), fixed)[0]


@lru_cache(maxsize=16384)
def _solve(shapes, fixed=None):
    k = len(shapes)
    if k == 1:
        return 0, 0
    fixed = fixed or (False,) * k
    dims = [s[-2] for s in shapes] + [shapes[-1][-1]]
    batch = [s[0] if len(s) == 3 else 1 for s in shapes]
    cost, split = {}, {}
    for i in range(k):
        cost[i, i] = 0
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            if all(fixed[i:j + 1]):
                cost[i, j], split[i, j] = 0, "kept"
                continue
            b = max(batch[i:j + 1])
            best = None
            for s in range(i, j):
                c = cost[i, s] + cost[s + 1, j] + b * dims[i] * dims[s + 1] * dims[j + 1]
                if best is None or c < best:
                    best, split[i, j] = c, s
            cost[i, j] = best

    def tree(i, j):
        if i == j:
            return i
        if split[i, j] == "kept":
            return ("kept", i, j)
        s = split[i, j]
        return (tree(i, s), tree(s + 1, j))

    return cost[0, k - 1], tree(0, k - 1)


def multiply(xs, matmul, shape, fixed=None, memo=None, key=None):
    """F₁⋯F_k in the order ``order`` chooses (``matmul`` multiplies two, ``shape`` reads one).
    With ``fixed`` (booleans) and ``memo`` (a dict), products of consecutive fixed factors are
    kept in ``memo`` under (key, i, j) and reused by later calls."""
    if len(xs) == 1:
        return xs[0]
    if cost._ACTIVE and not getattr(matmul, "counted", False):   # count (runtime.cost)
        inner = matmul

        def matmul(a, b):
            cost.add_matmul(tuple(shape(a)), tuple(shape(b)))
            return inner(a, b)
        matmul.counted = True
    if fixed is None and len(xs) == 2:
        return matmul(xs[0], xs[1])
    t = order(tuple(tuple(shape(x)) for x in xs), tuple(fixed) if fixed else None)

    def run(node):
        if isinstance(node, int):
            return xs[node]
        if node[0] == "kept":
            _, i, j = node
            k = (key, i, j)
            if memo is None:
                return multiply(xs[i:j + 1], matmul, shape)
            if k not in memo:
                memo[k] = multiply(xs[i:j + 1], matmul, shape)
            return memo[k]
        return matmul(run(node[0]), run(node[1]))

    return run(t)

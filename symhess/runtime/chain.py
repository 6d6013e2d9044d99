"""The order of a matrix chain at the sizes of the call.

``order(shapes)`` brackets F₁F₂⋯F_k by dynamic programming over split points, the cost of a
product of an (m × k) by a (k × n) block being b·m·k·n, b the number of sequences when
either side carries the batch axis (the classical O(k³) matrix-chain recursion).  Cached
by the shapes, so a routine called again at the same sizes decides nothing.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=16384)
def order(shapes):
    """A nested tuple of factor positions: ((0, 1), 2) = (F₀F₁)F₂.  ``shapes`` are tuples,
    (rows, cols) or (batch, rows, cols)."""
    k = len(shapes)
    if k == 1:
        return 0
    dims = [s[-2] for s in shapes] + [shapes[-1][-1]]
    batch = [s[0] if len(s) == 3 else 1 for s in shapes]
    cost, split, bat = {}, {}, {}
    for i in range(k):
        cost[i, i], bat[i, i] = 0, batch[i]
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            best = None
            for s in range(i, j):
                b = max(bat[i, s], bat[s + 1, j])
                c = cost[i, s] + cost[s + 1, j] + b * dims[i] * dims[s + 1] * dims[j + 1]
                if best is None or c < best:
                    best, split[i, j] = c, s
            cost[i, j], bat[i, j] = best, max(batch[i:j + 1])

    def tree(i, j):
        if i == j:
            return i
        s = split[i, j]
        return (tree(i, s), tree(s + 1, j))

    return tree(0, k - 1)


def multiply(xs, matmul, shape):
    """F₁⋯F_k in the order ``order`` chooses (``matmul`` multiplies two, ``shape`` reads one)."""
    if len(xs) == 1:
        return xs[0]
    if len(xs) == 2:
        return matmul(xs[0], xs[1])
    t = order(tuple(tuple(shape(x)) for x in xs))

    def run(node):
        if isinstance(node, int):
            return xs[node]
        return matmul(run(node[0]), run(node[1]))

    return run(t)

"""The work a routine does, as planned: flops of its contractions and matrix products and
the largest intermediate (entries).

    with counting() as c:
        state.diag("W_Q")
    c.flops, c.largest

Contractions report their plan (``contract.Plan``: opt_einsum's flop count, about 2·Π sizes
per pairwise product); matrix chains report 2·b·m·k·n per product of a (b, m, k) and a
(b, k, n) operand.  Elementwise work (softmax, entrywise functions) is not counted.  Nothing
is counted outside a ``counting`` block.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

_ACTIVE: list = []


@dataclass(eq=False)          # counters nest: each is removed as itself, not an equal one
class Count:
    flops: int = 0
    largest: int = 0


@contextmanager
def counting():
    c = Count()
    _ACTIVE.append(c)
    try:
        yield c
    finally:
        _ACTIVE.remove(c)


def add(flops, largest=0):
    for c in _ACTIVE:
        c.flops += int(flops)
        c.largest = max(c.largest, int(largest))


def add_matmul(sa, sb):
    """Count one (batched) matrix product of operands of shapes ``sa`` and ``sb``."""
    if not _ACTIVE:
        return
    batch = math.prod(max(x, y) for x, y in zip(sa[:-2][::-1], sb[:-2][::-1])) * \
        math.prod(sa[:-2][:max(0, len(sa) - len(sb))]) * math.prod(sb[:-2][:max(0, len(sb) - len(sa))])
    m, k, n = (sa[-2] if len(sa) > 1 else 1), sa[-1], (sb[-1] if len(sb) > 1 else 1)
    add(2 * batch * m * k * n, batch * m * n)

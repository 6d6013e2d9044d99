"""Sums in a routine rewritten so that its kernel forms fewer products and passes.

The matrix view differentiates each parameter's gradient on its own, so one quantity can
reach the printer in two spellings: (S) F with S = Σ_t c_t A_t a sum of its own, and the
distributed Σ_t c_t A_t F inside another sum.  Hash-consing shares only equal spellings,
so a kernel would form the product twice (post-LN's Hessian–vector product: the MLP's
backward tangent (d g) W_2ᵀ, a B L d d_ff product, once for W_1's output and once for the
attention parameters').

``factor_shared(exprs)`` rewrites, in every sum of the expressions, each group of ≥ 2
product terms with the same last factor F (first factor, on the left)

    Σ_{t∈group} c_t A_t F  →  S F        when S = Σ_t c_t A_t and S F (or (S F)ᵀ) are
                                         both nodes of the expressions already,

so the printer's sharing finds one node.  Only products that are computed anyway are
introduced: no rewrite adds a product or a sum that was not there.

It also collects, in every sum, the entrywise products that share their factors that
depend on the routine's arguments (the directions V):

    Σ_t c_t D ∘ I_t  →  D ∘ (Σ_t c_t I_t)      D the ∘-product of the V-dependent factors,

so the bracket, which does not depend on V, is a leaf (computed once per prepared state)
and each call makes one pass over D instead of one per term and factor (SwiGLU's
Hessian–vector product: the derivatives of silu(u) = u σ(u) spelled out as products of
σ(u), 1 − σ(u) and u, ≈ 30 passes over B L d_ff entries per call → 6).

Terminates: each rewrite replaces ≥ 2 terms of a sum by one, so the number of terms over
all sums of the DAG decreases with every pass that changes anything, and the loop stops at
the first pass without a change.
"""
from __future__ import annotations

from ..expr import nodes as E


def factor_shared(exprs):
    """The expressions with every sum's spelled-out existing products folded (see the
    module docstring); the same list when nothing applies."""
    exprs = list(exprs)
    while True:
        nodes = set()
        for e in exprs:
            nodes.update(E.walk(e))
        memo = {}
        for e in exprs:
            for node in E.walk(e):
                if node in memo:
                    continue
                args = tuple(memo.get(a, a) for a in node.args)
                new = node.rebuild(args) if args != node.args else node
                if isinstance(new, E.Add):
                    new = _folded(new, nodes)
                if isinstance(new, E.Add):
                    new = _collected(new)
                memo[node] = new
        out = [memo.get(e, e) for e in exprs]
        if all(a is b or a == b for a, b in zip(out, exprs)):
            return exprs
        exprs = out


def _folded(n, nodes):
    """The sum ``n`` with its groups of terms that spell an existing product S F replaced."""
    terms = list(n.args)
    for at in (-1, 0):
        groups = {}
        for i, t in enumerate(terms):
            core = E._split(t)[1]
            if isinstance(core, E.MatMul):
                groups.setdefault(core.args[at], []).append(i)
        for f, members in groups.items():
            if len(members) < 2:
                continue
            rest = []
            for i in members:
                c, core = E._split(terms[i])
                rest.append(E.scale(c, E.matmul(*(core.args[:-1] if at == -1 else core.args[1:]))))
            s = E.add(*rest)
            p = E.matmul(s, f) if at == -1 else E.matmul(f, s)
            core = E._split(p)[1]
            if E._split(s)[1] not in nodes or (core not in nodes and E.transpose(core) not in nodes):
                continue
            out = E.add(*(t for i, t in enumerate(terms) if i not in members), p)
            return _folded(out, nodes) if isinstance(out, E.Add) else out
    return n


def _dependent(node):
    return any(v.role == "direction" for v in node.free_vars)


def _collected(n):
    """The sum ``n`` with its entrywise products grouped by their V-dependent factors."""
    groups, others = {}, []
    for t in n.args:
        c, core = E._split(t)
        if isinstance(core, E.Hadamard):
            dep = [f for f in core.args if _dependent(f)]
            ind = [f for f in core.args if not _dependent(f)]
            if dep and ind:
                groups.setdefault(E.hadamard(*dep), []).append(E.scale(c, E.hadamard(*ind)))
                continue
        others.append(t)
    if all(len(g) < 2 for g in groups.values()):
        return n
    terms = list(others)
    for d, ind in groups.items():
        terms.append(E.hadamard(d, E.add(*ind)))
    out = E.add(*terms)
    return out

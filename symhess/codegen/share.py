"""Products of leaves that several compact tensors' terms hold, as compact tensors of their own.

A full block's per-token compacts apply the MLP's per-token Jacobian J_t = W_1 diag(σ′_t) W_2
to other compacts: post-LN's are (I + J) S, (I + Jᵀ) S′ and (I + J) S″, each term holding the
three leaves W_1, σ′(H), W_2 summed over the hidden atom.  Contracted term by term, every
one of them forms the product anew (2 B L d² d_ff flops for J S, twice that when the planner
applies W_2 and W_1 to S one after the other).  Named once, J is a compact of its own: the
runtime materialises it where that plans fewer flops (``network.resolve``: B L d² d_ff once,
then B L d³ per use) and inlines it otherwise, which gives back the terms as they were.

``share(prog)`` rewrites the terms of ``prog.compacts``: in each term, a *component* is a
set of at least two leaf operands joined through atoms that no other operand and no output
carries (atoms summed inside the component; at least one).  Two components are the same
product when their leaves, sorted by expression, carry the same atom pattern (atoms named by
first appearance); their *external* atoms (carried elsewhere in the term) become the axes of
one shared compact, in the order the first holder's output lists them.  Components of repeated
leaves (X and X) are left alone: their order, hence the pattern, is ambiguous.  Only products
with no more axes than their holder's output are shared (never an outer product blown up).

Terminates: one pass over the terms; each rewrite removes ≥ 2 operands from a term and adds
one, and the new compacts' terms hold leaves only (nothing left to share).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ..runtime.network import components


class SharedProduct:
    """The key of a compact that is a product of leaves (``Program.compacts``)."""

    name = "A product shared by several compacts"

    def __init__(self, index):
        self.index = index

    def __repr__(self):
        return f"<shared product {self.index}>"


def share(prog):
    """Rewrite ``prog``'s compact terms so that each product of leaves held by two or more
    of them is one compact (module docstring)."""
    found = {}                     # pattern → [(holder, term index, leaf positions, names, externals)]
    for node in list(prog.compact_order):
        for i, t in enumerate(prog.compacts[node]):
            for comp, names, ext, key in _components(t):
                found.setdefault(key, []).append((node, i, comp, names, ext))
    made = 0
    for users in found.values():
        if len(users) < 2:
            continue
        node, i, comp, names, ext = users[0]
        axes = [names[a] for a in ext]          # the first holder's order, as pattern names
        first = prog.compacts[node][i]
        shared = SharedProduct(made)
        made += 1
        prog.compacts[shared] = [replace(first, coef=1, operands=[first.operands[k] for k in comp],
                                         groups=[list(ext)])]
        prog.compact_order.insert(prog.compact_order.index(node), shared)
        for holder, j, comp_j, names_j, _ in users:
            atom = {c: a for a, c in names_j.items()}
            t = prog.compacts[holder][j]
            rest = [op for k, op in enumerate(t.operands) if k not in comp_j]
            rest.append(replace(t.operands[comp_j[0]], kind="compact", ref=shared,
                                rows=tuple(atom[c] for c in axes), cols=(1,) * len(axes)))
            prog.compacts[holder][j] = replace(t, operands=rest)
    return made


def _components(t):
    """(leaf positions, {atom: pattern name}, external atoms, pattern) of each shareable
    component of term t, the external atoms in the order of t's output (the first holder's
    order becomes the shared compact's axes)."""
    count = Counter(a for op in t.operands for a in op.rows + (op.cols if op.kind == "leaf" else ()))
    out_atoms = [a for g in t.groups for a in g]
    leaf = [k for k, op in enumerate(t.operands) if op.kind == "leaf"]
    atoms = {k: t.operands[k].rows + t.operands[k].cols for k in leaf}
    in_leaves = Counter(a for k in leaf for a in atoms[k])
    internal = {a for a, n in in_leaves.items() if n == count[a] and a not in out_atoms}
    result = []
    for group in components([atoms[k] for k in leaf], internal.__contains__):
        comp = [leaf[j] for j in group]
        refs = [t.operands[k].ref for k in comp]
        if len(comp) < 2 or len(set(refs)) < len(refs):
            continue
        comp = sorted(comp, key=lambda k: t.operands[k].ref.key)
        names, pattern = {}, []
        for k in comp:
            op = t.operands[k]
            pattern.append((op.ref.key, len(op.rows),
                            tuple(names.setdefault(a, len(names)) for a in atoms[k])))
        ext = [a for a in names if a not in internal]
        if not any(a in internal for a in names) or len(ext) > len(out_atoms):
            continue
        ext.sort(key=lambda a: (out_atoms.index(a) if a in out_atoms else len(out_atoms), names[a]))
        result.append((comp, names, ext, (tuple(pattern), frozenset(names[a] for a in ext))))
    return result

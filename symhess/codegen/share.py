"""Products that several compact tensors' or blocks' terms hold, as compact tensors of their own.

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

The blocks' and Jacobians' terms hold products of compacts too: the outer blocks of W_Q and
W_K in a full block both carry, per query token, the chain of LayerNorm and MLP Jacobians
applied to the value path and to the output's second moments (S S_2 ⋯ S_11 W_Vᵀ M_2: six
B L d³ products).  ``share`` names such a *chain* once when two or more of those terms hold
it: a component as above whose operands are compacts and parameter leaves that carry no
output atom (data leaves such as X stay out: they carry the sums over tokens), with at least
one compact; the runtime again materialises it or inlines it, whichever plans fewer flops.

Before any of this, a compact whose terms are another's with its axes permuted is replaced by
that one, its holders' atoms permuted (``_twins``): the modern block lowers the SwiGLU's
per-token Jacobian S (d × d_ff) and Sᵀ, and the RMSNorm's N and Nᵀ, as separate compacts, so
N S W_2 and W_2ᵀ Sᵀ Nᵀ would not be seen as one product read transposed, nor formed once.
Two terms match when their coefficients, operands and atom patterns agree with the axes
renamed by the permutation (an identity's second axis read as its first, ones and
identities symmetric); a term with two operands that sort alike is never matched.

A shared product can also sit inside a larger component of a term that ``_components``
does not name.  The modern block's residual around the MLP puts (I + J)ᵀ(I + J) between
attention and the loss: its J and Jᵀ terms share the product P = N S W_2 (N the RMSNorm's
per-token Jacobian, S the SwiGLU's, d × d_ff), while its JᵀJ term holds the chain
N S W_2 W_2ᵀ Sᵀ Nᵀ whole (W_2 twice: a component of repeated leaves, left alone above).
``_sub_products`` replaces every occurrence of a shared product's operands in a block's,
Jacobian's or compact's term (the same operands, their atoms mapped one to one, its summed
atoms carried by nothing else in the term) by that compact, larger products first: JᵀJ then
contracts P with itself (B L d³) instead of the chain with two d × d_ff factors per token
(≈ 5 B L d² d_ff where d_ff = 4d), and the compact (I + P)(I + Pᵀ) of the attention weights'
outer blocks multiplies the shared P by its second factor.  No compact uses itself, only
products of two or more operands are used, and the compacts are reordered so that each
follows those it holds; rewriting keeps them acyclic, since a term that holds a product's
operands already depends on everything the product does.

Terminates: one pass over the compacts for twins (each removed once); one pass over the
compacts' terms and one over the blocks' and Jacobians'; each
rewrite removes ≥ 2 operands from a term and adds one, and the new compacts' terms are not
visited again; the sub-product passes repeat only after a rewrite, and each rewrite
lowers the number of operands over all terms (a product of two or more becomes one).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

from ..runtime.network import components


class SharedProduct:
    """The key of a compact that is a product several terms hold (``Program.compacts``)."""

    name = "A product several terms share"

    def __init__(self, index):
        self.index = index

    @property
    def key(self):
        return f"<shared product {self.index}>"

    def __repr__(self):
        return f"<shared product {self.index}>"


def _atoms(op):
    """The atoms an operand carries: a leaf's rows and columns, a compact's axes."""
    return op.rows + (op.cols if op.kind == "leaf" else ())


def share(prog):
    """Rewrite the terms of ``prog``'s compacts so that each product of leaves held by two or
    more of them is one compact, then those of its blocks and Jacobians so that each chain of
    compacts held by two or more of them is one, then every term that holds a shared
    product's operands inside a larger product so that it holds the product (module
    docstring); returns how many products were made."""
    _twins(prog)
    holders = [prog.compacts[node] for node in prog.compact_order]
    found = _found(holders, lambda t: _components(t))
    made = 0
    for users in found.values():
        if len(users) >= 2:
            node = next(n for n in prog.compact_order if prog.compacts[n] is holders[users[0][0]])
            shared = _rewrite(prog, holders, users, made)
            prog.compact_order.insert(prog.compact_order.index(node), shared)
            made += 1
    d = prog.derivation
    data = {v for v in d.layer.variables.values() if v.role == "input"} | {d.Y}
    holders = list(prog.blocks.values()) + list(prog.jacobians.values())
    for users in _found(holders, lambda t: _chains(t, data)).values():
        if len(users) >= 2:
            prog.compact_order.append(_rewrite(prog, holders, users, made))   # after its operands
            made += 1
    _named_inside(prog, holders)
    prog.compact_order = _dependencies_first(prog)
    return made


def _twins(prog):
    """Replace every compact whose terms equal an earlier compact's with its axes permuted by
    that compact (its holders' operands read it with their atoms permuted) and drop it."""
    seen = {}
    terms_of = list(prog.blocks.values()) + list(prog.jacobians.values()) + \
        [prog.compacts[n] for n in prog.compact_order]
    for node in list(prog.compact_order):
        terms = prog.compacts[node]
        k = len(terms[0].groups[0])
        holders = [op for ts in terms_of for t in ts for op in t.operands
                   if op.kind == "compact" and op.ref == node]
        twin = None
        if all(set(op.cols) <= {1} for op in holders):
            for perm in itertools.permutations(range(k)):
                twin = seen.get(_signature(terms, perm, prog.sizes))
                if twin is not None:
                    break
        if twin is None:
            own = _signature(terms, tuple(range(k)), prog.sizes)
            if own is not None:
                seen.setdefault(own, node)
            continue
        other, axis = twin, {p: i for i, p in enumerate(perm)}   # node's axis p is other's i
        for ts in terms_of:
            for j, t in enumerate(ts):
                if any(op.kind == "compact" and op.ref == node for op in t.operands):
                    ts[j] = replace(t, operands=[_read_as(op, other, axis) if op.kind == "compact"
                                                 and op.ref == node else op for op in t.operands])
        prog.compact_order.remove(node)
        del prog.compacts[node]


def _read_as(op, other, axis):
    """The operand ``op`` of a twin read from ``other``: other's axis axis[i] is op's i-th."""
    rows = [None] * len(op.rows)
    for i, a in enumerate(op.rows):
        rows[axis[i]] = a
    return replace(op, ref=other, rows=tuple(rows))


def _signature(terms, perm, sizes):
    """The terms of a compact with its axes taken in the order ``perm`` (axis perm[i] named
    i), each term's operands sorted and its other atoms named by first appearance; None
    when a term holds two operands that sort alike (their order, hence the names, would be
    ambiguous)."""
    out = []
    for t in terms:
        axes = t.groups[0]
        name = {axes[p]: ("axis", i) for i, p in enumerate(perm)}
        same = {}                       # an identity's axes: the others read the first one
        for op in t.operands:
            if op.kind == "eye" and all(a in name for a in op.rows):
                low, high = sorted(op.rows, key=name.get)
                same[high] = same.get(low, low)

        def atoms(op):                  # ones and identities are symmetric in their atoms
            a = _atoms(op)
            if op.kind in ("ones", "eye"):
                return tuple(sorted(a, key=lambda x: (name.get(x, ("sum",)), str(sizes[x]))))
            return tuple(same.get(x, x) for x in a)

        def key(op):
            return (op.kind, str(getattr(op.ref, "key", op.ref)), len(op.rows),
                    tuple(op.cols) if op.kind != "leaf" else (),
                    tuple((name.get(a, ("sum",)), str(sizes[a])) for a in atoms(op)))
        ops = sorted(t.operands, key=key)
        if len({key(op) for op in ops}) < len(ops):
            return None
        inner = {}
        sig = tuple(key(op)[:4] + (tuple((name.get(a) or ("sum", inner.setdefault(a, len(inner))),
                                          str(sizes[a])) for a in atoms(op)),) for op in ops)
        out.append((str(t.coef), tuple(str(sizes[axes[p]]) for p in perm), sig))
    return tuple(sorted(out))


def _dependencies_first(prog):
    """``prog.compact_order`` reordered so that every compact follows those its terms hold
    (the sub-product pass may make a compact hold a shared product listed after it)."""
    order, done = [], set()

    def visit(node):
        if node not in done:
            done.add(node)
            for t in prog.compacts[node]:
                for op in t.operands:
                    if op.kind == "compact":
                        visit(op.ref)
            order.append(node)
    for node in prog.compact_order:
        visit(node)
    return order


def _named_inside(prog, holders):
    """Rewrite the compacts' terms and ``holders`` (the blocks' and Jacobians' term lists)
    with the shared products (``_sub_products``) until no term holds one's operands: a
    shared product's definition rewritten with a smaller one changes what it matches, so
    passes repeat while one rewrites a term.  A compact never uses itself, and a product
    used has at least two operands (so every rewrite removes one)."""
    lists = [(node, prog.compacts[node]) for node in prog.compact_order] + [(None, ts) for ts in holders]
    changed = True
    while changed:
        changed = False
        for node, terms in lists:
            shared = [n for n in prog.compact_order if isinstance(n, SharedProduct)
                      and n is not node and len(prog.compacts[n][0].operands) >= 2]
            shared.sort(key=lambda n: -len(prog.compacts[n][0].operands))
            for i, t in enumerate(terms):
                terms[i] = _sub_products(t, [(n, prog.compacts[n][0]) for n in shared])
                changed |= terms[i] is not t


def _sub_products(t, shared):
    """Term t with every occurrence of a shared product's operands (``shared``: [(key,
    defining term)], tried in order) replaced by that compact (module docstring)."""
    while True:
        for key, d in shared:
            found = _occurrence(t, d)
            if found is not None:
                picked, image = found
                rest = [op for k, op in enumerate(t.operands) if k not in picked]
                axes = tuple(image[a] for a in d.groups[0])
                rest.append(replace(t.operands[min(picked)], kind="compact", ref=key, rows=axes,
                                    cols=(1,) * len(axes)))
                t = replace(t, operands=rest)
                break
        else:
            return t


def _occurrence(t, d):
    """(positions of t's operands, {d's atom: t's atom}) of one occurrence in term t of the
    product that term d defines, or None: d's operands matched one to one with t's operands of
    the same kind, expression and row count, their atoms mapped one to one, and every atom d
    sums over carried by no other operand of t nor by t's output."""
    def same(a, b):
        return (a.kind == b.kind and a.ref.key == b.ref.key and len(a.rows) == len(b.rows)
                and (a.kind == "leaf" or set(a.cols) <= {1}))
    count = Counter(a for op in t.operands for a in _atoms(op))
    out = {a for g in t.groups for a in g}
    summed = {a for op in d.operands for a in _atoms(op)} - set(d.groups[0])
    options = [[k for k, op in enumerate(t.operands) if same(op, p)] for p in d.operands]
    for picked in itertools.product(*options):
        if len(set(picked)) < len(picked):
            continue
        image = {}
        if not all(image.setdefault(a, b) == b
                   for p, k in zip(d.operands, picked) for a, b in zip(_atoms(p), _atoms(t.operands[k]))):
            continue
        if len(set(image.values())) < len(image):
            continue
        inside = Counter(b for k in picked for b in _atoms(t.operands[k]))
        if all(image[a] not in out and inside[image[a]] == count[image[a]] for a in summed):
            return set(picked), image
    return None


def _found(holders, parts):
    """pattern → [(holder index, term index, operands, {atom: name}, external atoms)] of the
    parts (``_components``) of every term of ``holders`` (lists of terms)."""
    found = {}
    for h, terms in enumerate(holders):
        for i, t in enumerate(terms):
            for comp, names, ext, key in parts(t):
                found.setdefault(key, []).append((h, i, [t.operands[k] for k in comp], names, ext))
    return found


def _rewrite(prog, holders, users, index):
    """The compact of the product ``users`` share (formed as the first holds it), each user's
    operands of it replaced by the compact; returns its key."""
    h, i, ops, names, ext = users[0]
    axes = [names[a] for a in ext]              # the first holder's order, as pattern names
    shared = SharedProduct(index)
    prog.compacts[shared] = [replace(holders[h][i], coef=1, operands=list(ops), groups=[list(ext)])]
    for h, j, ops_j, names_j, _ in users:
        atom = {c: a for a, c in names_j.items()}
        t = holders[h][j]
        rest = [op for op in t.operands if not any(op is x for x in ops_j)]
        rest.append(replace(ops_j[0], kind="compact", ref=shared,
                            rows=tuple(atom[c] for c in axes), cols=(1,) * len(axes)))
        holders[h][j] = replace(t, operands=rest)
    return shared


def _chains(t, data):
    """The chains of a block's or Jacobian's term t: components (``_components``) of its
    compacts and of its parameter leaves that carry no output atom, holding a compact."""
    out = {a for g in t.groups for a in g}

    def link(op):
        if op.kind == "compact":
            return set(op.cols) == {1}
        return (op.kind == "leaf" and not (op.ref.free_vars & data)
                and not out.intersection(op.rows + op.cols))
    return [c for c in _components(t, link) if any(t.operands[k].kind == "compact" for k in c[0])]


def _components(t, link=lambda op: op.kind == "leaf"):
    """(positions, {atom: pattern name}, external atoms, pattern) of each shareable component
    of term t's operands that ``link`` admits (default: its leaves), the external atoms in
    the order of t's output (the first holder's order becomes the shared compact's axes)."""
    count = Counter(a for op in t.operands for a in _atoms(op))
    out_atoms = [a for g in t.groups for a in g]
    leaf = [k for k, op in enumerate(t.operands) if link(op)]
    atoms = {k: _atoms(t.operands[k]) for k in leaf}
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
            pattern.append((op.kind, op.ref.key, len(op.rows),
                            tuple(names.setdefault(a, len(names)) for a in atoms[k])))
        ext = [a for a in names if a not in internal]
        if not any(a in internal for a in names) or len(ext) > len(out_atoms):
            continue
        ext.sort(key=lambda a: (out_atoms.index(a) if a in out_atoms else len(out_atoms), names[a]))
        result.append((comp, names, ext, (tuple(pattern), frozenset(names[a] for a in ext))))
    return result

"""Compact tensors too large to keep, formed and used one slice of sequences or tokens at a time.

A per-token compact of a full block (LayerNorm's Jacobian composed with the MLP's, d × d per
token) has B L d² entries: 1.1 GB at L = d = 256, B = 8, past the schedule's
``compact_limit``.  ``resolve`` would then inline its networks into every network that uses
it, multiplying the networks and forming the MLP's per-token product in each.

A reduction sums its networks over every label it does not output, and a sum splits over any
partition of a summed label's range:

    Σ_x N(x) = Σ_chunks Σ_{x ∈ chunk} N(x).

``dense(state, nets, groups)`` (the diagonal, a block) therefore evaluates the networks that
hold an oversized compact chunk by chunk: the labels of the compacts' batch axis (and, when a
single sequence still does not fit, their token axis) are narrowed to a slice in every
operand that carries them, a compact to the compact of its networks narrowed the same way
(nested compacts too), so that each compact is formed only for the slice, once per slice for
all the networks of the reduction (``cache``), and released before the next.  Chunks are as
large as ``compact_limit`` allows.  Networks without such a compact, and those whose
compacts plan less time inlined than formed (``network.inlining_pays``), are evaluated as
they are.

Several sums evaluated together (``dense_each``: the diagonals of all parameters of a block)
share the slices: each compact's slice is formed once for every network of every sum that
holds it, and released (``Compact.release``) as soon as no network left in the slice can
read it (a compact whose slice is formed no longer needs the compacts it was formed from).

While the pass runs, each compact's ``users`` counts the networks of the pass (and of the
compacts they hold) that hold it (``_priced_once``): a compact formed for one of them is read
by the others, so each weighs a share of its formation when choosing to form or inline it
(``network._keep``); priced whole by each holder, a product that several networks share (the
modern block's N S W_2, held by the outer blocks of every attention weight) was inlined into
each of them.

Cost: the flops of forming each compact once (as when it fits) plus each network's per-chunk
contraction; memory: a slice of each compact alive in the slice (≤ ``compact_limit`` entries
each) and the contractions' intermediates (≤ the schedule's ``limit``).
"""
from __future__ import annotations

import itertools
from collections import Counter
from contextlib import contextmanager

from . import network as N


def dense(state, nets, groups=(0, 1)):
    """``network.dense`` with oversized compacts evaluated in slices (module docstring)."""
    return dense_each(state, {None: nets}, groups)[None] if nets else None


def dense_each(state, sums, groups=(0, 1)):
    """{key: ``dense(state, nets, groups)``} for the sums ``sums`` ({key: nets}) in one pass:
    each slice of a compact that several of them hold is formed once for all (the diagonals
    of a block's parameters share the per-token compacts of the layers above them)."""
    sums = {k: list(nets) for k, nets in sums.items() if nets}
    accs = {k: (None, N.layout(nets, groups)) for k, nets in sums.items()}
    with _priced_once([n for nets in sums.values() for n in nets]):
        for key, n in chunked(state, sums, groups):
            acc, (shape, flat) = accs[key]
            accs[key] = (N.add_term(state, n, groups, acc, shape), (shape, flat))
    return {k: state.ops.reshape(acc, flat) for k, (acc, (_, flat)) in accs.items()}


@contextmanager
def _priced_once(nets):
    """Every compact that ``nets`` hold (nested ones too) with ``users`` raised to the number
    of those networks and compact networks that hold it, restored on exit."""
    holders, compacts, todo = Counter(), {}, list(nets)
    while todo:
        held = {id(op): op for op in todo.pop().ops if isinstance(op, N.Compact)}
        holders.update(held.keys())
        for i, c in held.items():
            if i not in compacts:
                compacts[i] = c
                todo.extend(c.nets)
    before = {i: c.users for i, c in compacts.items()}
    for i, c in compacts.items():
        c.users = max(c.users, holders[i])
    try:
        yield
    finally:
        for i, c in compacts.items():
            c.users = before[i]


def chunked(state, sums, groups):
    """(key, network) for the networks of ``sums`` ({key: nets}) with every oversized
    compact's batch (and token) axis cut into slices: the networks without one first, as they
    are, then slice after slice; a slice's compacts are released once no network left in the
    slice can read them."""
    limit = state.schedule.compact_limit
    plans, plain = [], []
    for key, n in ((k, n) for k, nets in sums.items() for n in nets):
        cut = _cut_labels(state, n, groups, limit)
        if cut is not None and N.inlining_pays(state, n, groups, cut[0]):
            cut = None
        (plain if cut is None else plans).append((key, n, cut))
    for key, n, _ in plain:
        yield key, n
    if not plans:
        return
    # networks that hold the same compacts one after another: a slice's compacts are released
    # after their last holder, so fewer of them are alive at once
    plans.sort(key=lambda p: sorted(c.name for c in p[2][0]))
    big = [c for _, _, (cs, _) in plans for c in cs]
    s0, s1 = big[0].shape[0], big[0].shape[1]
    per_seq = max(c.entries // s0 for c in big)
    step0 = max(1, limit // per_seq)
    step1 = s1 if per_seq <= limit else max(1, limit // max(c.entries // (s0 * s1) for c in big))
    for b in range(0, s0, step0):
        rb = (b, min(step0, s0 - b))
        for t in range(0, s1, step1):
            rt = (t, min(step1, s1 - t))
            cache = {}
            for i, (key, n, (_, (batch, tokens))) in enumerate(plans):
                if step1 == s1 or not tokens:
                    cuts = [{batch: rb}]
                else:                                   # the first token label in this slice,
                    first, *rest = tokens               # every other one over its whole range
                    ranges = [[(u, min(step1, s1 - u)) for u in range(0, s1, step1)] for _ in rest]
                    cuts = [{batch: rb, first: rt, **dict(zip(rest, combo))}
                            for combo in itertools.product(*ranges)]
                for cut in cuts:
                    yield key, narrowed(state, n, cut, cache)
                needed = _needed([m for _, m, _ in plans[i + 1:]], cache)
                for k in [k for k in cache if k[0] not in needed]:
                    cache.pop(k).release()
            del cache


def _needed(nets, cache):
    """The compacts (by id) that evaluating ``nets`` may still read: those they hold, and
    those held by the networks of a compact whose slice is not formed yet (``cache``)."""
    formed = {k[0] for k, c in cache.items() if c.materialised}
    seen, todo = set(), [op for n in nets for op in n.ops if isinstance(op, N.Compact)]
    while todo:
        c = todo.pop()
        if id(c) not in seen:
            seen.add(id(c))
            if id(c) not in formed:
                todo.extend(op for m in c.nets for op in m.ops if isinstance(op, N.Compact))
    return seen


def _cut_labels(state, n, groups, limit):
    """(oversized compacts, (batch label, token labels)) of a network, or None when it holds
    none or they cannot be cut (their axes not all summed, of other sizes, or not sharing
    one batch label)."""
    big = [(op, ls) for op, ls in zip(n.ops, n.labels)
           if isinstance(op, N.Compact) and not op.materialised and op.entries > limit]
    if not big:
        return None
    out = {x for g in groups for x in n.groups[g]}
    shape = big[0][0].shape
    batch = {ls[0] for _, ls in big}
    if len(batch) != 1 or any(len(c.shape) < 3 or tuple(c.shape[:2]) != tuple(shape[:2])
                              for c, _ in big):
        return None
    tokens = list(dict.fromkeys(ls[1] for _, ls in big))
    if (batch | set(tokens)) & out or any(ls.count(ls[0]) > 1 or ls[1] in ls[2:] for _, ls in big):
        return None
    return [c for c, _ in big], (batch.pop(), tokens)


def narrowed(state, n, cuts, cache):
    """``n`` with each label of ``cuts`` ({label: (start, size)}) restricted to that range in
    every operand carrying it (compacts: their networks narrowed, shared through ``cache``)."""
    ops, labels = [], []
    for op, ls in zip(n.ops, n.labels):
        axes = {ax: cuts[x] for ax, x in enumerate(ls) if x in cuts}
        if axes:
            op = _compact(state, op, axes, cache) if isinstance(op, N.Compact) else _array(state, op, axes)
        ops.append(op)
        labels.append(ls)
    sizes = {x: (cuts[x][1] if x in cuts else s) for x, s in n.sizes.items()}
    return N.Net(n.coef, ops, labels, n.groups, sizes)


def _array(state, a, axes):
    for ax, (start, size) in axes.items():
        a = state.ops.narrow(a, ax, start, size)
    return a


def _compact(state, c, axes, cache):
    """The compact ``c`` restricted to ``axes`` ({axis: (start, size)}): a compact of its
    networks narrowed (once per slice, ``cache``), holding its array narrowed when it is
    materialised (``resolve`` may still inline it where that is cheaper)."""
    key = (id(c), tuple(sorted(axes.items())))
    if key not in cache:
        nets = []
        for m in c.nets:
            cut = {}
            for ax, r in axes.items():
                x = m.groups[0][ax]
                if cut.get(x, r) != r:
                    raise RuntimeError(f"compact {c.name}: one label cut at two ranges")
                cut[x] = r
            nets.append(narrowed(state, m, cut, cache))
        cache[key] = N.Compact(c.name, nets, c.users)
        if c.materialised:
            cache[key].hold(_array(state, c.array(state), axes))
    return cache[key]


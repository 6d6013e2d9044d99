"""Networks that agree but for a sub-network, summed as one network over a compact of the rest.

A full block's Hessian reaches the loss through the residual and the MLP, so the networks
of one block come in families that differ only in a *middle*: for the modern block's
H_o(W_K, W_K) the per-token factor (I + J)ᵀ(I + J) of the MLP's Jacobian J is spread over
four networks per pair of heads (I, J, Jᵀ and JᵀJ between the same two halves).  Read
backwards, distributivity sums them first:

    Σ_t c_t · P · D_t = P · (Σ_t c_t D_t),

with P the operands the networks share (the same arrays over the same labels, up to a
renaming) and D_t the rest of network t, contracted to the labels it shares with P (its
*interface*).  The sum K = Σ_t c_t D_t is a ``Compact`` over the union of the interfaces,
so it is materialised, inlined or formed slice by slice (``runtime.chunk``) like any other.

A network whose shared part carries one label where another's carries two (the identity
between the halves, I in (I + J)ᵀ(I + J)) is the other's with those labels identified: its
D is the identity over them (a compact network whose output repeats the label).

Matching: each network is aligned with a family's first network (a pairing of their equal
operands, the same arrays, under which the labels of the paired operands and of the outputs
map consistently; many labels of the first onto one of the other: an identity).  Networks
are tried richest first (most operands), so that a family's first network has the most
labels.  A family is kept only where K is no larger than an operand its networks already
hold (``_bounded``) and contracting P with K, plus forming K once for all the families whose
K is the same tensor (the middles of every pair of heads), plans less time
(``contract.Plan.cost``) than the networks as they are; otherwise they stay as they were.

Families of fewer than ``MIN_FAMILY`` networks are left alone: a pair saves one network
at most, and its compact is formed by memory-bound steps.  In ``nn.MultiheadAttention`` at
L = d = 128, B = 4, collecting pairs ran the diagonals 0.7 → 2.3 s (peak +0.3 → +1.1 GB)
while plans counted flops alone (labels one operand carries counted over the whole product,
outer products at a tenth of their time); with plans that count both (``runtime.contract``:
``_private``, ``MOVE_COST``) the pairs are declined by the comparison and the diagonals take
0.35 s either way.

Cost: the alignment is a search of at most ``SEARCH`` steps per pair of networks, the
comparison one plan per network; the reduction then contracts one network per family.
"""
from __future__ import annotations

import math

from . import network as N


def collected(state, nets, groups):
    """``nets`` (reduced over the output ``groups``) with every family of networks that agree
    but for a sub-network replaced by one network over a compact of their sums (module
    docstring).  The result reduces to the same sum; ``nets`` as they are when the schedule
    says not to collect (``Schedule.collect``)."""
    if not state.schedule.collect or len(nets) < MIN_FAMILY:
        return list(nets)
    order = sorted(range(len(nets)), key=lambda i: -len(nets[i].ops))
    families = []                      # [reference, [(member, alignment or None), ...]]
    for n in (nets[i] for i in order):
        if not _joined(families, n):
            families.append([n, [(n, None)]])
    shared = {}                        # families whose compacts are the same tensor
    out = []
    for ref, members in families:
        merged = _merged(ref, members) if len(members) >= MIN_FAMILY else None
        if merged is None:
            out.extend(m for m, _ in members)
        else:
            shared.setdefault(_key(merged.ops[-1]), []).append((merged, [m for m, _ in members]))
    for fams in shared.values():
        k = fams[0][0].ops[-1]
        k.users = len(fams)
        nets_k = [N.Net(m.coef, m.ops[:-1] + [k], m.labels, m.groups, m.sizes) for m, _ in fams]
        originals = [n for _, ms in fams for n in ms]
        with_k = sum(N._cost(state, m, groups) for m in nets_k) + k.cost(state)
        out.extend(originals if N._cheaper(state, originals, groups, with_k) else nets_k)
    return out


MIN_FAMILY = 3      # fewest networks collected: a pair saves one network at most (above)


def _key(k):
    """The compact's networks with their labels renamed canonically (first appearance, the
    output group first), in a canonical order: equal keys, equal tensors."""
    out = []
    for n in k.nets:
        canon = {}
        for x in list(n.groups[0]) + [x for ls in n.labels for x in ls]:
            canon.setdefault(x, len(canon))
        out.append((n.coef, tuple((id(op), tuple(canon[x] for x in ls)) for op, ls in zip(n.ops, n.labels)),
                    tuple((canon[x], n.sizes[x]) for x in n.groups[0])))
    return tuple(sorted(out))


def _joined(families, n):
    """Add ``n`` to the family it aligns with best (``_aligned``'s score) among those whose
    shared operands it all aligns with, else among those whose shared operands carrying
    outputs it aligns with (the others then move into the compact), as long as the compact
    stays ``_bounded``; whether it was added."""
    matches = [(fam, _aligned(fam[0], n)) for fam in families]
    matches = sorted((fm for fm in matches if fm[1] is not None), key=lambda fm: fm[1][2], reverse=True)
    for strict in (True, False):
        for fam, match in matches:
            if strict and not set(_shared(fam[1])) <= {i for i, _ in match[0]}:
                continue
            if not strict and not _keeps_outputs(fam[0], fam[1], match):
                continue
            if _bounded(_merged(fam[0], fam[1] + [(n, match)]), fam[1], n):
                fam[1].append((n, match))
                return True
    return False


def _shared(members):
    """The positions of the reference's operands that every member is aligned with (none for
    a family of the reference alone)."""
    out = None
    for _, m in members[1:]:
        got = {i for i, _ in m[0]}
        out = got if out is None else out & got
    return sorted(out or ())


def _keeps_outputs(ref, members, match):
    """Whether a new member aligns with every shared operand that carries an output label (a
    member that shares less may move other operands into the compact, not the outputs': the
    heads of a block meet in the loss through their own output projections)."""
    outs = {x for g in ref.groups for x in g}
    carriers = {i for i in _shared(members) if outs & set(ref.labels[i])}
    return carriers <= {i for i, _ in match[0]}


def _bounded(merged, members, n):
    """Whether the family's compact K is no larger than an operand its networks already hold
    (the middles of (I + J)ᵀ(I + J) are; the sum of two attention heads' halves is not)."""
    if merged is None:
        return False
    ops = [op for m, _ in members for op in m.ops] + list(n.ops)
    return merged.ops[-1].entries <= max(math.prod(op.shape) for op in ops)


def _aligned(ref, n):
    """(aligned operand pairs, label map ref → n) when ``n`` is ``ref``'s shared part (up to
    a renaming that may identify labels of ``ref``) times a sub-network of its own; else None.

    A search over the pairings of equal operands (the same array, the same number of axes)
    whose labels map consistently, outputs onto outputs: most operands paired first, then
    fewest labels identified, then fewest pairs out of order (a network written in the same
    order as the reference rather than mirrored); at most ``SEARCH`` steps (the best pairing
    found by then).  The pairing's score is returned third."""
    if len(ref.groups) != len(n.groups) or any(len(g) != len(h) for g, h in zip(ref.groups, n.groups)):
        return None
    f0 = {}
    for g, h in zip(ref.groups, n.groups):
        for x, y in zip(g, h):
            if f0.setdefault(x, y) != y or ref.sizes[x] != n.sizes[y]:
                return None
    if len(set(f0.values())) != len(f0):
        return None                    # the outputs themselves must not be identified
    cands = [[j for j in range(len(n.ops))
              if n.ops[j] is ref.ops[i] and len(n.labels[j]) == len(ref.labels[i])]
             for i in range(len(ref.ops))]
    left = [sum(1 for c in cands[i:] if c) for i in range(len(cands))] + [0]
    best, steps = [(-1, 0, 0), None], [0]

    def extend(f, i, j):
        g = dict(f)
        for x, y in zip(ref.labels[i], n.labels[j]):
            if g.setdefault(x, y) != y or ref.sizes[x] != n.sizes[y]:
                return None
        return g

    def search(i, f, pairs, used):
        steps[0] += 1
        if i == len(ref.ops):
            js = [j for _, j in pairs]
            inversions = sum(1 for a, b in zip(js, js[1:]) if b < a)
            score = (len(pairs), -(len(f) - len(set(f.values()))), -inversions)
            if score > best[0]:
                best[0], best[1] = score, (list(pairs), f, score)
            return
        if len(pairs) + left[i] < best[0][0] or steps[0] > SEARCH:
            return
        for j in cands[i]:
            if j not in used:
                g = extend(f, i, j)
                if g is not None:
                    pairs.append((i, j))
                    search(i + 1, g, pairs, used | {j})
                    pairs.pop()
        search(i + 1, f, pairs, used)

    search(0, f0, [], frozenset())
    found = best[1]
    if found is None or not found[0] or len(found[0]) == len(ref.ops) == len(n.ops):
        return None
    return found


SEARCH = 20000      # most steps of one alignment search


def _merged(ref, members):
    """The network P · K of a family (K: a Compact over the interface labels, in ref's
    labels), or None when the family shares no operand."""
    shared = _shared(members)
    if not shared:
        return None
    shared_labels = {x for i in shared for x in ref.labels[i]} | {x for g in ref.groups for x in g}
    parts, interface = [], set()
    for n, m in members:
        if m is None:                  # the reference itself
            own, f = [i for i in range(len(ref.ops)) if i not in shared], {x: x for x in shared_labels}
        else:
            pairs, f = m[:2]
            mine = {j for i, j in pairs if i in shared}
            own, f = [j for j in range(len(n.ops)) if j not in mine], {x: f[x] for x in shared_labels}
        inv = {}
        for x in sorted(shared_labels):
            inv.setdefault(f[x], []).append(x)
        carried = {y for j in own for y in n.labels[j]}
        # the shared labels this member's part carries, and those it identifies with others
        interface |= {x for x in shared_labels if f[x] in carried or len(inv[f[x]]) > 1}
        parts.append((n, own, f, inv))
    if not interface:
        return None
    iface = _ordered(ref, shared, interface)
    top = max(n.top for n, _ in members)
    core = []
    for n, own, f, inv in parts:
        ren = {}
        for y in dict.fromkeys(y for j in own for y in n.labels[j]):
            ren[y] = inv[y][0] if y in inv else top + len(ren)
        labels = [tuple(ren[y] for y in n.labels[j]) for j in own]
        group = tuple(inv[f[x]][0] for x in iface)
        sizes = {ren[y]: n.sizes[y] for y in ren}
        sizes.update({x: ref.sizes[x] for x in group})
        core.append(N.Net(n.coef, [n.ops[j] for j in own], labels, (group,), sizes))
    k = N.Compact("collected", core)
    ops = [ref.ops[i] for i in shared] + [k]
    labels = [ref.labels[i] for i in shared] + [tuple(iface)]
    present = {x for ls in labels for x in ls} | {x for g in ref.groups for x in g}
    return N.Net(1.0, ops, labels, ref.groups, {x: ref.sizes[x] for x in present})


def _ordered(ref, shared, interface):
    """The interface labels in order of first appearance in the shared part (its operands
    lead with their batch and token axes, the axes ``runtime.chunk`` slices a compact by)."""
    first = {}
    for i in shared:
        for x in ref.labels[i]:
            first.setdefault(x, len(first))
    return sorted(interface, key=lambda x: (first.get(x, len(first)), x))

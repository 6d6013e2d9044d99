"""Frobenius pairings in token form: token Gram matrices, half of them for a norm.

A network a (over output groups rows | columns) is in *token form* over its token labels τ
(internal labels, e.g. the sequence n and the query token c) when removing τ from it splits
its operands into components, each carrying every token label, whose output labels O_k
partition the output atoms:

    a = c_a Σ_τ Π_k F_k[τ, O_k]        (F_k: the component contracted to τ and O_k).

Two networks in token form over the same partition pair as

    ⟨a, b⟩ = c_a c_b Σ_{τ, τ′} Π_k Γ_k[τ, τ′],    Γ_k = F_k G_kᵀ  (a Gram matrix over O_k),

at the factors' formation plus T_a T_b Σ_k |O_k| multiply-adds (T: the tokens); ⟨a, a⟩ is
symmetric in (τ, τ′), so only the Gram tiles on and above the diagonal are formed (those
above counted twice): half.  For attention's H_o(W_K, W_K), F = (q, C_iᵀC_i, q) and the
pairing is Σ_{i,i′} (q_i·q_i′)² ⟨C_iᵀC_i, C_i′ᵀC_i′⟩.

Networks whose factors agree but for one (the same arrays over the same labels) add up:
Σ_τ Π_{j≠k} F_j (c F_k + c′ F′_k) (``merged``), so a block's outer and functional networks
over one skeleton pair as one network (‖H_o + H_f‖² directly, no cross term) and the four
networks of an inlined C_iᵀC_i form one factor.

Networks over different partitions are first joined to their common (coarser) partition
(``common``: the components sharing atoms multiplied into one), where that pairs no dearer.

Factors are formed in tiles along the first token label (a contraction of the component
with its operands narrowed), kept while they fit ``STORE`` times the schedule's
intermediate limit (a factor met again, in another pairing of the block, is not formed
again; ‖H_o + H_f‖'s factor starts from H_o's kept sum), and Gram tiles too (the
(q_i·q_i′) of one block's pairings are formed once).  ``Norms`` prices each pairing in
token form (``cost``) against the contraction planner's order for the paired networks and
keeps the cheaper; either way the result is exact (the same sum, another order).

Cost of ⟨a, a⟩ in token form: the factors' formation (the components' planned contractions,
at attention's sizes B L d³ for C_iᵀC_i) plus (B L)² Σ_k |O_k| flops (half of the Gram
tiles, two flops each); of ⟨a, b⟩ twice the Gram term.  Memory: one tile's factors (a
quarter of the intermediate limit) plus the kept factors and Grams (``STORE`` limits).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict

from . import contract as C
from . import cost as cost_
from . import network as N

STORE = 4          # factors and Gram tiles kept: at most this many intermediate limits
MAX_TOKEN = 3      # most token labels tried


class Form:
    """c · Σ_τ Π_k F_k: ``parts`` (one per component, ordered by its output atoms) each a
    list of (coefficient, network over (τ…, O_k…)) whose sum is F_k; ``okeys`` the output
    atoms of each part as (group, position); ``atoms`` the atom sizes per group."""

    __slots__ = ("coef", "tsizes", "okeys", "parts", "atoms", "keys", "form_flops")

    def __init__(self, coef, tsizes, okeys, parts, atoms, form_flops):
        self.coef, self.tsizes, self.okeys, self.parts = coef, tuple(tsizes), tuple(okeys), parts
        self.atoms, self.form_flops = atoms, form_flops
        self.keys = tuple(tuple(_key(m) + (c,) for c, m in p) for p in parts)

    @property
    def tokens(self):
        return math.prod(self.tsizes)

    def width(self, k):
        m = self.parts[k][0][1]
        return math.prod(m.sizes[x] for x in m.groups[0][len(self.tsizes):])


def _key(m):
    """The network up to label names: its operands (by identity) over canonical labels."""
    canon = {x: ("o", i) for i, x in enumerate(m.groups[0])}
    for ls in m.labels:
        for x in ls:
            canon.setdefault(x, ("i", len(canon), m.sizes[x]))
    return (tuple((id(op), tuple(canon[x] for x in ls)) for op, ls in zip(m.ops, m.labels)),
            tuple(m.sizes[x] for x in m.groups[0]))


def token_form(state, n):
    """The cheapest token form of a resolved network (arrays only), or None."""
    if len(n.groups) != 2 or any(not hasattr(op, "shape") for op in n.ops):
        return None
    out = [x for g in n.groups for x in g]
    carried = [x for ls in n.labels for x in ls]
    if len(set(out)) < len(out) or not set(out) <= set(carried) or \
            any(len(set(ls)) < len(ls) for ls in n.labels):
        return None
    coef = n.coef * N.free_factor(n, out)
    where = {x: (g, i) for g, grp in enumerate(n.groups) for i, x in enumerate(grp)}
    shared = sorted(x for x in set(carried) if x not in where and carried.count(x) > 1)
    best = None
    for r in range(1, MAX_TOKEN + 1):
        for tau in itertools.combinations(shared, r):
            comps = _components(n, set(tau))
            if comps is None:
                continue
            parts, okeys, flops = [], [], 0
            for ops in comps:
                own = [x for x in out if any(x in n.labels[i] for i in ops)]
                m = N.Net(1.0, [n.ops[i] for i in ops], [n.labels[i] for i in ops],
                          (tuple(tau) + tuple(own),), {x: n.sizes[x] for i in ops for x in n.labels[i]})
                flops += N._cost(state, m, (0,))
                parts.append([(1.0, m)])
                okeys.append(tuple(where[x] for x in own))
            tokens = math.prod(n.sizes[x] for x in tau)
            gram = 2 * tokens * tokens * sum(math.prod(n.sizes[x] for x in m.groups[0][r:])
                                             for [(_, m)] in parts)
            if best is None or flops + gram < best[0]:
                order = sorted(range(len(parts)), key=lambda k: okeys[k])
                best = (flops + gram, Form(coef, [n.sizes[x] for x in tau], [okeys[k] for k in order],
                                           [parts[k] for k in order],
                                           tuple(tuple(n.sizes[x] for x in g) for g in n.groups), flops))
    return None if best is None else best[1]


def _components(n, tau):
    """Operand positions per component of ``n`` without the labels ``tau`` (None unless there
    are at least two and each carries every token label)."""
    comps = N.components(n.labels, lambda x: x not in tau)
    if len(comps) < 2:
        return None
    for ops in comps:
        if not tau <= set(x for i in ops for x in n.labels[i]):
            return None
    return comps


def common(a, b):
    """a and b over the finest partition of the output atoms coarser than both (their
    components that share atoms joined, ``coarsened``), or None."""
    if a is None or b is None or a.atoms != b.atoms:
        return None
    if a.okeys == b.okeys:
        return a, b
    blocks = [set(k) for k in a.okeys + b.okeys if k]
    merged_ = True
    while merged_:
        merged_ = False
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                if blocks[i] & blocks[j]:
                    blocks[i] |= blocks.pop(j)
                    merged_ = True
                    break
            if merged_:
                break
    return coarsened(a, blocks), coarsened(b, blocks)


def coarsened(f, blocks):
    """``f`` with the components whose atoms fall in one block joined into one (the product of
    their networks: a sum of products where a component is a sum)."""
    groups = sorted(([k for k, o in enumerate(f.okeys) if o and set(o) <= b] for b in blocks),
                    key=lambda ks: sorted(x for k in ks for x in f.okeys[k]))
    groups[0] += [k for k, o in enumerate(f.okeys) if not o]      # per-token weights
    if all(len(ks) == 1 for ks in groups):
        return f
    okeys, parts = [], []
    r = len(f.tsizes)
    for ks in groups:
        order = sorted(((x, k, i) for k in ks for i, x in enumerate(f.okeys[k])))
        okeys.append(tuple(x for x, _, _ in order))
        combos = []
        for choice in itertools.product(*(f.parts[k] for k in ks)):
            c, nets, top = 1.0, {}, 0
            ops, labels, sizes, tau = [], [], {}, None
            for k, (ck, m) in zip(ks, choice):
                m = m.shifted(top)
                top = m.top
                if tau is None:
                    tau = m.groups[0][:r]
                else:
                    m = m.renamed(dict(zip(m.groups[0][:r], tau)))
                c *= ck
                nets[k] = m
                ops += m.ops
                labels += m.labels
                sizes.update(m.sizes)
            outs = tuple(nets[k].groups[0][r + i] for _, k, i in order)
            combos.append((c, N.Net(1.0, ops, labels, (tuple(tau) + outs,), sizes)))
        parts.append(combos)
    return Form(f.coef, f.tsizes, okeys, parts, f.atoms, f.form_flops)


def merged(forms):
    """Forms that agree in every factor but one combined (that factor summed, over their
    common partition of the output atoms); others kept."""
    out = []
    for f in forms:
        for i, g in enumerate(out):
            both = common(f, g) if f.tsizes == g.tsizes else None
            if both is None:
                continue
            fc, gc = both
            diff = [k for k in range(len(fc.parts)) if fc.keys[k] != gc.keys[k]]
            if len(diff) <= 1:
                k = diff[0] if diff else 0
                parts = list(gc.parts)
                parts[k] = [(c * gc.coef, m) for c, m in gc.parts[k]] + \
                    [(c * fc.coef, m) for c, m in fc.parts[k]]
                out[i] = Form(1.0, gc.tsizes, gc.okeys, parts, gc.atoms, gc.form_flops + fc.form_flops)
                break
        else:
            out.append(f)
    return out


def cost(a, b):
    """Planned flops of ⟨a, b⟩ in token form (the factors formed once each)."""
    same = a is b
    gram = 2 * a.tokens * b.tokens * sum(a.width(k) for k in range(len(a.parts)))
    return a.form_flops + (0 if same else b.form_flops) + (gram // 2 if same else gram)


class Pairer:
    """⟨a, b⟩ of forms, sharing formed factor and Gram tiles between the pairings of a block."""

    def __init__(self, state, step=None):
        self.state, self.step = state, step
        self.store = OrderedDict()
        self.held = 0
        self.cap = STORE * state.schedule.limit
        self.pairs = 0            # pairings computed in token form

    def pair(self, a, b):
        st, ops = self.state, self.state.ops
        same = a is b
        self.pairs += 1
        ta, tb = self._tiles(a), self._tiles(b)
        total = ops.scalar(0.0, st.like)
        for i, ti in enumerate(ta):
            for j, tj in enumerate(tb):
                if same and j < i:
                    continue
                prod = None
                for k in range(len(a.parts)):
                    g = self._gram(a, k, ti, b, k, tj)
                    prod = g if prod is None else prod * g
                s = ops.sum(prod, (0, 1))
                total = total + (2 * s if same and j > i else s)
        return a.coef * b.coef * total

    def _tiles(self, f):
        """(start, count) chunks of the first token label: a tile's factors within a quarter
        of the intermediate limit."""
        first, rest = f.tsizes[0], math.prod(f.tsizes[1:])
        per = rest * sum(f.width(k) for k in range(len(f.parts)))
        step = self.step or max(1, min(first, self.state.schedule.limit // (4 * max(per, 1))))
        return [(s, min(step, first - s)) for s in range(0, first, step)]

    def _gram(self, a, k, ti, b, kb, tj):
        key = ("g", a.keys[k], ti, b.keys[kb], tj)
        got = self._get(key)
        if got is None:
            fa, fb = self._factor(a, k, ti), self._factor(b, kb, tj)
            ops = self.state.ops
            fb = ops.tr(fb)
            cost_.add_matmul(ops.shape(fa), ops.shape(fb))
            got = ops.matmul2(fa, fb)
            self._put(key, got)
        return got

    def _factor(self, f, k, tile):
        """F_k over the tile's tokens as a (tokens × |O_k|) matrix (a kept sum of its first
        networks, formed for another pairing, is taken up: ‖H_o + H_f‖ adds H_f's terms to
        H_o's factor)."""
        key = ("f", f.keys[k], tile)
        got = self._get(key)
        if got is not None:
            return got
        st, ops = self.state, self.state.ops
        start, count = tile
        acc, done = None, 0
        for i in range(len(f.keys[k]) - 1, 0, -1):       # a sum begun in another pairing
            acc = self._get(("f", f.keys[k][:i], tile))
            if acc is not None:
                done = i
                break
        for c, m in f.parts[k][done:]:
            lab = m.groups[0][0]
            arrays = [_narrow(ops, op, ls, lab, start, count) for op, ls in zip(m.ops, m.labels)]
            sizes = dict(m.sizes)
            sizes[lab] = count
            r = C.contract(ops, arrays, m.labels, m.groups[0], st.schedule.limit, sizes)
            r = ops.reshape(r, (count * math.prod(f.tsizes[1:]), -1))
            acc = c * r if acc is None else acc + c * r
        self._put(key, acc)
        return acc

    def _get(self, key):
        got = self.store.get(key)
        if got is not None:
            self.store.move_to_end(key)
        return got

    def _put(self, key, a):
        size = math.prod(self.state.ops.shape(a))
        if size > self.cap:
            return
        while self.held + size > self.cap and self.store:
            _, old = self.store.popitem(last=False)
            self.held -= math.prod(self.state.ops.shape(old))
        self.store[key] = a
        self.held += size


def _narrow(ops, a, ls, lab, start, n):
    for axis, x in enumerate(ls):
        if x == lab:
            a = ops.narrow(a, axis, start, n)
    return a


# ----------------------------------------------------------------------------- norms
class _Item:
    """Networks summed, with their token form when they have one (merged networks share it)."""

    __slots__ = ("nets", "form")

    def __init__(self, nets, form):
        self.nets, self.form = list(nets), form


def items(state, nets):
    """The networks of a sum (resolved for pairing, ``network.resolve``) as items: those in
    token form merged by their factors (``merged``), the others by their skeletons
    (``network.merged``), which may give them a token form over the merged core."""
    formed, rest = [], []
    for n in nets:
        for m in N.resolve(state, n, (0, 1), paired=True):
            f = token_form(state, m)
            if f is None:
                rest.append(m)
            else:
                formed.append(_Item([m], f))
    plain = []
    for m in N.merged(state, rest):
        f = token_form(state, m)
        (plain if f is None else formed).append(_Item([m], f))
    out = []
    for it in formed:
        _join_into(out, it, len(out))
    return out + plain


def _join_into(its, it, among):
    """``it`` joined into the first of ``its[:among]`` it merges with (``_joined``), else
    appended; items without a token form join nothing."""
    for k, other in enumerate(its[:among]):
        m = _joined(other, it) if other.form is not None and it.form is not None else None
        if m is not None:
            its[k] = m
            return
    its.append(it)


def _joined(a, b):
    """a and b as one item when their forms merge into one that pairs no dearer than both
    (joining components can widen the Gram matrices), else None."""
    m = merged([a.form, b.form])
    if len(m) == 1 and cost(m[0], m[0]) <= cost(a.form, a.form) + cost(b.form, b.form):
        return _Item(a.nets + b.nets, m[0])
    return None


class Norms:
    """Squared Frobenius norms of sums of networks (``sq``), each pairing computed in token
    form or by the contraction planner, whichever plans fewer flops (``choose``), and kept:
    a pairing met again (H_o's items in ‖H_o‖ and in ‖H_o + H_f‖) costs nothing."""

    def __init__(self, state, prefer="auto", step=None):
        self.state, self.prefer = state, prefer
        self.pairer = Pairer(state, step)
        self.done = {}

    def sq(self, its):
        """‖Σ items‖²_F = Σ_i ⟨i, i⟩ + 2 Σ_{i<j} ⟨i, j⟩."""
        total = self.state.ops.scalar(0.0, self.state.like)
        for i, a in enumerate(its):
            total = total + self.pair(a, a)
            for b in its[i + 1:]:
                total = total + 2 * self.pair(a, b)
        return total

    def pair(self, a, b):
        key = (id(a), id(b))
        if key not in self.done:
            self.done[key] = self._pair(a, b)
        return self.done[key]

    def _pair(self, a, b):
        st = self.state
        pairs = [(x, y) for x in a.nets for y in b.nets]
        both = common(a.form, b.form) if self.prefer != "planner" else None
        if both is not None:
            fa, fb = both if a is not b else (a.form, a.form)
            if self.prefer == "token" or \
                    cost(fa, fb) < sum(N._cost(st, N.paired(st, x, y), ()) for x, y in pairs):
                return self.pairer.pair(fa, fb)
        return N.scalar(st, [N.paired(st, x, y) for x, y in pairs])


def frobenius_sq(state, nets, prefer="auto"):
    """‖Σ nets‖²_F (networks merged first, ``items``); ``prefer``:
    "auto" (the cheaper way per pairing), "token" (token form wherever the items have
    one), "planner" (paired networks only); ``step``: values of the first token label per
    tile (default: a tile's factors within a quarter of the intermediate limit)."""
    return Norms(state, prefer).sq(items(state, nets))


def frobenius_split_sq(state, outer, functional, prefer="auto", step=None):
    """(‖H_o‖², ‖H_f‖², ‖H_o + H_f‖²) of a block from its networks; the full part
    pairs the items of both, those in token form over one skeleton merged (one pairing
    instead of three), and the pairings of each part are shared with it."""
    norms = Norms(state, prefer, step)
    o, f = items(state, outer), items(state, functional)
    both = list(o)
    for it in f:
        _join_into(both, it, len(o))
    return norms.sq(o), norms.sq(f), norms.sq(both)

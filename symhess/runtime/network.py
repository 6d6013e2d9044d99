"""Index networks as data, and the reductions the kernels need from them.

A generated routine describes a Hessian block (or a Jacobian, or a compact per-token
tensor) as a list of networks, each written ``net(coef, "nia,nij,njb->ab|ce", X, A, K)``:
coef · Σ_{summed labels} Π operands, laid out over output *groups* (``|``-separated; a block
has two, its rows and its columns, each the C-order index atoms of a parameter).  A label
may appear in two groups (a Kronecker delta between them: the block is zero off that
diagonal) and in no operand (the block is constant along it; ``free`` gives its size).

Operands are arrays (with a leading batch axis ``n`` where they depend on the data),
``Compact`` tensors (a sum of networks of their own, materialised or inlined at the call's
sizes, see ``resolve``), ``ONES`` (an all-ones operand: dropped) and ``EYE`` (an identity:
its two labels are identified).  Invariant: ``Net.sizes`` holds exactly the labels of the
network; one that no operand carries is a sum of ones (``free_factor``) unless it is an
output label (then the result is constant along it).

Reductions of Σ_t N_t, every one a contraction of networks (never the dense block unless
asked for):

* dense:  out[r, c] = Σ_t N_t[r, c] (a network whose operands fall into parts that share no
  summed label is added as an entrywise product of its parts, one pass over ``out``);
* diag:   the column atoms identified with the row atoms, out[r] = Σ_t N_t[r, r];
* trace:  the same, summed;
* inner:  ⟨N_s, N_t⟩ = Σ_{r,c} N_s[r, c] N_t[r, c], one network of both (the second's
  internal labels renamed), so ‖Σ_t N_t‖²_F = Σ_{s,t} ⟨N_s, N_t⟩.

Groups that must be identified but are split into atoms differently (rows (d, k) against a
single atom d·k) are refined to their common C-order factorisation first (operands reshaped).
"""
from __future__ import annotations

import math
from functools import lru_cache

from . import contract as C
from . import cost


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


ONES = _Marker("ONES")      # an all-ones operand
EYE = _Marker("EYE")        # an identity over two labels of one size


@lru_cache(maxsize=None)
def parse(spec):
    """("nia,nij->ab|ce") → (operand label tuples, output groups, letters), labels as ints."""
    ins, _, outs = spec.partition("->")
    letters = {}

    def lab(ch):
        return letters.setdefault(ch, len(letters))

    labels = tuple(tuple(lab(ch) for ch in part) for part in ins.split(",")) if ins else ()
    groups = tuple(tuple(lab(ch) for ch in g) for g in outs.split("|"))
    return labels, groups, dict(letters)


class Net:
    """coef · Π operands over ``labels``, output ``groups`` (tuples of labels), ``sizes``."""

    __slots__ = ("coef", "ops", "labels", "groups", "sizes")

    def __init__(self, coef, ops, labels, groups, sizes):
        self.coef, self.ops, self.labels = coef, list(ops), [tuple(ls) for ls in labels]
        self.groups, self.sizes = tuple(tuple(g) for g in groups), dict(sizes)

    def __repr__(self):
        return f"<net {self.coef:g} · {len(self.ops)} operands → {self.groups}>"

    @property
    def top(self):
        return max(self.sizes, default=-1) + 1

    def renamed(self, ren):
        """Labels mapped through ``ren`` (missing ones unchanged)."""
        f = lambda ls: tuple(ren.get(x, x) for x in ls)
        sizes = {ren.get(k, k): v for k, v in self.sizes.items()}
        return Net(self.coef, self.ops, [f(ls) for ls in self.labels], [f(g) for g in self.groups],
                   sizes)

    def shifted(self, k):
        return self.renamed({x: x + k for x in self.sizes})

    def scaled(self, c):
        return Net(self.coef * c, self.ops, self.labels, self.groups, self.sizes)

    def transposed(self):
        """The network of the transposed block (rows and columns swapped)."""
        g = self.groups
        return Net(self.coef, self.ops, self.labels, (g[1], g[0]) + g[2:], self.sizes)


def net(coef, spec, *operands, free=None):
    """A network from its spec (see the module docstring); ``free``: sizes by letter of the
    labels no array operand carries."""
    labels, groups, letters = parse(spec)
    if len(labels) != len(operands):
        raise RuntimeError(f"network {spec!r} has {len(labels)} operand specs for "
                           f"{len(operands)} operands")
    sizes = {letters[k]: int(v) for k, v in (free or {}).items()}
    ops, labs, unions, ones = [], [], {}, []
    for op, ls in zip(operands, labels):
        if op is EYE:
            unions[ls[1]] = ls[0]
        elif op is ONES:
            ones.extend(ls)
        else:
            for x, s in zip(ls, _shape(op)):
                sizes[x] = int(s)
            ops.append(op)
            labs.append(ls)
    root = lambda x: x if x not in unions else root(unions[x])
    ren = {x: root(x) for x in sizes}
    ren.update({x: root(x) for x in unions})
    return Net(coef, ops, labs, groups, {x: s for x, s in sizes.items()}).renamed(ren)


def _shape(op):
    return op.shape


def components(labels, joins):
    """The positions of the operands whose label tuples ``labels`` are joined, directly or
    through others, by a label for which ``joins(label)`` holds (a summed label inside one
    factor), as lists in ascending order, ordered by their first position."""
    parent = list(range(len(labels)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    holder = {}
    for i, ls in enumerate(labels):
        for x in ls:
            if not joins(x):
                continue
            if x in holder:
                parent[find(i)] = find(holder[x])
            else:
                holder[x] = i
    groups = {}
    for i in range(len(labels)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


class Compact:
    """A tensor defined as a sum of networks over one output group (its axes), e.g. the
    per-token second moments M_2 as an (n, L, d, d) array.  ``array(state)`` materialises it
    once; ``resolve`` inlines its networks instead where that is cheaper at the call's sizes
    or the tensor would not fit the budget.  ``users``: how many networks of a reduction
    hold it (its formation is priced once for all of them)."""

    def __init__(self, name, nets, users=1):
        self.name, self.nets, self.users = name, list(nets), users
        first = self.nets[0]
        self.shape = tuple(first.sizes[x] for x in first.groups[0])
        self._array = None
        self._cost = None

    def __repr__(self):
        return f"<compact {self.name} {self.shape}, {len(self.nets)} networks>"

    @property
    def entries(self):
        return math.prod(self.shape)

    @property
    def materialised(self):
        return self._array is not None

    def array(self, state):
        if self._array is None:
            acc = None
            for n in self.nets:
                acc = accumulate(state, n, (0,), acc, self.shape)
            self._array = acc
        return self._array

    def hold(self, array):
        """Take ``array`` as the materialised tensor (formed elsewhere: a slice of another's)."""
        self._array = array

    def release(self):
        """Forget the materialised array (formed again from the networks if asked for)."""
        self._array = None

    def cost(self, state):
        """Planned time to materialise it (flop-equivalents, ``contract.Plan.cost``; 0 once
        done)."""
        if self._array is not None:
            return 0
        if self._cost is None:
            self._cost = sum(_cost(state, m, (0,))
                             for n in self.nets for m in _expand(state, n, (0,)))
        return self._cost


def refined(state, c, sizes, batched=False):
    """The compact ``c`` with its axes split into atoms of ``sizes`` (C order; after the
    batch axis when ``batched``): a compact of its own, whose networks carry the split labels."""
    sizes = ((c.shape[0],) if batched else ()) + tuple(int(x) for x in sizes)
    if sizes == tuple(c.shape):
        return c
    return Compact(c.name, [_refined_group(state, n, 0, sizes) for n in c.nets])


def _refined_group(state, n, g, sizes):
    """``n`` with output group g's labels split so their sizes are ``sizes``."""
    labels, target = list(n.groups[g]), list(sizes)
    while labels:
        x, t = labels.pop(0), target.pop(0)
        sx = n.sizes[x]
        if sx == t:
            continue
        if sx % t:
            raise RuntimeError(f"an axis of size {sx} cannot be split at {t}")
        n, (x1, x2) = _split(state, n, x, (t, sx // t))
        labels = [x2] + _sub(labels, x, (x1, x2))
    return n


# ----------------------------------------------------------------------------- compacts
def resolve(state, n, groups, paired=False):
    """``n`` as networks over arrays only: every Compact operand is materialised or its
    networks are inlined, whichever the plan says is cheaper at these sizes (materialising
    only if the tensor fits ``state.schedule.compact_limit``).  ``groups``: the output
    groups the result is wanted over (inlining may identify labels: read them from the
    returned networks).  ``paired``: the networks will be paired with each other (a
    Frobenius norm), where an inlined compact appears on both sides: every compact that
    fits is materialised (at L = 64, d = 128 inlining cost 700× the flops there).

    The compacts are decided one at a time, each against the others as they stand; a
    product of structured compacts (LayerNorm Jacobians, diagonal plus rank one per token)
    pays only when all of them are inlined, so that expansion (when it has at most
    ``JOINT_MAX`` networks) is compared with the one-at-a-time choice as a whole: post-LN's
    diag H_o(W_1) then needs no d × d tensor per token."""
    groups = tuple(groups)
    nets = _expand(state, n, groups, paired=paired)
    if state.schedule.materialise == "auto" and not paired and len(nets) < JOINT_MAX:
        flat = _inlined(n, JOINT_MAX)
        if flat is not None and len(flat) > len(nets):
            kept = {id(op): op for m in nets for op in m.ops if isinstance(op, Compact)}
            chosen = sum(_cost(state, m, groups) for m in nets) + \
                sum(c.cost(state) / c.users for c in kept.values())
            if _cheaper(state, flat, groups, chosen):
                nets = flat
    return [_materialised(state, m) for m in nets]


JOINT_MAX = 64       # most networks of an all-inlined expansion that ``resolve`` weighs


def inlining_pays(state, n, groups, compacts):
    """Whether ``n`` with every compact inlined (at most ``JOINT_MAX`` networks) plans fewer
    flops than forming ``compacts`` and contracting ``n`` with them as arrays: attention's
    per-token moments (B L d² entries) are cheaper inlined, where the planner contracts per
    token over d_K, than formed (``runtime.chunk``)."""
    flat = _inlined(n, JOINT_MAX)
    if flat is None:
        return False
    formed = _cost(state, n, groups) + sum(c.cost(state) / c.users for c in compacts)
    return _cheaper(state, flat, groups, formed)


def _cheaper(state, nets, groups, bound):
    """Whether the networks plan fewer than ``bound`` flops in all; planning stops as soon as
    the running sum reaches the bound (each plan costs a search over its operands)."""
    total = 0
    for m in nets:
        total += _cost(state, m, groups)
        if total >= bound:
            return False
    return True


def _inlined(n, cap):
    """``n`` with every Compact operand inlined (nested ones too), or None past ``cap``
    networks."""
    out, todo = [], [n]
    while todo:
        m = todo.pop()
        k = next((i for i, op in enumerate(m.ops) if isinstance(op, Compact)), None)
        if k is None:
            out.append(m)
        else:
            todo.extend(inline(m, k, c) for c in m.ops[k].nets)
        if len(out) + len(todo) > cap:
            return None
    return out[::-1]


def _expand(state, n, groups, start=0, paired=False, copies=1):
    """``n`` with the Compact operands from position ``start`` on either kept (to be
    materialised) or inlined; no side effects.  ``copies``: how many networks of the
    expansion hold this one's compacts (inlining a compact of T networks makes T copies of
    the rest, and a compact materialised once serves them all)."""
    k = next((i for i in range(start, len(n.ops)) if isinstance(n.ops[i], Compact)), None)
    if k is None:
        return [n]
    if _keep(state, n, k, groups, paired, copies):
        return _expand(state, n, groups, k + 1, paired, copies)
    nets = n.ops[k].nets
    return [r for m in nets
            for r in _expand(state, inline(n, k, m), groups, k, paired, copies * len(nets))]


def _keep(state, n, k, groups, paired=False, copies=1):
    """Whether the compact operand k of ``n`` is materialised rather than inlined: its cost,
    shared by the ``copies`` networks that hold it, plus contracting ``n`` with it, against
    contracting its networks inlined.  A compact already formed (for another network, or as
    a slice of ``runtime.chunk``) costs nothing more to form, yet is still inlined where its
    networks contract in less planned time (``contract.Plan.cost``) than its array does."""
    c, sched = n.ops[k], state.schedule
    fits = c.materialised or c.entries <= sched.compact_limit
    if sched.materialise != "auto" or paired:           # no cost comparison
        return c.materialised or (fits and sched.materialise != "never")
    if not fits:
        return False
    as_array = _cost(state, n, groups) + c.cost(state) / (copies * c.users)
    inlined = sum(_cost(state, inline(n, k, m), groups) for m in c.nets)
    return as_array <= inlined


def _materialised(state, n):
    if not any(isinstance(op, Compact) for op in n.ops):
        return n
    ops = [op.array(state) if isinstance(op, Compact) else op for op in n.ops]
    return Net(n.coef, ops, n.labels, n.groups, n.sizes)


def _with_array(n, k, a):
    ops = list(n.ops)
    ops[k] = a
    return Net(n.coef, ops, n.labels, n.groups, n.sizes)


def inline(n, k, m):
    """``n`` with its k-th operand (a Compact over labels ``n.labels[k]``) replaced by the
    compact's network ``m``: m's output labels become those labels (a label m repeats
    identifies the corresponding labels of ``n``), its other labels are renamed apart."""
    m = m.shifted(n.top)
    parent = {}

    def find(y):
        while parent.get(y, y) != y:
            y = parent[y]
        return y

    to_m = {}
    for x, y in zip(m.groups[0], n.labels[k]):
        if x not in to_m:
            to_m[x] = y
        else:                            # m is zero off this diagonal: identify n's labels
            a, b = find(to_m[x]), find(y)
            if a != b:
                parent[b] = a
    if parent:
        n = n.renamed({y: find(y) for y in parent})
    m = m.renamed({x: find(y) for x, y in to_m.items()})
    ops = n.ops[:k] + n.ops[k + 1:] + m.ops
    labels = n.labels[:k] + n.labels[k + 1:] + m.labels
    sizes = dict(m.sizes)
    sizes.update(n.sizes)
    return Net(n.coef * m.coef, ops, labels, n.groups, sizes)


def _cost(state, n, groups):
    """The planned time of one network in flop-equivalents (``contract.Plan.cost``;
    Compact operands counted as arrays)."""
    if not n.ops:
        return 0
    present = set(x for ls in n.labels for x in ls)
    o = tuple(dict.fromkeys(x for g in groups for x in n.groups[g] if x in present))
    return C.plan(n.labels, o, n.sizes, state.schedule.limit).cost


# ----------------------------------------------------------------------------- evaluation
def accumulate(state, n, groups, acc=None, shape=None):
    """acc += Σ n laid out over its output ``groups`` (indices; a label that repeats: the
    diagonal of those axes; a label no operand carries: broadcast).  Returns acc (made with
    ``shape``, the sizes of the groups' labels, when None)."""
    ops = state.ops
    for m in resolve(state, n, groups):
        out = tuple(x for g in groups for x in m.groups[g])
        uniq = tuple(dict.fromkeys(out))
        present = set(x for ls in m.labels for x in ls)
        if acc is None:
            acc = ops.zeros(shape if shape is not None else [m.sizes[x] for x in out], like=state.like)
        view = ops.diagonal_view(acc, out) if len(uniq) < len(out) else acc
        factors = _factors(state, m, uniq)
        if factors is not None:
            _add_entrywise(ops, view, factors, m.sizes, uniq, m.coef * free_factor(m, out))
            continue
        if m.ops:
            r = C.contract(ops, m.ops, m.labels, uniq, state.schedule.limit, m.sizes)
            kept = [x for x in uniq if x in present]
        else:
            r, kept = ops.scalar(1.0, like=state.like), []
        r = ops.expand_dims(r, [uniq.index(x) for x in kept], len(uniq))
        ops.add_scaled(view, r, m.coef * free_factor(m, out))
    return acc


def _factors(state, m, out):
    """``m`` as an entrywise product over ``out``: [(array, labels)] of its parts that share
    no summed label (``components``), each contracted to its output labels; None when it
    has one such part.  A per-token outer product (a LayerNorm Jacobian's rank-one term,
    possibly scaled by a per-token dot product) is then one pass over the result instead of
    a product written out and added in a second pass."""
    if len(m.ops) < 2:
        return None
    wanted = set(out)
    parts = components(m.labels, lambda x: x not in wanted)
    if len(parts) < 2:
        return None
    factors = []
    for pos in parts:
        labels = [m.labels[i] for i in pos]
        keep = tuple(x for x in out if any(x in ls for ls in labels))
        if len(pos) == 1 and labels[0] == keep:
            factors.append((m.ops[pos[0]], keep))
        else:
            factors.append((C.contract(state.ops, [m.ops[i] for i in pos], labels, keep,
                                       state.schedule.limit, m.sizes), keep))
    return factors


def _add_entrywise(ops, view, factors, sizes, out, c):
    """view += c · Π factors ([(array, labels)]) broadcast over ``out``: the smaller factors
    multiplied together, then one pass over the view with the largest."""
    factors = sorted(factors, key=lambda t: math.prod(sizes[x] for x in t[1]))
    aligned = [C.aligned(ops, a, ls, out) for a, ls in factors]
    t = aligned[0]
    for x in aligned[1:-1]:
        t = ops.product(t, x)
    cost.add(math.prod(ops.shape(view)) * (len(aligned) - 1))
    ops.add_product(view, t, aligned[-1], c)


def layout(nets, groups):
    """(shape, flat) of Σ nets over ``groups``: the sizes of the groups' atoms (C order) and
    of each group as one axis."""
    first = nets[0]
    shape = [first.sizes[x] for g in groups for x in first.groups[g]]
    return shape, [math.prod(first.sizes[x] for x in first.groups[g]) for g in groups]


def dense(state, nets, groups=(0, 1)):
    """Σ nets laid out over the atoms of ``groups`` (C order), reshaped to one axis per group
    (``runtime.chunk.dense``: the same with oversized compacts formed in slices)."""
    if not nets:
        return None
    shape, flat = layout(nets, groups)
    acc = None
    for n in nets:
        acc = add_term(state, n, groups, acc, shape)
    return state.ops.reshape(acc, flat)


def add_term(state, n, groups, acc, shape):
    """``accumulate`` for one network of a block laid out as ``shape`` (``layout``)."""
    if [n.sizes[x] for g in groups for x in n.groups[g]] != shape:
        raise RuntimeError("the networks of one block disagree on its layout")
    return accumulate(state, n, groups, acc, shape)


def identified(state, n, a, b):
    """``n`` with output group ``b``'s atoms identified with group ``a``'s (refining labels so
    both factorise their common size the same way)."""
    ga, gb = list(n.groups[a]), list(n.groups[b])
    while ga or gb:
        if not (ga and gb):
            raise RuntimeError("groups of different sizes cannot be identified")
        x, y = ga.pop(0), gb.pop(0)
        sx, sy = n.sizes[x], n.sizes[y]
        if x == y:
            continue
        if sx == sy:
            n = n.renamed({y: x})
            ga = [x if z == y else z for z in ga]
            gb = [x if z == y else z for z in gb]
        elif sx % sy == 0:
            n, (x1, x2) = _split(state, n, x, (sy, sx // sy))
            n = n.renamed({y: x1})
            ga, gb = [x2] + _sub(ga, x, (x1, x2)), _sub(gb, x, (x1, x2))
            gb = [x1 if z == y else z for z in gb]
        elif sy % sx == 0:
            n, (y1, y2) = _split(state, n, y, (sx, sy // sx))
            n = n.renamed({y1: x})
            ga, gb = _sub(ga, y, (x, y2)), [y2] + _sub(gb, y, (x, y2))
        else:
            raise RuntimeError(f"index atoms of sizes {sx} and {sy} cannot be aligned")
    return n


def _sub(g, x, parts):
    out = []
    for z in g:
        out.extend(parts if z == x else (z,))
    return out


def _split(state, n, x, parts):
    """Refine label x into labels of sizes ``parts`` (C order): operands carrying it are
    reshaped (a Compact operand is materialised first)."""
    if any(isinstance(op, Compact) and x in ls for op, ls in zip(n.ops, n.labels)):
        k = next(i for i, (op, ls) in enumerate(zip(n.ops, n.labels)) if isinstance(op, Compact) and x in ls)
        n = _with_array(n, k, n.ops[k].array(state))
        return _split(state, n, x, parts)
    new = tuple(range(n.top, n.top + len(parts)))
    sizes = dict(n.sizes)
    del sizes[x]
    sizes.update(zip(new, parts))
    ops, labels = [], []
    for op, ls in zip(n.ops, n.labels):
        if x in ls:
            shape = []
            for z, s in zip(ls, state.ops.shape(op)):
                shape.extend(parts if z == x else (s,))
            op = state.ops.reshape(op, shape)
            ls = tuple(_sub(ls, x, new))
        ops.append(op)
        labels.append(ls)
    groups = [tuple(_sub(g, x, new)) for g in n.groups]
    return Net(n.coef, ops, labels, groups, sizes), new


def paired(state, a, b):
    """The network ⟨a, b⟩ = Σ_out a[out] b[out] (both over the same groups)."""
    b = b.shifted(a.top)
    both = Net(a.coef * b.coef, a.ops + b.ops, a.labels + b.labels,
               a.groups + b.groups, {**a.sizes, **b.sizes})
    k = len(a.groups)
    for g in range(k):
        both = identified(state, both, g, k + g)
    return closed(both)


def closed(n):
    """``n`` summed over all its output labels."""
    return Net(n.coef, n.ops, n.labels, (), n.sizes)


def free_factor(n, out):
    """Σ over the labels of ``n`` that no operand carries and ``out`` leaves summed: each
    contributes its size (a sum of ones: an all-ones operand, a compact tensor constant along
    the batch axis once inlined, an output label closed by a trace or a pairing)."""
    carried = set(x for ls in n.labels for x in ls) | set(out)
    return math.prod(s for x, s in n.sizes.items() if x not in carried)


def scalar(state, nets):
    """Σ over every network of its full contraction (no output labels), a 0-d value of the
    backend (an array's scalar or a tensor on the data's device: no host synchronisation)."""
    total = state.ops.scalar(0.0, state.like)
    for n in nets:
        for m in resolve(state, n, ()):
            c = m.coef * free_factor(m, ())
            if m.ops:
                v = C.contract(state.ops, m.ops, m.labels, (), state.schedule.limit, m.sizes)
                total = total + c * v.reshape(())
            else:
                total = total + c
    return total


def merged(state, nets):
    """The networks of one block with the same *skeleton* combined into one.

    The skeleton of a network are its operands that carry an output label and share a label
    with another such operand (X[n,i,a] and X[n,i,a′] of H_o(W_Q, W_Q), tied by the token
    (n, i)); the rest contracts to a *core* over the labels it shares with them and the output
    labels it carries (the per-token dk × dk matrices C_iC_iᵀ).  Networks whose skeletons
    are the same arrays over the same labels differ only in their cores, which add up:
    Σ_t skeleton · core_t = skeleton · Σ_t core_t, so a Frobenius norm pairs one network
    instead of all T² pairs of terms.  A core larger than the intermediate limit is not
    formed, nor the core of a lone network unless forming it once and pairing the skeleton
    plans fewer flops than pairing the network as it is (``_core_pays``)."""
    out, groups = [], {}
    for n in nets:
        for m in resolve(state, n, (0, 1), paired=True):
            split = _skeleton(state, m)
            if split is None:
                out.append(m)
                continue
            key, skel, core_net = split
            if key in groups:
                g = groups[key]
                c = core_net.shifted(max(g["net"].top, core_net.top))   # apart from the first
                g["cores"].append(c.renamed(dict(zip(c.groups[0], g["core_labels"]))))
            else:
                groups[key] = {"net": m, "skel": skel, "core_labels": core_net.groups[0],
                               "cores": [core_net]}
    for g in groups.values():
        m, labels = g["net"], g["core_labels"]
        if len(g["cores"]) == 1 and not _core_pays(state, m, g["skel"], g["cores"][0]):
            out.append(m)
            continue
        shape = [m.sizes[x] for x in labels]
        acc = None
        for c in g["cores"]:
            acc = accumulate(state, c, (0,), acc, shape)
        ops = [m.ops[i] for i in g["skel"]] + [acc]
        lab = [m.labels[i] for i in g["skel"]] + [tuple(labels)]
        kept = set(x for ls in lab for x in ls) | set(x for grp in m.groups for x in grp)
        out.append(Net(1.0, ops, lab, m.groups, {x: m.sizes[x] for x in kept}))
    return out


def _core_pays(state, m, skel, core_net):
    """Whether a lone network's core is worth forming: its formation plus the pairing of the
    skeleton with it against the pairing of the network as it is.  At L = 16, d = 32 the core
    of H_o(W_K, W_K) (W_Q's rows with t, per token) has 10³ times the entries of its skeleton
    and pairs at 500× the flops; at L = d = 128, B = 8 the per-token d_K × d_K core of
    H_o(W_Q, W_Q) cuts that block's flops by a third."""
    core = tuple(core_net.groups[0])
    lean = Net(m.coef, [m.ops[i] for i in skel] + [None], [m.labels[i] for i in skel] + [core],
               m.groups, m.sizes)                     # the skeleton with the core to come
    with_core = _cost(state, core_net, (0,)) + _cost(state, paired(state, lean, lean), ())
    return with_core < _cost(state, paired(state, m, m), ())


def _skeleton(state, m):
    """(key, skeleton positions, core network) of a resolved network, or None."""
    outer = set(m.groups[0]) | set(m.groups[1])
    carriers = [i for i, ls in enumerate(m.labels) if outer & set(ls)]
    skel = [i for i in carriers
            if any(set(m.labels[i]) & set(m.labels[j]) - outer for j in carriers if j != i)]
    rest = [i for i in range(len(m.ops)) if i not in skel]
    if not skel or len(rest) < 2:
        return None
    skel_labels = set(x for i in skel for x in m.labels[i])
    rest_labels = set(x for i in rest for x in m.labels[i])
    core = tuple(sorted((rest_labels & skel_labels) | (rest_labels & outer)))
    if math.prod(m.sizes[x] for x in core) > state.schedule.limit:
        return None
    # the skeleton in canonical labels: the output positions, then first appearance
    canon = {x: ("o", k) for k, x in enumerate(m.groups[0] + m.groups[1])}
    for i in skel:
        for x in m.labels[i]:
            canon.setdefault(x, ("s", len(canon)))
    key = (tuple((id(m.ops[i]), tuple(canon[x] for x in m.labels[i])) for i in skel),
           tuple(canon[x] for x in core))
    core_net = Net(m.coef, [m.ops[i] for i in rest], [m.labels[i] for i in rest], (core,),
                   {x: m.sizes[x] for x in rest_labels})
    return key, skel, core_net


def frobenius_sq(state, first, second=None, premerged=False):
    """‖Σ first‖²_F (or ⟨Σ first, Σ second⟩) as a sum over pairs of networks (networks with
    one skeleton merged first, see ``merged``, unless ``premerged`` says they are)."""
    if not premerged:
        first = merged(state, first)
        second = merged(state, second) if second is not None else None
    total = state.ops.scalar(0.0, state.like)
    for i, a in enumerate(first):
        if second is None:
            total += scalar(state, [paired(state, a, a)])
            total += 2 * scalar(state, [paired(state, a, b) for b in first[i + 1:]])
        else:
            total += scalar(state, [paired(state, a, b) for b in second])
    return total

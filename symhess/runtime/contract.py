"""Contract one index network at the sizes of the call: plan, fit the budget, execute.

A network is  Σ_{summed labels} Π_k T_k[labels_k], its result laid out over the
output labels ``out`` (distinct; labels of ``out`` that no operand carries are left out of
the result and broadcast by the caller).  Labels are small integers.

* **plan** — the pairwise contraction order is chosen for the operands' actual shapes, with
  no intermediate above ``limit`` entries: the labels only one operand carries are summed
  out of it (``_private``, as ``pairwise`` does), then the contractions whose result is no
  larger than their larger operand (``_shrink``), then opt_einsum's greedy order and — when
  that is expensive (``SEARCH_FLOPS``) — dynamic programming (up to ``DP_MAX`` operands) or
  randomised greedy runs, keeping the cheapest.
  Plans are cached by the network's canonical form (labels renumbered by first
  appearance) and sizes, so a routine called again at the same sizes plans nothing.
* **slice** — when no order keeps every intermediate under the limit, the largest label
  shared by operands (or of the output) is cut into chunks (summed labels accumulate,
  output labels fill their slice of the result), recursively.  The result itself is not
  limited (callers check it against the memory budget); ``BudgetError`` is raised when
  chunks of size one still do not fit, and at the floor: when keeping to the limit would
  cut one contraction into more than ``MAX_SLICES`` pieces (counted before anything runs,
  ``_pieces``: the plans of the chunk sizes, which repeat, so the count costs a few plans),
  where the fixed cost of each piece (≈ 1–3 ms of planning, loops and small products) would
  make the work run for minutes instead of a fraction of a second (a budget of 1000 bytes
  made attention's exact diagonal at L = 50 take 18 s instead of 0.3 s).
* **execute** — each pairwise step is one batched matrix product: labels only one side
  carries are summed first, shared labels still needed later are batch axes, the other
  shared labels the inner dimension; a step with no inner dimension is a broadcast product.
  A *triangle* — an outer product that the next step multiplies by an operand with no label
  of its own and sums over one label e (the rotary key factors met by ∂A/∂T) — has no
  matrix-product form; it runs as one loop over e that accumulates into the result
  (``_triangle``), instead of writing the outer product, |e| times the result, to memory.

Cost: the planned flop count (opt_einsum's, about 2·Π sizes per product) is ``Plan.flops``;
its time in flop-equivalents (``_time``: memory-bound steps at ``MOVE_COST`` per entry moved),
by which plans are compared, ``Plan.cost``;
the peak memory of a step is its operands plus its result.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import opt_einsum as oe

from ..errors import BudgetError
from . import cost

# planning effort follows the work: the contractions that cost no memory first (``_shrink``),
# then a greedy order; when that costs more than SEARCH_FLOPS flops, dynamic programming (up
# to DP_MAX operands) or 64 randomised greedy runs look for a cheaper one (on attention's
# Frobenius networks at L = 256 they find orders 20-50× cheaper than greedy; at toy sizes
# they would cost more time than they save)
SEARCH_FLOPS = 2 * 10 ** 7
# an order kept under the memory limit may cost far more than slicing the cheapest order
# (on attention's Frobenius networks at L = 64, d = 128: 1.1e12 against 2e10 flops)
SLICE_RATIO = 4
DP_MAX = 16
RANDOM_REPEATS = 64
# the floor of slicing: one contraction is cut into at most this many pieces
MAX_SLICES = 1024
# the least result (entries) for which a triangle contraction loops over its summed label
TRIANGLE_MIN = 1 << 12
# the entries of the result tile a triangle accumulates into at a time (256 KB in float64)
TRIANGLE_TILE = 1 << 15
# the least matrix (entries) of a stack that a product takes as views of a larger operand
# whose own labels become batch axes (``_promoted``)
PROMOTE_MIN = 1 << 10
# a step that reads and writes more entries than it multiplies runs at memory speed: an entry
# moved costs as much time as this many flops of a matrix product (an outer product of
# per-token rows ran at 2 GFlop/s against 25 for per-token matrix products on one core)
MOVE_COST = 5


@dataclass(frozen=True)
class Plan:
    """A pairwise order (opt_einsum path) with its cost at the planned sizes."""

    path: tuple
    flops: int
    largest: int          # entries of the largest intermediate (the result included)
    cost: int             # flops, or MOVE_COST per entry read and written where that is more


def _canonical(labels, out):
    """(labels renumbered by first appearance, out renumbered, the renumbering)."""
    ren = {}
    for lab in [x for ls in labels for x in ls] + list(out):
        if lab not in ren:
            ren[lab] = len(ren)
    return (tuple(tuple(ren[x] for x in ls) for ls in labels), tuple(ren[x] for x in out), ren)


def plan(labels, out, sizes, limit=None) -> Plan:
    """The cheapest pairwise order for ``labels`` → ``out`` at ``sizes`` (label → size) with
    no intermediate above ``limit`` entries (None: unlimited); ``largest`` tells whether it
    fits (a step over more than two operands means no order does)."""
    can_l, can_o, ren = _canonical(labels, out)
    size_t = tuple(sizes[lab] for lab in sorted(ren, key=ren.get))
    return _plan(can_l, can_o, size_t, limit)


@lru_cache(maxsize=65536)
def _plan(labels, out, sizes, limit):
    """The unlimited order when it fits ``limit``; else the order within ``limit``, unless
    keeping to it costs more than ``SLICE_RATIO`` times the unlimited order's flops: then the
    unlimited order, which ``_run`` slices."""
    free = _plan_within(labels, out, sizes, None)
    if limit is None or free.largest <= max(int(limit), math.prod(sizes[x] for x in out)):
        return free
    within = _plan_within(labels, out, sizes, limit)
    return free if within.flops > SLICE_RATIO * free.flops else within


def _plan_within(labels, out, sizes, limit):
    path, flops, largest = _order(labels, out, sizes, limit)
    return Plan(path, flops, largest, _time(labels, out, sizes, path))


def _time(labels, out, sizes, path):
    """The time of ``path`` in flop-equivalents: per step (as ``execute`` runs it: labels
    only one operand carries summed first), the larger of its flops and ``MOVE_COST`` times
    the entries it reads and writes.  Matrix products over a wide inner dimension count
    their flops; outer products, scalings and matrix-vector products their memory traffic,
    which opt_einsum's flop count puts at a tenth of their time."""
    ops = [tuple(ls) for ls in labels]
    size = lambda ls: math.prod(sizes[x] for x in set(ls))          # noqa: E731
    total = 0
    for step in path:
        taken = [ops.pop(i) for i in sorted(step, reverse=True)]
        needed = set(out).union(*ops)
        moved, reduced = 0, []
        for i, ls in enumerate(taken):
            others = needed.union(*(t for j, t in enumerate(taken) if j != i))
            kept = tuple(x for x in ls if x in others)
            moved += size(ls)
            if len(set(kept)) < len(set(ls)) and len(taken) > 1:
                total += MOVE_COST * (size(ls) + size(kept))
                moved += size(kept) - size(ls)
            reduced.append(kept)
        union = set().union(*reduced)
        result = tuple(x for x in dict.fromkeys(y for r in reduced for y in r) if x in needed)
        ops.append(result)
        if len(taken) == 1 and set(result) == set(taken[0]):
            continue                               # nothing to sum: the step is a no-op
        summed = len(union) > len(set(result))
        flops = size(union) * (2 if summed and len(taken) > 1 else 1)
        total += max(flops, MOVE_COST * (moved + size(result)))
    return total


def _order(labels, out, sizes, limit):
    """(path, flops, largest) of the cheapest pairwise order by opt_einsum's flop count."""
    if len(labels) == 1:
        flops = math.prod(sizes[x] for x in set(labels[0]))
        return ((0,),), flops, math.prod(sizes[x] for x in out)
    mem = None if limit is None else max(int(limit), math.prod(sizes[x] for x in out))
    labels, own_flops = _private(labels, out, sizes)
    prefix, rest, pre_flops, pre_largest = _shrink(labels, out, sizes)
    pre_flops += own_flops
    if len(rest) == 1:
        return tuple(prefix) + ((0,),), pre_flops, max(pre_largest, math.prod(sizes[x] for x in out))
    sym = [oe.get_symbol(i) for i in range(len(sizes))]
    eq = ",".join("".join(sym[x] for x in ls) for ls in rest) + "->" + "".join(sym[x] for x in out)
    shapes = [tuple(sizes[x] for x in ls) for ls in rest]
    path, info = oe.contract_path(eq, *shapes, shapes=True, optimize="greedy", memory_limit=mem)
    if int(info.opt_cost) > SEARCH_FLOPS and len(rest) > 2:
        opt = oe.paths.DynamicProgramming(minimize="flops") if len(rest) <= DP_MAX else \
            oe.path_random.RandomGreedy(max_repeats=RANDOM_REPEATS)
        try:
            p2, i2 = oe.contract_path(eq, *shapes, shapes=True, optimize=opt, memory_limit=mem)
        except RuntimeError:            # no order within the limit: greedy's (sliced) stays
            p2 = None
        if p2 is not None and int(i2.opt_cost) < int(info.opt_cost) and all(len(st) <= 2 for st in p2):
            path, info = p2, i2
    largest = max(int(info.largest_intermediate), pre_largest)
    if any(len(step) > 2 for step in path):     # no pairwise order fits the limit
        _, free = oe.contract_path(eq, *shapes, shapes=True, optimize="greedy")
        largest = max(largest, int(free.largest_intermediate), (mem or 0) + 1)
    return tuple(prefix) + tuple(tuple(s) for s in path), pre_flops + int(info.opt_cost), largest


def _private(labels, out, sizes):
    """The operands with the labels only they carry (and the output does not) summed out,
    as ``pairwise`` sums them before its product, and the flops of those sums: a product
    of two per-token matrices that meet only in their batch axes, each summed over one
    axis of its own, costs two row sums and an outer product, not Π sizes over all their
    labels (opt_einsum's count for the pair).  Returns (label lists, flops)."""
    holders = Counter(x for ls in labels for x in set(ls))
    keep = set(out)
    reduced, flops = [], 0
    for ls in labels:
        own = [x for x in ls if holders[x] == 1 and x not in keep]
        if own:
            flops += math.prod(sizes[x] for x in set(ls))
            ls = tuple(x for x in ls if x not in own)
        reduced.append(ls)
    return reduced, flops


def _shrink(labels, out, sizes):
    """Contract, cheapest first, the pairs of operands that share a label and whose result
    is no larger than the larger of them (X W_K, X t): never a memory cost, and the networks
    left for the search are smaller.  Returns (path steps, remaining label lists, flops,
    largest result)."""
    labels = [tuple(ls) for ls in labels]
    steps, flops, largest = [], 0, 0
    outs = set(out)
    size = lambda ls: math.prod(sizes[x] for x in set(ls))
    while len(labels) > 1:
        sets = [set(ls) for ls in labels]
        holders = Counter(x for st in sets for x in st)     # operands carrying each label
        own = [size(ls) for ls in labels]
        best = None
        for i in range(len(labels)):
            for j in range(i + 1, len(labels)):
                a, b = labels[i], labels[j]
                if not sets[i] & sets[j]:
                    continue
                # kept: an output label, or one that an operand other than a and b carries
                res = tuple(dict.fromkeys(x for x in a + b if x in outs or
                                          holders[x] > (x in sets[i]) + (x in sets[j])))
                if size(res) <= max(own[i], own[j]):
                    cost = size(a + b)
                    if best is None or cost < best[0]:
                        best = (cost, i, j, res)
        if best is None:
            break
        cost, i, j, res = best
        steps.append((i, j))
        flops += 2 * cost
        largest = max(largest, size(res))
        labels = [ls for k, ls in enumerate(labels) if k not in (i, j)] + [res]
    return steps, labels, flops, largest


def network_sizes(ops, arrays, labels):
    """label → size from the operands' shapes (a clash raises: it is a bug in the caller)."""
    sizes = {}
    for a, ls in zip(arrays, labels):
        for lab, s in zip(ls, ops.shape(a)):
            if sizes.setdefault(lab, s) != s:
                raise RuntimeError(f"label {lab} has sizes {sizes[lab]} and {s}")
    return sizes


def contract(ops, arrays, labels, out, limit=None, sizes=None):
    """Σ Π arrays over ``labels`` → an array over the labels of ``out`` that some operand
    carries (in ``out``'s order); ``limit``: most entries of any intermediate."""
    if sizes is None:
        sizes = network_sizes(ops, arrays, labels)
    if limit is not None:
        limit = max(1, int(limit))
    present = set(x for ls in labels for x in ls)
    out = tuple(x for x in out if x in present)
    labels = [tuple(ls) for ls in labels]
    if limit is not None:
        n = _pieces(labels, out, sizes, limit, {})
        if n > MAX_SLICES:
            largest = plan(labels, out, sizes, limit).largest
            raise BudgetError(f"keeping every intermediate under the memory budget of {limit:,} "
                              f"entries would cut a contraction into {'more than ' if n > 2 * MAX_SLICES else ''}"
                              f"{min(n, 2 * MAX_SLICES):,} slices (the most is {MAX_SLICES:,}; its "
                              f"largest intermediate has {largest:,} entries); raise the memory "
                              f"budget (SYMHESS_MEMORY_BUDGET or memory_budget=)")
    return _run(ops, list(arrays), labels, out, sizes, limit)


def _pieces(labels, out, sizes, limit, memo):
    """How many pieces ``_run`` cuts the contraction into (counted up to 2 · MAX_SLICES)."""
    key = tuple(sorted(sizes.items()))
    if key in memo:
        return memo[key]
    p = plan(labels, out, sizes, limit)
    choice = None
    if p.largest > max(limit, math.prod(sizes[x] for x in out)):
        choice = _slice_label(labels, out, sizes, limit, p.largest)
    if choice is None:
        memo[key] = 1
        return 1
    lab, step = choice
    full, rest = divmod(sizes[lab], step)
    total = full * _pieces(labels, out, {**sizes, lab: step}, limit, memo)
    if rest and total <= 2 * MAX_SLICES:
        total += _pieces(labels, out, {**sizes, lab: rest}, limit, memo)
    memo[key] = total
    return total


def _run(ops, arrays, labels, out, sizes, limit):
    p = plan(labels, out, sizes, limit)
    if limit is None or p.largest <= max(limit, math.prod(sizes[x] for x in out)):
        cost.add(p.flops, p.largest)
        return execute(ops, arrays, labels, out, p.path)
    choice = _slice_label(labels, out, sizes, limit, p.largest)
    if choice is None:
        desc = ", ".join(f"{sizes[x]}" for x in out) or "a scalar"
        raise BudgetError(f"a contraction does not fit the memory budget of {limit:,} entries "
                          f"even when sliced (result {desc}); raise the budget")
    lab, step = choice
    size = sizes[lab]
    sub = dict(sizes)
    result = None
    for start in range(0, size, step):
        n = min(step, size - start)
        sub[lab] = n
        part = [_narrow(ops, a, ls, lab, start, n) for a, ls in zip(arrays, labels)]
        r = _run(ops, part, labels, out, sub, limit)
        if lab in out:
            if result is None:
                shape = [sizes[x] for x in out]
                result = ops.zeros(shape, like=r)
            ops.narrow(result, out.index(lab), start, n)[...] = r
        else:
            result = r if result is None else result + r
    return result


def _narrow(ops, a, ls, lab, start, n):
    """``a`` restricted to entries start … start + n − 1 of ``lab`` on every axis carrying it."""
    for axis, x in enumerate(ls):
        if x == lab:
            a = ops.narrow(a, axis, start, n)
    return a


def _slice_label(labels, out, sizes, limit, largest):
    """(label, chunk size) to cut: among the labels whose chunks shrink a big intermediate
    (any label of size > 1 carried by more than one operand, or an output label), the one
    whose chunks cost the fewest planned flops in all (work that does not carry the label is
    repeated in every chunk, so the largest label is not always the cheapest to cut)."""
    counts = {}
    for ls in labels:
        for x in set(ls):
            counts[x] = counts.get(x, 0) + 1
    cands = [x for x in counts if sizes[x] > 1 and (counts[x] > 1 or x in out)]
    best = None
    for x in cands:
        chunks = min(sizes[x], max(2, math.ceil(largest / limit)))
        step = math.ceil(sizes[x] / chunks)
        sub = dict(sizes)
        sub[x] = step
        q = plan(labels, out, sub, limit)
        n = math.ceil(sizes[x] / step)
        key = (n * q.flops, -sizes[x], x)
        if best is None or key < best[0]:
            best = (key, x, step)
    return None if best is None else (best[1], best[2])


def execute(ops, arrays, labels, out, path):
    """Run an opt_einsum ``path`` (positions into the current operand list; the result of a
    step is appended) with pairwise batched products, each result laid out so that the step
    consuming it can take it as a view (``_next_inner``)."""
    arrays, labels = list(arrays), [tuple(ls) for ls in labels]
    hints = _next_inner(labels, out, path)
    owned = [False] * len(arrays)          # results of earlier steps may be overwritten
    fused = set()
    for si, step in enumerate(path):
        if si in fused:
            continue
        taken = [(arrays.pop(i), labels.pop(i), owned.pop(i)) for i in sorted(step, reverse=True)]
        needed = set(out).union(*labels)
        triple = _triangle(ops, taken, arrays, labels, out, path, si, needed)
        if triple is not None:
            fused.add(si + 1)
            arrays.append(triple[0])
            labels.append(triple[1])
            owned.append(True)
            continue
        a, la, mine = taken[0]
        if len(taken) == 1:
            a, la = _reduce(ops, a, la, needed)
        for i in range(1, len(taken)):
            b, lb, theirs = taken[i]
            later = set(x for _, ls, _ in taken[i + 1:] for x in ls)
            a, la = pairwise(ops, a, la, b, lb, needed | later, hints.get(si, ()), mine, theirs)
            mine = True
        arrays.append(a)
        labels.append(la)
        owned.append(mine and len(taken) > 1)
    (a,), (la,) = arrays, labels
    a, la = _reduce(ops, a, la, set(out))
    if la != tuple(out):
        a = ops.transpose(a, [la.index(x) for x in out])
    return a


def _triangle(ops, taken, arrays, labels, out, path, si, needed):
    """Steps ``si`` and ``si + 1`` as one, when ``si`` is an outer product (no label summed,
    each operand with labels of its own, so it is larger than both) whose result the next step multiplies by a third operand c carrying no label of its own
    and sums over one label e: Σ_e a b c, the *triangle* contraction (P[e,l,k] Q[e,m,k]
    R[e,l,m] — each pair of operands shares a label the third lacks, so it has no
    matrix-product form).  Run as two steps, it writes the outer product a b (|e| times the
    result), then multiplies and sums it at memory speed; here the operands are laid out
    alike once and the result is accumulated one entry of e at a time, ``result += (a_e ∘
    c_e) ∘ b_e`` (the pair with the smaller product first): the same 2 |e| Π(result) flops,
    no intermediate larger than the result.  (result, labels) or None when the pattern does
    not hold (a c with labels of its own makes the second step a matrix product) or the
    result is too small for a loop over e to pay (``TRIANGLE_MIN``)."""
    if len(taken) != 2 or si + 1 >= len(path) or len(path[si + 1]) != 2:
        return None
    position = len(arrays)                         # where the outer product would go
    if position not in path[si + 1]:
        return None
    (a, la, _), (b, lb, _) = taken
    a, la = _reduce(ops, a, la, needed | set(lb))
    b, lb = _reduce(ops, b, lb, needed | set(la))
    if set(la) & set(lb) - needed or set(la) <= set(lb) or set(lb) <= set(la):
        return None                                # a summed label, or a scaling: no blow-up
    other = [i for i in path[si + 1] if i != position][0]
    c, lc = arrays[other], labels[other]
    rest = [ls for i, ls in enumerate(labels) if i != other]
    needed2 = set(out).union(*rest)
    ab = list(dict.fromkeys(la + lb))
    c, lc = _reduce(ops, c, lc, needed2 | set(ab))
    summed = [x for x in ab if x in lc and x not in needed2]
    if len(summed) != 1 or any(x not in needed2 and x not in lc for x in ab) \
            or not set(lc) <= set(ab):             # c with labels of its own: a GEMM step
        return None
    (e,) = summed
    sizes = {**dict(zip(la, ops.shape(a))), **dict(zip(lb, ops.shape(b))),
             **dict(zip(lc, ops.shape(c)))}
    big = max(((a, la), (b, lb), (c, lc)), key=lambda t: math.prod(ops.shape(t[0])))[1]
    order = [x for x in dict.fromkeys(list(big) + ab + list(lc)) if x != e]
    if sizes[e] < 2 or math.prod(sizes[x] for x in order) < TRIANGLE_MIN:
        return None
    arrays.pop(other)
    labels.pop(other)
    lay = [e] + order
    laid = []
    for x, lx in ((a, la), (b, lb), (c, lc)):      # laid out alike: e first, then ``order``
        ly = [y for y in lay if y in lx]
        laid.append((ops.contiguous(_perm(ops, x, lx, ly)), ly))
    # the pair whose product is smallest first; the third multiplies into the result
    splits = [((laid[i], laid[j]), laid[3 - i - j]) for i, j in ((0, 1), (0, 2), (1, 2))]
    pair, last = min(splits, key=lambda t: math.prod(sizes[x] for x in set(t[0][0][1]) | set(t[0][1][1])))
    result = ops.zeros([sizes[x] for x in order], like=a)
    view = ops.reshape(result, [1] + [sizes[x] for x in order])
    # on the host, tiles along the outermost label of the result (of size above one), each
    # small enough to stay in cache while every entry of e is added into it; on a device,
    # one tile (its kernels are launched per tile and entry of e)
    at = next((j for j, x in enumerate(order) if sizes[x] > 1), 0)
    first, inner = order[at], math.prod(sizes[x] for x in order[at + 1:])
    step = max(1, TRIANGLE_TILE // inner) if ops.on_host(a) else sizes[first]
    for start in range(0, sizes[first], step):
        n = min(step, sizes[first] - start)
        tile = _narrow(ops, view, lay, first, start, n)[0]
        x, y, z = (aligned(ops, _narrow(ops, t, lt, first, start, n), lt, lay)
                   for t, lt in (*pair, last))
        for i in range(sizes[e]):          # entry i of e, or the one entry of an operand without e
            ops.add_product(tile, ops.product(x[min(i, len(x) - 1)], y[min(i, len(y) - 1)]),
                            z[min(i, len(z) - 1)], 1.0)
    return result, tuple(order)


def _next_inner(labels, out, path):
    """step → the labels summed over by the first step that multiplies its result (a scaling
    in between keeps the layout, so it passes the labels of the step after it)."""
    sets, made_by = [set(ls) for ls in labels], [None] * len(labels)
    inner, consumer, result = {}, {}, {}
    for si, step in enumerate(path):
        taken = [(sets.pop(i), made_by.pop(i)) for i in sorted(step, reverse=True)]
        needed = set(out).union(*sets)
        inner[si] = (taken[0][0] & taken[1][0]) - needed if len(taken) == 2 else set()
        for _, producer in taken:
            if producer is not None:
                consumer[producer] = si
        result[si] = set().union(*(t for t, _ in taken)) & needed
        sets.append(result[si])
        made_by.append(si)
    hints = {}
    for si in reversed(range(len(path))):
        c = consumer.get(si)
        if c is None:
            continue
        scaling = not inner[c] and result[c] == result[si]
        hints[si] = hints.get(c, set()) if scaling else inner[c]
    return hints


def _reduce(ops, a, la, keep):
    """Sum the labels of ``a`` that are not kept; repeated labels become a diagonal first."""
    if len(set(la)) < len(la):
        a, la = ops.diagonal(a, la)
    drop = [i for i, x in enumerate(la) if x not in keep]
    if drop:
        a = ops.sum(a, drop)
        la = tuple(x for x in la if x in keep)
    return a, la


def pairwise(ops, a, la, b, lb, keep, then=(), a_owned=False, b_owned=False):
    """One step: Σ over the shared labels that are not kept, as a batched matrix product.

    Layouts are followed, not imposed.  The shared labels take the larger operand's order; an
    operand laid out as (batch, rows, inner) or (batch, inner, rows) enters as a view, and the
    product is computed as A B or as (Bᵀ Aᵀ)ᵀ, whichever transposes the smaller operand (BLAS
    runs fastest on an operand in its own layout).  A step whose smaller operand carries no
    label of its own — a scaling, or a matrix-vector product over a larger operand in neither
    layout — is a broadcast product (summed over the inner labels) in the larger operand's
    layout.  Only an operand that fits no layout is copied; ``then`` (the labels the next step
    sums over) orders the rows of such an operand, so the result is a view for that step.
    An operand marked owned (a temporary of the network) may be overwritten."""
    a, la = _reduce(ops, a, la, keep | set(lb))
    b, lb = _reduce(ops, b, lb, keep | set(la))
    sa = dict(zip(la, ops.shape(a)))
    sb = dict(zip(lb, ops.shape(b)))
    size = lambda d, xs: math.prod(d[x] for x in xs)        # noqa: E731
    na, nb_ = size(sa, la), size(sb, lb)
    ref, other = (la, lb) if na >= nb_ else (lb, la)
    shared = [x for x in ref if x in other]
    batch = [x for x in shared if x in keep]
    inner = [x for x in shared if x not in keep]
    left = [x for x in la if x not in lb]
    right = [x for x in lb if x not in la]
    fa, fb = _fit(la, batch, left, inner), _fit(lb, batch, right, inner)
    big_fits = fa if na >= nb_ else fb
    if not (right if na >= nb_ else left) and not (inner and big_fits):
        order = list(ref) + [x for x in other if x not in ref]
        x, y = aligned(ops, a, la, order), aligned(ops, b, lb, order)
        if (a_owned if na >= nb_ else b_owned):         # a temporary of this network
            r = ops.scale_(x, y) if na >= nb_ else ops.scale_(y, x)
        else:
            r = x * y
        if inner:
            r = ops.sum(r, [order.index(x) for x in inner])
        return r, tuple(x for x in order if x not in inner)
    if inner and not big_fits:
        promoted = _promoted(ops, a, la, b, lb, batch, left, right, inner, sa, sb, na >= nb_)
        if promoted is not None:
            return promoted
    if then and not fa:
        left = [x for x in left if x in then] + [x for x in left if x not in then]
    if then and not fb:
        right = [x for x in right if x not in then] + [x for x in right if x in then]
    nb, m, k, n = size(sa, batch), size(sa, left), size(sa, inner), size(sb, right)
    # A B transposes a laid out (batch, inner, rows) and b laid out (batch, cols, inner);
    # (Bᵀ Aᵀ)ᵀ the other way round
    moved_ab = (na if fa == "KM" else 0) + (nb_ if fb == "NK" else 0)
    moved_ba = (na if fa == "MK" else 0) + (nb_ if fb == "KN" else 0)
    if not inner:
        x = ops.reshape(_perm(ops, a, la, batch + left), (nb, m, 1))
        y = ops.reshape(_perm(ops, b, lb, batch + right), (nb, 1, n))
        r, out = ops.product(x, y), batch + left + right
    elif moved_ba < moved_ab:
        x = _matrix(ops, b, lb, batch, right, inner, (nb, n, k))
        y = _matrix(ops, a, la, batch, inner, left, (nb, k, m))
        r, out = ops.matmul(x, y), batch + right + left
    else:
        x = _matrix(ops, a, la, batch, left, inner, (nb, m, k))
        y = _matrix(ops, b, lb, batch, inner, right, (nb, k, n))
        r, out = ops.matmul(x, y), batch + left + right
    sizes = {**sa, **sb}
    return ops.reshape(r, [sizes[x] for x in out]), tuple(out)


def _promoted(ops, a, la, b, lb, batch, left, right, inner, sa, sb, a_big):
    """The product with some of the larger operand's own labels made batch axes, when that
    lets it enter as a view: X[n, i, k, j] (k summed) is a stack over (n, i) of k × j
    matrices, and the smaller operand, which lacks i, is repeated along it.  When the
    product has no batch label the repetition is a view (its stride-0 axes merge into one
    batch axis): a per-token d × d matrix Mᵀ times a weight W runs as one batched product of
    transposed views, with nothing copied (at d = 128 it ran 1.5× faster than copying M to
    a (tokens·d) × d layout for one product).  Otherwise the repetition is a copy, taken
    when it is smaller than the larger operand's permuted copy (in a sliced contraction the
    larger one would otherwise be copied again in every slice).  Stacks of matrices with
    fewer than ``PROMOTE_MIN`` entries are left to one product of a copy.  (result, labels)
    or None."""
    lx, own, sx = (la, left, sa) if a_big else (lb, right, sb)
    for cut in range(len(lx) + 1):
        pre, post = list(lx[:cut]), list(lx[cut:])
        if set(pre) & set(inner):
            return None
        rows = [x for x in post if x not in inner]
        if not set(batch) <= set(pre) or not (post == rows + inner or post == inner + rows):
            continue
        moved = [x for x in pre if x not in batch]
        if not moved:
            return None
        sizes = {**sa, **sb}
        nb, k = math.prod(sizes[x] for x in pre), math.prod(sizes[x] for x in inner)
        big = math.prod(ops.shape(a if a_big else b))
        if batch:                     # the repetition is a copy
            small = math.prod(ops.shape(b if a_big else a))
            if small * math.prod(sx[x] for x in moved) >= big:
                return None
        elif big // nb < PROMOTE_MIN:
            return None
        if a_big:
            m, n = math.prod(sizes[x] for x in rows), math.prod(sizes[x] for x in right)
            x = _matrix(ops, a, la, pre, rows, inner, (nb, m, k))
            order = pre + inner + right
            y = ops.reshape(ops.expand(aligned(ops, b, lb, order), [sizes[z] for z in order]), (nb, k, n))
            out = pre + rows + right
        else:
            m, n = math.prod(sizes[x] for x in left), math.prod(sizes[x] for x in rows)
            y = _matrix(ops, b, lb, pre, inner, rows, (nb, k, n))
            order = pre + left + inner
            x = ops.reshape(ops.expand(aligned(ops, a, la, order), [sizes[z] for z in order]), (nb, m, k))
            out = pre + left + rows
        r = ops.matmul(x, y)
        return ops.reshape(r, [sizes[z] for z in out]), tuple(out)
    return None


def _fit(labels, batch, rows, inner):
    """"MK" if ``labels`` is laid out (batch, rows, inner), "KM" if (batch, inner, rows),
    else "" (the operand must be copied to enter a product)."""
    labels = list(labels)
    if labels == batch + rows + inner:
        return "MK"
    return "KM" if labels == batch + inner + rows else ""


def aligned(ops, a, la, order):
    """``a`` with its labels in ``order``'s order and size-one axes for the labels it lacks."""
    sizes = dict(zip(la, ops.shape(a)))
    return ops.reshape(_perm(ops, a, la, [x for x in order if x in sizes]), [sizes.get(x, 1) for x in order])


def _matrix(ops, a, la, batch, rows, cols, shape):
    """``a`` as a (batch, rows, cols) stack: a view of a (batch, rows, cols) or (batch, cols,
    rows) layout (the latter transposed), a permuted copy otherwise."""
    la = list(la)
    if la == batch + cols + rows and la != batch + rows + cols:
        t = ops.reshape(a, (shape[0], shape[2], shape[1]))
        return ops.transpose(t, (0, 2, 1))
    return ops.reshape(_perm(ops, a, la, batch + rows + cols), shape)


def _perm(ops, a, la, order):
    if list(la) == list(order):
        return a
    return ops.transpose(a, [la.index(x) for x in order])

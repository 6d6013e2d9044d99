"""Generated Jacobian kernels: dense ∂vec_r F/∂vec_r W_p and its compact (structured) form.

The Kronecker-view Jacobian ``Derivation.jacobian(p)`` is lowered to index networks
(``printing.index``) against F's row/column labels and W_p's.  Its compact layout is read
off the lowered terms mechanically:

* **shared axes.**  Every row and column position of the Jacobian resolves, in each term,
  to an atom (an index).  Two positions are merged into one compact axis when they resolve
  to the same atom *in every term* (a Kronecker delta common to the whole sum).  The
  LayerNorm input Jacobian (rows (i, a) of F, columns (j, b) of X) has δ_ij in all four
  terms, so its compact form is J_c[i, a, b] = ∂F[i, a]/∂X[i, b], an L×d×d array.
  A term with further identifications of its own (an identity term δ_ab) is written into
  a diagonal view of the compact array (the same values an ``eye`` operand would give,
  without multiplying by it).
* **factors.**  A Jacobian that is a single network is returned as its factors rather
  than their product: the operands are grouped into connected components through their
  contracted indices, and each component is contracted to its own compact axes.  The FFN
  Jacobian w.r.t. W_1 has no shared axis but is one product,
  J[(i,a),(b,k)] = X[i,b] · σ'(H)[i,k] · W_2[k,a], so its structured form is the three
  factors (L×d, L×d_ff, d×d_ff) instead of the L·d·d·d_ff entries.  A sum of several
  networks is one factor: the compact tensor itself.

``Layout`` records this (which compact axis every row and column atom of the dense
Jacobian lands on, and the axes of each factor); it is stored next to the generated
functions and used by ``Kernel.jacobian`` to expand compact results.

The Jacobian does not depend on the loss: its routines are generated once per option
combination and shared by the loss variants.  Data-dependent Jacobians carry a leading
batch axis (one Jacobian per sequence, not a mean).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import expr as E
from .printing.code import Routine, _scaled, size_lines

JAC_KEY = "jacobian"


@dataclass(frozen=True)
class Layout:
    """J[rows, cols] = Π_f factor_f[axes_f] where the merged positions agree, 0 elsewhere.

    ``row_sizes``/``col_sizes``: the sizes of F's and W_p's index atoms (C order, so the
    dense Jacobian reshapes to row_sizes + col_sizes); ``row_axes``/``col_axes``: the compact
    axis of each atom; ``axis_sizes``: the compact shape; ``factors``: the compact axes of
    each returned factor (axes on no factor are broadcast: the value is 1 along them).
    """

    row_sizes: tuple
    col_sizes: tuple
    row_axes: tuple
    col_axes: tuple
    axis_sizes: tuple
    factors: tuple

    def literal(self) -> str:
        """A Python literal (sizes as strings of the dimension symbols) for generated code."""
        s = lambda xs: tuple(str(x) for x in xs)
        return repr({"row_sizes": s(self.row_sizes), "col_sizes": s(self.col_sizes),
                     "row_axes": self.row_axes, "col_axes": self.col_axes,
                     "axis_sizes": s(self.axis_sizes), "factors": self.factors})

    @property
    def identified(self) -> bool:
        """True when some row atom shares a compact axis with a column atom (a delta)."""
        return len(self.axis_sizes) < len(self.row_axes) + len(self.col_axes)


# ----------------------------------------------------------------------------- analysis
SMALL_TERMS = 8


def lower_jacobian(low, p):
    """(terms, row labels, column labels) of ∂vec_r F/∂vec_r W_p, lowered once per variant."""
    cache = low.__dict__.setdefault("_jacobian_terms", {})
    if p not in cache:
        lw, d = low.lw, low.d
        r = [lab for n in d.F.shape for lab in lw.labels.fresh(n)]
        c = [lab for n in d.param(p).shape for lab in lw.labels.fresh(n)]
        J = d.jacobian(p)
        # a Jacobian with a few terms is written term by term (one elementwise pass each)
        terms = lw.lower_small(J, r, c, SMALL_TERMS)
        cache[p] = (terms if terms is not None else lw.lower(J, r, c), r, c)
    return cache[p]


def _classes(atoms_per_term, n):
    """Positions 0..n−1 merged when their atoms agree in every term: a class per position."""
    cls = list(range(n))
    for i in range(n):
        for j in range(i):
            if cls[j] == j and all(a[i] == a[j] for a in atoms_per_term):
                cls[i] = j
                break
    firsts = list(dict.fromkeys(cls))
    return [firsts.index(c) for c in cls]


def analyse(lw, terms, r, c):
    """(Layout, per-term atom of every compact axis) from the lowered terms."""
    atoms, sizes = [], set()
    for t in terms:
        ra, ca = lw.resolve(t, r), lw.resolve(t, c)
        atoms.append(ra + ca)
        sizes.add((tuple(lw.labels.size[a] for a in ra), tuple(lw.labels.size[a] for a in ca)))
    if len(sizes) != 1:
        # the terms refine F's or W_p's indices differently: no position-wise comparison,
        # the compact form is the dense one over the declared indices
        row_sizes = tuple(lw.labels.size[a] for a in r)
        col_sizes = tuple(lw.labels.size[a] for a in c)
        n = len(r) + len(c)
        layout = Layout(row_sizes, col_sizes, tuple(range(len(r))), tuple(range(len(r), n)),
                        row_sizes + col_sizes, (tuple(range(n)),))
        return layout, None
    (row_sizes, col_sizes), = sizes
    nr = len(row_sizes)
    cls = _classes(atoms, nr + len(col_sizes)) if terms else list(range(nr + len(col_sizes)))
    n_axes = max(cls, default=-1) + 1
    all_sizes = row_sizes + col_sizes
    axis_sizes = tuple(all_sizes[cls.index(k)] for k in range(n_axes))
    axis_atoms = [[a[cls.index(k)] for k in range(n_axes)] for a in atoms]
    layout = Layout(row_sizes, col_sizes, tuple(cls[:nr]), tuple(cls[nr:]), axis_sizes,
                    (tuple(range(n_axes)),))
    return layout, axis_atoms


def components(term, keep):
    """Operand groups joined by contracted indices (atoms not in ``keep``), in operand order."""
    n = len(term.factors)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner = {}
    for i, labs in enumerate(term.labels_resolved):
        for a in labs:
            if a in keep:
                continue
            if a in owner:
                parent[find(i)] = find(owner[a])
            else:
                owner[a] = i
    groups = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


# ----------------------------------------------------------------------------- printing
def routine(variant):
    """A Routine over the layer's variables without the target Y (a Jacobian never reads it)."""
    vs = {n: v for n, v in variant.vars.items() if n != "Y"}
    batched = [n for n in variant.batched if n != "Y"]
    return Routine(variant.t, vs, batched, variant.symbols, lowering=variant.low.lw), vs, batched


def header(variant, vs, batched):
    """Bind every dimension (and the batch size, when there is data) from the arguments."""
    return size_lines(variant.t, variant.symbols, vs, batched)


def _diag(rt, view, atoms):
    """A writable view of the entries of ``view`` whose repeated atoms agree (batch axis kept)."""
    order = list(dict.fromkeys(atoms))
    if len(order) == len(atoms):
        return view, order
    if rt.t["name"] == "numpy":
        sym = {a: chr(ord("a") + i) for i, a in enumerate(order)}
        spec = "..." + "".join(sym[a] for a in atoms) + "->..." + "".join(sym[a] for a in order)
        return rt.emit(f"np.einsum({spec!r}, {view})", False), order
    labels, code = list(atoms), view
    while len(set(labels)) < len(labels):
        i = next(k for k, a in enumerate(labels) if a in labels[k + 1:])
        j = labels.index(labels[i], i + 1)
        n = len(labels)
        # negative axes: the leading batch axis (if any) is untouched
        code = f"{code}.diagonal(0, {i - n}, {j - n})"
        labels = [x for k, x in enumerate(labels) if k not in (i, j)] + [labels[i]]
    return rt.emit(code, False), labels


def write_terms(rt, target, batched, jobs, zeroed=False):
    """Σ_t network_t into ``target`` (allocated); jobs: (term, its atoms in target order).

    A term whose atoms repeat (a delta) is written into a diagonal view, so only the
    entries it can reach are touched.  Terms with distinct atoms go first: the first one
    assigns the whole target and no zero fill is needed.
    """
    jobs = sorted(jobs, key=lambda j: len(set(j[1])) < len(j[1]))
    if not zeroed and len(set(jobs[0][1])) < len(jobs[0][1]):
        rt.line(f"{target}[...] = 0")
    for k, (term, atoms) in enumerate(jobs):
        dims = (["n_batch"] if batched else []) + [rt.size(rt.lw.labels.size[a]) for a in atoms]
        view = rt.emit(rt.fmt("view", target, "(" + ", ".join(dims) + ",)"), False)
        view, order = _diag(rt, view, atoms)
        term = strip_ones(rt, term, order)
        if _outer(rt, term, order, view, batched, accumulate=k > 0):
            continue
        coef, code, _ = rt.network(term, order, keep_batch=True, fold_coef=True)
        rhs = _scaled(rt, coef, code)
        rt.line(f"{view}[...] = {rhs}" if k == 0 else f"{view} += {rhs}")


def _is_ones(ref):
    return (isinstance(ref, tuple) and ref[0] == "ones") or isinstance(ref, E.Ones)


def strip_ones(rt, term, outputs):
    """The term without its all-ones operands (they only broadcast or count).

    A ones operand makes einsum carry a label it would otherwise not see; multiplied into
    a network it can force a path through a huge intermediate (Σ_c 1[a,c] M[i,c] 1[c,b]
    contracted as an (i, a, b, c) array).  Labels left on no operand are broadcast by
    ``Routine.network`` (outputs) or summed as a size factor (the rest).
    """
    keep = [f for f in term.factors if not _is_ones(f.ref)]
    if len(keep) == len(term.factors) or not keep:
        return term
    seen = {a for f in keep for a in rt.lw.resolve(term, f.labels)} | set(outputs)
    coef = sp.sympify(term.coef)
    gone = {a for f in term.factors if _is_ones(f.ref) for a in rt.lw.resolve(term, f.labels)}
    for a in gone - seen:
        coef = coef * rt.lw.labels.size[a]
    return term.copy(factors=tuple(keep), coef=coef)


def _outer(rt, term, order, view, batched, accumulate=False):
    """Write a network without summed indices as one broadcast product into ``view``.

    opt_einsum's last step of such a product (e.g. X[i,b] · C[i,a,k] → J[i,a,b,k]) is a
    batched GEMM whose result is then permuted into the output: two passes over the
    block.  Here both halves are contracted first (small), then multiplied with
    ``out=view`` (one pass); with ``accumulate`` they are added in place (a broadcast
    ``+=`` of one small operand, torch's ``addcmul_`` of two).  False when the term sums an
    index (or, assigning, has one operand).
    """
    labs = [rt.lw.resolve(term, f.labels) for f in term.factors]
    if not labs:
        return False
    if any(not any(a in ls for ls in labs) for a in order):
        # constant along some target axis: contract to the others, broadcast in one pass
        part = _broadcast_part(rt, term, order, list(range(len(labs))), batched, term.coef)
        rt.line(f"{view} += {part}" if accumulate else f"{view}[...] = {part}")
        return True
    if any(a not in order for ls in labs for a in ls):
        return False
    if len(labs) < 2:
        if not accumulate:
            return False
        rt.line(f"{view} += {_broadcast_part(rt, term, order, [0], batched, term.coef)}")
        return True
    # the largest operand alone against the rest (contracted together: still small)
    sizes = [_size(rt, ls) for ls in labs]
    big = max(range(len(labs)), key=lambda i: (sizes[i], -i))
    halves = [[big], [i for i in range(len(labs)) if i != big]]
    coef = sp.sympify(term.coef)
    parts = [_broadcast_part(rt, term, order, h, batched, coef if n == 1 else 1)
             for n, h in enumerate(halves)]
    if not accumulate:
        fn = "np.multiply" if rt.t["name"] == "numpy" else "torch.mul"
        rt.line(f"{fn}({parts[0]}, {parts[1]}, out={view})")
    elif rt.t["name"] == "torch":
        rt.line(f"{view}.addcmul_({parts[0]}, {parts[1]})")
    else:
        rt.line(f"{view} += {parts[0]} * {parts[1]}")
    return True


def _broadcast_part(rt, term, order, h, batched, coef):
    """The factors ``h`` of a term contracted to their output atoms, indexed to broadcast
    against the target's axes ``order`` (None where they do not vary)."""
    labs = [rt.lw.resolve(term, f.labels) for f in term.factors]
    atoms = [a for a in order if any(a in labs[i] for i in h)]
    sub = term.copy(factors=tuple(term.factors[i] for i in h), coef=sp.sympify(coef))
    c, code, b = rt.network(sub, atoms, keep_batch=True)
    name = rt.emit(_scaled(rt, c, code), b)
    idx = ([":"] if b else []) + [(":" if a in atoms else "None") for a in order]
    if not b and batched:
        idx = ["None"] + idx
    return f"{name}[{', '.join(idx)}]"


def _size(rt, labels):
    out = 1
    for a in labels:
        out *= rt._label_size(a)
    return out


def _any_batched(rt, terms):
    """Whether some term reads data (its network keeps a batch axis)."""
    for t in terms:
        for f in t.factors:
            ref = f.ref
            if isinstance(ref, tuple) and ref[0] == "ones":
                continue
            name = rt.intermediate(ref[1])[0] if isinstance(ref, tuple) else rt.mat(ref)
            if rt.is_batched[name]:
                return True
    return False


def _alloc(rt, name, batched, sizes, zero=False):
    dims = (["n_batch"] if batched else []) + [rt.size(s) for s in sizes]
    shape = "(" + ", ".join(dims) + ",)"
    rt.line(f"{name} = {rt.fmt('zeros' if zero else 'empty', shape)}")


def dense(variant, p):
    """``jacobian__<p>``: the dense (numel F × numel W_p) Jacobian, per sequence."""
    terms, r, c = lower_jacobian(variant.low, p)
    rt, vs, batched_args = routine(variant)
    batched = _any_batched(rt, terms)
    numel_f = variant.d.F.rows * variant.d.F.cols
    jobs = [(t, rt.lw.resolve(t, r) + rt.lw.resolve(t, c)) for t in terms]
    # a Jacobian with deltas (block-diagonal) starts from zeros and only its diagonal
    # views are written; NumPy's zeros are calloc'd, so untouched pages cost nothing
    sparse = not jobs or any(len(set(a)) < len(a) for _, a in jobs)
    _alloc(rt, "out", batched, (numel_f, variant.numel(p)), zero=sparse)
    if jobs:
        write_terms(rt, "out", batched, jobs, zeroed=sparse)
    doc = (f"∂vec_r F/∂vec_r {p}: dense (numel F × numel {p}); with data, one Jacobian "
           f"per sequence (leading batch axis), not a mean.")
    return _function(variant, p, "jacobian", rt, vs, batched_args, "out", doc)


def compact(variant, p):
    """(``jacobian_compact__<p>``, Layout): the factors of the compact Jacobian."""
    terms, r, c = lower_jacobian(variant.low, p)
    rt, vs, batched_args = routine(variant)
    layout, axis_atoms = analyse(rt.lw, terms, r, c)
    if axis_atoms is None:                     # refinements differ: dense over declared labels
        batched = _any_batched(rt, terms)
        _alloc(rt, "J", batched, layout.axis_sizes, zero=not terms)
        if terms:
            write_terms(rt, "J", batched,
                        [(t, rt.lw.resolve(t, r) + rt.lw.resolve(t, c)) for t in terms])
        return _function(variant, p, "jacobian_compact", rt, vs, batched_args, "(J,)",
                         _compact_doc(p, layout)), layout
    if len(terms) == 1:
        factors = _factors(rt, terms[0], axis_atoms[0])
        if factors is not None:
            layout = Layout(layout.row_sizes, layout.col_sizes, layout.row_axes,
                            layout.col_axes, layout.axis_sizes, tuple(ax for _, ax in factors))
            ret = "(" + "".join(f"{name}, " for name, _ in factors) + ")"
            return _function(variant, p, "jacobian_compact", rt, vs, batched_args, ret,
                             _compact_doc(p, layout)), layout
    batched = _any_batched(rt, terms)
    _alloc(rt, "J", batched, layout.axis_sizes, zero=not terms)
    if terms:
        write_terms(rt, "J", batched, list(zip(terms, axis_atoms)), zeroed=False)
    return _function(variant, p, "jacobian_compact", rt, vs, batched_args, "(J,)",
                     _compact_doc(p, layout)), layout


def _factors(rt, term, axis_atoms):
    """[(name, compact axes)] of a one-network Jacobian split at its uncontracted indices.

    Components that are only a ones operand are dropped (they are 1); a component with no
    compact axis (a scalar) or a term with repeated axis atoms is not split (None).
    """
    if len(set(axis_atoms)) < len(axis_atoms):
        return None
    keep = set(axis_atoms)
    term = strip_ones(rt, term, axis_atoms)
    term = term.copy()
    term.labels_resolved = [rt.lw.resolve(term, f.labels) for f in term.factors]
    groups = components(term, keep)
    parts = []
    for g in groups:
        labs = {a for i in g for a in term.labels_resolved[i]}
        axes = tuple(k for k, a in enumerate(axis_atoms) if a in labs)
        facs = [term.factors[i] for i in g]
        if all(isinstance(f.ref, tuple) and f.ref[0] == "ones" for f in facs) and len(axes) == len(labs):
            continue
        if not axes:
            return None
        parts.append((facs, axes))
    if not parts:
        return None
    coef = sp.sympify(term.coef)
    out = []
    # the coefficient scales the smallest factor
    smallest = min(range(len(parts)), key=lambda k: len(parts[k][1]))
    for k, (facs, axes) in enumerate(parts):
        sub = term.copy(factors=tuple(facs), coef=coef if k == smallest else sp.Integer(1))
        c, code, _ = rt.network(sub, [axis_atoms[a] for a in axes], keep_batch=True)
        name = rt.emit(_scaled(rt, c, code), False, hint="J")
        out.append((name, axes))
    return out


def _compact_doc(p, layout):
    shape = " × ".join(str(s) for s in layout.axis_sizes)
    return (f"∂vec_r F/∂vec_r {p}, compact ({shape}; row atoms → axes {layout.row_axes}, "
            f"{p} atoms → axes {layout.col_axes}); factors over axes {layout.factors}; "
            f"per sequence.")


def _function(variant, p, kind, rt, vs, batched, ret, doc):
    from .codegen import Function
    name = f"{variant.tag}__{kind}__{p}" if variant.tag else f"{kind}__{p}"
    return Function(name, list(vs), header(variant, vs, batched) + rt.lines, ret, doc)


def routines(variant):
    """(functions, table entries) of every parameter's dense and compact Jacobian."""
    fns, table = [], []
    for p in variant.d.layer.param_names:
        f = dense(variant, p)
        fc, layout = compact(variant, p)
        fns += [f, fc]
        table += [(repr(("jacobian", p)), f.name), (repr(("jacobian_compact", p)), fc.name),
                  (repr(("jacobian_layout", p)), layout.literal())]
    return fns, table

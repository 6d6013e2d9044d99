"""What a variant's kernels compute, independent of the backend: its index networks and
its matrix-view routines.

``Program(derivation)`` lowers, once,

* every Hessian block H_part(p, q) with p not after q in the declared order and part
  ``outer`` or ``functional`` (H(q, p) = H(p, q)ᵀ and the full part is their sum, so the
  runtime derives the rest) to a list of ``Term``: a coefficient and operands over index
  atoms, grouped into the block's row atoms (W_p's) and column atoms (W_q's);
* every Jacobian ∂vec_r F/∂vec_r W_p likewise, over F's atoms and W_p's;
* the compact tensors those terms use (block-diagonal sums such as M_2, kept as per-token
  arrays), each a list of terms over its own axes, and the products of leaves that several
  of those terms hold (``codegen.share``: the MLP's per-token Jacobian of a full block);

and collects the plain-matrix *leaves* the operands read (A, X W_K, the output gradient …)
and the matrix-view routines (loss, gradient, Hessian–vector products, the layer's check
inputs), each routine's sums folded onto the products it forms anyway
(``codegen.factor``).  ``codegen.python`` turns it into source.

Operands carry index *atoms* (integers with symbolic sizes, ``sizes``); data-dependent
operands additionally carry the batch axis, which the printer adds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from ..expr import nodes as E
from ..calculus.hessian import Derivation
from .factor import factor_shared
from .share import share
from .index import Lowering

HALVES = ("outer", "functional")


@dataclass
class Operand:
    """``kind``: leaf (a plain-matrix Expr ``ref`` over ``rows`` + ``cols`` atoms),
    compact (``ref`` the Named/structured node, ``rows`` the atoms of its axes, ``cols`` how
    many atoms each axis has: more than one where the user refines an axis), ones, eye."""

    kind: str
    ref: object
    rows: tuple
    cols: tuple = ()


@dataclass
class Term:
    coef: sp.Expr
    operands: list
    groups: list          # lists of atoms (block: rows, cols; compact: its axes)


@dataclass
class Program:
    derivation: Derivation
    blocks: dict = field(default_factory=dict)       # (p, q, part) -> [Term]
    jacobians: dict = field(default_factory=dict)    # p -> [Term] over (F atoms, W_p atoms)
    compacts: dict = field(default_factory=dict)     # node -> [Term] over its axes
    compact_order: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)        # atom -> symbolic size
    lowering: Lowering = None                          # the lowering (labels, intermediates)
    with_routines: bool = True
    _routines: dict = field(default=None, repr=False)   # ``routines()``, formed once

    @classmethod
    def build(cls, derivation, jacobians=True, pairs=None, routines=True):
        """``pairs``: the blocks (p, q) to lower (default: every p not after q);
        ``jacobians``: True (every parameter), False or a list of parameters; ``routines``:
        whether the matrix-view routines belong to the program (a part of a variant rendered
        on first use holds blocks only)."""
        prog = cls(derivation, with_routines=routines)
        lw = prog.lowering = Lowering()
        d = derivation
        names = d.layer.param_names
        if pairs is None:
            pairs = [(p, q) for i, p in enumerate(names) for q in names[i:]]
        for p, q in pairs:
            for part in HALVES:
                expr = d.block(p, q, part).expr
                prog.blocks[(p, q, part)] = prog._lower(lw, expr, d.param(p).shape, d.param(q).shape)
        for p in (names if jacobians is True else jacobians or ()):
            prog.jacobians[p] = prog._lower(lw, d.jacobian(p), d.F.shape, d.param(p).shape)
        share(prog)
        return prog

    def _lower(self, lw, expr, row_shape, col_shape):
        if expr.is_zero:
            return []
        r = [lab for s in row_shape for lab in lw.labels.fresh(s)]
        c = [lab for s in col_shape for lab in lw.labels.fresh(s)]
        return [self._term(lw, t, [r, c]) for t in lw.lower(expr, r, c)]

    def _term(self, lw, t, groups):
        ops, coef = [], sp.sympify(t.coef)
        for f in t.factors:
            atoms = tuple(lw.resolve(t, f.labels))
            for a in atoms:
                self.sizes[a] = lw.labels.size[a]
            ref = f.ref
            if isinstance(ref, tuple) and ref[0] == "inter":
                self._compact(lw, ref[1])
                per_axis = tuple(len(lw.resolve(t, [ax])) for ax in f.labels)
                ops.append(Operand("compact", ref[1], atoms, per_axis))
            elif isinstance(ref, tuple):
                ops.append(Operand(ref[0], None, atoms))
            else:
                c, op = _leaf(ref, atoms, self.sizes)
                coef *= c
                ops.append(op)
        out = [tuple(lw.resolve(t, g)) for g in groups]
        for g in out:
            for a in g:
                self.sizes[a] = lw.labels.size[a]
        return Term(coef, ops, out)

    def _compact(self, lw, node):
        if node in self.compacts:
            return
        inter = lw.intermediates[node]
        self.compacts[node] = None            # a compact never uses itself
        terms = []
        for t, outs in zip(inter.terms, inter.outputs):
            terms.append(self._term(lw, t, [list(outs)]))
        self.compacts[node] = terms
        self.compact_order.append(node)

    # -- the leaves and routines ---------------------------------------------------------
    def leaves(self):
        """Every plain-matrix operand, in first-use order."""
        seen = {}
        for terms in list(self.blocks.values()) + list(self.jacobians.values()) + \
                [self.compacts[n] for n in self.compact_order]:
            for t in terms:
                for op in t.operands:
                    if op.kind == "leaf":
                        seen.setdefault(op.ref, None)
        return list(seen)

    def routines(self):
        """{name: (expressions, directions)} of the matrix-view routines (``factor_shared``
        applied to each routine's expressions; formed once: the printer counts their
        references and then prints them)."""
        if not self.with_routines:
            return {}
        if self._routines is None:
            self._routines = {name: (factor_shared(exprs), dirs)
                              for name, (exprs, dirs) in self._form_routines().items()}
        return self._routines

    def _form_routines(self):
        d = self.derivation
        out = {"loss": ([d.loss_expr], []), "gradient": ([d.gradient(p) for p in d.layer.param_names], [])}
        dirs = list(d.hvp_directions().values())
        for part in ("outer", "functional", "full"):
            out[f"hvp__{part}"] = (list(d.hvp_expressions(part).values()), dirs)
        checks = d.layer.batch_checks
        if checks:
            out["check_inputs"] = ([c.input for c in checks], [])
        return out


def _leaf(ref, atoms, sizes):
    """(scalar, leaf operand): the atoms split into the matrix's rows and columns (by size),
    transposes and scalar factors taken off (a relabelling and a coefficient)."""
    coef, swap = sp.Integer(1), False
    while isinstance(ref, (E.Scale, E.Transpose)):
        if isinstance(ref, E.Scale):
            coef *= ref.coef
        else:
            swap = not swap
            atoms = _swapped(atoms, sizes, ref.rows)
        ref = ref.args[0]
    rows, cols = _split_by_size(atoms, sizes, ref.rows)
    return coef, Operand("leaf", ref, tuple(rows), tuple(cols))


def _swapped(atoms, sizes, rows):
    """The atoms of Mᵀ (rows first) as those of M (its rows first)."""
    r, c = _split_by_size(atoms, sizes, rows)
    return tuple(c) + tuple(r)


def _split_by_size(atoms, sizes, rows):
    """(row atoms, column atoms): the leading atoms whose sizes multiply to ``rows``."""
    acc, k = sp.Integer(1), 0
    while k < len(atoms) and not E.same(acc, rows):
        acc *= sizes[atoms[k]]
        k += 1
    if not E.same(acc, rows):
        raise NotImplementedError(f"cannot split the atoms {atoms} of a leaf into {rows} rows")
    return list(atoms[:k]), list(atoms[k:])

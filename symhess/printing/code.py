"""Print expressions as NumPy or torch statements (one printer; the targets are data).

``Routine`` collects the statements of one generated function.  Matrix-view expressions
(gradients, Hessian–vector products, and the plain-matrix leaves of Kronecker-view
blocks) are printed node by node, each distinct node once (common subexpressions come
for free from structural hashing).  Kronecker-view expressions are lowered to index
networks (``printing.index``) and printed as ``opt_einsum.contract`` calls whose
contraction path is chosen here, at generation time, and stored in the code.

All data arrays carry a leading batch axis (one sequence per entry); parameters do not.
Matrix code is batch-agnostic (``@`` broadcasts, transposes swap the last two axes);
einsum networks give the batch axis its own label and sum it at the end (the loss is
the batch mean, so the Hessian is too).  Unknown nodes raise: nothing falls back to
``str()``.
"""
from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

import opt_einsum as oe
import sympy as sp
from sympy.printing.pycode import pycode

from .. import expr as E
from .. import scalarfn
from .index import Factor, Lowering, Term, is_leaf

BATCH = ("batch", 0)
N_BATCH = sp.Symbol("n_batch", positive=True, integer=True)   # the number of sequences


def representative_sizes(symbols, hint=None, batch=4):
    """Sizes used to choose contraction orders at generation time: the layer's typical sizes
    where it declares them (``hint``, with "batch" for the number of sequences), else L short
    and widths wide."""
    hint = dict(hint or {})
    env = {s: int(hint.get(s.name, 16 if s.name in ("L", "N") else 64)) for s in symbols}
    return env, int(hint.get("batch", batch))


class Routine:
    """The statements of one generated function and the printer that fills them."""

    def __init__(self, target, variables, batched, symbols, lowering=None, sizes=None):
        self.t = target
        self.variables = variables            # name -> Var (arguments)
        self.batched_vars = set(batched)      # names of arguments with a batch axis
        self.lines = []
        self.memo = {}                        # Expr -> variable name
        self.rhs = {}                         # right-hand side -> variable name (CSE)
        self.is_batched = {}                  # variable name -> bool
        self.taken = set(variables)
        self.count = 0
        self.lw = lowering or Lowering()
        self.inter = {}                       # Named -> compact tensor name
        self.sums = {}                        # compact tensor name -> its (coef, code) terms
        self.uses = {}                        # factor tuple -> chains holding it (plan)
        self.products = {}                    # factor tuple -> (name, transposed)
        self.transposed = {}                  # name of a transposed view -> name of its base
        self.bcast = {}                       # code of a broadcast product -> its operands
        self.gemms = {}                       # code of a (P…, M, K) @ (P…, K, N) product -> its parts
        self.written = 0                      # entries written by dense_into (its passes)
        self.chunk = None                     # a SlabChunk recording dense writes, or None
        self.env, self.batch_size = representative_sizes(symbols, sizes)
        self.env_key = E.size_env(self.env)
        self.like = next((n for n in variables if n in self.batched_vars), next(iter(variables)))
        for n in variables:
            self.is_batched[n] = n in self.batched_vars

    # -- statements --------------------------------------------------------------------
    def fmt(self, key, *args):
        return self.t[key].format(*args, like=self.like)

    def fresh(self, hint="t"):
        base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in hint) or "t"
        if base == "t" or base in self.taken:
            while True:
                name = f"{base}{self.count}"
                self.count += 1
                if name not in self.taken:
                    break
        else:
            name = base
        self.taken.add(name)
        return name

    def emit(self, rhs, batched, hint="t", comment=None):
        """Assign ``rhs`` to a new name (or reuse the name of an identical right-hand side)."""
        if rhs in self.rhs:
            return self.rhs[rhs]
        name = self.fresh(hint)
        if comment:
            self.lines.append(f"# {comment}")
        self.lines.append(f"{name} = {rhs}")
        self.rhs[rhs] = name
        self.is_batched[name] = batched
        return name

    def line(self, text):
        self.lines.append(text)

    def pruned(self, ret):
        """The statements without assignments nothing later reads (a half printed for a
        term and then summed with others through ``_sum_nets`` is one), nor their ``del``."""
        used = set(_NAME.findall(ret))
        keep, dropped = [], False
        for ln in reversed(self.lines):
            if ln.startswith("#"):              # a comment goes with the statement below it
                if not dropped:
                    keep.append(ln)
                continue
            m = _ASSIGN.match(ln)
            dropped = bool(m) and m.group(1) not in used
            if dropped:
                continue
            if ln.startswith("del "):
                keep.append(ln)
                continue
            used.update(_NAME.findall(ln if m is None else ln[m.end():]))
            keep.append(ln)
        kept = [ln for ln in reversed(keep)
                if not ln.startswith("del ") or ln[4:].strip() in used]
        return _freed(kept, set(_NAME.findall(ret)) | set(self.variables))

    def size(self, d) -> str:
        """A dimension expression as Python code (sizes are bound at the function's top)."""
        return _pycode(sp.sympify(d))

    def shape(self, dims) -> str:
        parts = [self.size(d) for d in dims]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"

    def coef(self, c) -> str:
        return _pycode(sp.sympify(c))

    # -- matrix view -----------------------------------------------------------------------
    def mat(self, n) -> str:
        """The name of a variable holding the matrix ``n`` (batched if it reads data)."""
        if n in self.memo:
            return self.memo[n]
        fn = _MATRIX.get(type(n))
        if fn is None:
            raise NotImplementedError(f"the {self.t['name']} printer has no rule for "
                                      f"{type(n).__name__} in a matrix expression")
        name = fn(self, n)
        self.memo[n] = name
        return name

    def batched(self, *names):
        return any(self.is_batched[m] for m in names)

    def plan(self, exprs):
        """Count, over every product chain of ``exprs``, the chains holding each sub-chain
        (either orientation: BᵀAᵀ is (AB)ᵀ), so ``_chain`` can amortise a shared product."""
        for e in exprs:
            for n in E.walk(e):
                if isinstance(n, E.MatMul):
                    for piece in _pieces(n.args):
                        for i in range(len(piece)):
                            for j in range(i + 2, len(piece) + 1):
                                for key in set(_orientations(piece[i:j])):
                                    self.uses[key] = self.uses.get(key, 0) + 1

    def _chain(self, factors):
        """Product of plain matrices in the cheapest order for the representative sizes.

        A sub-product already computed (in either orientation) costs nothing; one that
        other chains of the routine share (``plan``) costs its flops over its users.
        """
        factors = list(factors)
        if len(factors) == 1:
            return self.mat(factors[0])
        cost, split = self._order(factors)

        def build(i, j):
            if i == j:
                return self.mat(factors[i])
            have = self._have(factors[i:j + 1])
            if have is not None:
                return have
            m = split[(i, j)]
            a, b = build(i, m), build(m + 1, j)
            name = self.emit(f"{a} @ {b}", self.batched(a, b))
            key = tuple(factors[i:j + 1])
            self.products.setdefault(key, (name, False))
            self.products.setdefault(_orientations(key)[1], (name, True))
            return name

        return build(0, len(factors) - 1)

    def _order(self, factors):
        """(cost, split) of the matrix-chain dynamic programme over ``factors``."""
        dims = [self._rep(factors[0].rows)] + [self._rep(f.cols) for f in factors]
        k = len(factors)
        cost = {(i, i): Fraction(0) for i in range(k)}
        split = {}
        for span in range(1, k):
            for i in range(k - span):
                j = i + span
                key = tuple(factors[i:j + 1])
                if key in self.products:
                    cost[(i, j)], split[(i, j)] = Fraction(0), i
                    continue
                share = max(1, self.uses.get(key, 1))
                cost[(i, j)], split[(i, j)] = min(
                    (cost[(i, m)] + cost[(m + 1, j)]
                     + Fraction(dims[i] * dims[m + 1] * dims[j + 1], share), m)
                    for m in range(i, j))
        return cost, split

    def chain_cost(self, factors):
        """Flops (amortised, at the representative sizes) of the product of ``factors``."""
        factors = list(factors)
        if len(factors) < 2:
            return Fraction(0)
        return self._order(factors)[0][(0, len(factors) - 1)]

    def T(self, name):
        """The transposed view of ``name`` (remembered: an entrywise function of it is the
        transpose of the function of its base, which may be computed already)."""
        if name in self.transposed:
            return self.transposed[name]
        out = self.emit(self.fmt("T", name), self.batched(name))
        self.transposed.setdefault(out, name)
        return out

    def _have(self, factors):
        """The name of an already computed product of ``factors`` (a view if transposed)."""
        hit = self.products.get(tuple(factors))
        if hit is None:
            return None
        name, transposed = hit
        return self.T(name) if transposed else name

    def _rep(self, d):
        return E.size_at(sp.sympify(d), self.env_key)

    # -- index view ----------------------------------------------------------------------
    def operand(self, factor, term, side_labels):
        """(code, labels) of one einsum operand, reshaped to its refined indices."""
        atoms = self.lw.resolve(term, factor.labels)
        sizes = [self.lw.labels.size[a] for a in atoms]
        ref = factor.ref
        if isinstance(ref, tuple) and ref[0] == "ones":
            return self.emit(self.fmt("ones", self.shape(sizes)), False), atoms
        if isinstance(ref, tuple) and ref[0] == "eye":
            return self._eye(sizes, atoms)
        if isinstance(ref, tuple) and ref[0] == "inter":
            name, axis_sizes = self.intermediate(ref[1])
            natural = list(axis_sizes)
            stored = len(natural)
        else:
            name = self.mat(ref)
            natural = [ref.rows, ref.cols]
            natural = [d for d in natural if sp.sympify(d) != 1]
            stored = 2                # a vector leaf is stored as an (n × 1) matrix
        labels = list(atoms)
        if self.is_batched[name]:
            labels = [side_labels] + labels
        if (len(sizes) != stored or len(sizes) != len(natural)
                or not all(E.same(a, b) for a, b in zip(sizes, natural))):
            dims = ([-1] if self.is_batched[name] else []) + sizes
            name = self.emit(self.fmt("reshape", name, self.shape(dims)), self.is_batched[name])
        return name, labels

    def network(self, term, outputs, keep_batch=False, summed=(), fold_coef=False, search=False,
                layout=None):
        """(coef, contraction code, batched) for one term with the given output atoms.

        ``summed``: atoms summed over that may sit on no operand (a trace of I gives n).
        ``layout``: (batch axes, row atoms) of the Hessian block the result is written into
        (``_direct_halves``).
        """
        if search:      # a pairing: inline one-term intermediates where that is cheaper
            term, ops, labs = self._cheaper_operands(term, outputs)
        else:
            ops, labs = self._operands(term)
        present = {a for ls in labs for a in ls}
        missing = [a for a in dict.fromkeys(outputs) if a not in present]
        if missing:   # an index no operand carries (a broadcast): an explicit ones operand
            sizes = [self.lw.labels.size[a] for a in missing]
            ops.append(self.emit(self.fmt("ones", self.shape(sizes)), False))
            labs.append(missing)
        for a in dict.fromkeys(summed):
            if a not in present and a not in outputs:
                term = term.copy(coef=term.coef * self.lw.labels.size[a])
        batch_labels = sorted({lab for ls in labs for lab in ls if isinstance(lab, tuple)})
        batched = bool(batch_labels)
        out = ([BATCH] if keep_batch and batched else []) + list(outputs)
        coef = sp.sympify(term.coef)
        if not keep_batch:
            coef = coef / N_BATCH ** len(batch_labels)
        if fold_coef and coef != 1 and len(ops) > 1:
            coef, ops = 1, self._fold(coef, ops, labs)
        code = self.split_contract(ops, labs, out, layout=layout) if fold_coef else None
        return coef, code or self.contract(ops, labs, out, search), (batched and keep_batch)

    def _operands(self, term, inline=False):
        """(codes, labels) of a term's einsum operands; with ``inline``, a one-term compact
        intermediate (M_2 = Xᵀ ∂A X per token) enters as its own operands, so the path
        search may contract through it (a Frobenius pairing then works with L×L Gram
        matrices instead of the per-token d×d moments)."""
        ops, labs = [], []
        for f in term.factors:
            sub = self._inlined(f, term) if inline else None
            if sub is not None:
                c, s_ops, s_labs = sub
                term = term.copy(coef=term.coef * c)
                ops += s_ops
                labs += s_labs
                continue
            code, labels = self.operand(f, term, ("batch", f.side))
            ops.append(code)
            labs.append(labels)
        return (term, ops, labs) if inline else (ops, labs)

    def _inlined(self, f, term, dry=False):
        """(coef, codes, labels) of a one-term intermediate's defining network used at the
        factor ``f``: its compact axes become the caller's atoms, its inner indices fresh
        labels, its batch index the caller's copy; None where that does not apply.
        ``dry``: the labels only, nothing printed."""
        ref = f.ref
        if not (isinstance(ref, tuple) and ref[0] == "inter"):
            return None
        inter = self.lw.intermediates.get(ref[1])
        if inter is None or len(inter.terms) != 1:
            return None
        outer = [self.lw.resolve(term, [a]) for a in f.labels]
        if any(len(o) != 1 for o in outer) or len({o[0] for o in outer}) != len(outer):
            return None
        inner, outs = inter.terms[0], inter.outputs[0]
        ren = dict(zip(outs, (o[0] for o in outer)))
        present = set()
        ops, labs = [], []
        for g in inner.factors:
            if dry:
                code, glabs = None, self._operand_labels(g, inner, ("batch", f.side))
            else:
                code, glabs = self.operand(g, inner, ("batch", f.side))
            new = []
            for a in glabs:
                if isinstance(a, tuple):
                    new.append(("batch", f.side))
                    continue
                present.add(a)
                if a not in ren:
                    ren[a] = self.lw.labels.new(self.lw.labels.size[a])
                new.append(ren[a])
            ops.append(code)
            labs.append(new)
        if not set(outs) <= present:
            return None                      # a broadcast axis: keep the computed tensor
        return labs if dry else (sp.sympify(inner.coef), ops, labs)

    def _cheaper_operands(self, term, outputs):
        """The term's operands as they are or with one-term intermediates inlined, whichever
        contracts in fewer flops at the representative sizes.  Both are compared by their
        labels alone (``_labels``); only the chosen one is printed."""
        plain = self._labels(term, inline=False)
        flat = self._labels(term, inline=True)
        if len(flat) != len(plain):
            costs = []
            for ls in (plain, flat):
                shapes = tuple(tuple(self._label_size(a) for a in x) for x in ls)
                costs.append(_path(_spec(ls, list(dict.fromkeys(outputs))), shapes, True)[1])
            if costs[1] < costs[0]:
                return self._operands(term, inline=True)
        ops, labs = self._operands(term)
        return term, ops, labs

    def _labels(self, term, inline):
        """The operand labels ``_operands`` gives (batch label included), printing nothing."""
        labs = []
        for f in term.factors:
            sub = self._inlined(f, term, dry=True) if inline else None
            if sub is not None:
                labs += sub
                continue
            labs.append(self._operand_labels(f, term, ("batch", f.side)))
        return labs

    def _operand_labels(self, factor, term, side_labels):
        """The labels ``operand`` gives a factor (its atoms, after the batch label when it
        reads data), without printing it."""
        atoms = list(self.lw.resolve(term, factor.labels))
        return ([side_labels] if self._reads_data(factor.ref) else []) + atoms

    def _reads_data(self, ref):
        """Whether an operand (a leaf expression or an intermediate key) carries the batch
        axis, as its printed array would."""
        if isinstance(ref, tuple):
            if ref[0] != "inter":
                return False
            if ref[1] in self.inter:
                return self.is_batched[self.inter[ref[1]][0]]
            inter = self.lw.intermediates[ref[1]]
            return any(self._reads_data(g.ref) for t in inter.terms for g in t.factors)
        if ref in self.memo:
            return self.is_batched[self.memo[ref]]
        if isinstance(ref, E.Var):
            return ref.name in self.batched_vars
        return any(self._reads_data(a) for a in ref.args)

    def _snapshot(self):
        return (self.written, len(self.lines), dict(self.rhs), set(self.taken), self.count,
                dict(self.is_batched), dict(self.memo), dict(self.inter), dict(self.products),
                dict(self.transposed), dict(self.bcast), dict(self.gemms), dict(self.sums))

    def _restore(self, snap):
        """Forget every statement and name made since ``_snapshot``."""
        self.written, n, rhs, taken, count, is_batched, memo, inter, products, transposed, \
            bcast, gemms, sums = snap
        self.bcast, self.gemms, self.sums = dict(bcast), dict(gemms), dict(sums)
        del self.lines[n:]
        self.rhs, self.taken, self.count = dict(rhs), set(taken), count
        self.is_batched, self.memo, self.inter = dict(is_batched), dict(memo), dict(inter)
        self.products, self.transposed = dict(products), dict(transposed)

    def _fold(self, coef, ops, labs):
        """Scale the smallest operand instead of the (block-sized) result: one pass fewer."""
        k = min(range(len(ops)), key=lambda i: (_prod(self._label_size(a) for a in labs[i]), i))
        ops = list(ops)
        ops[k] = self.emit(_scaled(self, coef, ops[k]), self.is_batched[ops[k]])
        return ops

    def contract(self, ops, labs, out, search=False):
        """A contraction with its order chosen now for the representative sizes, printed as
        one statement per pairwise step (a permute/reshape and a batched matmul each).

        Printing the steps instead of one ``oe.contract`` call removes its per-call parsing
        (≈ 60–100 µs, more than the arithmetic of most steps here) and lets identical steps
        of different networks share one statement (the routine's common-subexpression
        table), e.g. the Gram matrices of the pairings of a Frobenius norm.
        """
        if not ops:                   # a pure product of deltas (⟨I, I⟩): the coefficient
            return "1.0"
        out = list(out)
        spec = _spec(labs, out)
        if len(ops) == 1 and spec.split("->")[0] == spec.split("->")[1]:
            return ops[0]
        shapes = tuple(tuple(self._label_size(a) for a in ls) for ls in labs)
        path, _ = _path(spec, shapes, search)
        ops, labs = list(ops), [list(ls) for ls in labs]
        for k, pos in enumerate(path):
            taken = [(ops.pop(i), labs.pop(i)) for i in sorted(pos, reverse=True)]
            keep = set(out).union(*map(set, labs))
            last = k == len(path) - 1
            code, lab = self._step(taken, keep, out if last else None)
            if last:
                return self._arrange_out(code, lab, out)
            ops.append(self.emit(code, bool(lab) and isinstance(lab[0], tuple)))
            labs.append(lab)
        raise AssertionError("a contraction path ends with its last step")

    def _step(self, taken, keep, out):
        """(code, labels) of one pairwise (or single-operand) step; ``out``: the routine's
        output order at the last step (the product's orientation is chosen to match it)."""
        if any(len(set(ls)) < len(ls) for _, ls in taken):     # a diagonal: let einsum do it
            labs = [ls for _, ls in taken]
            res = [a for a in dict.fromkeys(a for ls in labs for a in ls) if a in keep]
            args = ", ".join(c for c, _ in taken)
            return f"oe.contract({_spec(labs, res)!r}, {args})", res
        if len(taken) == 1:
            return self._sum_out(*taken[0], keep)
        (x, lx), (y, ly) = taken
        x, lx = self._sum_out(x, lx, keep | set(ly))
        y, ly = self._sum_out(y, ly, keep | set(lx))
        if out is None:               # an inner step: its natural order (shared, then free)
            out = [a for a in lx if a in ly and a in keep] + \
                [a for a in lx if a not in ly] + [a for a in ly if a not in lx]
        return self.product(x, lx, y, ly, list(out)), list(out)

    def product(self, x, lx, y, ly, out, split=None):
        """Σ over the labels both operands carry and ``out`` lacks, with the result laid out
        in ``out``'s order: one broadcast matmul (P…, M, K) @ (P…, K, N) when ``out`` splits
        as P + M + N (M free labels of one operand, N of the other, the rest in P), so no
        strided transpose follows a block-sized product; else the natural order, permuted."""
        both = [a for a in lx if a in ly]
        con = [a for a in both if a not in out]
        if all(a in both for a in out):
            if not con:                                   # a Hadamard product
                return self._arrange_out(f"{x} * {self._permuted(y, ly, lx)}", lx, out)
            if not out:                                   # a full inner product
                return f"({x} * {self._permuted(y, ly, lx)}).sum()"
        if not con:         # a broadcast product: both operands aligned to out, no permute
            return self._broadcast(x, lx, y, ly, out)
        (x, lx), (y, ly), pre, m, n = _oriented((x, lx), (y, ly), out, split)
        xm = self._grouped(x, lx, pre, [m, con])
        ym = self._grouped(y, ly, pre, [con, n])
        if _carries(lx, ly, pre):
            gemm = (xm, ym)
        elif split:                 # one half broadcasts along P: expanded for a direct write
            gemm = (xm, ym, all(a in lx for a in pre), all(a in ly for a in pre))
        else:
            gemm = None
        return self._finish(f"({xm} @ {ym})", pre, m, n, out, gemm)

    def _aligned(self, x, lx, out):
        """``x`` (labels ``lx`` ⊆ ``out``) permuted to ``out``'s order with a unit axis for
        each label it lacks, so that it broadcasts against the result."""
        own = [a for a in out if a in lx]
        x = self._permuted(x, lx, own)
        if len(own) == len(out):
            return x
        return self.fmt("reshape", x, self.shape([self._dim(a) if a in lx else 1 for a in out]))

    def _broadcast(self, x, lx, y, ly, out):
        """The code of x * y, both aligned to ``out``, remembered with the aligned operands
        and the labels (``out``, each operand's) so that a dense write can multiply straight
        into its target (``mul_into``), or into one chunk of it at a time (``SlabChunk``)."""
        xa, ya = self._aligned(x, lx, out), self._aligned(y, ly, out)
        code = f"({xa} * {ya})"
        self.bcast[code] = (xa, ya, list(out), set(lx), set(ly))
        return code

    def _finish(self, code, pre, m, n, out, gemm=None):
        """A (P…, M, N) product result reshaped to its labels and permuted to ``out``.

        ``gemm``: the operands (P…, M, K), (P…, K, N) of a matrix product whose halves both
        carry every P label; a result that needs no permute is remembered with them, so that
        a dense write can multiply straight into its target (``_gemm_into``)."""
        if len(m) != 1 or len(n) != 1:
            code = self.fmt("reshape", code, self.shape([self._dim(a) for a in pre + m + n]))
        if gemm is not None and list(pre + m + n) == list(out) and m and n:
            full = tuple(gemm[2:]) or (True, True)
            self.gemms[code] = (gemm[0], gemm[1], [self._dim(a) for a in pre], len(m), len(n),
                                _prod(self._dim(a) for a in m), _prod(self._dim(a) for a in n),
                                full)
        return self._arrange_out(code, pre + m + n, out)

    def _dim(self, lab):
        return N_BATCH if isinstance(lab, tuple) else self.lw.labels.size[lab]

    def _sum_out(self, x, lx, keep):
        """Sum the axes of ``x`` no later step needs."""
        gone = [i for i, a in enumerate(lx) if a not in keep]
        if not gone:
            return x, lx
        axes = ", ".join(map(str, gone)) + ("," if len(gone) == 1 else "")
        return f"{x}.sum(({axes}))", [a for a in lx if a in keep]

    def _permuted(self, x, lx, order):
        if list(lx) == list(order):
            return x
        return self.fmt("permute", x, ", ".join(str(lx.index(a)) for a in order))

    def _grouped(self, x, lx, pre, groups):
        """``x`` permuted to (pre…, group₀…, group₁…), each group merged into one axis and a
        unit axis for each label of ``pre`` that ``x`` lacks (broadcast by the product)."""
        own = [a for a in pre if a in lx]
        x = self._permuted(x, lx, own + groups[0] + groups[1])
        if len(own) == len(pre) and all(len(g) == 1 for g in groups):
            return x
        dims = [self._dim(a) if a in lx else 1 for a in pre] + \
            [_prod(self._dim(a) for a in g) for g in groups]
        return self.fmt("reshape", x, self.shape(dims))

    def _arrange_out(self, code, lab, out):
        if list(lab) == list(out):
            return code
        return self._permuted(code if code.isidentifier() else f"({code})", lab, list(out))

    def split_contract(self, ops, labs, out, depth=0, layout=None):
        """A block-sized product whose last GEMM writes straight in the output's layout.

        opt_einsum's last step puts the newest intermediate's free indices first, so the
        result often needs a strided transpose (its innermost axis outermost in the block)
        that costs several times the contraction.  Here the two halves of the last step
        are contracted first and the final product is emitted with the operand whose free
        indices end the output on the right.  The result is a ``Final`` (its halves can be
        stacked with other terms'); ``None`` when the last step is not a product of two
        halves with disjoint free indices.
        """
        if len(ops) < 2:
            return None
        shapes = tuple(tuple(self._label_size(a) for a in ls) for ls in labs)
        path, cost = _path(_spec(labs, out), shapes)
        halves = _last_halves(len(ops), path)
        frees = [_half_frees(labs, h, out) for h in halves]
        split = None
        if _out_split(*frees, out) is None:     # the default last product needs a permute
            alt = self._direct_halves(labs, out, cost, layout)
            if alt is not None:
                halves, frees, split = alt
        both = set(frees[0]) & set(frees[1])
        if not both - set(out) and (len(ops) < 3 or set(frees[0]) == set(frees[1])):
            return None     # no GEMM, and no broadcast product of halves to share
        names, nets = [], []
        for k in (0, 1):
            h = halves[k]
            nets.append(([ops[i] for i in h], [labs[i] for i in h], frees[k]))
            if len(h) == 1 and list(labs[h[0]]) == frees[k]:
                names.append(ops[h[0]])
            else:
                names.append(self.emit(self.contract(*nets[-1]), False))
        x, y = (names[0], frees[0]), (names[1], frees[1])
        final = Final(self.product(*x, *y, list(out), split), x, y, list(out))
        final.nets, final.depth, final.split = nets, depth, split
        # stacking halves of several terms copies them: worth it only for small halves
        final.small = STACK_RATIO * sum(_prod(self._label_size(a) for a in f) for f in frees) \
            <= _prod(self._label_size(a) for a in out)
        return final

    def _direct_halves(self, labs, out, cost, layout):
        """(halves, frees, split) of another last product of a network written into a block,
        one whose result lies in the block's order with one half broadcast along the leading
        output labels (P) it lacks -- e.g. Σ_l c[l,f] X[l,k'] E[l,k,q] into the block
        [k, f, k', q] as c (broadcast over k) times X ∘ E, one batched GEMM written into the
        strided block, where opt_einsum's cheapest order (c ∘ X first) leaves f and k' in one
        half and the block needs a permuted copy.  Only a few GEMMs of fair size, halves small
        next to the block, and a cost (both halves, the GEMM, one write) below the default's
        plus the copy; None when no halving qualifies."""
        n = len(labs)
        if n > DIRECT_MAX_OPERANDS or layout is None:
            return None
        n_lead, n_rows = layout
        size = _prod(self._label_size(a) for a in out)
        best, limit = None, cost + 2 * TRAFFIC_WEIGHT * size
        for mask in range(1, 2 ** (n - 1)):
            halves = [[i for i in range(n) if not mask >> i & 1],
                      [i for i in range(n) if mask >> i & 1]]
            frees = [_half_frees(labs, h, out) for h in halves]
            split = _out_split(*frees, out, bcast=True)
            if split is None:
                continue
            swap, pre, m, nn = split
            if not _writes_into(len(pre), len(m), n_lead, n_rows):
                continue
            left, right = (frees[1], frees[0]) if swap else (frees[0], frees[1])
            con = [a for a in left if a in right and a not in out]
            if not (con and m and nn):
                continue
            lacks = [not all(a in f for a in pre) for f in (left, right)]
            if all(lacks):
                continue             # at most one half broadcasts
            dims = [_prod(self._label_size(a) for a in g) for g in (pre, m, nn)]
            if dims[0] > DIRECT_MAX_BATCH or min(dims[1:]) < DIRECT_MIN_SIDE:
                continue             # many small GEMMs: slower than one and a permuted copy
            sizes = [_prod(self._label_size(a) for a in f) for f in (left, right)]
            if max(sizes) * 2 > size:
                continue             # a half as large as the block: no pass saved
            c = _prod(self._label_size(a) for a in set(frees[0]) | set(frees[1]))
            c += TRAFFIC_WEIGHT * (size + sum(sizes))
            for h, f in zip(halves, frees):
                if len(h) > 1 or list(labs[h[0]]) != f:
                    c += _path(_spec([labs[i] for i in h], f),
                               tuple(tuple(self._label_size(a) for a in labs[i]) for i in h))[1]
            if c < limit:
                best, limit = (halves, frees, split), c
        return best

    def _eye(self, sizes, atoms):
        """δ between two (possibly refined) label groups: an identity reshaped to the atoms."""
        name = self.emit(self.fmt("eye", self.size(_prod(sizes[:len(atoms) // 2]))), False)
        if len(atoms) > 2:
            name = self.emit(self.fmt("reshape", name, self.shape(sizes)), False)
        return name, atoms

    def _label_size(self, lab):
        if isinstance(lab, tuple):
            return self.batch_size
        return self._rep(self.lw.labels.size[lab])

    def intermediate(self, node):
        """Compute a compact structured intermediate (e.g. M_2 as L×d×d) once."""
        if node in self.inter:
            return self.inter[node]
        inter = self.lw.intermediates[node]
        parts, batched = [], False
        for term, outputs in zip(inter.terms, inter.outputs):
            c, code, b = self.network(term, outputs, keep_batch=True)
            parts.append((c, code))
            batched |= b
        rhs = _sum(self, self._reused_sum(parts))
        label = node.name if isinstance(node, E.Named) else _compact_label(node)
        name = rhs if rhs in self.sums else self.emit(
            rhs, batched, hint=label,
            comment=f"{label}: compact tensor {tuple(str(s) for s in inter.axis_sizes)}")
        self.inter[node] = (name, inter.axis_sizes)
        self.sums[name] = parts
        return self.inter[node]

    def _reused_sum(self, parts):
        """``parts`` with the largest earlier compact sum they contain, up to one scalar,
        replaced by that tensor: LayerNorm chains give nested sums (S₁ ⊂ S₂ ⊂ S₃, and
        2/d_V · S₂ as a term set of its own), each otherwise recomputed term by term."""
        best = None
        for name, prev in self.sums.items():
            if len(prev) < 2 or len(prev) > len(parts) or (best and len(prev) <= len(best[2])):
                continue
            left, k = list(parts), None
            for c, code in prev:
                j = next((i for i, (_, code2) in enumerate(left) if code2 == code), None)
                if j is None:
                    break
                r = sp.cancel(sp.sympify(left[j][0]) / sp.sympify(c))
                if k is not None and sp.cancel(r - k) != 0:
                    break
                k = r
                del left[j]
            else:
                best = (k, name, prev, left)
        if best is None:
            return parts
        k, name, _, left = best
        return [(k, name)] + left

    # -- outputs of Kronecker-view expressions ----------------------------------------------
    def terms(self, expr, rows, cols):
        """Lower ``expr`` with row labels split as ``rows`` sizes and columns as ``cols``."""
        r = [lab for d in rows for lab in self.lw.labels.fresh(d)]
        c = [lab for d in cols for lab in self.lw.labels.fresh(d)]
        return self.lw.lower(expr, r, c), r, c

    def dense_into(self, target, terms, r, c, fresh, keep_batch=False):
        """Write Σ terms into ``target`` (a 2-D array or slice); ``fresh``: target unset.
        ``keep_batch``: the target has a leading batch axis and receives each sequence's
        sum (no batch mean); a term that reads no data broadcasts over it.

        Terms whose last product has the same shape (same free indices of each half in the
        same output positions) are written by one product: their halves are stacked along
        the contracted index, Σ_t L_t R_t = [L_1 … L_T][R_1; …; R_T], so the block is
        written once per group instead of once per term.
        """
        if not terms:
            self._zero(target)
            return
        lead = [BATCH] if keep_batch else []
        size = (self.batch_size if keep_batch else 1) * _prod(
            self._rep(self.lw.labels.size[a])
            for a in self.lw.resolve(terms[0], r) + self.lw.resolve(terms[0], c))
        # a term that writes every entry goes first, so the block needs no zeroing pass
        terms = sorted(terms, key=lambda t: _repeats(self, t, r, c))
        needs_zero = fresh and _repeats(self, terms[0], r, c)
        chunk = self.chunk
        if needs_zero:
            self._zero(target)
            self.written += size
        printed, split = [], {}
        for term in terms:
            row_atoms = self.lw.resolve(term, r)
            n_rows, atoms = len(row_atoms), row_atoms + self.lw.resolve(term, c)
            sizes = [self.lw.labels.size[a] for a in atoms]
            view = self.emit(self.fmt("view", target, self.shape([N_BATCH] * len(lead) + sizes)),
                             False)
            order = list(dict.fromkeys(atoms))
            if len(order) < len(atoms):        # the batch label never repeats: it stays first
                view, order = _diag_view(self, view, lead + atoms)
                order = order[len(lead):]
            else:      # the view's axes: (batch,) rows…, columns… (a group merges within one)
                split.setdefault(view, set()).add((len(lead), n_rows, len(atoms)))
            if chunk is not None:
                chunk.view(view, target, lead, row_atoms, atoms, order)
            layout = None if len(order) < len(atoms) or keep_batch else (len(lead), n_rows)
            coef, code, _ = self.network(term, order, fold_coef=True, keep_batch=keep_batch,
                                         layout=layout)
            printed.append((view, coef, code))
        first = fresh and not needs_zero
        for view, how, members in self._write_groups(printed):
            rhs = self._group_code(how, members)
            pair = self.bcast.get(rhs)
            if chunk is not None:           # a broadcast product, or the slab is not chunked
                chunk.write(self, "mul_into" if first else "addmul_into", pair, view)
            elif pair is not None and "mul_into" in self.t:     # one pass, no temporary
                self.line(self.fmt("mul_into" if first else "addmul_into", *pair[:2], view))
            elif self._gemm_into(view, rhs, first, split.get(view)):
                pass
            else:
                self.line(f"{view}[...] = {rhs}" if first else f"{view} += {rhs}")
            self.written += size
            first = False

    def _zero(self, target):
        """Zero ``target`` (recorded for each chunk instead while a ``SlabChunk`` is open)."""
        if self.chunk is not None:
            self.chunk.zero(target)
        else:
            self.line(f"{target}[...] = 0")

    def _gemm_into(self, view, rhs, first, split):
        """Write (first) or add the matrix product ``rhs`` straight into ``view`` when the
        product's (P…, M, N) layout is the view's own axis order and each group merges in
        place: P over the batch axis and leading rows, M within the rows or within the
        columns, N the trailing columns (a view's columns are contiguous, its rows evenly
        strided). BLAS then writes the block once instead of into a temporary that is
        copied (or added) into it. Returns False where that does not apply."""
        g = self.gemms.get(rhs)
        if g is None or split is None or len(split) != 1:
            return False
        (n_lead, n_rows, n_atoms), = split
        xm, ym, pre, n_m, n_n, m_size, n_size, (x_full, y_full) = g
        p = len(pre)
        if p + n_m + n_n != n_lead + n_atoms or not _writes_into(p, n_m, n_lead, n_rows):
            return False
        key = ("" if first else "add") + ("bmm_into" if pre else "mm_into")
        if key not in self.t:
            return False
        if pre:
            P = _prod(pre)
            lead = self.shape(pre)
            if not x_full:          # a half without the batch labels: expanded along them
                xm = self.fmt("bcast_lead", self.emit(xm, False), lead)
            if not y_full:
                ym = self.fmt("bcast_lead", self.emit(ym, False), lead)
            x3 = xm if p == 1 else self.fmt("reshape", xm, f"({self.size(P)}, {self.size(m_size)}, -1)")
            y3 = ym if p == 1 else self.fmt("reshape", ym, f"({self.size(P)}, -1, {self.size(n_size)})")
            shape = [P, m_size, n_size]
        else:
            x3, y3, shape = xm, ym, [m_size, n_size]
        out = self.emit(self.fmt("view", view, self.shape(shape)), False)
        self.line(self.fmt(key, x3, y3, out))
        return True

    def _group_code(self, how, members):
        """The code of one group of ``_write_groups``: a (scaled) term alone, one product of
        stacked halves, or one product of a shared half with the sum of the others."""
        if how == "alone":
            coef, code = members[0]
            return _scaled(self, coef, str(code))
        if how == "stack":
            return self._stacked([code for _, code in members])
        return self._shared([code for _, code in members], how)

    def _write_groups(self, printed):
        """[(view, how, members)]: terms written by one product each ("alone"), by one product
        of stacked halves ("stack": small halves of the same arrangement), or by one product
        of a half they share with the sum of their other halves ("M"/"N": Σ_t A B_t =
        A Σ_t B_t, e.g. the functional terms of a post-LN block that share ∂Y/∂W_Q)."""
        keys = []
        for view, coef, code in printed:
            final = isinstance(code, Final) and coef == 1
            stack = code.stack_key() if final and code.small else None
            shared = self._shared_keys(code) if final else {}
            keys.append((stack, shared))
        count = {}
        for view_code, (_, shared) in zip(printed, keys):
            for k in shared.values():
                count[(view_code[0], k)] = count.get((view_code[0], k), 0) + 1
        groups = {}
        for i, ((view, coef, code), (stack, shared)) in enumerate(zip(printed, keys)):
            key = (view, "alone", i)
            # a half shared with another term beats stacking (no copies of it, K not K·T)
            side = next((sd for sd, k in shared.items() if count[(view, k)] > 1), None)
            if side is not None:
                key = (view, side, shared[side])
            elif stack is not None:
                key = (view, "stack", stack)
            groups.setdefault(key, []).append((coef, code))
        return [(view, how if len(members) > 1 else "alone", members)
                for (view, how, _), members in groups.items()]

    def _halves(self, f):
        """(codes of the two halves arranged as (P…, M, K) and (P…, K, N), P, M, N)."""
        (x, lx), (y, ly), pre, m, n = f.oriented()
        return (self._grouped(x, lx, pre, [m, f.summed]), self._grouped(y, ly, pre, [f.summed, n]),
                pre, m, n)

    def _shared_keys(self, f):
        """{"M": key, "N": key}: the product's arrangement with one half's code; two terms
        with an equal key multiply the same tensor, laid out alike, on that side."""
        stack = f.arrangement_key()
        if stack is None:
            return {}
        xg, yg, _, _, _ = self._halves(f)
        return {"M": (stack, "M", xg), "N": (stack, "N", yg)}

    def _shared(self, finals, side):
        """One product for Σ_t A B_t (``side`` "M": A on the left) or Σ_t B_t A ("N").

        The B_t are summed before they are permuted when their axes play the same roles
        (one permuted copy of the sum instead of one per term: the halves can be as large
        as the block)."""
        parts = [self._halves(f) for f in finals]
        xg, yg, pre, m, n = parts[0]
        own = 1 if side == "M" else 0          # the half each term brings itself
        raw = []
        for f in finals:
            (x, lx), (y, ly), pre_t, m_t, n_t = f.oriented()
            name, labs = ((y, ly) if own else (x, lx))
            order = pre_t + (f.summed + n_t if own else m_t + f.summed)
            raw.append((name, labs, tuple(order.index(a) for a in labs)))
        if len({r[2] for r in raw}) == 1:        # same roles: sum first, arrange once
            if finals[0].depth < SUM_DEPTH:       # the sum's own shared factors pulled out
                total = self._sum_nets([f.nets[_half_index(f, r[0])] for f, r in zip(finals, raw)],
                                       finals[0].depth + 1)
            else:
                total = self.emit(" + ".join(r[0] for r in raw), False)
            f, labs = finals[0], raw[0][1]
            if not f.summed:                       # Σ_t A ∘ B_t = A ∘ Σ_t B_t, aligned
                (x, lx), (y, ly), _, _, _ = f.oriented()
                halves = ((x, lx), (total, labs)) if own else ((total, labs), (y, ly))
                return self._broadcast(*halves[0], *halves[1], f.out)
            groups = [f.summed, n] if own else [m, f.summed]
            rest = self._grouped(total, labs, pre, groups)
        else:
            rest = self.emit(" + ".join(p[own] for p in parts), False)
        op = "@" if finals[0].summed else "*"
        code = f"({xg} {op} {rest})" if own else f"({rest} {op} {yg})"
        gemm = ((xg, rest) if own else (rest, yg)) if op == "@" and _full(finals, pre) else None
        return self._finish(code, pre, m, n, finals[0].out, gemm)

    def _sum_nets(self, nets, depth):
        """The name of Σ networks ((ops, labels, out) each, outputs alike), grouped as a dense
        block's terms are (``_write_groups``): halves that terms share are multiplied once."""
        codes = []
        for ops, labs, out in nets:
            code = self.split_contract(ops, labs, out, depth) if len(ops) > 1 else None
            if code is None:
                code = ops[0] if len(ops) == 1 and list(labs[0]) == list(out) else \
                    self.contract(ops, labs, out)
            codes.append(code)
        parts = [self._group_code(how, members)
                 for _, how, members in self._write_groups([(None, 1, c) for c in codes])]
        return self.emit(" + ".join(parts), False)

    def _stacked(self, finals):
        """One product for Σ_t L_t R_t: each term's halves arranged as (P…, M, K_t) and
        (P…, K_t, N), concatenated along K (the terms share P, M, N: same ``stack_key``)."""
        parts = [self._halves(f) for f in finals]
        xs = [self.emit(p[0], False) for p in parts]
        ys = [self.emit(p[1], False) for p in parts]
        big_x = self.emit(self.fmt("concat_last", ", ".join(xs)), False)
        big_y = self.emit(self.fmt("concat_rows", ", ".join(ys)), False)
        _, _, pre, m, n = parts[0]
        return self._finish(f"({big_x} @ {big_y})", pre, m, n, finals[0].out,
                            (big_x, big_y) if _full(finals, pre) else None)

    def scalar(self, networks):
        """Σ coef · contraction for scalar networks."""
        return _sum(self, networks) if networks else self.zero()

    def zero(self):
        """A structurally zero scalar result: a 0-d array of the inputs' dtype (and device),
        like every other result of a routine."""
        return self.emit(self.fmt("zeros", "()"), False, hint="zero")


# networks of up to this many operands are searched for a last product written in the
# block's order (``Routine._direct_halves``: 2^(n-1) halvings), with at most
# DIRECT_MAX_BATCH GEMMs of at least DIRECT_MIN_SIDE rows and columns
DIRECT_MAX_OPERANDS = 10
DIRECT_MAX_BATCH = 64
DIRECT_MIN_SIDE = 16


def _writes_into(p, n_m, n_lead, n_rows):
    """Whether a (P…, M, N) product of a block view's atoms (``n_lead`` batch axes, then
    ``n_rows`` row atoms, then columns) can be written into it by BLAS: P over the batch
    axis and leading rows, M within the rows or within the columns, N the trailing columns."""
    rows_end = n_lead + n_rows
    return p >= n_lead and (p + n_m == rows_end or p == rows_end)


def _half_frees(labs, h, out):
    """The free labels of the operands ``h`` of a network: output labels they carry (in
    ``out``'s order), then the labels they share with the other operands."""
    inside = {a for i in h for a in labs[i]}
    outside = {a for i in range(len(labs)) if i not in h for a in labs[i]}
    shared = [a for a in dict.fromkeys(lab for i in h for lab in labs[i])
              if a in outside and a not in out]
    return [a for a in out if a in inside] + shared


# terms of a dense block are stacked into one product when their halves together are at most
# this fraction of the block (at the representative sizes)
STACK_RATIO = 8


# how deep the halves summed by ``Routine._shared`` are themselves grouped (``_sum_nets``)
SUM_DEPTH = 3


def _half_index(final, name):
    """Which of a product's two halves (0 or 1) is the operand ``name``."""
    return 0 if final.halves[0][0] == name else 1


_ASSIGN = re.compile(r"^(\w+) = ")
_NAME = re.compile(r"[A-Za-z_]\w*")


def size_lines(target, symbols, variables, batched):
    """Statements binding each dimension symbol (and ``n_batch`` when there is data) from the
    shape of the first argument that has it: as a row dimension, axis -2, else axis -1."""
    lines = []
    for s in symbols:
        for n, v in variables.items():
            if s in v.shape:
                axis = -2 if v.shape[0] == s else -1
                lines.append(f"{s.name} = " + target["size"].format(n, axis))
                break
    if batched:
        lines.append("n_batch = " + target["size"].format(batched[0], 0))
    return lines


# routines of at least this many statements free their temporaries early (``_freed``); in a
# short one they live until it returns anyway, a few microseconds later
FREE_FROM = 150


def _freed(lines, keep):
    """``lines`` with ``del`` statements after the last use of every name assigned at the top
    level (not in ``keep``): a routine's temporaries are freed as soon as nothing reads
    them, so later ones reuse their memory while it is still in cache, instead of all of
    them living until the routine returns. A statement with indented lines after it (a loop,
    a branch) counts as one."""
    units = []
    for ln in lines:
        if ln[:1].isspace() and units:
            units[-1].append(ln)
        else:
            units.append([ln])
    if len(units) < FREE_FROM:
        return lines
    first, last, gone = {}, {}, set()
    for k, unit in enumerate(units):
        head = unit[0]
        if head.startswith("del "):
            gone.update(n.strip() for n in head[4:].split(","))
            continue
        if head.startswith("#"):
            continue
        m = _ASSIGN.match(head) if len(unit) == 1 else None
        if m:
            first.setdefault(m.group(1), k)
        for n in _NAME.findall(" ".join(unit) if m is None else head[m.end():]):
            last[n] = k
    after = {}
    for n, k in first.items():
        if n not in keep and n not in gone:
            after.setdefault(max(k, last.get(n, k)), []).append(n)
    out = []
    for k, unit in enumerate(units):
        out += unit
        if k in after:
            out.append("del " + ", ".join(sorted(after[k])))
    return out


# the contracted axis of stacked halves, in a stacking key
STACKED = "stacked"


class Final(str):
    """The code of a last pairwise product of two halves ((name, labels) each), with them."""

    small = False
    nets = None         # the halves' networks [(ops, labels, out)], for sums of halves
    depth = 0
    split = None        # (swap, P, M, N) when P broadcasts over one half (``_direct_halves``)

    def __new__(cls, code, left, right, out):
        obj = super().__new__(cls, code)
        obj.halves, obj.out = (left, right), list(out)
        obj.summed = [a for a in left[1] if a in right[1] and a not in out]
        return obj

    def oriented(self):
        """((x, lx), (y, ly), P, M, N): the halves in product order, the left one giving M."""
        return _oriented(*self.halves, self.out, self.split)

    def stack_key(self):
        """The arrangement (P, M, N, output order) of the product as a canonical string;
        terms of a block with equal keys are written by one product of stacked halves."""
        if not self.summed:
            return None
        return self.arrangement_key()

    def arrangement_key(self):
        """``stack_key`` without the need of a summed index: terms with equal keys that
        share one half are written by one product (a broadcast one when nothing is summed)."""
        (_, la), (_, lb) = self.halves
        if len(set(la)) < len(la) or len(set(lb)) < len(lb):
            return None
        _, _, pre, m, n = self.oriented()
        return _spec([pre + m + [STACKED], pre + [STACKED] + n], self.out)


def _compact_label(node):
    """A variable hint for an unnamed compact node (a sum or a softmax derivative)."""
    return {"SoftmaxJac": "dA", "SoftmaxHess": "d2A"}.get(type(node).__name__, "S")


def _spec(labs, out):
    """The einsum string of operands labelled ``labs`` with output ``out``."""
    symbols = {}
    for lab in [lab for ls in labs for lab in ls] + list(out):
        if lab not in symbols:
            symbols[lab] = oe.get_symbol(len(symbols))
    spec = ",".join("".join(symbols[a] for a in ls) for ls in labs)
    return spec + "->" + "".join(symbols[a] for a in out)


def _out_split(lx, ly, out, bcast=False):
    """(swap, P, M, N) with out = P + M + N, P the labels both operands keep, M ⊆ free labels of
    one operand (the other's when ``swap``), N ⊆ the other's; the shortest P wins. None when
    there is none.  ``bcast``: P may hold labels of one operand only (broadcast over the
    other, which the caller then expands along them)."""
    best = None
    for swap, (la, lb) in enumerate(((lx, ly), (ly, lx))):
        fa = [a for a in la if a not in lb]
        fb = [a for a in lb if a not in la]
        for s in range(len(out) + 1):
            if best is not None and s >= len(best[1]):
                break
            t = len(out)
            while t > s and out[t - 1] in fb:
                t -= 1
            m, n, pre = out[s:t], out[t:], out[:s]
            if all(a in fa for a in m) and all(a in pre for a in fa + fb if a not in m + n):
                best = (bool(swap), pre, m, n)
                break
    if best is None:
        return None
    _, pre, m, n = best
    if not bcast and any(a not in lx or a not in ly for a in pre):
        return None       # a broadcast prefix: torch's matmul would copy the operand per entry
    return best


def _arrangement(lx, ly, out):
    """(swap, P, M, N) of a product: ``_out_split`` when the result can lie in ``out``'s
    order, else the natural order (shared labels, then each operand's free labels)."""
    split = _out_split(lx, ly, out)
    if split is None:
        # free labels in the output's order, and the operand holding the output's innermost
        # label on the right: the permuted copy after the GEMM then moves contiguous runs
        fx = [a for a in out if a in lx and a not in ly]
        fy = [a for a in out if a in ly and a not in lx]
        swap = bool(out) and out[-1] in fx
        split = (swap, [a for a in out if a in lx and a in ly], fy if swap else fx,
                 fx if swap else fy)
    return split


def _oriented(x, y, out, split=None):
    """((x, lx), (y, ly), P, M, N): two (code, labels) operands of a product in the order of
    its ``_arrangement`` (or of ``split``), the left one giving M."""
    swap, pre, m, n = split or _arrangement(x[1], y[1], out)
    if swap:
        x, y = y, x
    return x, y, pre, m, n


def _last_halves(n, path):
    """The two groups of operand positions that opt_einsum's last step multiplies."""
    groups = [[i] for i in range(n)]
    for step in path[:-1]:
        merged = sorted(i for k in sorted(step, reverse=True) for i in groups.pop(k))
        groups.append(merged)
    return groups


# networks of up to this many operands also get opt_einsum's dynamic-programming search
# (pairings only above DP_FLOPS: greedy can miss the Gram-matrix order of one by 10×)
DP_MAX_OPERANDS = 10
DP_FLOPS = 10 ** 9


@lru_cache(maxsize=None)
def _path(spec, shapes, search=False):
    """The contraction order for representative shapes, and its cost: the best of
    opt_einsum's optimal (≤ 4 operands) or greedy and branch-1 searches and, up to
    ``DP_MAX_OPERANDS``, dynamic programming (pairings: above ``DP_FLOPS``).  Scalar
    pairings (``search``: Frobenius norms) are ranked by flops; everything else by flops
    plus ``TRAFFIC_WEIGHT`` per entry written, since block-sized intermediates, not
    multiply-adds, bound those kernels."""
    if len(shapes) <= 4:
        candidates = ["auto"]
    else:
        candidates = ["greedy", "branch-1"]
    if not search and 2 < len(shapes) <= DP_MAX_OPERANDS:
        candidates.append(oe.DynamicProgramming(minimize="combo"))
    best = None
    for optimize in candidates:
        path, info = oe.contract_path(spec, *shapes, shapes=True, optimize=optimize)
        cost = int(info.opt_cost) if search else _cost(info)
        if best is None or cost < best[2]:
            best = (path, info, cost)
    if search and best[2] > DP_FLOPS and 4 < len(shapes) <= DP_MAX_OPERANDS:
        path, info = oe.contract_path(spec, *shapes, shapes=True,
                                      optimize=oe.DynamicProgramming(minimize="flops"))
        if info.opt_cost < best[2]:
            best = (path, info, int(info.opt_cost))
    path, _, cost = best
    return list(path), cost


# one entry written to (and read back from) memory costs about as much as this many flops:
# the contractions here are memory-bound, so a path with block-sized intermediates loses
TRAFFIC_WEIGHT = 8


def _cost(info):
    """Flops plus the entries of every intermediate (and the result) written."""
    written = 0
    for step in info.contraction_list:
        out = step[2].split("->")[1]
        written += _prod(info.size_dict[c] for c in out)
    return int(info.opt_cost) + TRAFFIC_WEIGHT * written


def _pieces(factors):
    """The runs of a factor list between ones factors (those print as row/column sums)."""
    piece = []
    for f in factors:
        if isinstance(f, E.Ones):
            if piece:
                yield tuple(piece)
            piece = []
        else:
            piece.append(f)
    if piece:
        yield tuple(piece)


def _orientations(factors):
    """(A₁…A_k, A_kᵀ…A₁ᵀ): a chain and the chain of its transpose."""
    factors = tuple(factors)
    return factors, tuple(E.transpose(f) for f in reversed(factors))


def _carries(lx, ly, pre):
    """Both operands carry every label of ``pre`` (no broadcast axis: they reshape to
    (P, M, K) and (P, K, N) without copies along P)."""
    return all(a in lx and a in ly for a in pre)


def _full(finals, pre):
    """Every product in ``finals`` has halves that carry every label of ``pre``."""
    oriented = (f.oriented() for f in finals)
    return all(_carries(lx, ly, pre) for (_, lx), (_, ly), _, _, _ in oriented)


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@lru_cache(maxsize=None)
def _pycode(e):
    """Python code of a sympy expression (cached: sizes recur in every statement)."""
    return pycode(e)


def _repeats(rt, term, r, c):
    atoms = rt.lw.resolve(term, r) + rt.lw.resolve(term, c)
    return len(set(atoms)) < len(atoms)


def _diag_view(rt, view, atoms):
    """A writable view of the diagonal entries of a target whose indices repeat."""
    code, labels = _diag_code(rt, view, atoms)
    return rt.emit(code, False), labels


def _diag_code(rt, view, atoms):
    """(code, labels) of the diagonal view of ``view`` (axes ``atoms``, some repeated)."""
    order = list(dict.fromkeys(atoms))
    if "diag_view_einsum" in rt.t:
        sym = {a: oe.get_symbol(i) for i, a in enumerate(order)}
        spec = "".join(sym[a] for a in atoms) + "->" + "".join(sym[a] for a in order)
        return rt.t["diag_view_einsum"].format(repr(spec), view), order
    labels = list(atoms)
    code = view
    while len(set(labels)) < len(labels):
        for i, a in enumerate(labels):
            j = labels.index(a, i + 1) if a in labels[i + 1:] else None
            if j is not None:
                code = f"{code}.diagonal(0, {i}, {j})"
                labels = [x for k, x in enumerate(labels) if k not in (i, j)] + [a]
                break
    return code, labels


# entries of a slab operand's chunk (``SlabChunk``): 2 MiB of float64. 1 MiB (half the L2
# of the Intel core the eighth session measured on) was best there with MKL's GEMMs; on the
# AMD EPYC of the tenth session (1 MiB L2, the slab GEMMs through symhess.smallk) 2 MiB made
# the post-LN and pre-LN Hessians 0.5-1.4 ms faster, NumPy's too (BENCHMARKS.md)
CHUNK_ENTRIES = 1 << 18


class NotChunkable(Exception):
    """A slab operand write that ``SlabChunk`` cannot split (the slab is written whole)."""


def _narrowed(rt, code, pos, start, length):
    """``code`` restricted to ``start`` … ``start + length`` along the axis ``pos`` places
    from the end (one ``narrow`` in torch: a slice per axis would be one operation each)."""
    return rt.fmt("narrow", code, -pos, start, length, ", :" * (pos - 1))


class SlabChunk:
    """The operand R of a row slab (``codegen.Variant._slab``), written and multiplied a
    chunk of its rows at a time.

    R[s, f, c] holds, for every row f of the rest of a parameter's row index (W_1's d_ff
    index f of W_1[i, f]), all the Hessian's columns c; H[(i, f), c] = Σ_s X[s, i] R[s, f, c]
    is one GEMM. Written whole, R is half the slab's size (L/d of it) and goes out to memory
    and back; a chunk of rows small enough for the core's cache (``CHUNK_ENTRIES``) is
    written, multiplied into its rows of H and overwritten by the next. While a chunk is
    open, ``Routine.dense_into`` records its writes here instead of printing them; a write
    that is not a broadcast product (``mul_into``) of operands aligned to the row axis
    raises ``NotChunkable``, and the slab is printed whole.
    """

    def __init__(self):
        self.views = {}       # view name -> (target, lead, row atoms, atoms, product order)
        self.writes = []      # ("zero", target) or (key, x, x sliced?, y, y sliced?, view, pos)
        self._targets = {}    # target name -> its columns of R ("a:b")

    def columns(self, target, cols):
        """``target`` stands for the columns ``cols`` of R in the writes that follow."""
        self._targets[target] = cols

    def zero(self, target):
        self.writes.append(("zero", target))

    def view(self, view, target, lead, row_atoms, atoms, order):
        """Register a view of R's columns: its (batch,) rows and columns ``atoms``, the
        labels of a product written into it in ``order``."""
        if len(row_atoms) != 2:
            raise NotChunkable(f"{len(row_atoms)} row atoms")
        self.views.setdefault(view, (target, lead, row_atoms, atoms, order))

    def write(self, rt, key, pair, view):
        if pair is None or "mul_into" not in rt.t or view not in self.views:
            raise NotChunkable("not a broadcast product")
        xa, ya, out, lx, ly = pair
        order = self.views[view][4]
        pos = len(order) - order.index(self.views[view][2][1])   # the row axis, from the end
        # the product may come from an earlier network with labels of its own: by position
        f = out[len(out) - pos]
        self.writes.append((key, rt.emit(xa, False), f in lx, rt.emit(ya, False), f in ly,
                            view, pos))

    def lines(self, rt, flat, f0, size):
        """(statements before the loop, statements of one chunk, rows ``f0`` … ``f0 + size``)
        writing R's chunk through ``flat``, the chunk viewed as ([batch,] s·size, columns).
        The chunk's views are the same objects for every chunk and made once; a diagonal
        view depends on the chunk's rows and is made in the loop."""
        before, loop, made = [], [], {}
        for w in self.writes:
            if w[0] == "zero":
                loop.append(f"{flat}[..., {self._cols(w[1])}][...] = 0")
                continue
            key, x, x_rows, y, y_rows, view, pos = w
            if view not in made:
                code, moving = self._chunk_view(rt, view, flat, f0, size)
                made[view] = rt.fresh()
                (loop if moving else before).append(f"{made[view]} = {code}")
            xs = _narrowed(rt, x, pos, f0, size) if x_rows else x
            ys = _narrowed(rt, y, pos, f0, size) if y_rows else y
            loop.append(rt.fmt(key, xs, ys, made[view]))
        return before, loop

    def _cols(self, target):
        return self._targets[target]

    def _chunk_view(self, rt, view, flat, f0, size):
        """(code, whether it depends on the chunk's rows) of ``view`` on the chunk."""
        target, lead, row_atoms, atoms, _ = self.views[view]
        f = row_atoms[1]
        sizes = [N_BATCH] * len(lead) + [rt.lw.labels.size[a] for a in atoms]
        sizes[len(lead) + 1] = sp.Symbol(size)
        code = rt.fmt("view", f"{flat}[..., {self._cols(target)}]", rt.shape(sizes))
        moving = atoms.count(f) > 1
        if moving:                # a diagonal with a column atom: its rows of the chunk
            j = atoms.index(f, 2)
            code = _narrowed(rt, code, len(atoms) - j, f0, size)
        if len(set(atoms)) < len(atoms):
            code = _diag_code(rt, code, lead + atoms)[0]
        return code, moving


def _scaled(rt, coef, code):
    coef = sp.sympify(coef)
    if coef == 1:
        return code
    if coef == -1:
        return f"-{code}"
    return f"({rt.coef(coef)}) * {code}"


def _sum(rt, parts):
    out = []
    for c, code in parts:
        s = _scaled(rt, c, code)
        if out and s.startswith("-"):
            out.append(f"- {s[1:]}")
        else:
            out.append(("+ " if out else "") + s)
    return " ".join(out)


# ----------------------------------------------------------------------------- matrix rules
_MATRIX = {}


def _m(t):
    def deco(fn):
        _MATRIX[t] = fn
        return fn
    return deco


@_m(E.Var)
def _var(rt, n):
    if n.name not in rt.variables:
        raise NotImplementedError(f"{n.name} is not an argument of this routine")
    return n.name


@_m(E.Named)
def _named(rt, n):
    if not is_leaf(n.inner):
        raise NotImplementedError(f"{n.name} is a structured operator; lower it with an index network")
    inner = rt.mat(n.inner)
    name = rt.fresh(n.name)
    rt.line(f"{name} = {inner}")
    rt.is_batched[name] = rt.is_batched[inner]
    return name


@_m(E.MatMul)
def _matmul(rt, n):
    """Ones factors become row/column sums: P 1 Q = rowsum(P) · colsum(Q) (an outer product)."""
    f = list(n.args)
    j = next((i for i, x in enumerate(f) if isinstance(x, E.Ones)), None)
    if j is None:
        return rt._chain(f)
    left, ones, right = f[:j], f[j], f[j + 1:]
    lv = rt.emit(rt.fmt("sum_last", rt._chain(left)), rt.batched(rt._chain(left))) if left else None
    rv = rt.mat(E.matmul(*right)) if right else None
    rv = rt.emit(rt.fmt("sum_rows", rv), rt.batched(rv)) if rv else None
    if lv and rv:
        return rt.emit(f"{lv} * {rv}", rt.batched(lv, rv))
    if lv:
        if sp.sympify(ones.cols) == 1:
            return lv
        return rt.emit(rt.fmt("bcast_last", lv, rt.size(ones.cols)), rt.batched(lv))
    if rv:
        if sp.sympify(ones.rows) == 1:
            return rv
        return rt.emit(rt.fmt("bcast_rows", rv, rt.size(ones.rows)), rt.batched(rv))
    return rt.emit(rt.fmt("ones", rt.shape(n.shape)), False)


@_m(E.Add)
def _add(rt, n):
    """A sum printed with its shared structure pulled out (each saves passes or products):
    Σ F Rᵢ = F (Σ Rᵢ) when cheaper, Σ c rᵢ Bᵢ = c Σ rᵢ Bᵢ (rᵢ rational), Σ Bᵢᵀ = (Σ Bᵢ)ᵀ."""
    terms = [E._split(t) for t in n.args]
    common = _common_factor(rt, terms)
    if common is not None:
        idx, outer, side = common
        inner = E.add(*(E.scale(terms[i][0], E.matmul(*_rest(terms[i][1], side))) for i in idx))
        prod = E.matmul(outer, inner) if side == "left" else E.matmul(inner, outer)
        rest = [E.scale(c, core) for i, (c, core) in enumerate(terms) if i not in idx]
        return rt.mat(E.add(prod, *rest) if rest else prod)
    c = terms[0][0]
    c = -c if c.could_extract_minus_sign() else c
    if c.as_coeff_Mul()[1] != 1 and all((ci / c).is_Rational for ci, _ in terms):
        inner = rt.mat(E.add(*(E.scale(ci / c, core) for ci, core in terms)))
        return rt.emit(_scaled(rt, c, inner), rt.batched(inner))
    if all(isinstance(core, E.Transpose) for _, core in terms):
        inner = rt.mat(E.add(*(E.scale(ci, core.args[0]) for ci, core in terms)))
        return rt.T(inner)
    out, names = [], []
    for ci, core in sorted(terms, key=lambda t: t[0].could_extract_minus_sign()):
        neg = ci.could_extract_minus_sign()
        name = rt.mat(E.scale(-ci if neg else ci, core))
        names.append(name)
        out.append(("- " if neg else "+ ") + name)
    code = " ".join(out)
    code = code[2:] if code.startswith("+ ") else "-" + code[2:]
    return rt.emit(code, rt.batched(*names))


def _rest(core, side):
    """The factors of a product without its first (``left``) or last (``right``) one."""
    f = list(core.args)
    return f[1:] if side == "left" else f[:-1]


def _common_factor(rt, terms):
    """(term indices, F, side) whose factoring Σ F Rᵢ → F (Σ Rᵢ) saves the most flops at the
    representative sizes (amortised as in ``Routine._chain``); None when nothing is saved."""
    best = None
    for side in ("left", "right"):
        groups = {}
        for i, (_, core) in enumerate(terms):
            if isinstance(core, E.MatMul) and not any(isinstance(x, E.Ones) for x in core.args):
                end = core.args[0] if side == "left" else core.args[-1]
                groups.setdefault(end, []).append(i)
        for outer, idx in groups.items():
            if len(idx) < 2:
                continue
            chains = [list(terms[i][1].args) for i in idx]
            rests = [_rest(terms[i][1], side) for i in idx]
            before = sum(rt.chain_cost(f) for f in chains)
            rows, cols = ((outer.rows, rests[0][-1].cols) if side == "left"
                          else (rests[0][0].rows, outer.cols))
            mid = outer.cols if side == "left" else outer.rows
            after = sum(rt.chain_cost(r) for r in rests) + rt._rep(rows) * rt._rep(mid) * rt._rep(cols)
            if before >= after and (best is None or before - after > best[0]):
                best = (before - after, idx, outer, side)
    return None if best is None else best[1:]


@_m(E.Scale)
def _scale(rt, n):
    a = rt.mat(n.args[0])
    return rt.emit(_scaled(rt, n.coef, a), rt.batched(a))


@_m(E.Transpose)
def _transpose(rt, n):
    return rt.T(rt.mat(n.args[0]))


@_m(E.Hadamard)
def _hadamard(rt, n):
    names = [rt.mat(a) for a in n.args]
    return rt.emit(" * ".join(names), rt.batched(*names))


@_m(E.Elementwise)
def _elementwise(rt, n):
    a = rt.mat(n.args[0])
    if a in rt.transposed:            # f(Bᵀ) = f(B)ᵀ: reuse f(B)
        base = rt.transposed[a]
        return rt.T(rt.emit(scalar_code(rt.t, n.fn.expr, base), rt.batched(base)))
    return rt.emit(scalar_code(rt.t, n.fn.expr, a), rt.batched(a))


@_m(E.SoftmaxRows)
def _softmax(rt, n):
    t = rt.mat(n.args[0])
    b = rt.batched(t)
    if n.causal:
        mask = rt.emit(rt.fmt("triu_mask", rt.size(n.rows)), False)
        t = rt.emit(rt.fmt("where", mask, "-math.inf", t), b)
    z = rt.emit(f"{rt.t['fn']['exp'].format(t + ' - ' + rt.fmt('max_last', t))}", b)
    return rt.emit(f"{z} / {rt.fmt('sum_last', z)}", b, hint="A")


@_m(E.LogSoftmaxRows)
def _log_softmax(rt, n):
    t = rt.mat(n.args[0])
    b = rt.batched(t)
    z = rt.emit(f"{t} - {rt.fmt('max_last', t)}", b)
    lse = rt.t["fn"]["log"].format(rt.fmt("sum_last", rt.t["fn"]["exp"].format(z)))
    return rt.emit(f"{z} - {lse}", b)


def _centred(rt, a, e):
    """E − rowsum(A ∘ E): shared by the first and second softmax differentials."""
    return rt.emit(f"{e} - {rt.fmt('sum_last', f'({a} * {e})')}", rt.batched(a, e))


@_m(E.SoftmaxDiff)
def _softmax_diff(rt, n):
    """dA[E] = A ∘ (E − rowsum(A ∘ E))."""
    a, e = rt.mat(n.args[0]), rt.mat(n.args[1])
    return rt.emit(f"{a} * {_centred(rt, a, e)}", rt.batched(a, e))


@_m(E.SoftmaxDiff2)
def _softmax_diff2(rt, n):
    """d²A[E,F] = w − A rowsum(w), w = A ∘ (E − rowsum(A∘E)) ∘ (F − rowsum(A∘F))."""
    a, e, f = (rt.mat(x) for x in n.args)
    b = rt.batched(a, e, f)
    da = rt.emit(f"{a} * {_centred(rt, a, e)}", rt.batched(a, e))   # = dA[E], often needed too
    w = rt.emit(f"{da} * {_centred(rt, a, f)}", b)
    return rt.emit(f"{w} - {a} * {rt.fmt('sum_last', w)}", b)


@_m(E.Identity)
def _identity(rt, n):
    return rt.emit(rt.fmt("eye", rt.size(n.rows)), False)


@_m(E.Zero)
def _zero(rt, n):
    return rt.emit(rt.fmt("zeros", rt.shape(n.shape)), False)


@_m(E.CausalMask)
def _causal_mask(rt, n):
    """M[i, j] = [j ≤ i] as a 0/1 array of the values' dtype."""
    return rt.emit(rt.fmt("tril_ones", rt.size(n.rows)), False, hint="Mcausal")


@_m(E.Ones)
def _ones(rt, n):
    return rt.emit(rt.fmt("ones", rt.shape(n.shape)), False)


@_m(E.Diag)
def _diag(rt, n):
    """diag(v) = I ∘ v (v broadcast along rows)."""
    v = rt.mat(n.args[0])
    eye = rt.emit(rt.fmt("eye", rt.size(n.rows)), False)
    return rt.emit(f"{eye} * {v}", rt.batched(v))


@_m(E.DiagPart)
def _diag_part(rt, n):
    a = rt.mat(n.args[0])
    return rt.emit(rt.fmt("diag_part", a), rt.batched(a))


@_m(E.VecR)
def _vec_r(rt, n):
    a = rt.mat(n.args[0])
    return rt.emit(rt.fmt("flatten_mats", a, rt.size(n.rows)), rt.batched(a))


@_m(E.UnvecR)
def _unvec_r(rt, n):
    a = rt.mat(n.args[0])
    return rt.emit(rt.fmt("unflatten_mats", a, rt.size(n.rows), rt.size(n.cols)), rt.batched(a))


# ----------------------------------------------------------------------------- scalar functions
def scalar_code(target, expr, arg):
    """An entrywise sympy function of x as target code applied to ``arg``."""
    fns = target["fn"]

    def p(e):
        if e == scalarfn.x:
            return arg
        if e.is_number:               # constants such as sqrt(2) (torch.sqrt wants a tensor)
            return repr(float(e))
        if e is sp.pi:
            return "math.pi"
        if isinstance(e, sp.Add):
            return "(" + " + ".join(p(a) for a in e.args) + ")"
        if isinstance(e, sp.Mul):
            return "(" + " * ".join(p(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow):
            base, ex = e.args
            if ex == sp.Rational(1, 2):
                return fns["sqrt"].format(p(base))
            return f"({p(base)} ** {p(ex)})"
        if isinstance(e, sp.Heaviside):
            h0 = e.args[1] if len(e.args) > 1 else sp.Rational(1, 2)
            return fns["heaviside"].format(p(e.args[0]), repr(float(h0)))
        name = type(e).__name__.lower()
        if name in fns and len(e.args) == 1:
            return fns[name].format(p(e.args[0]))
        raise NotImplementedError(f"the {target['name']} printer cannot print {e} "
                                  f"({type(e).__name__}) in an entrywise function")

    return p(expr)


__all__ = ["Routine", "scalar_code", "Factor", "Term"]

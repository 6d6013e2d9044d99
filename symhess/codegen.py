"""Kernel generation: derived expressions → printed routines → Jinja-rendered modules.

Layout: ``generated/<backend>/<layer>.py`` holds, for every loss and every combination
of the layer's boolean options (other options at their defaults), one function per
routine (``<variant>__block__W_Q__W_K__outer``, ``<variant>__hvp__full``, …) and a
``VARIANTS`` table ``{(loss, options): {routine key: function}}``.  Generated functions
take data arrays with a leading batch axis and return batch means; ``symhess.kernel``
wraps them with input validation.  Templates hold the file skeleton only.
"""
from __future__ import annotations

import difflib
import itertools
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jinja2
import sympy as sp

from . import jacobians
from .hessian import PARTS, derive
from .layers import LAYERS, layer as get_layer, layer_options
from .printing.code import (CHUNK_ENTRIES, N_BATCH, NotChunkable, Routine, SlabChunk,
                            _narrowed, size_lines)
from .printing.index import Factor, Lowering
from .printing.numpy import NUMPY
from .printing.torch import TORCH

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
TARGETS = {"numpy": NUMPY, "torch": TORCH}


# a slab GEMM (K = L, a few dozen rows, hundreds of thousands of columns) runs in blocks of at
# most this many rows: MKL wrote 64 such rows at 0.9 ms per million entries and 16 or 32 at
# 0.7 (BENCHMARKS.md, eighth session). A target may say otherwise ("slab_gemm_rows"): the
# torch modules' products take any number of rows (symhess.smallk blocks its BLAS fallback)
SLAB_GEMM_ROWS = 32


def _row_blocks(rt, a, b, dest, m):
    """Statements writing ``dest`` = ``a`` @ ``b`` (``a`` with ``m`` rows) in blocks of at
    most ``SLAB_GEMM_ROWS`` rows (one product where ``m`` is that small, or where the target
    takes any number)."""
    rows = rt.size(m)
    limit = rt.t.get("slab_gemm_rows", SLAB_GEMM_ROWS)
    if limit is None or sp.sympify(m).is_number and int(m) <= limit:
        return [rt.fmt("matmul_into", a, b, dest)]
    r = rt.fresh("r0")
    k = f"min({limit}, {rows} - {r})"
    return [f"if {rows} <= {limit}:",
            "    " + rt.fmt("matmul_into", a, b, dest),
            "else:",
            f"    for {r} in range(0, {rows}, {limit}):",
            "        " + rt.fmt("matmul_into", _narrowed(rt, a, 2, r, k), b,
                                _narrowed(rt, dest, 2, r, k))]


@dataclass
class Function:
    name: str
    args: list
    lines: list
    ret: str
    doc: str


# ----------------------------------------------------------------------------- variants
DEFAULT_LOSSES = ("mse", "ce")
# options whose every value is committed (a mask changes the code); all other options are
# generated at their defaults and rendered in memory on first use (symhess.kernel)
VARIED_OPTIONS = ("causal",)
# layers whose kernels are rendered on demand only, never committed (with the reason)
ON_DEMAND = {
    "addition_block": "the experiments model: its losses are the custom ce_answer/mse_sum and "
                      "its 7 parameters give 49 blocks through LayerNorm; kernels are rendered "
                      "in memory on first use",
    "attention_stack": "a deep model (3·depth parameters): kernels rendered on demand",
    "post_ln_stack": "a deep model (5·depth parameters): kernels rendered on demand",
}
# layers committed at their default options only (both losses); every other option value,
# causal included, is rendered in memory on first use (with the reason)
DEFAULTS_ONLY = {
    "post_ln_block": "5 parameters give 214 routines per variant (3.5 MB per backend); the "
                     "causal variants would double generated/ and generation time",
    "pre_ln_block": "5 parameters give 214 routines per variant (2 MB per backend); the causal "
                    "variants would double generated/ and generation time",
}


def generated_losses(layer_name):
    """The losses committed for a layer: ``factory.losses`` if declared, else mse and ce."""
    from .layers import _factory
    return tuple(getattr(_factory(layer_name), "losses", DEFAULT_LOSSES))


def variants(layer_name):
    """(loss, options) pairs committed for a layer: its losses × every value of causal
    (``DEFAULTS_ONLY`` layers: its losses at the default options)."""
    opts = layer_options(layer_name)
    flags = [] if layer_name in DEFAULTS_ONLY else sorted(
        k for k in VARIED_OPTIONS if isinstance(opts.get(k), bool))
    out = []
    for loss in generated_losses(layer_name):
        for values in itertools.product((False, True), repeat=len(flags)):
            o = dict(opts)
            o.update(zip(flags, values))
            out.append((loss, tuple(sorted(o.items()))))
    return out


def variant_tag(loss, options):
    flags = "".join(f"_{k}{int(v)}" for k, v in options if isinstance(v, bool))
    return f"{loss}{flags}"


_DERIVATIONS = {}


def lowered(layer_name, loss, options):
    """The derivation of one variant with its lowered blocks, shared by both backends."""
    key = (layer_name, loss, options)
    if key not in _DERIVATIONS:
        _DERIVATIONS[key] = Lowered(derive(get_layer(layer_name, **dict(options)), loss))
    return _DERIVATIONS[key]


class Lowered:
    """A derivation and its blocks lowered once to index networks (backend-independent)."""

    def __init__(self, derivation):
        self.d = derivation
        self.lw = Lowering()
        self._terms = {}

    def terms(self, p, q, part):
        """(terms, row labels, column labels) of H_part(p, q), lowered once."""
        key = (p, q, part)
        if key not in self._terms:
            wp, wq = self.d.param(p), self.d.param(q)
            r = [lab for d in wp.shape for lab in self.lw.labels.fresh(d)]
            c = [lab for d in wq.shape for lab in self.lw.labels.fresh(d)]
            self._terms[key] = (self.lw.lower(self.d.block(p, q, part).expr, r, c), r, c)
        return self._terms[key]


# ----------------------------------------------------------------------------- routines
# a Frobenius norm as Σ_{t,t'} ⟨N_t, N_t'⟩ costs one contraction per pair of terms; above
# this many terms (LayerNorm blocks have up to ~170) the block is built densely in a
# temporary and its norm taken instead: still exact, cost and memory of one dense block
PAIRWISE_MAX_TERMS = 16
# frobenius_split is the experiments' route (no dense block wanted): pairwise up to this many
SPLIT_PAIRWISE_MAX_TERMS = 64


# a block below the diagonal of ``hessian`` with more index networks than MIRROR_MIN_TERMS, or
# more operands over all its networks than MIRROR_MIN_OPERANDS, is copied from the transposed
# block above it (H(q, p) = H(p, q)ᵀ for every part: B and the second derivatives are
# symmetric). A transposed copy costs about three block-sized products; many operands stand
# for the block-sized steps of the LayerNorm chains (post-LN lower blocks have 21–54 operands,
# attention's 2–16). Same-process A/Bs of ``hessian`` (full, MSE): post-LN 59.2 → 57.3 and
# 125.3 → 118.9 ms, pre-LN 65.3 → 62.0 and 68.4 → 65.7 ms; with 14 instead of 16, the
# attention CE (W_K, W_Q) block (16 operands) got slower (54.0 → 61.5 ms), so it stays computed.
MIRROR_MIN_TERMS = 3
MIRROR_MIN_OPERANDS = 16
# … and in the block-by-block version as printed (where no slab-vs-block comparison depends
# on it): blocks of more than one network. With the tiled transpose (symhess.smallk) the
# dense attention-family Hessians took 15-31 % less (L = 16, d = 24); counted with this
# threshold the comparisons moved post-LN rows and the FFN's CE row to blocks, 13 % and 50 %
# slower at the sizes (BENCHMARKS.md, eleventh session)
MIRROR_MIN_TERMS_BLOCKS = 1


# a transposed copy of a block costs about this many block-sized writes: 3 while it was torch's
# strided copy (≈ 5 ms per 1M entries, see MIRROR_MIN_TERMS); through ``symhess.smallk``'s tiled
# transpose (≈ 0.5 ms per 1M, two ``fill_`` passes) it costs about what a product written into a
# block costs, whose passes ``Routine.written`` counts as one each. With 2, the post-LN Hessian
# computed its W_2 row block by block; with 1, as a slab with its three blocks left of the
# diagonal copied: 15.3 → 12.7 ms eager, 13.2 → 10.6 traced (BENCHMARKS.md, eleventh session)
MIRROR_PASSES = 1


def _count_copy(rt, offs, i, j):
    """Count block (i, j), copied from its transpose, as ``MIRROR_PASSES`` writes."""
    rt.written += MIRROR_PASSES * _prod_rep(rt, (offs[i + 1] - offs[i]) * (offs[j + 1] - offs[j]))


def _prod_rep(rt, n):
    """A size expression at the routine's representative sizes."""
    return int(rt._rep(n))


def _lead_key(lw, t, r, c):
    """((leaf, position of i, size of s), factor, s) when exactly one factor of term ``t``
    carries the first row atom i, as a plain leaf over (i, s) or (s, i) with s summed and
    shared with another factor; else None."""
    ri = lw.resolve(t, r[:1])
    if len(ri) != 1:
        return None
    i0 = ri[0]
    holders = [f for f in t.factors if i0 in lw.resolve(t, f.labels)]
    if len(holders) != 1:
        return None
    f = holders[0]
    if isinstance(f.ref, tuple):
        return None
    atoms = lw.resolve(t, f.labels)
    if len(atoms) != 2 or len(set(atoms)) != 2:
        return None
    s = atoms[1 - atoms.index(i0)]
    outer = set(lw.resolve(t, r)) | set(lw.resolve(t, c))
    if s in outer:
        return None
    if not any(s in lw.resolve(t, g.labels) for g in t.factors if g is not f):
        return None
    return (f.ref, atoms.index(i0), lw.labels.size[s]), f, s


def _mirrored(terms, min_terms=MIRROR_MIN_TERMS):
    """Whether a lower block of ``hessian`` is cheaper as the transposed upper block."""
    return len(terms) > min_terms or sum(len(t.factors) for t in terms) > MIRROR_MIN_OPERANDS


class Variant:
    """Prints every routine of one (layer, loss, options) for one target."""

    def __init__(self, low, target, tag):
        self.low = low
        self.d = derivation = low.d
        self.t = target
        self.tag = tag
        lay = derivation.layer
        names = list(lay.variables)
        ordered = [v.name for v in lay.inputs] + list(lay.param_names)
        ordered += sorted(n for n in names if n not in ordered) + ["Y"]
        self.vars = {n: (lay.variables[n] if n != "Y" else derivation.Y) for n in ordered}
        self.batched = [n for n, v in self.vars.items() if v.role == "input" or n == "Y"]
        syms = set()
        for v in self.vars.values():
            for d in v.shape:
                syms |= sp.sympify(d).free_symbols
        self.symbols = sorted(syms, key=lambda s: s.name)

    def routine(self, extra=()):
        variables = dict(self.vars)
        variables.update({v.name: v for v in extra})
        return Routine(self.t, variables, self.batched, self.symbols, lowering=self.low.lw,
                       sizes=self.d.layer.typical_sizes)

    def header(self, rt):
        """Bind every dimension (and the batch size) from the argument shapes."""
        return size_lines(self.t, self.symbols, self.vars, self.batched)

    def function(self, kind, rt, ret, doc, extra=(), out=False):
        """``out``: the function takes ``out=None``, an array to write the result into."""
        name = f"{self.tag}__{kind}"
        args = list(self.vars) + [v.name for v in extra] + (["out=None"] if out else [])
        return Function(name, args, self.header(rt) + rt.pruned(ret), ret, doc)

    def numel(self, p):
        w = self.d.param(p)
        return w.rows * w.cols

    # -- dense blocks --------------------------------------------------------------
    def block(self, p, q, part):
        rt = self.routine()
        rt.line(f"out = {rt.fmt('empty', rt.shape((self.numel(p), self.numel(q))))}")
        terms, r, c = self.low.terms(p, q, part)
        rt.dense_into("out", terms, r, c, fresh=True)
        return self.function(f"block__{p}__{q}__{part}", rt, "out",
                             f"H_{part}({p}, {q}) as a dense (numel {p} × numel {q}) block, vec_r layout.")

    def hessian(self, part):
        """The full Hessian.  Two versions where row slabs pay (see ``_slab``): the slab
        version, chosen row by row at one sequence, runs for batches up to the size where
        its per-sequence slab operands would write more than the block-by-block version."""
        names = self.d.layer.param_names
        doc = f"The full {part} Hessian, parameters in declared order {', '.join(names)}."
        rows = []                                 # entries each row writes block by block
        _, written, _ = self._hessian_into(part, rows)
        srt, s_written, per_seq = self._hessian_into(part, rows, slabs=True)
        limit = int((written - s_written + per_seq) // per_seq) if per_seq else 0
        # the block version as printed copies more of the lower blocks; ``rows`` and
        # ``written`` (the comparisons with the slabs) stay those of MIRROR_MIN_TERMS
        rt, _, _ = self._hessian_into(part, [], mirror_terms=MIRROR_MIN_TERMS_BLOCKS)
        fn = self.function(f"hessian__{part}", rt, "H", doc, out=True)
        if limit < 1:
            return fn
        body = [f"if n_batch <= {limit}:    # row slabs (their operands grow with the batch)"]
        body += ["    " + ln for ln in srt.pruned("H")] + ["    return H"]
        return Function(fn.name, fn.args, self.header(rt) + body + rt.pruned("H"), "H", doc)

    def _hessian_into(self, part, rows, slabs=False, mirror_terms=MIRROR_MIN_TERMS):
        """(routine, entries written, entries of slab operands per sequence) of the full
        Hessian.  Block by block, the entries each row writes are appended to ``rows``;
        ``slabs``: a row by ``_slab`` where that writes fewer entries than ``rows`` says
        (at the sizes for one sequence: block writes do not grow with the batch)."""
        rt = self.routine()
        if slabs:
            rt.batch_size = 1
        names = self.d.layer.param_names
        offs = [sp.Integer(0)]
        for p in names:
            offs.append(offs[-1] + self.numel(p))
        # every entry is written (no zeroing), so a caller's array of any content can serve
        rt.line(f"H = {rt.fmt('empty', rt.shape((offs[-1], offs[-1])))} if out is None else out")

        def block(i, j):
            return rt.emit(f"H[{rt.size(offs[i])}:{rt.size(offs[i + 1])}, "
                           f"{rt.size(offs[j])}:{rt.size(offs[j + 1])}]", False)

        mirrored, per_seq = [], 0
        for i in range(len(names)):
            if slabs:
                snap = rt._snapshot()
                slab = self._slab(rt, i, names, offs, part, block)
                if slab is not None and rt.written - snap[0] < rows[i]:
                    per_seq += slab[0]
                    mirrored += slab[1]
                    continue
                rt._restore(snap)
            before = rt.written
            mirrored += self._row(rt, i, names, part, block, offs, mirror_terms)
            if not slabs:
                rows.append(rt.written - before)
        for i, j in mirrored:
            rt.line(rt.fmt("transpose_into", block(j, i), block(i, j)))
        return rt, rt.written, per_seq

    def _row(self, rt, i, names, part, block, offs, mirror_terms=MIRROR_MIN_TERMS):
        """Write row ``i`` of the Hessian block by block; [(i, j)]: the blocks left to be
        copied from their transposes (counted as ``MIRROR_PASSES`` writes each), those with
        more than ``mirror_terms`` networks (or many operands)."""
        mirrored = []
        for j, q in enumerate(names):
            terms, r, c = self.low.terms(names[i], q, part)
            if j < i and _mirrored(terms, mirror_terms):
                mirrored.append((i, j))   # H(q, p) = H(p, q)ᵀ: copied once that is written
                _count_copy(rt, offs, i, j)
                continue
            rt.dense_into(block(i, j), terms, r, c, fresh=True)
        return mirrored

    def _slab(self, rt, i, names, offs, part, block):
        """Write row slab ``i`` of the Hessian (H[p, :] for the column parameters) by one
        GEMM where the terms allow: a parameter entering as U = X W makes every term of
        H(W, ·) that reaches W through U carry the leaf X with the row index i of W_ij and a
        summed index s; then H[(i, j), c] = Σ_s X[s, i] R[s, j, c], R holding the rest of
        each term, all columns side by side.  Terms without that leaf (the product rule on
        X) are added to their blocks afterwards, except in the blocks left of the diagonal:
        blocks with such terms (a leading run of them) are left out of R and of the GEMM and
        copied from their transposes above the diagonal, which the earlier rows wrote (X
        depends on earlier parameters, so those blocks are where the product-rule terms
        are).  Returns (the entries written into R per sequence (R holds each sequence's
        terms when X reads data), the blocks (i, j) to be copied), or None (nothing written)
        when no leaf is shared by the row's terms."""
        p = names[i]
        lw = self.low.lw
        per_q, leads, keys = [], [], {}
        for q in names:
            terms, r, c = self.low.terms(p, q, part)
            per_q.append((terms, r, c))
            leads.append([_lead_key(lw, t, r, c) for t in terms])
            for k in leads[-1]:
                if k is not None:
                    keys[k[0]] = keys.get(k[0], 0) + 1
        m = self.d.param(p).shape[0]
        if not keys or any(sp.simplify(lw.labels.size[r[0]] - m) != 0 for _, r, _ in per_q):
            return None     # (the row labels must start with W's row index: not for a 1 × d γ)
        key = max(keys, key=lambda k: (keys[k], str(k)))
        s_size = key[2]
        S = lw.labels.new(s_size)
        n_rest = sp.simplify(self.numel(p) / m)
        slab_terms, direct, firsts = [], [], []
        for (terms, r, c), row_leads in zip(per_q, leads):
            mine, other = [], []
            for t, k in zip(terms, row_leads):
                if k is not None and k[0] == key:
                    f, s = k[1], k[2]
                    firsts.append((len(slab_terms), f, t, r))
                    rest = t.copy(factors=tuple(g for g in t.factors if g is not f))
                    rest.subst[s] = [S]
                    mine.append(rest)
                else:
                    other.append(t)
            slab_terms.append(mine)
            direct.append(other)
        lo = 0                  # blocks 0 … lo-1 of the row: copied from their transposes
        while lo < i and direct[lo]:
            lo += 1
        firsts = [x[1:] for x in firsts if x[0] >= lo]      # the leaf of a term in R
        if not firsts:
            return None
        f, t0, r0 = firsts[0]
        lead_code, lead_labs = rt.operand(f, t0, ("batch", f.side))
        batched = rt.is_batched[lead_code]
        seqs = [N_BATCH] if batched else []      # R holds each sequence's terms
        c0 = offs[lo]
        width = offs[-1] - c0                   # R's columns: those of blocks lo, lo+1, …
        R = rt.fresh("R")
        before = rt.written
        cols = {j: f"{rt.size(offs[j] - c0)}:{rt.size(offs[j + 1] - c0)}"
                for j in range(lo, len(per_q))}

        def write_operand(target):      # R's columns j written through target(j)
            for j in range(lo, len(per_q)):
                _, r, c = per_q[j]
                rt.dense_into(target(j), slab_terms[j], [S] + r[1:], c, fresh=True,
                              keep_batch=batched)

        chunk = self._chunked_operand(rt, write_operand, cols)
        if chunk is None:
            rt.line(f"{R} = {rt.fmt('scratch', rt.shape(seqs + [s_size, n_rest, width]))}")
            flat = rt.emit(rt.fmt("view", R, rt.shape(seqs + [s_size * n_rest, width])), False)
            write_operand(lambda j: rt.emit(f"{flat}[..., {cols[j]}]", False))
        grown = (rt.written - before) // rt.batch_size if batched else 0
        # the leaf as (i, [batch,] s), scaled by the batch mean
        i0 = lw.resolve(t0, r0[:1])[0]
        labs = list(lead_labs)
        order = [labs.index(i0)] + [k for k, a in enumerate(labs) if isinstance(a, tuple)] + \
            [k for k, a in enumerate(labs) if a != i0 and not isinstance(a, tuple)]
        a = rt.emit(rt.fmt("permute", lead_code, ", ".join(map(str, order))), False)
        inner = (N_BATCH if batched else 1) * s_size
        a = rt.emit(rt.fmt("reshape", a, rt.shape([m, inner])), False)
        if batched:
            a = rt.emit(f"(1/n_batch) * {a}", False)
        rows = f"H[{rt.size(offs[i])}:{rt.size(offs[i + 1])}]"
        if lo:      # the GEMM batched over R's rows j: each writes columns c0 … of row (i, j)
            dest = rt.emit(rt.fmt("view", rows, rt.shape([m, n_rest, offs[-1]])), False)
            dest = rt.emit(_narrowed(rt, dest, 1, rt.size(c0), rt.size(width)), False)
        else:
            dest = rt.emit(rt.fmt("view", rows, rt.shape([m, n_rest * offs[-1]])), False)

        def gemm(b_rows, f0, n):
            """Statements multiplying ``a`` into the rows j = f0 … f0 + n of the slab."""
            if not lo:
                if f0 is None:
                    return _row_blocks(rt, a, b_rows, dest, m)
                out = rt.fresh()        # the chunk's columns of the slab (in the loop)
                return [f"{out} = " + rt.fmt("narrow", dest, -1, f"{f0}*({rt.size(offs[-1])})",
                                             f"{n}*({rt.size(offs[-1])})", "")] + \
                    _row_blocks(rt, a, b_rows, out, m)
            out = dest if f0 is None else _narrowed(rt, dest, 2, f0, n)
            n = rt.size(n_rest) if f0 is None else n
            b3 = rt.fmt("permute", rt.fmt("view", b_rows, f"({rt.size(inner)}, {n}, "
                                                          f"{rt.size(width)})"), "1, 0, 2")
            a3 = rt.fmt("bcast_lead", a, f"({n},)")
            return _row_blocks(rt, a3, b3, rt.fmt("permute", out, "1, 0, 2"), m)

        if chunk is None:
            b = rt.emit(rt.fmt("view", R, rt.shape([inner, n_rest * width])), False)
            for ln in gemm(b, None, None):
                rt.line(ln)
        else:       # R a chunk of its rows at a time, each multiplied into its rows of H
            n = rt.fresh("n_rows")
            f0 = rt.fresh("f0")
            k = sp.Symbol(n)
            per_row = (N_BATCH if seqs else 1) * s_size * width     # entries of R per row
            rt.line(f"{n} = max(1, min({rt.size(n_rest)}, "
                    f"{CHUNK_ENTRIES} // ({rt.size(per_row)})))")
            rt.line(f"while {rt.size(n_rest)} % {n}:    # chunks of equal size")
            rt.line(f"    {n} -= 1")
            rt.line(f"{R} = {rt.fmt('scratch', rt.shape(seqs + [s_size, k, width]))}")
            flat = rt.emit(rt.fmt("view", R, rt.shape(seqs + [s_size * k, width])), False)
            b = rt.emit(rt.fmt("view", R, rt.shape([inner, k * width])), False)
            before_loop, loop = chunk.lines(rt, flat, f0, n)
            for ln in before_loop:
                rt.line(ln)
            rt.line(f"for {f0} in range(0, {rt.size(n_rest)}, {n}):")
            for ln in loop:
                rt.line("    " + ln)
            for ln in gemm(b, f0, n):
                rt.line("    " + ln)
        rt.written += _prod_rep(rt, (offs[i + 1] - offs[i]) * width)
        rt.line(f"del {R}")
        below = [(i, j) for j in range(lo)]
        for _, j in below:
            _count_copy(rt, offs, i, j)
        for j in range(lo, len(per_q)):
            terms, r, c = per_q[j]
            if direct[j]:
                rt.dense_into(block(i, j), direct[j], r, c, fresh=False)
        return grown, below

    @staticmethod
    def _chunked_operand(rt, write_operand, cols):
        """A ``SlabChunk`` holding the writes of a slab's operand R (``write_operand``; the
        statements before them printed), or None, nothing printed, where a write cannot be
        split by rows."""
        snap = rt._snapshot()
        chunk = rt.chunk = SlabChunk()

        def target(j):                  # a name standing for R's columns j in the writes
            name = rt.fresh("R_cols")
            chunk.columns(name, cols[j])
            return name

        try:
            write_operand(target)
        except NotChunkable:
            rt._restore(snap)
            return None
        finally:
            rt.chunk = None
        return chunk

    # -- matrix view -----------------------------------------------------------------
    def _mean(self, rt, name):
        """The batch mean of a result; one sequence needs no reduction pass (mean = entry 0)."""
        if not rt.is_batched[name]:
            return name
        return f"({name}[0] if n_batch == 1 else {rt.fmt('mean_batch', name)})"

    def hvp(self, part):
        dirs = list(self.d.hvp_directions().values())
        rt = self.routine(dirs)
        exprs = list(self.d.hvp_expressions(part).values())
        rt.plan(exprs)                # products shared between the parameters' rows
        outs = [self._mean(rt, rt.mat(e)) for e in exprs]
        return self.function(f"hvp__{part}", rt, "(" + ", ".join(outs) + ",)",
                             f"(Σ_q H_{part}(p, q) V_q for p in the parameters): matrix view, no block.",
                             extra=dirs)

    def gradient(self):
        rt = self.routine()
        exprs = [self.d.gradient(p) for p in self.d.layer.param_names]
        rt.plan(exprs)
        outs = [self._mean(rt, rt.mat(e)) for e in exprs]
        return self.function("gradient", rt, "(" + ", ".join(outs) + ",)",
                             "(∂ℓ/∂W_p for p in the parameters), batch mean.")

    def check_inputs(self):
        """The inputs of the layer's batch checks, for every sequence at once (Y not read):
        the kernels validate values with one call of this instead of interpreting the
        declaration sequence by sequence."""
        from .jacobians import header, routine
        rt, vs, batched = routine(self)
        checks = self.d.layer.batch_checks
        ret = "(" + "".join(f"{rt.mat(c.input)}, " for c in checks) + ")"
        doc = "The inputs of the layer's value checks (" + \
            ", ".join(f"LayerNorm {c.label}" if hasattr(c, "label") else type(c).__name__
                      for c in checks) + ")."
        return Function(f"{self.tag}__check_inputs", list(vs), header(self, vs, batched) +
                        rt.pruned(ret), ret, doc)

    def loss(self):
        rt = self.routine()
        v = self._mean(rt, rt.mat(self.d.loss_expr))
        return self.function("loss", rt, f"{v}[0, 0]", "The loss, batch mean.")

    # -- reductions ------------------------------------------------------------------
    def _diag_terms(self, rt, p, part):
        terms, r, c = self.low.terms(p, p, part)
        out = []
        for t in terms:
            t = t.copy()
            rt.lw.unify(t, r, c)
            out.append(t)
        return out, r

    def diag(self, p, part):
        rt = self.routine()
        terms, r = self._diag_terms(rt, p, part)
        rt.line(f"out = {rt.fmt('empty', rt.shape((self.numel(p),)))}")
        rt.dense_into("out", terms, r, [], fresh=True)
        return self.function(f"diag__{p}__{part}", rt, "out",
                             f"diag H_{part}({p}, {p}) (vec_r order) without the dense block.")

    def trace(self, p, part):
        rt = self.routine()
        terms, r = self._diag_terms(rt, p, part)
        nets = [rt.network(t, [], summed=rt.lw.resolve(t, r))[:2] for t in terms]
        return self.function(f"trace__{p}__{part}", rt, rt.scalar(nets),
                             f"tr H_{part}({p}, {p}) without the dense block.")

    def frobenius(self, p, q, part):
        """‖Σ_t N_t‖² = Σ_{t,t'} ⟨N_t, N_t'⟩, each pairing one contraction (no block built)."""
        rt = self.routine()
        ret = self._frobenius_into(rt, p, q, part)
        return self.function(f"frobenius__{p}__{q}__{part}", rt, ret,
                             f"‖H_{part}({p}, {q})‖_F from index networks, exact, without the block.")

    def frobenius_all(self, part):
        """Every block's norm in one routine, so the moments are computed once for all."""
        rt = self.routine()
        names = self.d.layer.param_names
        outs = [self._frobenius_into(rt, p, q, part) for p in names for q in names]
        return self.function(f"frobenius_all__{part}", rt, "(" + ", ".join(outs) + ",)",
                             f"(‖H_{part}(p, q)‖_F for p, q in the parameters, row-major).")

    def _frobenius_into(self, rt, p, q, part):
        terms, r, c = self.low.terms(p, q, part)
        if not terms:
            return rt.zero()
        if len(terms) > PAIRWISE_MAX_TERMS:
            return self._frobenius_dense(rt, p, q, terms, r, c)
        s = rt.emit(rt.scalar(self._pairings(rt, (terms, r, c))), True)
        return rt.emit(rt.fmt("sqrt_pos", s), True)

    def _pairings(self, rt, first, second=None):
        """[(coef, code)] of the networks ⟨N_t, N'_t'⟩ over the terms of two lowered blocks
        ((terms, rows, cols) each); with one block, each unordered pair once (twice weighted
        off the diagonal), so their sum is ‖Σ_t N_t‖²."""
        ta, r, c = first
        tb, r2, c2 = second or first
        nets = []
        for i, t1 in enumerate(ta):
            for j, t2 in enumerate(tb):
                if second is None and j < i:
                    continue
                t2 = _relabel(rt.lw, t2, r2 + c2, r + c)
                pair = _pair(rt.lw, t1, t2, r, c)
                outer = rt.lw.resolve(pair, r) + rt.lw.resolve(pair, c)
                coef, code, _ = rt.network(pair, [], summed=outer, search=True)
                nets.append((coef * (1 if (second is None and i == j) else 2), code))
        return nets

    def _dense_temporary(self, rt, p, q, terms, r, c):
        """The name of a temporary holding the block Σ terms densely."""
        tmp = rt.fresh("blk")
        rt.line(f"{tmp} = {rt.fmt('scratch', rt.shape((self.numel(p), self.numel(q))))}")
        rt.dense_into(tmp, terms, r, c, fresh=True)
        return tmp

    def _frobenius_dense(self, rt, p, q, terms, r, c):
        """‖H‖_F of a block with many terms: built densely in a temporary, then freed."""
        tmp = self._dense_temporary(rt, p, q, terms, r, c)
        norm = rt.fresh("nrm")
        rt.line(f"{norm} = {rt.fmt('norm', tmp)}")
        rt.line(f"del {tmp}")
        return norm

    def frobenius_split(self, p, q):
        """(‖H_o‖, ‖H_f‖, ‖H‖) of one block from the pairings of the two parts' terms:
        ‖H‖² = ‖H_o‖² + ‖H_f‖² + 2⟨H_o, H_f⟩, so the full block costs one cross term more."""
        rt = self.routine()
        sq = {}
        parts = {part: self.low.terms(p, q, part) for part in ("outer", "functional")}
        if any(len(t) > SPLIT_PAIRWISE_MAX_TERMS for t, _, _ in parts.values()):
            return self._frobenius_split_dense(rt, p, q, parts)
        for a, b in (("outer", "outer"), ("functional", "functional"), ("outer", "functional")):
            nets = self._pairings(rt, parts[a], parts[b] if a != b else None)
            sq[(a, b)] = rt.emit(rt.scalar(nets), True) if nets else None
        o, f, x = sq[("outer", "outer")], sq[("functional", "functional")], sq[("outer", "functional")]
        present = [v for v in (o, f, x) if v is not None]
        full = rt.emit(" + ".join(present), True) if present else None
        outs = [rt.emit(rt.fmt("sqrt_pos", v), True) if v is not None else rt.zero()
                for v in (o, f, full)]
        return self.function(f"frobenius_split__{p}__{q}", rt, "(" + ", ".join(outs) + ",)",
                             f"(‖H_o({p}, {q})‖_F, ‖H_f({p}, {q})‖_F, ‖H({p}, {q})‖_F), exact, "
                             "from the parts' pairings (no block built).")

    def _frobenius_split_dense(self, rt, p, q, parts):
        """The split norms of a block with many terms: both parts built densely, then freed."""
        o, f = (self._dense_temporary(rt, p, q, *parts[part]) for part in ("outer", "functional"))
        outs = [rt.emit(rt.fmt("norm", x), False) for x in (o, f, f"({o} + {f})")]
        rt.line(f"del {o}, {f}")
        return self.function(f"frobenius_split__{p}__{q}", rt, "(" + ", ".join(outs) + ",)",
                             f"(‖H_o({p}, {q})‖_F, ‖H_f({p}, {q})‖_F, ‖H({p}, {q})‖_F), exact, "
                             "from dense temporaries (the parts have many terms).")

    def keys(self):
        """Every routine key of the variant, in the order of the generated module."""
        names = self.d.layer.param_names
        out = [("loss",), ("gradient",)] + ([("check_inputs",)] if self.d.layer.batch_checks else [])
        for part in PARTS:
            out += [("hessian", part), ("hvp", part), ("frobenius_all", part)]
            for p in names:
                out += [("diag", p, part), ("trace", p, part)]
                for q in names:
                    out += [("block", p, q, part), ("frobenius", p, q, part)]
        out += [("frobenius_split", p, q) for p in names for q in names]
        return out

    def make(self, key):
        """The generated function of one routine key."""
        kind, args = key[0], key[1:]
        return {"loss": self.loss, "gradient": self.gradient, "check_inputs": self.check_inputs,
                "hessian": self.hessian,
                "hvp": self.hvp, "frobenius_all": self.frobenius_all, "diag": self.diag,
                "trace": self.trace, "block": self.block, "frobenius": self.frobenius,
                "frobenius_split": self.frobenius_split}[kind](*args)

    def all(self):
        fns, table = [], []
        for key in self.keys():
            fn = self.make(key)
            fns.append(fn)
            table.append((repr(key), fn.name))
        return fns, table


def _relabel(lw, t, old, new):
    """A term lowered against labels ``old`` re-expressed over ``new`` (same sizes)."""
    if list(old) == list(new):
        return t
    t = t.copy()
    lw.unify(t, list(new), list(old))
    return t


def _pair(lw, t1, t2, r, c):
    """The network ⟨N_1, N_2⟩: t2's indices renamed, its outer indices identified with t1's."""
    t = t1.copy()
    ren = {}

    def rn(a):
        if a not in ren:
            ren[a] = lw.labels.new(lw.labels.size[a])
        return ren[a]

    facs = tuple(Factor(f.ref, tuple(rn(a) for a in lw.resolve(t2, f.labels)), side=1)
                 for f in t2.factors)
    t.factors = t1.factors + facs
    t.coef = t1.coef * t2.coef
    lw.unify(t, lw.resolve(t1, r), [rn(a) for a in lw.resolve(t2, r)])
    lw.unify(t, lw.resolve(t1, c), [rn(a) for a in lw.resolve(t2, c)])
    return t


# ----------------------------------------------------------------------------- modules
def _env():
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def render_module(layer_name, backend, only=None) -> str:
    """The source of ``generated/<backend>/<layer>.py`` (``only``: restrict to some variants)."""
    target = TARGETS[backend]
    functions, vs = [], []
    jac = {}        # options -> Jacobian table entries (loss-independent: printed once)
    for loss, options in (only or variants(layer_name)):
        fns, table = Variant(lowered(layer_name, loss, options), target, variant_tag(loss, options)).all()
        functions.extend(fns)
        if options not in jac:
            jfns, jac[options] = _jacobian_routines(layer_name, loss, options, target)
            functions.extend(jfns)
        vs.append(_variant_entry(loss, options, table + jac[options]))
    description = " ".join((get_layer(layer_name).description or "").split())
    return _module_source(layer_name, backend, description, vs, functions)


def _jacobian_routines(layer_name, loss, options, target):
    """(functions, table entries) of a variant's Jacobians (tagged by the options only)."""
    tag = variant_tag("", options).lstrip("_")
    return jacobians.routines(Variant(lowered(layer_name, loss, options), target, tag))


def _variant_entry(loss, options, table):
    return {"tag": variant_tag(loss, options), "loss": loss, "options": dict(options),
            "key": repr((loss, options)), "table": table}


def _module_source(layer_name, backend, description, variants, functions):
    """The template rendered for some variants' functions."""
    from . import __version__
    return _env().get_template("kernels.py.j2").render(
        version=__version__, backend=backend, layer=layer_name, description=description,
        variants=variants, functions=functions, imports=TARGETS[backend]["imports"],
        preamble=TARGETS[backend]["preamble"])


def render_routine(layer_name, backend, loss, options, key):
    """One routine of one variant, rendered and executed in memory (on-demand layers)."""
    target = TARGETS[backend]
    if key[0].startswith("jacobian"):
        fns, table = _jacobian_routines(layer_name, loss, options, target)
    else:
        fn = Variant(lowered(layer_name, loss, options), target, variant_tag(loss, options)).make(key)
        fns, table = [fn], [(repr(key), fn.name)]
    src = _module_source(layer_name, backend, "", [_variant_entry(loss, options, table)], fns)
    ns = {"__name__": f"symhess_inline_{backend}_{layer_name}"}
    exec(compile(src, f"<symhess {backend} {layer_name} {key}>", "exec"), ns)
    return ns["VARIANTS"][(loss, options)]


# at most this many rendering processes (each holds a layer's derivation, up to ≈ 1 GB)
MAX_WORKERS = 4


def _render_layer(name):
    """{relative path: source} of one layer's modules (both backends share its derivation)."""
    return {f"{backend}/{name}.py": render_module(name, backend) for backend in TARGETS}


def render_all():
    """{relative path: source} for every registered layer and backend.

    Layers are independent, so with several CPUs they render in forked worker processes
    (layers registered at run time are inherited); the result does not depend on it.
    """
    names = sorted(n for n in LAYERS if n not in ON_DEMAND)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(len(names), cpus, MAX_WORKERS)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            parts = list(pool.map(_render_layer, names))
    else:
        parts = [_render_layer(n) for n in names]
    return {path: src for part in parts for path, src in part.items()}


def generate(out_dir="generated", check=False) -> list:
    """Write (or with ``check`` only compare) every generated module; returns the stale paths.

    Writing is atomic: everything is rendered into a temporary folder first and only then
    replaces ``out_dir``, so a failure leaves the previous files untouched.
    """
    out_dir = Path(out_dir)
    files = render_all()
    stale = _differing(out_dir, files)
    if out_dir.exists():
        for path in sorted(out_dir.rglob("*.py")):
            if str(path.relative_to(out_dir)) not in files:
                stale.append(str(path))
    if check:
        return stale
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".generated-", dir=out_dir.parent))
    try:
        for rel, src in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(src)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old-" + tmp.name[-8:])
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return stale


def check_layer(name, out_dir="generated") -> list:
    """The stale paths among one layer's committed modules (both backends), without rendering
    the other layers: what ``symhess run LAYER`` checks. Empty for an on-demand layer."""
    if name in ON_DEMAND:
        return []
    return _differing(Path(out_dir), _render_layer(name))


def _differing(out_dir, files):
    """The paths under ``out_dir`` of the rendered ``files`` that are missing or differ."""
    return [str(out_dir / rel) for rel, src in files.items()
            if not (out_dir / rel).exists() or (out_dir / rel).read_text() != src]


def main_check_layer(name, out_dir="generated") -> int:
    """CLI entry for ``symhess run``: prints the layer's stale modules; exit code 1 if any."""
    if name in ON_DEMAND:
        print(f"{name}: kernels are not committed ({ON_DEMAND[name]})")
        return 0
    stale = check_layer(name, out_dir)
    for path in stale:
        print(f"stale: {path}")
    if stale:
        print(f"{len(stale)} generated file(s) of {name} differ from a fresh generation; "
              "run `symhess generate`")
        return 1
    print(f"generated/{{numpy,torch}}/{name}.py are up to date")
    return 0


def main_generate(check: bool, out_dir="generated") -> int:
    """CLI entry: generate (or check); prints the stale files; exit code 1 if check finds any."""
    stale = generate(out_dir, check=check)
    verb = "stale" if check else "written"
    for path in stale:
        print(f"{verb}: {path}")
    if check and stale:
        print(f"{len(stale)} generated file(s) differ from a fresh generation; run `symhess generate`")
        return 1
    if not stale:
        print("generated/ is up to date")
    return 0


def diff(a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True)))

"""Prepared values: one generated variant bound to the arrays of one call.

A generated module defines, per (loss, options) variant, a subclass of ``Forward`` whose

* ``@leaf`` methods are the forward quantities (A, M_1, the output gradient G, …), each
  computed on first use and kept: an iterative method (Lanczos, CG) calling ``hvp`` again
  and again at the same values computes them once;
* ``block__P__Q__PART`` methods (P not after Q in the declared order, PART ``outer`` or
  ``functional``) return the block's index networks (``symhess.runtime.network``); a block
  with no method is the zero block; H(Q, P) = H(P, Q)ᵀ for every part;
* ``hvp__PART``, ``gradient``, ``loss`` are matrix-view routines; ``jacobian__P`` returns the
  Jacobian's networks over (batch | rows of F | atoms of W_P); ``check_inputs`` the inputs of
  the layer's value checks.

Every public method below is exact and reads ``self.schedule`` (memory budget, compacts);
its result (``RESULTS``) is checked once for NaN/inf and its vectors for shape, dtype and
finiteness (``runtime.checks``): an overflow from finite values is an ``InputError`` naming
the quantity and its likely cause.  Result and vector flags are read together, once per call
(on a device the call's one host synchronisation; traces and norms stay 0-d tensors).
Costs, with T the networks of a block and c(N) the planned cost of contracting N:
hessian_block Σ_T c(N → block) (+ writing it); diag Σ_T c(N with columns = rows → rows);
trace likewise to a scalar; frobenius_norm Σ_{s≤t} c(⟨N_s, N_t⟩) (no block built); hvp: the
matrix-view statements (about a gradient's products).
"""
from __future__ import annotations

import functools
import math
from functools import cached_property

from . import chain, checks, chunk, collect, gram
from . import network as N
from ..errors import InputError, UnknownNameError

leaf = cached_property

# the public results, each checked once for NaN/inf (``runtime.checks.finite``) when it is
# returned (a non-finite result from finite values: an overflow, named with its cause)
RESULTS = ("loss", "gradient", "hvp", "block_hvp", "diag", "diagonals", "trace", "frobenius_norm",
           "frobenius_split", "frobenius_norms", "hessian_block", "hessian")


def _checked(fn):
    """``fn`` with its result and vectors checked for NaN/inf at once, by one flag read on
    the host (``checks.all_finite``); a checked call made by another skips its own check."""
    @functools.wraps(fn)
    def run(self, *args, **kw):
        if self._deferred is not None:
            return fn(self, *args, **kw)
        self._deferred = deferred = []
        try:
            out = fn(self, *args, **kw)
        finally:
            self._deferred = None
        parts = list(out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,))
        if not checks.all_finite(parts + [a for _, a in deferred]):
            for name, a in deferred:
                checks.vector_finite(name, a, self.like)
            call = ", ".join(["v" if hasattr(a, "shape") else repr(a) for a in args]
                             + [f"{k}={'v' if hasattr(v, 'shape') else repr(v)}" for k, v in kw.items()])
            for x in parts:
                checks.finite(x, f"{fn.__name__}({call})", {**self._values, **dict(deferred)}, self.like)
        return out
    run.checked = True
    return run


# columns of a matrix product per vectorised call, and the temporaries of one column in
# multiples of the call's values (a Hessian–vector product's largest temporaries are a few
# times the activations it passes through, B L d_ff or B L² per head)
COLUMNS_PER_CALL = 64
COLUMN_WORK = 16


def _ndim(v):
    return len(getattr(v, "shape", ()))


def _nbytes(a):
    return getattr(a, "nbytes", 0)       # NumPy arrays and torch tensors both have it


def _part(part):
    if part not in ("outer", "functional", "full"):
        raise UnknownNameError(f"unknown part {part!r}; valid: outer, functional, full")
    return part


class Product:
    """A product F₁⋯F_k of a routine not formed yet (``Forward.prod``): ``value()`` forms it
    (a fresh array), ``into(acc, c)`` adds c times it to acc in place; ``shape`` is the
    result's."""

    __slots__ = ("state", "key", "xs", "shape")

    def __init__(self, state, key, xs):
        self.state, self.key, self.xs = state, key, xs
        shapes = [tuple(state.ops.shape(x)) for x in xs]
        batch = max((sh[0] for sh in shapes if len(sh) == 3), default=None)
        self.shape = ((batch,) if batch is not None else ()) + (shapes[0][-2], shapes[-1][-1])

    def value(self):
        """The product as an array of its own (the caller may write into it): when the whole
        chain is a run the state keeps (``mm``), a copy, not the kept array."""
        out = self.state.mm(self.key, *self.xs)
        n, runs = chain.runs(self.key)
        whole = runs.get((0, n - 1))
        if whole is not None and whole[0] in self.state._kept(whole[0]):
            return self.state.ops.copy(out)
        return out

    def into(self, acc, c):
        return self.state.mm(self.key, *self.xs, into=(acc, c))


class Forward:
    """The values of one call bound to a variant (made by ``Kernel.prepare``)."""

    PARAMS = ()           # parameter names in declared order (set by the generated class)
    RUNS = {}             # named runs of factors held by several chains → their number (``mm``)
    _one_shot = False     # made for a single call: only products shared within it are kept
    # a variant rendered in parts: LAZY(what) → the class of that part (blocks of a pair of
    # parameters, ("block", p, q), or a Jacobian, ("jacobian", p)), rendered on first use
    LAZY = None
    _deferred = None      # during a checked call: the vectors whose finiteness it reads

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in RESULTS:                      # the generated loss and gradient
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "checked", False):
                setattr(cls, name, _checked(fn))

    def __init__(self, arrays, dims, n_batch, ops, schedule, like):
        self.__dict__.update(arrays)
        self._values = arrays
        self.__dict__.update(dims)
        self.n_batch = n_batch
        self.ops, self.schedule, self.like = ops, schedule, like
        self._nets = {}
        self._runs = {}           # products of named factors (``mm``), by name
        self._local = {}          # … of runs holding a routine's locals, for one call only
        self._diag_sums = {}      # (p, part) → Σ diag, so a later trace costs nothing
        self._splits = {}         # (p, q) → frobenius_split, so H(q, p) costs nothing
        self._parts = set()       # parts of a variant rendered in parts, loaded into this state

    def __repr__(self):
        return f"<prepared {type(self).__qualname__}: {self.n_batch} sequence(s)>"

    # -- blocks as networks ---------------------------------------------------------------
    def _param(self, p):
        if p not in self.PARAMS:
            raise UnknownNameError(f"unknown block {p!r}; valid: {', '.join(self.PARAMS)}")
        return p

    def member(self, name, part):
        """The generated method ``name`` (None if the variant has none: a zero block); in a
        variant rendered in parts, the ``part`` that holds it is rendered (or loaded) first and
        this state's class extended by it."""
        fn = getattr(self, name, None)
        if fn is None and self.LAZY is not None and part not in self._parts:
            self._parts.add(part)
            extra = type(self).LAZY(part)
            if extra is not None:
                self.__class__ = type(type(self).__name__, (extra, type(self)), {})
            fn = getattr(self, name, None)
        return fn

    def numel(self, p):
        return math.prod(self.ops.shape(getattr(self, self._param(p))))

    def nets(self, p, q, part="full"):
        """The index networks whose sum is H_part(p, q) (rows: W_p's atoms, columns: W_q's)."""
        self._param(p), self._param(q), _part(part)
        if part == "full":
            return self.nets(p, q, "outer") + self.nets(p, q, "functional")
        key = (p, q, part)
        if key not in self._nets:
            if self.PARAMS.index(p) <= self.PARAMS.index(q):
                fn = self.member(f"block__{p}__{q}__{part}", ("block", p, q))
                self._nets[key] = list(fn()) if fn is not None else []
            else:
                self._nets[key] = [n.transposed() for n in self.nets(q, p, part)]
        return self._nets[key]

    # -- dense ------------------------------------------------------------------------------
    def hessian_block(self, p, q, part="full"):
        """H_part(p, q) as a dense (numel p × numel q) array, vec_r layout.

        Cost: each network contracted to the block's rows and columns (planned at these sizes;
        ``runtime.cost`` counts it); memory: the block plus the largest intermediate."""
        nets = self.nets(p, q, part)
        if not nets:
            return self.ops.zeros((self.numel(p), self.numel(q)), like=self.like)
        return chunk.dense(self, nets)

    def all_blocks(self):
        """In a variant rendered in parts, every block rendered at once (one lowering for all:
        what a whole Hessian or all Frobenius norms need)."""
        if self.LAZY is not None:
            self.member("block__", ("blocks",))
            self._parts.update(("block", p, q) for p in self.PARAMS for q in self.PARAMS)

    def hessian(self, part="full", out=None):
        """The whole Hessian, parameters in declared order (written into ``out`` if given)."""
        _part(part)
        self.all_blocks()
        sizes = [self.numel(p) for p in self.PARAMS]
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        fresh = out is None
        if fresh:
            out = self.ops.zeros((offs[-1], offs[-1]), like=self.like)
        for i, p in enumerate(self.PARAMS):
            for j, q in enumerate(self.PARAMS):
                view = out[offs[i]:offs[i + 1], offs[j]:offs[j + 1]]
                if j < i and self.schedule.mirror:
                    view[...] = out[offs[j]:offs[j + 1], offs[i]:offs[i + 1]].T
                    continue
                if not fresh:
                    view[...] = 0
                nets = self.nets(p, q, part)
                if nets:
                    first = nets[0]
                    shape = [first.sizes[x] for g in first.groups[:2] for x in g]
                    acc = self.ops.reshape(view, shape)
                    for n in nets:
                        N.accumulate(self, n, (0, 1), acc, shape)
        return out

    # -- reductions --------------------------------------------------------------------------
    def diag(self, p, part="full"):
        """diag H_part(p, p) (vec_r order), without the block.

        Cost: the block's networks with column atoms identified with row atoms, contracted to
        the rows; for attention's H_o(W_Q) that is the per-token C_i = Σ_j A_ij k_j (v_j − μ_i)ᵀ,
        O(B L² d_K d_V) flops, for H_o(W_K) two contractions of B L² d_K d (over the query
        token first, then with the value Gram matrix), the functional parts O(B L² d); memory
        O(B L d_K d_V) or less when sliced to the schedule's limit."""
        return self.diagonals(part, (self._param(p),))[p]

    def diagonals(self, part="full", params=None):
        """{p: diag H_part(p, p)} for ``params`` (default: every parameter) in one pass.

        Cost: each parameter's ``diag``, except that a per-token compact too large to keep
        (``runtime.chunk``: a full block's LayerNorm and MLP Jacobians, B L d² entries) is
        formed once per slice for every parameter whose networks hold it, not once per
        parameter: the attention weights' diagonals of a post-LN block share all of theirs;
        and networks that differ only in a sub-network are contracted once over the sum of
        those sub-networks (``runtime.collect``: the modern block's H_o(W_K, W_K), 16 networks
        of two heads and the middles of (I + J)ᵀ(I + J), contracts 4 over one per-token sum)."""
        _part(part)
        params = self.PARAMS if params is None else tuple(self._param(p) for p in params)
        nets = {p: self._diagonal_nets(p, part) for p in params}
        out = chunk.dense_each(self, nets, groups=(0,))
        for p in params:
            if p not in out:
                out[p] = self.ops.zeros((self.numel(p),), like=self.like)
            self._diag_sums[(p, part)] = out[p].sum()
        return {p: out[p] for p in params}

    def _diagonal_nets(self, p, part):
        """The networks of H_part(p, p) with column atoms identified with row atoms, those
        that differ only in a sub-network collected (``runtime.collect``)."""
        return collect.collected(self, [N.identified(self, n, 0, 1) for n in self.nets(p, p, part)], (0,))

    def trace(self, p, part="full"):
        """tr H_part(p, p), without the block (the sum of ``diag`` when it was computed)."""
        known = self._diag_sums.get((p, part))
        if known is not None:
            return known
        return N.scalar(self, [N.closed(n) for n in self._diagonal_nets(p, part)])

    def frobenius_norm(self, p, q, part="full"):
        """‖H_part(p, q)‖_F, exact, from pairs of networks (no block built)."""
        return self.ops.root(gram.frobenius_sq(self, self.nets(p, q, part)))

    def frobenius_split(self, p, q):
        """{outer, functional, full: ‖H_part(p, q)‖_F}; the full norm pairs the networks of
        both parts (``runtime.gram``): those over one skeleton as one network, so ‖H‖² is
        computed directly where it can be, else ‖H_o‖² + ‖H_f‖² + 2⟨H_o, H_f⟩ from the
        pairings already made.  Kept per state, so H(q, p) after H(p, q) costs nothing.

        Cost: each pairing of the block's (merged) networks in token form or by the
        contraction planner, whichever plans fewer flops: token Gram matrices over the
        batch's B·L tokens, half of them for a norm, shared by the block's pairings.  For
        attention O((B L)² d²) flops for H(W_K, W_K) (Σ (q_i·q_i′)² ⟨C_iᵀC_i, C_i′ᵀC_i′⟩,
        half the pairs) and the cross pairings of W_K, W_V rows, O(B L d³) to form C_iᵀC_i,
        O((B L)² (d + d_K²)) for H(W_Q, W_Q)."""
        known = self._splits
        if (q, p) in known:                   # ‖H(q, p)‖ = ‖H(p, q)ᵀ‖
            return dict(known[(q, p)])
        oo, ff, full = gram.frobenius_split_sq(self, self.nets(p, q, "outer"),
                                               self.nets(p, q, "functional"))
        root = self.ops.root
        known[(p, q)] = {"outer": root(oo), "functional": root(ff), "full": root(full)}
        return dict(known[(p, q)])

    def frobenius_norms(self, part="full"):
        """{(p, q): ‖H_part(p, q)‖_F} for every block (H(q, p) = H(p, q)ᵀ computed once)."""
        self.all_blocks()
        out = {}
        for i, p in enumerate(self.PARAMS):
            for q in self.PARAMS[i:]:
                out[(p, q)] = out[(q, p)] = self.frobenius_norm(p, q, part)
        return {(p, q): out[(p, q)] for p in self.PARAMS for q in self.PARAMS}

    def block_hvp(self, p, q, v, part="full"):
        """H_part(p, q) v for v of shape (numel q,) or (numel q, k), without the block: each
        network contracted with v over the column atoms."""
        nets = self.nets(p, q, part)
        nq = self.numel(q)
        k = getattr(v, "shape", (None, None))[1] if len(getattr(v, "shape", ())) == 2 else None
        v = checks.vector(v, self.like, [(nq,)] + ([(nq, k)] if k else []), deferred=self._deferred)
        shape = (self.numel(p),) if k is None else (self.numel(p), k)
        if not nets:
            return self.ops.zeros(shape, like=self.like)
        acc = None
        for n in nets:
            cols = n.groups[1]
            extra = () if k is None else (n.top,)
            vv = self.ops.reshape(v, [n.sizes[x] for x in cols] + ([k] if k else []))
            sizes = dict(n.sizes)
            if k:
                sizes[n.top] = k
            m = N.Net(n.coef, n.ops + [vv], n.labels + [tuple(cols) + extra],
                      (tuple(n.groups[0]) + extra,), sizes)
            acc = N.accumulate(self, m, (0,), acc, [n.sizes[x] for x in n.groups[0]] + ([k] if k else []))
        return self.ops.reshape(acc, shape)

    # -- matrix view -------------------------------------------------------------------------
    def mm(self, key, *xs, mean=False, into=None):
        """F₁⋯F_k in the cheapest order at these sizes (``runtime.chain``); ``mean``: its
        batch mean, the batch folded into the last product (``ops.matmul_mean``: one product
        over the n·L tokens, no per-sequence results); ``into`` (acc, c): acc + c F₁⋯F_k
        written into acc, the last product accumulated by the GEMM itself
        (``ops.addmm_``: no array for the product, no pass to add it).  ``key`` names
        the factors, one word each: a factor that does not depend on the routine's arguments
        by its member name (' for its transpose), a local of the routine by @ and its name
        ("@t_3 X W_V"), any other factor by _ ("_ X W_V").

        Products of consecutive named factors are shared: formed once per state and found by
        every later chain that holds them, in either orientation (t W_Vᵀ Xᵀ finds X W_V).  A
        chain prices a run that ``RUNS`` counts in n chains at 1/n of its cost, so the first
        chain forms it even where its own orders tie; in a prepared state's routines a run
        is kept across the calls and priced as free (a one-off state keeps only the shared).
        A run that holds a local (dS K in dS K W_Qᵀ and N_1ᵀ dS K) is shared the same way
        within the routine's call and dropped at its end (``hvp``)."""
        n, runs = chain.runs(key)
        if len(xs) != n:
            raise ValueError(f"chain key {key!r} names {n} factors, {len(xs)} given")
        free, shared = self._prices(key) if runs else ((), ())
        ops = self.ops

        def fetch(i, j):
            name, flipped = runs[i, j]
            got = self._kept(name).get(name)
            if got is None:
                return None
            return ops.tr(got) if flipped else got

        def store(i, j, product):
            name, flipped = runs[i, j]
            self._kept(name)[name] = ops.tr(product) if flipped else product

        fold = (ops.matmul_mean, ops.batch_mean) if mean else None
        if into is not None:
            acc, c = into
            fold = (lambda a, b: ops.addmm_(acc, a, b, c),
                    lambda x: ops.added(acc, x, c))
        return chain.multiply(xs, ops.matmul2, ops.shape, free, shared, fetch, store, fold=fold)

    def prod(self, key, *xs):
        """F₁⋯F_k deferred (``Product``): the backends' ``lin`` accumulates it into its sum
        (``mm(…, into=…)``) or takes it as the sum's fresh array."""
        return Product(self, key, xs)

    def _kept(self, name):
        """Where the product of the run ``name`` is kept: a run holding a routine's local
        (``@``) for the routine's call, any other for the state's life."""
        return self._local if "@" in name else self._runs

    def _prices(self, key):
        """(free intervals, shared intervals with their counts) of a chain key, now."""
        _, runs = chain.runs(key)
        routine = any(t == "_" or t[0] == "@" for t in key.split())
        free, shared = [], []
        for (i, j), (name, _) in runs.items():
            if name in self._kept(name) or ("@" not in name and routine and not self._one_shot):
                free.append((i, j))
            elif self.RUNS.get(name, 1) > 1:
                shared.append((i, j, self.RUNS[name]))
        return tuple(free), tuple(shared)

    def mm_sum(self, side, *terms, mean=False):
        """Σ_t c_t F_t,1 ⋯ F_t,k for terms ``(c_t, key_t, F_t,1, …)`` (keys as in ``mm``) that
        share their last (``side`` "r") or first ("l") factor F: computed as written or as
        (Σ_t c_t F_t,1 ⋯ F_t,k−1) F (F (Σ …) on the left), whichever multiplies less at these
        sizes.  Factoring t W_Vᵀ Xᵀ + t′ V_Vᵀ Xᵀ saves a product of size L² d; factoring
        X V_Q W_Kᵀ Xᵀ + X W_Q V_Kᵀ Xᵀ would cost L d² more.  The terms are summed by the
        backend's ``lin``: one fresh array, each later product accumulated by its GEMM.
        ``mean``: the batch mean (as in ``mm``)."""
        shape = lambda x: tuple(self.ops.shape(x))         # noqa: E731
        cost = lambda key, xs: chain.chain_cost(tuple(shape(x) for x in xs), *self._prices(key))  # noqa: E731
        as_written = sum(cost(t[1], t[2:]) for t in terms)
        cut = (lambda xs: xs[:-1]) if side == "r" else (lambda xs: xs[1:])        # noqa: E731
        parts = [(t[0], " ".join(cut(t[1].split())), cut(t[2:])) for t in terms]
        shared = terms[0][2:][-1] if side == "r" else terms[0][2]
        inner = sum(cost(k, fs) for _, k, fs in parts if len(fs) > 1)
        rows = max((shape(fs[0]) for _, _, fs in parts), key=len)
        cols = max((shape(fs[-1]) for _, _, fs in parts), key=len)
        s_shape = shape(shared)
        batch = max(x[0] if len(x) == 3 else 1 for x in (rows, cols, s_shape))
        last = batch * (rows[-2] * cols[-1] * s_shape[-1] if side == "r" else
                        s_shape[-2] * s_shape[-1] * cols[-1])
        if inner + last < as_written:
            acc = self.ops.lin(*[(c, self.prod(k, *fs) if len(fs) > 1 else fs[0])
                                 for c, k, fs in parts])
            fold = (self.ops.matmul_mean, self.ops.batch_mean) if mean else None
            return chain.multiply((acc, shared) if side == "r" else (shared, acc),
                                  self.ops.matmul2, self.ops.shape, fold=fold)
        if mean:
            return self.ops.lin(*[(t[0], self.mm(t[1], *t[2:], mean=True)) for t in terms])
        return self.ops.lin(*[(t[0], self.prod(t[1], *t[2:])) for t in terms])

    def hvp(self, v, part="full"):
        """H_part v for a flat vector v (parameters in declared order), no block built; for a
        matrix v (n × k), H_part v column by column, the columns vectorised (``ops.columns``:
        ``torch.func.vmap`` over chunks of ``columns_per_call(k)`` columns; NumPy: a loop).

        Cost: the matrix-view statements, products of size B L² d or B L d² (attention: 12 of
        them and about 20 of size B L² d_K for a one-off call, where X W_V is formed once for
        its three products; 8 for a prepared state's later calls, which reuse the kept
        products of named factors); k columns: k times that, in ⌈k / chunk⌉ calls whose
        temporaries are chunk times one call's."""
        _part(part)
        n = sum(self.numel(p) for p in self.PARAMS)
        v = checks.vector(v, self.like, checks.vector_or_columns(n, v), deferred=self._deferred)
        routine = getattr(self, f"hvp__{part}")
        shapes = [tuple(self.ops.shape(getattr(self, p))) for p in self.PARAMS]

        def one(x):
            dirs, off = [], 0
            for shape in shapes:
                k = math.prod(shape)
                dirs.append(self.ops.reshape(x[off:off + k], shape))
                off += k
            self._local = {}              # products of the routine's locals: this call's only
            try:
                return self._flat(routine(*dirs))
            finally:
                self._local = {}
        if _ndim(v) == 1:
            return one(v)
        return self.ops.columns(one, v, self.columns_per_call(v.shape[1]))

    def columns_per_call(self, k):
        """Columns per vectorised call of a matrix product: at most ``COLUMNS_PER_CALL``, and
        as many as fit the schedule's intermediate budget when each column's temporaries take
        ``COLUMN_WORK`` times the call's values (the data and parameters); at least 1."""
        budget = self.schedule.memory_budget
        per = COLUMN_WORK * max(1, sum(_nbytes(a) for a in self._values.values()))
        return max(1, min(k, COLUMNS_PER_CALL, int(budget // per)))

    def _flat(self, outs):
        return self.ops.concat([self.ops.reshape(o, (-1,)) for o in outs])

    def gradient_flat(self):
        return self._flat(self.gradient())


for _name in RESULTS:                              # the results Forward defines itself
    if _name in Forward.__dict__:
        setattr(Forward, _name, _checked(Forward.__dict__[_name]))

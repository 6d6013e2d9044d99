"""Every kernel quantity over a dataset: the exact mean over all its sequences.

``Dataset(kernel, data, params=None)`` reads ``data`` as

* one batch: a dict of values by name (parameters included), as ``Kernel.prepare`` takes;
* an iterable of batches that can be iterated again (a list, a ``torch.utils.data.DataLoader``):
  each batch a dict of the data values by name, or a pair ``(X, Y)`` — the layer's data input
  (a tuple or a dict by name when the layer has several) and the target — as in curvlinops;
  ``params`` then gives the parameters (and the layer's constants) by name.

A batch of N_b sequences contributes with weight N_b / N, N = Σ_b N_b (counted while the data
are read, or ``num_data``, which is then checked), so every result is the mean over the
dataset's sequences, exactly as if it were one batch:

    H v = Σ_b (N_b/N) H_b v,   diag, trace likewise,
    ‖H(p, q)‖_F² = Σ_{a,b} (N_a N_b / N²) ⟨H_a(p, q), H_b(p, q)⟩_F        (the mean block's norm)

The Frobenius norm of the mean block is either accumulated densely (``frobenius="dense"``:
one pass, one block in memory) or computed from pairs of batches (``"pairs"``: the block's
index networks of batch a paired with those of batch b, no block built; every pair is read,
so the work grows with the square of the number of batches while the memory stays that of
two batches).  ``"auto"`` takes the dense route when the block fits the kernels' memory
budget.

**Memory.**  A pass holds one prepared batch at a time plus the results, so its memory does
not grow with the number of batches.  When the prepared batches of the whole dataset fit in
``keep`` bytes (default: an eighth of the memory budget, at most 1 GiB), they are kept after
the first pass and later passes neither read the data nor recompute the forward quantities
(the same as a single batch, which is always kept); otherwise every pass reads the data again.

**Processes.**  With ``torch.distributed`` initialised (and ``distributed`` not False), each
process passes its own shard of the data (e.g. a ``DistributedSampler``) and every result is
reduced with one all-reduce (``symhess.curvature.distributed``); every process gets the dataset mean.
Every process must make the same calls in the same order.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from . import distributed as D
from ..expr.budget import memory_budget
from ..errors import InputError, SymhessError
from ..calculus.hessian import check_part
from ..runtime import checks
from .matview import BlockProduct
from .passes import Fingerprint, agreement, describe, refuse_one_shot

_END = object()
KEEP_MAX = 2 ** 30
FROBENIUS = ("auto", "dense", "pairs")
METHODS = ("auto", "matview", "kernel")


class Values:
    """One batch's values checked and bound to the layer's sizes without the generated kernels
    (what block products in the matrix view need): the arrays as attributes (data with a leading
    batch axis), ``dims``, ``like``, ``n_batch``.  The same checks as ``Kernel.prepare``: names,
    dtypes, one device, shapes (the dimensions bound), non-finite entries, the layer's own value
    checks (one sequence at a time)."""

    def __init__(self, kernel, values, check_finite=True):
        from ..errors import InputError as IE
        from ..expr.evaluate import bind_dims, check_values
        from .kernels import _Shape
        if not isinstance(values, Mapping):
            raise IE(f"values must be a dict of arrays by name ({', '.join(kernel.names)})")
        unknown = sorted(set(values) - set(kernel.names), key=str)
        if unknown:
            raise IE(f"unknown value name(s) {', '.join(map(str, unknown))} for layer "
                     f"{kernel.layer.name!r}; valid: {', '.join(kernel.names)}")
        missing = [n for n in kernel.names if n not in values]
        if missing:
            raise IE(f"missing value(s) {', '.join(missing)}; needed: {', '.join(kernel.names)}")
        arrays = {n: kernel._array(n, values[n]) for n in kernel.names}
        check_values(arrays, check_finite=False)
        given = dict(arrays)            # as the caller shaped them: a bad entry's index is theirs
        if kernel.backend == "torch" and len({str(a.device) for a in arrays.values()}) > 1:
            desc = ", ".join(f"{n}: {a.device}" for n, a in arrays.items())
            raise IE(f"all values must share one device, got {desc}")
        data = [n for n in kernel._data if n in arrays]
        sizes = set()
        for n in data:
            a = arrays[n]
            if a.ndim == 2:
                arrays[n] = a[None]
            elif a.ndim != 3:
                raise IE(f"{n} must have shape ({kernel._vars[n].rows} × {kernel._vars[n].cols}) "
                         f"or (N, …) with a batch axis, got shape {tuple(a.shape)}")
            sizes.add(arrays[n].shape[0])
        if len(sizes) > 1:
            desc = ", ".join(f"{n}: {tuple(arrays[n].shape)}" for n in data)
            raise IE(f"the data values need the same leading batch size, got {desc}")
        self.n_batch = sizes.pop() if sizes else 1
        if self.n_batch == 0:
            raise IE("the batch is empty (N = 0 sequences); give at least one")
        order = data + [n for n in kernel.names if n not in data]
        shapes = {n: _Shape(arrays[n].shape[-2:]) for n in order}
        env = bind_dims([kernel._vars[n] for n in order], shapes)
        if check_finite:
            check_values(given)
        self.__dict__.update(arrays)
        self.dims = {str(k): int(v) for k, v in env.items()}
        self.like = arrays[kernel.params[0]]
        if kernel.layer.checks:
            host = {n: (a.detach().cpu().numpy() if hasattr(a, "detach") else a)
                    for n, a in arrays.items()}
            for i in range(self.n_batch):
                kernel.layer.validate({n: (a[i] if n in data else a) for n, a in host.items()})

    def _param(self, p):
        return p


class Batch:
    """One batch: its values checked (``values``) and, when a reduction needs them, the
    generated kernel's prepared state (``state``); both kept as long as the batch is."""

    def __init__(self, dataset, values):
        self.dataset, self._values = dataset, values
        self._light = self._state = None
        self.bound = {}          # (p, q, part) → BoundProduct (no reference back: no cycle)

    @property
    def light(self):
        if self._state is not None:
            return self._state
        if self._light is None:
            ds = self.dataset
            self._light = Values(ds.kernel, self._values, ds.check_finite)
        return self._light

    @property
    def state(self):
        if self._state is None:
            ds = self.dataset
            self._state = ds.kernel.prepare(self._values, check_finite=ds.check_finite,
                                            memory_budget=ds.memory_budget)
        return self._state

    @property
    def n(self):
        return self.light.n_batch

    @property
    def nbytes(self):
        return state_bytes(*(x for x in (self._light, self._state, self.bound) if x is not None))


class Dataset:
    """A kernel's quantities over a dataset (module docstring)."""

    def __init__(self, kernel, data, params=None, num_data=None, keep=None, progressbar=False,
                 check_finite=True, memory_budget=None, distributed="auto"):
        from .kernels import Kernel
        if not isinstance(kernel, Kernel):
            raise InputError(f"expected a symhess kernel (symhess.kernel(...)), got "
                             f"{type(kernel).__name__}")
        self.kernel = kernel
        self.params_names = kernel.params
        self._data_names = list(kernel._data)
        self._inputs = [n for n in self._data_names if n != "Y"]
        self.check_finite, self.memory_budget = check_finite, memory_budget
        self.progressbar = progressbar
        self.reducer = D.reducer(distributed)
        if isinstance(data, Mapping):
            if params is not None:
                raise InputError("params are given with the values when data is one batch "
                                 "(a dict); pass either a dict of all values or batches and params")
            self._single = dict(data)
            self._fixed = {k: v for k, v in data.items() if k not in self._data_names}
            self._data = None
        else:
            if params is None:
                raise InputError("params (a dict of the parameters by name: "
                                 f"{', '.join(self.params_names)}) are needed with batches of data")
            if not isinstance(params, Mapping):
                raise InputError(f"params must be a dict of arrays by name, got {type(params).__name__}")
            if not (hasattr(type(data), "__iter__") or hasattr(type(data), "__getitem__")) \
                    or isinstance(data, (str, bytes)):
                raise InputError(f"data must be a dict of values or an iterable of batches, got "
                                 f"{type(data).__name__}")
            refuse_one_shot(data, "a dataset")
            self._single, self._data = None, data
            bad = sorted(set(params) & set(self._data_names))
            if bad:
                raise InputError(f"params must not contain data ({', '.join(bad)}); the data "
                                 f"come with the batches")
            self._fixed = dict(params)
        self.num_data = num_data
        if num_data is not None and (isinstance(num_data, bool) or not isinstance(num_data, int)
                                     or num_data < 1):
            raise InputError(f"num_data must be a positive integer, got {num_data!r}")
        self._keep_limit = _keep_limit(keep)
        self._kept = None           # [(state, n)] once the whole dataset is kept
        self._products = {}         # (p, q, part) → BlockProduct
        self._first = None
        self._probe = None          # (first Batch, the live iterator) read by ``first``
        self._pass = None           # the first complete pass's Fingerprint
        self._agreed = self.reducer.world == 1
        self._total = None

    # -- batches ---------------------------------------------------------------------------
    def _values(self, batch):
        """A batch as the kernel's values (the fixed values added)."""
        if isinstance(batch, Mapping):
            extra = sorted(set(batch) - set(self._data_names))
            if extra:
                raise InputError(f"a batch may hold only data ({', '.join(self._data_names)}), "
                                 f"got {', '.join(extra)}")
            vals = dict(batch)
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            x, y = batch
            vals = {"Y": y}
            if isinstance(x, Mapping):
                vals.update(x)
            elif len(self._inputs) == 1:
                vals[self._inputs[0]] = x
            elif isinstance(x, (tuple, list)) and len(x) == len(self._inputs):
                vals.update(zip(self._inputs, x))
            else:
                raise InputError(f"the layer has inputs {', '.join(self._inputs)}: give X as a "
                                 f"tuple in this order or a dict by name")
        else:
            raise InputError(f"a batch must be a dict of data by name or a pair (X, Y), got "
                             f"{type(batch).__name__}")
        return {**self._fixed, **{k: self._convert(k, v) for k, v in vals.items()}}

    def _convert(self, name, a):
        """Data on the parameters' side: host arrays for NumPy kernels, tensors on the
        parameters' device for torch kernels (no dtype is changed; what is not a real
        numeric array is an InputError naming it)."""
        from ..expr.evaluate import real_array
        if self.kernel.backend == "numpy":
            if hasattr(a, "detach"):
                return a.detach().cpu().numpy()
            return a
        import torch
        like = self._fixed.get(self.params_names[0])
        dev = like.device if isinstance(like, torch.Tensor) else None
        if not isinstance(a, torch.Tensor):
            a = torch.as_tensor(real_array(a, name))
        return a.to(dev) if dev is not None and a.device != dev else a

    def batches(self, desc=None):
        """Yields every batch of this process (``Batch``: checked values, prepared state)."""
        if self._single is not None:
            if self._kept is None:
                self._kept = [Batch(self, self._single)]
            yield from self._kept
            return
        if self._kept is not None:
            yield from self._kept
            return
        kept, size, fp = [], 0, Fingerprint()
        for b in self._read(desc):
            yield b
            st = b._state if b._state is not None else b.light
            fp.add([getattr(st, k) for k in self._data_names])
            if kept is not None:
                kept.append(b)
                size += b.nbytes
                if size > self._keep_limit:
                    kept = None
        if fp.count == 0 and self._pass is None:
            raise InputError("the data hold no batch" + (" in this process (fewer batches than "
                             "processes?)" if self.reducer.world > 1 else ""))
        fp.check_against(self._pass)
        self._pass = self._pass or fp
        if kept is not None:
            self._kept = kept

    def _read(self, desc):
        """The batches of one pass, starting with the one ``first`` read (nothing read is
        dropped: a source that cannot be read again still gives every batch once)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            b, it = probe
            yield b
        else:
            it = iter(self._data)
        for raw in self._progress(it, desc):
            yield Batch(self, self._values(raw))

    def states(self, desc=None):
        """Yields (prepared state, number of sequences) for every batch of this process."""
        for b in self.batches(desc):
            yield b.state, b.n

    def _progress(self, it, desc):
        if not self.progressbar:
            return it
        from tqdm import tqdm
        return tqdm(it, desc=desc or "batches", leave=False, disable=None)   # a terminal only

    def _check_count(self, total):
        if self.num_data is not None and total != self.num_data:
            raise InputError(f"num_data is {self.num_data} but the data hold {total} sequences")
        if self._total is not None and total != self._total:
            raise InputError(f"the data held {self._total} sequences in an earlier pass and "
                             f"{total} now; the data must be the same in every pass")
        self._total = total

    def first(self):
        """The first batch's checked values (sizes, dtype, device).  The batch is read from
        a live iterator that the next pass continues, so no batch is read and dropped.
        Across processes the first call is where they agree (``agree``)."""
        self.agree()
        return self._first_local()

    def _first_local(self):
        if self._first is None:
            if self._single is not None or self._kept is not None:
                self._first = next(self.batches()).light
            else:
                it = iter(self._data)
                raw = next(it, _END)
                if raw is _END:
                    raise InputError("the data hold no batch" + (
                        " in this process (fewer batches than processes?)"
                        if self.reducer.world > 1 else ""))
                b = Batch(self, self._values(raw))
                self._first = b.light
                self._probe = (b, it)
        return self._first

    def schedule(self):
        """The kernels' schedule at the first batch's dtype and device (memory limits)."""
        from ..runtime.schedule import Schedule
        st = self.first()
        return Schedule.default(self.memory_budget, _itemsize(st), getattr(st.like, "device", None))

    def agree(self):
        """Once, before the first reduction across processes: every process checks that all
        hold a batch and the same kernel and parameters (``symhess.curvature.passes``); a difference or
        an error on any process raises the same InputError on every process."""
        if self._agreed:
            return
        self._agreed = True
        err = None
        try:
            self._first_local()
        except SymhessError as exc:
            err = str(exc)
        descs, errors = self.reducer.gather((describe(self.kernel, self._fixed), err))
        bad = agreement(descs, errors)
        if bad is not None:
            raise bad

    def numel_of(self, p):
        import math as _m
        return _m.prod(tuple(getattr(self.first(), self._param(p)).shape))

    def _param(self, p):
        if p not in self.params_names:
            from ..errors import UnknownNameError
            raise UnknownNameError(f"unknown block {p!r}; valid: {', '.join(self.params_names)}")
        return p

    # -- reductions --------------------------------------------------------------------------
    def _mean(self, per_batch, desc, light=False, vector=None):
        """Σ_b N_b f(state_b) / N for f returning a list of arrays/floats; one all-reduce.
        ``light``: f needs only the checked values (``Values``), not the kernel's state."""
        self.agree()
        acc, n = None, 0
        for b in self.batches(desc):
            nb = b.n
            vals = per_batch(b if light else b.state)
            if acc is None:
                acc = [_scaled(v, nb) for v in vals]
            else:
                for i, v in enumerate(vals):
                    acc[i] = _add(acc[i], _scaled(v, nb))
            n += nb
        first = self.first()
        acc, n = self.reducer.sum(acc, n, like=first.like)
        self._check_count(n)
        out = [_scaled(a, 1.0 / n) for a in acc]
        for a in out:                  # one check of each result (an overflow is named)
            checks.finite(a, f"the dataset mean of {desc}", {
                **{k: getattr(first, k) for k in self.kernel.names}, **(vector or {})}, first.like)
        return out

    def _vector(self, v, shapes):
        """A vector given to a product, checked once (``runtime.checks.vector``)."""
        return checks.vector(v, self.first().like, shapes)

    def _total_numel(self):
        return sum(self.numel_of(p) for p in self.params_names)

    @property
    def numel(self):
        return {p: self.numel_of(p) for p in self.params_names}

    def loss(self):
        return float(self._mean(lambda st: [float(st.loss())], "loss")[0])

    def gradient(self):
        """The flat gradient (parameters in declared order)."""
        return self._mean(lambda st: [st.gradient_flat()], "gradient")[0]

    def hvp(self, v, part="full"):
        """H_part v over every parameter (flat v, declared order; or a matrix v, n × k,
        whose columns each batch's state takes in vectorised calls)."""
        check_part(part)
        v = self._vector(v, checks.vector_or_columns(self._total_numel(), v))
        return self._mean(lambda st: [st.hvp(v, part)], "hvp", vector={"v": v})[0]

    def row_hvp(self, p, v, part="full", method="auto"):
        """Σ_q H_part(p, q) v_q (flat v over every parameter)."""
        check_part(part)
        self._param(p)
        v = self._vector(v, [(self._total_numel(),)])
        offs = self._offsets()
        if _method(method) == "kernel":
            return self._mean(lambda st: [st.hvp(v, part)[offs[p][0]:offs[p][1]]], "hvp",
                              vector={"v": v})[0]
        parts = [(q, v[offs[q][0]:offs[q][1]]) for q in self.params_names]
        return self._mean(lambda st: [sum_of(self._apply(st, p, q, part, vq) for q, vq in parts)],
                          "hvp", light=True, vector={"v": v})[0]

    def block_hvp(self, p, q, v, part="full", method="auto"):
        """H_part(p, q) v for v of shape (numel q,) or (numel q, k)."""
        check_part(part)
        nq = self.numel_of(q)
        self._param(p)
        v = self._vector(v, checks.vector_or_columns(nq, v))
        if _method(method) == "kernel":
            return self._mean(lambda st: [st.block_hvp(p, q, v, part)], "hvp", vector={"v": v})[0]
        return self._mean(lambda st: [self._apply(st, p, q, part, v)], "hvp", light=True,
                          vector={"v": v})[0]

    def _apply(self, b, p, q, part, v):
        """H_part,b(p, q) v on one batch through the matrix view (columns one by one)."""
        bound = self._bound_product(b, p, q, part)
        st = b.light
        ops = bound.ops
        shape_q = tuple(ops.shape(getattr(st, q)))
        vs = ops.shape(v)
        if len(vs) == 1:
            return ops.reshape(bound.apply(ops.reshape(v, shape_q)), (-1,))
        cols = [ops.reshape(bound.apply(ops.reshape(v[:, j], shape_q)), (-1, 1))
                for j in range(vs[1])]
        return _hstack(cols)

    def _bound_product(self, b, p, q, part):
        key = (p, q, part)
        if key not in self._products:
            from ..calculus.hessian import derive
            self._param(p), self._param(q)
            self._products[key] = BlockProduct(derive(self.kernel.layer, self.kernel.loss_name),
                                               p, q, part)
        if key not in b.bound:
            b.bound[key] = self._products[key].bind(b.light, self._data_names)
        return b.bound[key]

    def diag(self, p, part="full"):
        check_part(part)
        return self._mean(lambda st: [st.diag(p, part)], "diag")[0]

    def diagonals(self, part="full"):
        """{p: the dataset mean of diag H_part(p, p)} for every parameter, each batch's in one
        pass (``Forward.diagonals``)."""
        check_part(part)
        names = self.kernel.params
        return dict(zip(names, self._mean(
            lambda st: [d[p] for d in [st.diagonals(part)] for p in names], "diag")))

    def trace(self, p, part="full"):
        check_part(part)
        return float(self._mean(lambda st: [float(st.trace(p, part))], "trace")[0])

    def hessian_block(self, p, q, part="full"):
        """The dense mean block (numel p × numel q); refused beyond the memory budget."""
        check_part(part)
        _fits(self.first(), self.numel_of(p) * self.numel_of(q))
        return self._mean(lambda s: [s.hessian_block(p, q, part)], "block")[0]

    def frobenius_norm(self, p, q, part="full", method="auto"):
        """‖H_part(p, q)‖_F of the dataset-mean block, exact (module docstring)."""
        sq = self.frobenius_sq(p, q, part, method)
        first = self.first()
        checks.finite(sq, f"the dataset's frobenius_norm({p!r}, {q!r}, {part!r})",
                      {k: getattr(first, k) for k in self.kernel.names}, first.like)
        return math.sqrt(max(sq, 0.0))

    def frobenius_sq(self, p, q, part="full", method="auto"):
        check_part(part)
        if method not in FROBENIUS:
            raise InputError(f"unknown Frobenius method {method!r}; valid: {', '.join(FROBENIUS)}")
        if self._single is not None:
            st = next(self.batches()).state
            return float(st.frobenius_norm(p, q, part)) ** 2
        entries = self.numel_of(p) * self.numel_of(q)
        if method == "auto":
            sched = self.schedule()
            method = "dense" if entries * sched.itemsize <= sched.memory_budget else "pairs"
        if method == "dense":
            _fits(self.first(), entries)
            H = self._mean(lambda s: [s.hessian_block(p, q, part)], "block")[0]
            return float((H * H).sum())
        return self._frobenius_pairs(p, q, part)

    def _frobenius_pairs(self, p, q, part):
        from ..runtime import network as N
        self.agree()
        total, n = 0.0, 0

        def cross(sa, na, sb, nb):
            a, b = sa.nets(p, q, part), sb.nets(p, q, part)
            if not a or not b:
                return 0.0
            return na * nb * sum(N.scalar(sa, [N.paired(sa, x, y)]) for x in a for y in b)

        if self.reducer.world == 1:
            outer = list(self.states("pairs")) if self._kept is not None else None
            for i, (sa, na) in enumerate(outer or self.states("pairs")):
                n += na
                for j, (sb, nb) in enumerate(self.states("pairs")):
                    if j < i:
                        continue
                    total += (1 if j == i else 2) * cross(sa, na, sb, nb)
            return total / n ** 2
        # processes: every batch is sent to all processes in turn and paired with theirs
        for values, na in self.reducer.each_batch(self._raw_batches()):
            sa = Batch(self, self._values(values)).state
            n += na
            for sb, nb in self.states("pairs"):
                total += cross(sa, na, sb, nb)
        total = self.reducer.scalar(total)
        return total / n ** 2

    def _raw_batches(self):
        """(values as host arrays, sequences) of this process's batches (to send)."""
        for b in self.batches("send"):
            st = b.light
            vals = {k: _host(getattr(st, k)) for k in self._data_names}
            yield vals, b.n

    def _offsets(self):
        offs, o = {}, 0
        for p in self.params_names:
            k = self.numel_of(p)
            offs[p] = (o, o + k)
            o += k
        return offs


# ----------------------------------------------------------------------------- helpers
def _method(method):
    if method not in METHODS:
        raise InputError(f"unknown product method {method!r}; valid: {', '.join(METHODS)}")
    return "matview" if method == "auto" else method


def _keep_limit(keep):
    if keep is None:
        total, _ = memory_budget(None)
        return KEEP_MAX if total is None else min(KEEP_MAX, total // 8)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not keep >= 0:
        raise InputError(f"keep must be a number of bytes >= 0, got {keep!r}")
    return keep


def _scaled(v, c):
    return v * c


def _add(a, b):
    return a + b


def sum_of(xs):
    out = None
    for x in xs:
        out = x if out is None else out + x
    return out


def _hstack(cols):
    c = cols[0]
    if hasattr(c, "detach"):
        import torch
        return torch.cat(cols, 1)
    return np.concatenate(cols, 1)


def _host(a):
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


def _itemsize(st):
    return 4 if "32" in str(st.like.dtype) else 8


def _fits(st, entries):
    from ..expr.budget import check_budget
    check_budget(entries * _itemsize(st), f"the dense block ({entries} entries)",
                 device=getattr(st.like, "device", None))


def _nbytes(x):
    if hasattr(x, "element_size") and hasattr(x, "nelement"):
        return x.element_size() * x.nelement(), x.data_ptr()
    if isinstance(x, np.ndarray):
        base = x if x.base is None else x.base
        return x.nbytes, id(base)
    return 0, None


def state_bytes(*objs):
    """Bytes of the arrays that prepared batches (states, checked values, bound block
    products) keep, each array counted once."""
    seen, total = set(), 0

    def add(x):
        nonlocal total
        if isinstance(x, (list, tuple)):
            for y in x:
                add(y)
            return
        if isinstance(x, dict):
            for y in x.values():
                add(y)
            return
        arr = getattr(x, "_array", None)      # a materialised Compact
        if arr is not None:
            add(arr)
            return
        keep = getattr(x, "_keep", None)      # a BoundProduct
        if isinstance(keep, dict):
            add(list(keep.values()))
            return
        n, key = _nbytes(x)
        if key is not None and key not in seen:
            seen.add(key)
            total += n

    for o in objs:
        if isinstance(o, dict):
            add(o)
        else:
            add({k: v for k, v in vars(o).items() if k not in ("ops", "schedule", "like")})
    return total


__all__ = ["Dataset", "state_bytes"]

"""Hessians as ``scipy.sparse.linalg.LinearOperator`` s: one block, a block row, or all of it.

    op = symhess.operator(kernel, data, p=None, q=None, part="full", params=None, ...)

* ``p = q = None``: the whole Hessian over every parameter (declared order, vec_r layout);
* ``p`` only: the block row H(p, ·) (numel p × total);
* ``p`` and ``q``: the block H(p, q) (numel p × numel q);
* ``p`` a list of parameter names S: the principal sub-matrix H(S, S) (the curvature of some
  parameters — one Transformer block's inside a whole model — of the whole loss: every
  other parameter fixed, everything downstream of them in the declaration), each product
  one whole Hessian–vector product with x placed on S (its S-rows kept).

``part``: "full", "outer" (the Gauss–Newton / GGN part) or "functional" (the rest).
``data``: one batch (a dict of all values) or batches of (X, Y) / dicts with ``params``, as in
``symhess.curvature.dataset`` (whose conventions follow curvlinops: ``num_data``, data as an iterable
of (X, Y), ``progressbar``); every product is the dataset mean, reduced across processes when
``torch.distributed`` is initialised.

The operator supports ``@``, ``matvec``, ``matmat``, ``rmatvec``, ``rmatmat`` and ``adjoint``
(H(p, q)ᵀ = H(q, p); a diagonal block, the whole Hessian and their parts are symmetric:
``op.symmetric``).  Its dtype is the values' (float32 or float64).  NumPy arrays in give NumPy
arrays out; torch tensors in give tensors out, on the input's device, without passing through
NumPy.

Products reuse the prepared forward quantities: a single batch (and a dataset whose prepared
batches fit ``keep`` bytes) is prepared once, so an eigensolver's thousand products compute
the softmax, the moments and the output gradient once.  Block products run in the matrix
view (``symhess.curvature.matview``), the whole Hessian, H(S, S) and block rows through the
generated kernel's Hessian-vector product; a matrix's columns (``matmat``, ``to_dense`` of
H(S, S)) go through it together, vectorised (torch: ``torch.func.vmap`` over chunks of
columns, ``Forward.columns_per_call``), k columns costing about what a few single products
cost per chunk on small models, where one product's time is mostly per-operation overhead.
"""
from __future__ import annotations

import numbers

import numpy as np
from scipy.sparse.linalg import LinearOperator

from .dataset import Dataset, _method, sum_of
from ..errors import InputError
from ..calculus.hessian import check_part
from ..runtime import checks


def operator(kernel, data, p=None, q=None, part="full", params=None, num_data=None,
             progressbar=False, method="auto", keep=None, check_finite=True,
             memory_budget=None, distributed="auto") -> "HessianOperator":
    """The Hessian (block, block row or whole) of ``kernel`` over ``data`` as a LinearOperator
    (module docstring)."""
    check_part(part)
    ds = data if isinstance(data, Dataset) else Dataset(
        kernel, data, params=params, num_data=num_data, keep=keep, progressbar=progressbar,
        check_finite=check_finite, memory_budget=memory_budget, distributed=distributed)
    return HessianOperator(ds, p, q, part, method)


def _is_torch(x):
    return type(x).__module__.startswith("torch")


class HessianOperator(LinearOperator):
    """H_part (whole, row p, or block (p, q)) of a dataset's mean loss."""

    def __init__(self, dataset, p=None, q=None, part="full", method="auto"):
        check_part(part)
        names = dataset.params_names
        subset = isinstance(p, (list, tuple))
        if subset:
            p = _subset(p, q, names)
        for x in ((q,) if subset else (p, q)):
            if x is not None and x not in names:
                raise InputError(f"unknown block {x!r}; valid: {', '.join(names)}")
        if p is None and q is not None:
            raise InputError("give p with q (a block H(p, q)), p alone (a block row) or neither")
        _method(method)
        self.dataset, self.p, self.q, self.part, self.method = dataset, p, q, part, method
        st = dataset.first()
        self._like = st.like
        numel = {n: dataset.numel_of(n) for n in names}
        total = sum(numel.values())
        rows = total if p is None else (sum(numel[n] for n in p) if subset else numel[p])
        cols = total if q is None else numel[q]
        cols = rows if subset else cols
        self.numel = numel
        self.symmetric = (p is None) or subset or (q is not None and p == q)
        self.kind = "subset" if subset else "whole" if p is None else ("row" if q is None else "block")
        if subset:
            offs, o = {}, 0
            for n in names:
                offs[n] = (o, o + numel[n])
                o += numel[n]
            self._slices = [offs[n] for n in p]
            self._total = total
        dtype = np.dtype(str(st.like.dtype).removeprefix("torch."))
        super().__init__(dtype=dtype, shape=(rows, cols))

    def __repr__(self):
        what = {"whole": "H", "row": f"H({self.p}, ·)", "block": f"H({self.p}, {self.q})",
                "subset": f"H(S, S) over {len(self.p or ())} parameters"}[self.kind]
        return (f"<symhess {self.part} {what} of {self.dataset.kernel.layer.name}: "
                f"{self.shape[0]}×{self.shape[1]}, {self.dtype}>")

    @property
    def is_zero(self):
        """Whether the engine derives this block as the Zero node (a structural zero)."""
        if self.kind != "block":
            return False
        from ..calculus.hessian import derive
        from .matview import BlockProduct
        ds = self.dataset
        key = (self.p, self.q, self.part)
        if key not in ds._products:
            ds._products[key] = BlockProduct(derive(ds.kernel.layer, ds.kernel.loss_name),
                                             self.p, self.q, self.part)
        return ds._products[key].is_zero

    # -- conventions -------------------------------------------------------------------
    @property
    def device(self):
        """The values' device (torch kernels) or "cpu"."""
        return getattr(self._like, "device", "cpu")

    @property
    def num_data(self):
        """The number of sequences the mean is over (after the first product)."""
        return self.dataset._total

    def to_scipy(self):
        """The operator itself (it is a SciPy LinearOperator already)."""
        return self

    # -- backend conversions -------------------------------------------------------------
    def _to_backend(self, x, shapes):
        """``x`` checked (real, one of ``shapes``, finite) and converted to the kernel's
        backend, dtype and device (``runtime.checks.vector``)."""
        if _is_torch(x) and self.dataset.kernel.backend == "numpy":
            x = x.detach().cpu().numpy()
        return checks.vector(x, self._like, shapes, "the vector" if len(shapes[0]) == 1
                             else "the matrix", convert=True)

    def _from_backend(self, y, like):
        if _is_torch(like):
            import torch
            if not isinstance(y, torch.Tensor):
                y = torch.from_numpy(np.ascontiguousarray(y))
            return y.to(device=like.device)
        if _is_torch(y):
            return y.detach().cpu().numpy()
        return np.asarray(y)

    # -- products --------------------------------------------------------------------------
    def _product(self, x, transpose):
        """H x (or Hᵀ x) for x of shape (cols,) or (cols, k), in the kernel's backend."""
        ds, p, q, part = self.dataset, self.p, self.q, self.part
        if self.kind == "whole":
            return ds.hvp(x, part)
        if self.kind == "subset":
            return self._subset_hvp(x)
        if self.kind == "block":
            a, b = (q, p) if transpose else (p, q)
            return ds.block_hvp(a, b, x, part, self.method)
        if not transpose:
            return self._columns(x, lambda v: ds.row_hvp(p, v, part, self.method))
        # H(p, ·)ᵀ x = H(·, p) x: every block (r, p) applied to x
        return _vstack([ds.block_hvp(r, p, x, part, self.method) for r in ds.params_names])

    def _subset_hvp(self, v):
        """(H [v on S; 0])_S: one whole Hessian–vector product (a matrix v: its columns)."""
        shape = (self._total,) + tuple(v.shape[1:])
        full = v.new_zeros(shape) if _is_torch(v) else np.zeros(shape, dtype=v.dtype)
        o = 0
        for a, b in self._slices:
            full[a:b] = v[o:o + b - a]
            o += b - a
        y = self.dataset.hvp(full, self.part)
        parts = [y[a:b] for a, b in self._slices]
        if _is_torch(y):
            import torch
            return torch.cat(parts)
        return np.concatenate(parts)

    def _columns(self, x, f):
        if len(self._shape_of(x)) == 1:
            return f(x)
        cols = [f(x[:, j]) for j in range(self._shape_of(x)[1])]
        return _stack_cols(cols)

    @staticmethod
    def _shape_of(x):
        return tuple(x.shape)

    def _call(self, x, transpose, matrix):
        """Every product's entry: x checked (shape, real, finite), H x (or Hᵀ x) in the
        kernel's backend, returned like x (NumPy or a tensor on x's device)."""
        n = self.shape[0] if transpose else self.shape[1]
        if not (hasattr(x, "shape") or _is_torch(x)):
            x = np.asarray(x)
        shape = tuple(getattr(x, "shape", ()))
        if matrix is None:
            matrix = len(shape) == 2 and shape[1] != 1
        k = shape[1] if len(shape) == 2 else 1
        if k == 0:
            raise InputError(f"the matrix has no columns (shape {shape}); give at least one")
        xb = self._to_backend(x, [(n, k)] if matrix else [(n,), (n, 1)])
        col = not matrix and len(shape) == 2
        if col:
            xb = xb.reshape(-1)
        y = self._product(xb, transpose)
        if col:
            y = y.reshape(-1, 1)
        return self._from_backend(y, x)

    # scipy's private entry points (called by scipy with arrays it made)
    def _matvec(self, x):
        return self._call(np.ravel(x), False, False)

    def _rmatvec(self, x):
        return self._call(np.ravel(x), True, False)

    def _matmat(self, X):
        return self._call(X, False, True)

    def _rmatmat(self, X):
        return self._call(X, True, True)

    def _adjoint(self):
        if self.symmetric:
            return self
        if self.kind == "block":
            return HessianOperator(self.dataset, self.q, self.p, self.part, self.method)
        return _Transposed(self)

    # public entry points: every vector is checked; torch tensors stay tensors
    def matvec(self, x):
        return self._call(x, False, False)

    def rmatvec(self, x):
        return self._call(x, True, False)

    def matmat(self, X):
        return self._call(X, False, True)

    def rmatmat(self, X):
        return self._call(X, True, True)

    def dot(self, x):
        if isinstance(x, (LinearOperator, numbers.Number)):
            return super().dot(x)
        return self._call(x, False, None)

    def __matmul__(self, x):
        return self.dot(x)

    def __mul__(self, x):
        return self.dot(x)

    def __call__(self, x):
        return self.dot(x)

    # -- dense -----------------------------------------------------------------------------
    def to_dense(self):
        """The dense matrix (NumPy), refused beyond the memory budget: the exact reference
        for small blocks (``symhess.curvature.spectra`` uses it for ``method="eigh"``)."""
        ds, part = self.dataset, self.part
        names = ds.params_names
        rows = names if self.p is None else [self.p]
        cols = names if self.q is None else [self.q]
        from .dataset import _fits
        _fits(ds.first(), self.shape[0] * self.shape[1])
        if self.kind in ("block", "subset"):   # products: no block rendered
            eye = np.eye(self.shape[1], dtype=self.dtype)
            return np.asarray(self.matmat(eye))
        blocks = {(a, b): ds.hessian_block(a, b, part) for a in rows for b in cols}
        host = lambda m: m.detach().cpu().numpy() if _is_torch(m) else np.asarray(m)  # noqa: E731
        return np.block([[host(blocks[(a, b)]) for b in cols] for a in rows])


def _subset(p, q, names):
    """A list of parameter names as a tuple (unknown or repeated names refused)."""
    if q is not None:
        raise InputError("a list of parameters p gives the sub-matrix H(S, S); give no q with it")
    if not p:
        raise InputError("the list of parameters is empty; name at least one of: "
                         f"{', '.join(names)}")
    bad = [n for n in p if n not in names]
    if bad:
        raise InputError(f"unknown parameter {bad[0]!r}; valid: {', '.join(names)}")
    if len(set(p)) != len(p):
        raise InputError("the list of parameters names one twice")
    return tuple(p)


class _Transposed(LinearOperator):
    """The transpose of a block row (a block column)."""

    def __init__(self, op):
        self.op = op
        super().__init__(dtype=op.dtype, shape=(op.shape[1], op.shape[0]))

    def _matvec(self, x):
        return self.op._rmatvec(x)

    def _rmatvec(self, x):
        return self.op._matvec(x)

    def _matmat(self, X):
        return self.op._rmatmat(X)

    def _rmatmat(self, X):
        return self.op._matmat(X)

    def _adjoint(self):
        return self.op


def _stack_cols(cols):
    if _is_torch(cols[0]):
        import torch
        return torch.stack(cols, 1)
    return np.stack(cols, 1)


def _vstack(xs):
    if _is_torch(xs[0]):
        import torch
        return torch.cat(xs, 0)
    return np.concatenate(xs, 0)


__all__ = ["operator", "HessianOperator", "sum_of"]

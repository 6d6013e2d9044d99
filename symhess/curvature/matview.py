"""Block products in the matrix view with the forward quantities kept.

``BlockProduct(derivation, p, q, part)`` derives, once, the matrix expression

    R(V) = H_part(p, q)[V]          (V ∈ R^{shape of W_q}, R ∈ R^{shape of W_p})

from the same differential rules as every block (``symhess.calculus.hessian``):

* functional: R = d g_p[V on W_q] with G = ∂ℓ/∂F frozen;
* outer:      R = g_p with G replaced by ∂²ℓ/∂F²[dF[V on W_q]];
* full:       R = d g_p[V on W_q] with G differentiated too (the sum of the two).

``BoundProduct`` evaluates R for one batch (a prepared state's arrays, data with a leading
batch axis) and keeps every sub-expression that does not read V across calls: the softmax
A, the logits' factors X W_K, the output gradient G … are computed on the first product
and reused by every later one, so an iterative eigensolver pays the forward pass once per
batch.  Products inside a matrix chain are regrouped at the call's sizes: each maximal run
of V-free factors is one kept product when that makes the chain cheaper (the classical
matrix-chain cost, ``symhess.runtime.chain``), and the batch mean is pushed into the kept
run of a chain whose other factors carry no batch axis (mean_n(C_n) V instead of
mean_n(C_n V)).

Contract: ``BoundProduct.apply(V)`` returns mean over the batch of H_part,n(p, q)[V], shape of
W_p, exactly (tested against torch autograd in float64); V may carry a trailing axis of k
directions flattened as (numel q, k) via ``matmat``.  Only matrix-view nodes are evaluated
(products, sums, transposes, entrywise maps, softmax and its differentials); a Kronecker-view
node is refused with a ``DeclarationError`` naming it.
"""
from __future__ import annotations

import math

import sympy as sp

from ..expr import nodes as E
from ..errors import DeclarationError
from ..calculus.hessian import check_part
from ..calculus.rules import differential

_DIR = "__symhess_direction__"


class BlockProduct:
    """R(V) = H_part(p, q)[V] as a matrix expression in the direction V (on W_q)."""

    def __init__(self, derivation, p, q, part="full"):
        check_part(part)
        d = derivation
        wp, wq = d.param(p), d.param(q)
        self.p, self.q, self.part = p, q, part
        self.direction = E.Var(f"{_DIR}{q}", wq.rows, wq.cols, "direction")
        dirs = {wq: self.direction}
        g = d.output_gradient
        if part == "functional":
            expr = differential(d.gradient(p), dirs)
        elif part == "outer":
            expr = E.substitute(d.gradient(p), {g: d.loss_hessian_map(differential(d.F, dirs))})
        else:
            expr = differential(d.gradient(p, cot=g.inner), dirs)
        self.expr = expr
        self.shape = (wp.rows, wp.cols)
        self.is_zero = expr.is_zero

    def bind(self, state, batched):
        """The product bound to one prepared batch (``state``: a kernel's prepared state)."""
        return BoundProduct(self, state, batched)


class BoundProduct:
    """``BlockProduct`` on one batch; V-free sub-expressions are kept across calls."""

    def __init__(self, product, state, batched):
        self.product = product
        self.state = state
        self.ops = _ops(state)
        self.batched_vars = frozenset(batched)
        self.env = {E.dim(k): v for k, v in state.dims.items()}
        self._keep = {}          # id(node) or (id(node), i, j, tag) → value (V-free)
        self._dep, self._bat = {}, {}
        self._coef = {}
        rows, cols = (int(sp.sympify(x).subs(self.env)) for x in product.shape)
        self.out_shape = (rows, cols)

    # -- classification ------------------------------------------------------------------
    def dep(self, n) -> bool:
        """Whether ``n`` reads the direction."""
        k = id(n)
        if k not in self._dep:
            if type(n) is E.Var:
                self._dep[k] = n is self.product.direction or n.name == self.product.direction.name
            else:
                self._dep[k] = any(self.dep(a) for a in _children(n))
        return self._dep[k]

    def batched(self, n) -> bool:
        """Whether ``n`` carries the batch axis (reads data)."""
        k = id(n)
        if k not in self._bat:
            if type(n) is E.Var:
                self._bat[k] = n.name in self.batched_vars
            else:
                self._bat[k] = any(self.batched(a) for a in _children(n))
        return self._bat[k]

    # -- evaluation ----------------------------------------------------------------------
    def apply(self, v):
        """H_part(p, q)[V] (batch mean) for V of W_q's shape."""
        if self.product.is_zero:
            return self.ops.zeros(self.out_shape, like=self.state.like)
        memo = {}
        out = self._mean(self.product.expr, v, memo)
        return out

    def _mean(self, n, v, memo):
        """mean over the batch axis of ``n`` (``n`` itself when it carries none)."""
        if not self.batched(n):
            return self._eval(n, v, memo)
        t = type(n)
        if t is E.Named:
            return self._mean(n.args[0], v, memo)
        if t is E.Scale:
            return self._scalar(n) * self._mean(n.args[0], v, memo)
        if t is E.Add:
            out = None
            for a in n.args:
                r = self._mean(a, v, memo)
                out = r if out is None else out + r
            return out
        if t is E.MatMul and not any(type(f) is E.Ones for f in n.args):
            fs = n.args
            idx = [i for i, f in enumerate(fs) if self.batched(f)]
            i, j = idx[0], idx[-1]
            if all(not self.dep(f) for f in fs[i:j + 1]):
                key = (id(n), i, j, "mean")
                if key not in self._keep:
                    self._keep[key] = self._mean_axis(self._chain(fs[i:j + 1], v, memo))
                factors = [self._eval(f, v, memo) for f in fs[:i]] + [self._keep[key]] + \
                          [self._eval(f, v, memo) for f in fs[j + 1:]]
                return self._multiply(factors)
        return self._mean_axis(self._eval(n, v, memo))

    def _mean_axis(self, x):
        return x.mean(0) if len(self.ops.shape(x)) == 3 else x

    def _eval(self, n, v, memo):
        if not self.dep(n):
            k = id(n)
            if k not in self._keep:
                self._keep[k] = self._node(n, v, memo)
            return self._keep[k]
        k = id(n)
        if k not in memo:
            memo[k] = self._node(n, v, memo)
        return memo[k]

    def _scalar(self, n):
        k = id(n)
        if k not in self._coef:
            self._coef[k] = float(sp.sympify(n.coef).subs(self.env))
        return self._coef[k]

    def _size(self, d):
        return int(sp.sympify(d).subs(self.env))

    def _node(self, n, v, memo):
        ops, like, t = self.ops, self.state.like, type(n)
        args = lambda: [self._eval(a, v, memo) for a in n.args]  # noqa: E731
        if t is E.Var:
            if self.dep(n):
                return v
            return getattr(self.state, n.name)
        if t is E.Zero:
            return ops.zeros((self._size(n.rows), self._size(n.cols)), like=like)
        if t is E.Identity:
            return ops.eye(self._size(n.rows), like)
        if t is E.Ones:
            return ops.ones((self._size(n.rows), self._size(n.cols)), like=like)
        if t is E.CausalMask:
            return ops.causal_mask(self._size(n.rows), like)
        if t is E.Named:
            return self._eval(n.args[0], v, memo)
        if t is E.MatMul:
            return self._chain(n.args, v, memo, node=n)
        if t is E.Add:
            out = None
            for a in args():
                out = a if out is None else out + a
            return out
        if t is E.Scale:
            return self._scalar(n) * self._eval(n.args[0], v, memo)
        if t is E.Transpose:
            return ops.tr(self._eval(n.args[0], v, memo))
        if t is E.Hadamard:
            out = None
            for a in args():
                out = a if out is None else out * a
            return out
        if t is E.Elementwise:
            return _fn(n.fn, ops)(self._eval(n.args[0], v, memo))
        if t is E.SoftmaxRows:
            mask = self._eval(n.args[1], v, memo) if len(n.args) > 1 else None
            return ops.softmax_rows(self._eval(n.args[0], v, memo), n.params[0], mask)
        if t is E.LogSoftmaxRows:
            return ops.log_softmax_rows(self._eval(n.args[0], v, memo))
        if t is E.SoftmaxDiff:
            return ops.softmax_diff(*args())
        if t is E.SoftmaxDiff2:
            return ops.softmax_diff2(*args())
        raise DeclarationError(f"the matrix view of block ({self.product.p}, {self.product.q}) "
                               f"contains a {t.__name__} node, which block products do not "
                               f"evaluate; use method='networks'")

    # -- matrix chains -------------------------------------------------------------------
    def _chain(self, fs, v, memo, node=None):
        """F₁⋯F_k: an all-ones factor is a row/column sum; runs of V-free factors are kept
        products where that makes the chain cheaper."""
        ops = self.ops
        j = next((i for i, f in enumerate(fs) if type(f) is E.Ones), None)
        if j is not None:
            left = self._chain(fs[:j], v, memo) if j > 0 else None
            right = self._chain(fs[j + 1:], v, memo) if j + 1 < len(fs) else None
            ones = fs[j]
            if left is not None and right is not None:
                return ops.sum_last(left) * ops.sum_rows(right)
            if left is not None:
                return ops.bcast_last(ops.sum_last(left), self._size(ones.cols))
            return ops.bcast_rows(ops.sum_rows(right), self._size(ones.rows))
        if node is None or len(fs) < 3:
            return self._multiply([self._eval(f, v, memo) for f in fs])
        runs, i = [], 0
        while i < len(fs):
            k = i
            if not self.dep(fs[i]):
                while k + 1 < len(fs) and not self.dep(fs[k + 1]):
                    k += 1
            runs.append((i, k))
            i = k + 1
        vals = [self._eval(f, v, memo) for f in fs]
        if all(a == b for a, b in runs):
            return self._multiply(vals)
        shapes = [tuple(ops.shape(x)) for x in vals]
        kept_shapes = [_product_shape(shapes[a:b + 1]) for a, b in runs]
        if _chain_cost(kept_shapes) < _chain_cost(shapes):
            grouped = []
            for a, b in runs:
                if a == b:
                    grouped.append(vals[a])
                    continue
                key = (id(node), a, b, "run")
                if key not in self._keep:
                    self._keep[key] = self._multiply(vals[a:b + 1])
                grouped.append(self._keep[key])
            return self._multiply(grouped)
        return self._multiply(vals)

    def _multiply(self, xs):
        return self.ops.mm(*xs) if len(xs) > 1 else xs[0]


# ----------------------------------------------------------------------------- helpers
def _children(n):
    return n.args[:1] if type(n) is E.Named else n.args


def _product_shape(shapes):
    batch = max((s[0] for s in shapes if len(s) == 3), default=None)
    rc = (shapes[0][-2], shapes[-1][-1])
    return rc if batch is None else (batch,) + rc


def _chain_cost(shapes):
    """The matrix-chain cost (multiply–adds) of the best bracketing of ``shapes``."""
    k = len(shapes)
    if k < 2:
        return 0
    dims = [s[-2] for s in shapes] + [shapes[-1][-1]]
    bat = [s[0] if len(s) == 3 else 1 for s in shapes]
    cost = {(i, i): 0 for i in range(k)}
    b = {(i, i): bat[i] for i in range(k)}
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            cost[i, j] = min(cost[i, s] + cost[s + 1, j]
                             + max(b[i, s], b[s + 1, j]) * dims[i] * dims[s + 1] * dims[j + 1]
                             for s in range(i, j))
            b[i, j] = max(bat[i:j + 1])
    return cost[0, k - 1]


class _NumpyOps:
    def __init__(self):
        import numpy as np
        from ..runtime import numpy_ops as m
        self.np, self.m = np, m

    def __getattr__(self, name):
        return getattr(self.m, name)

    def shape(self, x):
        return self.np.shape(x)

    def reshape(self, x, shape):
        return self.np.reshape(x, shape)

    def zeros(self, shape, like):
        return self.np.zeros(shape, dtype=like.dtype)

    def ones(self, shape, like):
        return self.np.ones(shape, dtype=like.dtype)


class _TorchOps:
    def __init__(self):
        import torch
        from ..runtime import torch_ops as m
        self.torch, self.m = torch, m

    def __getattr__(self, name):
        return getattr(self.m, name)

    def shape(self, x):
        return tuple(x.shape)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def zeros(self, shape, like):
        return self.torch.zeros(shape, dtype=like.dtype, device=like.device)

    def ones(self, shape, like):
        return self.torch.ones(shape, dtype=like.dtype, device=like.device)


_OPS = {}


def _ops(state):
    kind = "torch" if type(state.like).__module__.startswith("torch") else "numpy"
    if kind not in _OPS:
        _OPS[kind] = _TorchOps() if kind == "torch" else _NumpyOps()
    return _OPS[kind]


def _fn(fn, ops):
    return fn.torch() if isinstance(ops, _TorchOps) else fn.numpy()


__all__ = ["BlockProduct", "BoundProduct"]

"""Reference interpreter: evaluate any expression densely with NumPy or torch.

Dimensions are inferred from the arrays given for the variables.  This is the oracle
for the generated kernels and the engine's own self-check; it favours clarity over
speed (structured operators are built densely).
"""
from __future__ import annotations

import math

import numpy as np
import sympy as sp

from . import expr as E
from .errors import InputError


def _is_tensor(x):
    return hasattr(x, "detach") and hasattr(x, "is_complex")


def real_array(x, name):
    """``x`` as a real NumPy array (a torch tensor is kept); anything else is an InputError."""
    if _is_tensor(x):
        if x.is_complex():
            raise InputError(f"{name} is complex ({x.dtype}); symhess works with real arrays")
        return x
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{name} is not a numeric array ({exc})") from None
    if a.dtype.kind == "c":
        raise InputError(f"{name} is complex ({a.dtype}); symhess works with real arrays")
    if a.dtype.kind not in "biuf":
        raise InputError(f"{name} must be a real numeric array, got {type(x).__name__} "
                         f"of dtype {a.dtype}")
    return a


class _Numpy:
    name = "numpy"

    def __init__(self, like=None):
        self.dtype = np.float64 if like is None else like.dtype

    def asarray(self, x, name):
        a = real_array(x.detach().cpu().numpy() if _is_tensor(x) else x, name)
        if not np.issubdtype(a.dtype, np.floating):
            a = a.astype(np.float64)
        return a

    def isfinite(self, a):
        return bool(np.all(np.isfinite(a)))

    def zeros(self, m, n):
        return np.zeros((m, n), dtype=self.dtype)

    def eye(self, n):
        return np.eye(n, dtype=self.dtype)

    def ones(self, m, n):
        return np.ones((m, n), dtype=self.dtype)

    def arange(self, n):
        return np.arange(n)

    kron = staticmethod(np.kron)
    einsum = staticmethod(np.einsum)
    exp = staticmethod(np.exp)

    def matmul_chain(self, mats):
        return mats[0] if len(mats) == 1 else np.linalg.multi_dot(mats)

    def triu_mask(self, n):
        return np.triu(np.ones((n, n), dtype=bool), 1)

    def where(self, c, a, b):
        return np.where(c, a, b)

    def fn(self, f):
        return f.numpy()

    def reshape(self, a, shape):
        return np.reshape(a, shape)

    def max_rows(self, a):
        return a.max(axis=1, keepdims=True)


class _Torch:
    name = "torch"

    def __init__(self, like=None):
        import torch
        self.torch = torch
        self.dtype = torch.float64 if like is None else like.dtype
        self.device = None if like is None else like.device

    def asarray(self, x, name):
        t = self.torch
        a = real_array(x, name)
        if not isinstance(a, t.Tensor):
            a = t.as_tensor(a, dtype=self.dtype)
        if not a.is_floating_point():
            a = a.to(self.dtype)
        return a

    def isfinite(self, a):
        return bool(self.torch.isfinite(a).all())

    def zeros(self, m, n):
        return self.torch.zeros((m, n), dtype=self.dtype, device=self.device)

    def eye(self, n):
        return self.torch.eye(n, dtype=self.dtype, device=self.device)

    def ones(self, m, n):
        return self.torch.ones((m, n), dtype=self.dtype, device=self.device)

    def arange(self, n):
        return self.torch.arange(n, device=self.device)

    def kron(self, a, b):
        # torch.kron's backward fails on non-contiguous inputs (e.g. a transpose)
        return self.torch.kron(a.contiguous(), b.contiguous())

    def einsum(self, spec, *ops):
        return self.torch.einsum(spec, *ops)

    def exp(self, a):
        return self.torch.exp(a)

    def matmul_chain(self, mats):
        return mats[0] if len(mats) == 1 else self.torch.linalg.multi_dot(mats)

    def triu_mask(self, n):
        return self.torch.triu(self.torch.ones((n, n), dtype=self.torch.bool, device=self.device), 1)

    def where(self, c, a, b):
        return self.torch.where(c, a, b)

    def fn(self, f):
        return f.torch()

    def reshape(self, a, shape):
        return a.reshape(shape)

    def max_rows(self, a):
        return a.max(dim=1, keepdim=True).values


def backend_for(name, like=None):
    if name == "numpy":
        return _Numpy(like)
    if name == "torch":
        return _Torch(like)
    raise ValueError(f"unknown backend {name!r}; valid: numpy, torch")


def leaves(expr):
    """The variables an expression reads (inputs, parameters, constants)."""
    return sorted({n for n in E.walk(expr) if isinstance(n, E.Var)}, key=lambda v: v.name)


def bind_dims(variables, arrays, known=None) -> dict:
    """Infer the symbolic dimensions from the arrays (and ``known`` ones); names both shapes on a mismatch."""
    env, later = dict(known or {}), []
    source = {}   # dimension -> the value that fixed it, to name both shapes on a clash
    for var in variables:
        arr = arrays[var.name]
        shape = tuple(arr.shape)
        if arr.ndim != 2:
            raise InputError(f"{var.name} must be a 2-D array of shape {E._fmt(var.shape)}, "
                             f"got shape {shape}")
        if 0 in shape:
            raise InputError(f"{var.name} is empty: shape {shape} (declared {E._fmt(var.shape)})")
        for d, s in zip(var.shape, shape):
            if isinstance(d, sp.Symbol):
                if d in env and env[d] != s:
                    other = (f"{source[d][0]} has shape {source[d][1]} (declared {source[d][2]})"
                             if d in source else "the other values give")
                    raise InputError(f"shape mismatch: {var.name} has shape {shape} (declared "
                                     f"{E._fmt(var.shape)}) but {other}: {d} = {env[d]} vs {s}")
                env[d] = int(s)
                source.setdefault(d, (var.name, shape, E._fmt(var.shape)))
            else:
                later.append((var, d, s, arr))
    for var, d, s, arr in later:
        val = d.subs(env)
        if not val.is_number:
            raise InputError(f"cannot infer {d} from {var.name}")
        if int(val) != s:
            raise InputError(f"shape mismatch: {var.name} has shape {tuple(arr.shape)}, "
                             f"declared {E._fmt(var.shape)} = {tuple(int(x.subs(env)) for x in var.shape)}")
    return env


def evaluate(expr, values, backend="numpy", env=None):
    """Evaluate ``expr`` densely; ``values`` maps variable names to 2-D arrays."""
    variables = leaves(expr)
    missing = [v.name for v in variables if v.name not in values]
    if missing:
        raise InputError(f"missing values for {', '.join(missing)} "
                         f"(needed: {', '.join(v.name for v in variables)})")
    like = None
    if backend == "torch":
        import torch
        like = next((values[v.name] for v in variables if isinstance(values[v.name], torch.Tensor)), None)
    xp = backend_for(backend, like)
    arrays = {}
    for v in variables:
        a = xp.asarray(values[v.name], v.name)
        if not xp.isfinite(a):
            raise InputError(f"{v.name} contains non-finite entries (NaN or inf)")
        arrays[v.name] = a
    # dimensions already known (e.g. from a layer's other values) resolve products like m²
    env = bind_dims(variables, arrays, env)
    interp = Interpreter(xp, env, arrays)
    out = interp.run(expr)
    if not xp.isfinite(out):
        raise InputError(_non_finite_origin(interp, expr))
    return out


def _non_finite_origin(interp, expr):
    """Name the first sub-expression that turned finite values into NaN/inf (e.g. the
    rsqrt of a LayerNorm row of zero variance), instead of returning a wrong number."""
    for node in E.walk(expr):
        val = interp.memo.get(node)
        if val is None or interp.xp.isfinite(val):
            continue
        if all(interp.xp.isfinite(interp.memo[a]) for a in node.args):
            what = node.name if isinstance(node, E.Named) else repr(node)
            if len(what) > 160:
                what = what[:157] + "..."
            return (f"the values give a non-finite (NaN or inf) result: {what} is undefined here "
                    f"(e.g. a LayerNorm row of zero variance with eps = 0, or a division by zero)")
    return "the values give a non-finite (NaN or inf) result"


class Interpreter:
    def __init__(self, xp, env, arrays):
        self.xp, self.env, self.arrays = xp, env, arrays
        self.env_key = E.size_env(env)
        self.memo = {}

    def size(self, d) -> int:
        v = E.size_at(sp.sympify(d), self.env_key)
        if v is None:
            raise InputError(f"dimension {d} is not determined by the values given")
        return v

    def _matmul(self, n, a):
        """A product chain; an all-ones factor is a row/column sum, not a dense product
        (A 1 1ᵀ is rowsum(A) broadcast: O(L d) instead of O(L d²))."""
        j = next((i for i, f in enumerate(n.args) if isinstance(f, E.Ones)), None)
        if j is None or len(a) < 2:
            return self.xp.matmul_chain(a)
        left = self.xp.matmul_chain(a[:j]) if j > 0 else None
        right = self.xp.matmul_chain(a[j + 1:]) if j + 1 < len(a) else None
        ones = n.args[j]
        lsum = left.sum(1).reshape(-1, 1) if left is not None else None          # (r × 1)
        rsum = right.sum(0).reshape(1, -1) if right is not None else None        # (1 × c)
        if lsum is not None and rsum is not None:
            return lsum * rsum
        if lsum is not None:
            return lsum * self.xp.ones(1, self.size(ones.cols))
        return self.xp.ones(self.size(ones.rows), 1) * rsum

    def run(self, expr):
        for node in E.walk(expr):
            if node not in self.memo:
                self.memo[node] = self.eval(node, [self.memo[a] for a in node.args])
        return self.memo[expr]

    def eval(self, n, a):
        xp = self.xp
        t = type(n)
        if t is E.Var:
            return self.arrays[n.name]
        if t is E.Zero:
            return xp.zeros(self.size(n.rows), self.size(n.cols))
        if t is E.Identity:
            return xp.eye(self.size(n.rows))
        if t is E.Ones:
            return xp.ones(self.size(n.rows), self.size(n.cols))
        if t is E.CausalMask:
            k = self.size(n.rows)
            return xp.where(xp.triu_mask(k), xp.zeros(k, k), xp.ones(k, k))
        if t is E.Commutation:
            m, k = self.size(n.params[0]), self.size(n.params[1])
            out = xp.zeros(m * k, m * k)
            i = xp.arange(m).reshape(-1, 1)
            j = xp.arange(k).reshape(1, -1)
            out[(i * k + j).reshape(-1), (j * m + i).reshape(-1)] = 1
            return out
        if t is E.DiagSelector:
            k = self.size(n.params[0])
            out = xp.zeros(k * k, k)
            r = xp.arange(k)
            out[r * k + r, r] = 1
            return out
        if t is E.MatMul:
            return self._matmul(n, a)
        if t is E.Add:
            out = a[0]
            for b in a[1:]:
                out = out + b
            return out
        if t is E.Scale:
            return float(n.coef.subs(self.env)) * a[0]
        if t is E.Transpose:
            return a[0].T
        if t is E.Kron:
            out = a[0]
            for b in a[1:]:
                out = xp.kron(out, b)
            return out
        if t is E.Hadamard:
            out = a[0]
            for b in a[1:]:
                out = out * b
            return out
        if t is E.Elementwise:
            return xp.fn(n.fn)(a[0])
        if t is E.SoftmaxRows:
            return self.softmax(a[0], n.causal)
        if t is E.LogSoftmaxRows:
            z = a[0] - xp.max_rows(a[0])
            s = xp.exp(z).sum(1)
            logs = s.log() if xp.name == "torch" else np.log(s)
            return z - logs.reshape(-1, 1)
        if t is E.SoftmaxDiff:
            p, e = a
            return p * (e - (p * e).sum(1).reshape(-1, 1))
        if t is E.SoftmaxDiff2:
            p, e, f = a
            ec = e - (p * e).sum(1).reshape(-1, 1)
            fc = f - (p * f).sum(1).reshape(-1, 1)
            w = p * ec * fc
            return w - p * w.sum(1).reshape(-1, 1)
        if t is E.SoftmaxJac:
            p = a[0]
            return self.block_diag_rows(p, p)
        if t is E.SoftmaxHess:
            p, e = a
            u = p * (e - (p * e).sum(1).reshape(-1, 1))
            return self.block_diag_rows(u, p, sym=True)
        if t is E.Diag:
            v = a[0].reshape(-1)
            k = v.shape[0]
            out = xp.zeros(k, k)
            r = xp.arange(k)
            out[r, r] = v
            return out
        if t is E.DiagPart:
            r = xp.arange(a[0].shape[0])
            return a[0][r, r].reshape(-1, 1)
        if t is E.VecR:
            return a[0].reshape(-1, 1)
        if t is E.UnvecR:
            return a[0].reshape(self.size(n.params[0]), self.size(n.params[1]))
        if t is E.KronContract:
            g, c = a
            side = n.params[0]
            m, k = self.size(n.params[1]), self.size(n.params[2])
            p, q = c.shape
            if side == "right":
                return xp.einsum("ab,aibj->ij", c, g.reshape(p, m, q, k))
            return xp.einsum("ab,iajb->ij", c, g.reshape(m, p, k, q))
        if t is E.Named:
            return a[0]
        raise NotImplementedError(f"the interpreter does not know {t.__name__}")

    def softmax(self, t, causal):
        xp = self.xp
        if causal:
            t = xp.where(xp.triu_mask(t.shape[0]), -math.inf, t)
        z = xp.exp(t - xp.max_rows(t))
        return z / z.sum(1).reshape(-1, 1)

    def block_diag_rows(self, u, p, sym=False):
        """blockdiag_i(diag(u_i) − u_i p_iᵀ [− p_i u_iᵀ])."""
        xp = self.xp
        m, k = p.shape
        blocks = -xp.einsum("ij,ik->ijk", u, p)
        if sym:
            blocks = blocks - xp.einsum("ij,ik->ijk", p, u)
        r = xp.arange(k)
        blocks[:, r, r] = blocks[:, r, r] + u
        out = xp.zeros(m * k, m * k).reshape(m, k, m, k)
        i = xp.arange(m)
        out[i, :, i, :] = blocks
        return out.reshape(m * k, m * k)

"""Reference interpreter: evaluate any expression densely with NumPy or torch.

Dimensions are inferred from the arrays given for the variables.  This is the oracle
for the generated kernels and the engine's own self-check; it favours clarity over
speed (structured operators are built densely).

**The value policy** (``check_values``, shared with ``verify`` and the kernels): values are a
mapping from names to real float32 or float64 arrays of one dtype (integer, boolean, float16
and complex arrays are refused, never cast), without NaN or inf entries (the error names the
array and the first bad index; ``check_finite=False`` skips that scan).  Before allocating,
``evaluate`` estimates the memory of the work and refuses it with a ``BudgetError`` beyond
the budget (``symhess.expr.budget``).

**Softmax nodes are evaluated in a cancellation-free form.**  Every softmax derivative
contains the centring  c_p(e) = e − rowsum(p ∘ e)  and the Jacobian's diagonal p ∘ (1 − p).
When a row of p saturates (p_* → 1 at the row's largest entry, the others of size δ ≪ 1),
the naive forms lose everything at that entry: e_* − Σ_k p_k e_k is a difference of two
numbers of size |e_*| whose result is of size δ|e|, and p_* − p_*² one of two numbers near 1
whose result is about δ — absolute rounding errors of ε|e| and ε against results of δ|e| and
δ (attention at input scale σ = 30: the W_Q and W_K blocks came out wrong by 10 % to several
times their size).  With s = e_* the entry at the row's largest p (exact, since Σ_k p_k = 1):

    c_p(e)_j = (e_j − s) − Σ_k p_k (e_k − s)         (the k = * term is exactly 0)
    1 − p_j  = Σ_{k≠*} p_k  at j = *,  1 − p_j  otherwise (p_j ≤ 1/2 there)

SoftmaxDiff = p ∘ c_p(e), SoftmaxDiff2 = p ∘ c_p(c_p(e) ∘ c_p(f)), SoftmaxJac =
blockdiag(diag(p ∘ (1 − p)) − p pᵀ off the diagonal), SoftmaxHess = blockdiag(diag(u) − u pᵀ −
p uᵀ) with u = SoftmaxDiff.  Tested against an mpmath reference in tests/test_softmax_accuracy.py.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import sympy as sp

from . import nodes as E
from .budget import check_budget
from ..errors import DeclarationError, InputError, UnknownNameError

ACCEPTED_DTYPES = ("float32", "float64")


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


def _dtype_name(a) -> str:
    return str(a.dtype).removeprefix("torch.")


def _first_non_finite(a):
    """(index tuple, value, count) of the first NaN/inf entry in row-major order, or None."""
    if _is_tensor(a):
        import torch
        if bool(torch.isfinite(a.detach().sum())):    # a finite sum has no NaN/inf term
            return None
        bad = ~torch.isfinite(a.detach())
        if not bool(bad.any()):
            return None
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        idx = tuple(int(i) for i in np.unravel_index(flat, tuple(a.shape)))
        return idx, float(a.detach().reshape(-1)[flat]), int(bad.sum())
    with np.errstate(all="ignore"):                  # the scan reports; numpy need not warn
        if np.isfinite(np.add.reduce(a, axis=None)):   # a finite sum has no NaN/inf term
            return None
    bad = ~np.isfinite(a)
    if not bad.any():                                # the sum overflowed, the entries are fine
        return None
    flat = int(np.argmax(bad.reshape(-1)))
    return tuple(int(i) for i in np.unravel_index(flat, a.shape)), float(a.reshape(-1)[flat]), int(bad.sum())


def _check_mapping(arrays):
    if not isinstance(arrays, Mapping):
        raise InputError(f"values must be a mapping from names to arrays (e.g. {{'X': x}}), "
                         f"got {type(arrays).__name__}")
    bad_keys = [k for k in arrays if not isinstance(k, str)]
    if bad_keys:
        raise InputError(f"value names must be strings, got {', '.join(map(repr, bad_keys))}")


def check_values(arrays, check_finite=True) -> dict:
    """Check values against symhess's one value policy; returns {name: array}.

    The policy (used by ``evaluate``, ``Block.evaluate``, ``verify`` and the kernels):

    * ``arrays`` is a mapping from names (str) to arrays: NumPy arrays and torch tensors are
      returned as they are (no copy, device kept); anything else (nested lists, scalars) is
      converted with ``np.asarray`` first;
    * every array is real floating point of dtype float32 or float64 (``ACCEPTED_DTYPES``):
      integer, boolean, float16, bfloat16 and complex arrays are refused, never cast;
    * all arrays share one dtype (nothing is promoted behind the caller's back);
    * with ``check_finite`` (the default) no entry is NaN or ±inf: the error names the
      array, the first bad index in row-major order, its value and how many entries are bad.
      ``check_finite=False`` skips this scan (one pass over every array) for speed; NaN and
      inf then propagate into the results.

    Shapes are not checked here (``bind_dims`` does that).  Every violation is an
    ``InputError`` whose message names the array.
    """
    _check_mapping(arrays)
    out = {}
    for name, x in arrays.items():
        a = real_array(x, name)
        dt = _dtype_name(a)
        if dt not in ACCEPTED_DTYPES:
            raise InputError(f"{name} has dtype {dt}; symhess computes in "
                             f"{' or '.join(ACCEPTED_DTYPES)} (convert it, e.g. "
                             f"np.asarray({name}, dtype=np.float64) or {name}.double())")
        out[name] = a
    dtypes = {_dtype_name(a) for a in out.values()}
    if len(dtypes) > 1:
        desc = ", ".join(f"{n}: {_dtype_name(a)}" for n, a in out.items())
        raise InputError(f"all values must share one dtype, got {desc}")
    if check_finite:
        for name, a in out.items():
            hit = _first_non_finite(a)
            if hit is not None:
                idx, value, count = hit
                raise InputError(f"{name} contains non-finite entries (NaN or inf): {value} at "
                                 f"index {idx}, {count} of {int(np.prod(a.shape))} entries "
                                 f"(check_finite=False skips this check)")
    return out


class _Numpy:
    name = "numpy"

    def __init__(self, like=None):
        self.dtype = np.float64 if like is None else like.dtype

    def asarray(self, x, name):
        """A checked value (``check_values``) as a NumPy array (tensors are copied to the host)."""
        return x.detach().cpu().numpy() if _is_tensor(x) else np.asarray(x)

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

    def argmax_rows(self, a):
        return np.argmax(a, axis=1).reshape(-1, 1)

    def take_rows(self, a, idx):
        return np.take_along_axis(a, idx, axis=1)


class _Torch:
    name = "torch"

    def __init__(self, like=None):
        import torch
        self.torch = torch
        self.dtype = torch.float64 if like is None else like.dtype
        self.device = None if like is None else like.device

    def asarray(self, x, name):
        """A checked value (``check_values``) as a tensor (NumPy arrays keep their dtype)."""
        t = self.torch
        return x if isinstance(x, t.Tensor) else t.as_tensor(np.asarray(x), device=self.device)

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

    def argmax_rows(self, a):
        return a.argmax(dim=1, keepdim=True)

    def take_rows(self, a, idx):
        return self.torch.gather(a, 1, idx)


def backend_for(name, like=None):
    if name == "numpy":
        return _Numpy(like)
    if name == "torch":
        return _Torch(like)
    raise UnknownNameError(f"unknown backend {name!r}; valid: numpy, torch")


def leaves(expr):
    """The variables an expression reads (inputs, parameters, constants)."""
    return sorted({n for n in E.walk(expr) if isinstance(n, E.Var)}, key=lambda v: v.name)


def bind_dims(variables, arrays, known=None) -> dict:
    """Infer the symbolic dimensions from the arrays (and ``known`` ones); names both shapes on a mismatch.

    A dimension that only appears inside a product or power (a value declared (L·b × d)) is
    solved for once the product's other factors are known (from other values, ``known`` or
    another product): L·b = 6 with L = 2 gives b = 3.  A product with two unknown factors
    is an InputError that names them.
    """
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
                later.append((var, d, int(s), arr))
    while later:   # solve products with one unknown factor until nothing changes
        rest = []
        for var, d, s, arr in later:
            val = sp.sympify(d).subs(env)
            if val.is_number:
                if int(val) != s:
                    raise InputError(f"shape mismatch: {var.name} has shape {tuple(arr.shape)}, "
                                     f"declared {E._fmt(var.shape)} = "
                                     f"{tuple(int(sp.sympify(x).subs(env)) for x in var.shape)}")
                continue
            unknown = sorted(val.free_symbols, key=lambda x: x.name)
            if len(unknown) == 1:
                sym = unknown[0]
                roots = [r for r in sp.solve(sp.Eq(val, s), sym) if r.is_integer and r > 0]
                if len(roots) != 1:
                    raise InputError(f"shape mismatch: {var.name} has shape {tuple(arr.shape)}, "
                                     f"declared {E._fmt(var.shape)}: no positive integer {sym} "
                                     f"gives {d} = {s}" + (f" with {_known(val, d, env)}"
                                                          if _known(val, d, env) else ""))
                env[sym] = int(roots[0])
                source.setdefault(sym, (var.name, tuple(arr.shape), E._fmt(var.shape)))
                continue
            rest.append((var, d, s, arr))
        if len(rest) == len(later):
            var, d, s, arr = rest[0]
            unknown = sorted(sp.sympify(d).subs(env).free_symbols, key=lambda x: x.name)
            names = ", ".join(x.name for x in unknown)
            raise InputError(f"cannot infer {names} from {var.name} (shape {tuple(arr.shape)}, "
                             f"declared {E._fmt(var.shape)}): {d} = {s} has {len(unknown)} "
                             f"unknown factors; give a value that fixes all but one of {names}")
        later = rest
    return env


def _known(val, d, env):
    used = sorted(sp.sympify(d).free_symbols - val.free_symbols, key=lambda x: x.name)
    return ", ".join(f"{x} = {env[x]}" for x in used if x in env)


def _like(arrays, backend):
    """An array of the values' dtype (and device) for the backend's constants, or None."""
    if not arrays:
        return None
    tensors = [a for a in arrays.values() if _is_tensor(a)]
    first = next(iter(arrays.values()))
    if backend == "torch":
        import torch
        return tensors[0] if tensors else torch.as_tensor(np.asarray(first).reshape(-1)[:0])
    return np.asarray(first.detach().cpu().numpy() if _is_tensor(first) else first).reshape(-1)[:0]


def estimate_bytes(expr, env, itemsize=8):
    """(total bytes, largest node, its bytes) the interpreter keeps alive for ``expr`` at the
    sizes ``env`` (it keeps every node's value); softmax Jacobians also count their
    (rows × k × k) block stack.  Nodes whose size is not bound are skipped."""
    key = E.size_env(env)
    total, largest, most = 0, None, -1
    for node in E.walk(expr):
        r, c = E.size_at(node.rows, key), E.size_at(node.cols, key)
        if r is None or c is None:
            continue
        n = r * c
        if isinstance(node, (E.SoftmaxJac, E.SoftmaxHess)):
            m, k = (E.size_at(x, key) for x in node.args[0].shape)
            n += 2 * m * k * k if m is not None and k is not None else 0
        if n > most:
            largest, most = node, n
        total += n
    return total * itemsize, largest, most * itemsize


def _sizes_text(env) -> str:
    return ", ".join(f"{k} = {v}" for k, v in sorted(env.items(), key=lambda kv: str(kv[0])))


def check_evaluation_budget(expr, env, itemsize=8, what=None, device=None):
    """A BudgetError before evaluating ``expr`` at ``env`` when its estimate exceeds the budget."""
    from .budget import format_bytes, memory_budget
    total, largest, most = estimate_bytes(expr, env, itemsize)
    budget, _ = memory_budget(device)
    if budget is None or total <= budget:
        return
    key = E.size_env(env)
    shape = " × ".join(str(E.size_at(x, key)) for x in largest.shape)
    kind = largest.name if isinstance(largest, (E.Var, E.Named)) else type(largest).__name__
    check_budget(total, f"evaluating {what or 'the expression'} (its largest intermediate, a "
                        f"{kind} of {shape}, is {format_bytes(most)})", _sizes_text(env), device)


def evaluate(expr, values, backend="numpy", env=None, check_finite=True, what=None):
    """Evaluate ``expr`` densely; ``values`` maps variable names to 2-D arrays.

    Values follow ``check_values`` (float32/float64 of one dtype; NaN/inf refused unless
    ``check_finite=False``, which also skips the check of the result).  ``env``: dimensions
    already known (e.g. from a layer's other values).  ``what`` names the work in a
    ``BudgetError`` (raised before allocating when the estimate exceeds the budget).
    """
    if not isinstance(expr, E.Expr):
        raise DeclarationError(f"evaluate needs a symhess expression (symhess.expr), "
                               f"got {type(expr).__name__} {_short(expr)}")
    _check_mapping(values)
    variables = leaves(expr)
    missing = [v.name for v in variables if v.name not in values]
    if missing:
        raise InputError(f"missing values for {', '.join(missing)} "
                         f"(needed: {', '.join(v.name for v in variables)})")
    checked = check_values({v.name: values[v.name] for v in variables}, check_finite)
    like = _like(checked, backend)
    xp = backend_for(backend, like)
    arrays = {name: xp.asarray(a, name) for name, a in checked.items()}
    # dimensions already known (e.g. from a layer's other values) resolve products like m²
    env = bind_dims(variables, arrays, env)
    itemsize = 8 if like is None else np.dtype(_dtype_name(like)).itemsize
    check_evaluation_budget(expr, env, itemsize, what, getattr(xp, "device", None))
    interp = Interpreter(xp, env, arrays)
    if check_finite:                     # a non-finite result raises below, naming its origin
        with np.errstate(all="ignore"):
            out = interp.run(expr)
    else:
        out = interp.run(expr)
    if check_finite and not xp.isfinite(out):
        raise InputError(_non_finite_origin(interp, expr))
    return out


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


# sums and products: finite operands give a non-finite value only by overflowing the dtype
_ARITHMETIC = (E.MatMul, E.Add, E.Scale, E.Hadamard, E.Kron, E.Transpose)


def _non_finite_origin(interp, expr):
    """Name the first sub-expression that turned finite values into NaN/inf: a sum or
    product overflowed the dtype (named with its largest operand entry), or a function is
    undefined there (the rsqrt of a LayerNorm row of zero variance), instead of returning a
    wrong number."""
    for node in E.walk(expr):
        val = interp.memo.get(node)
        if val is None or interp.xp.isfinite(val):
            continue
        if all(interp.xp.isfinite(interp.memo[a]) for a in node.args):
            what = node.name if isinstance(node, E.Named) else repr(node)
            if len(what) > 160:
                what = what[:157] + "..."
            if isinstance(node, _ARITHMETIC):
                dt = _dtype_name(val)
                big = max((float(abs(interp.memo[a]).max()) for a in node.args
                           if math.prod(interp.memo[a].shape)), default=0.0)
                return (f"the values give a non-finite (NaN or inf) result: {what} overflowed "
                        f"{dt} (largest {float(np.finfo(dt).max):.3g}) from operands as large as "
                        f"{big:.3g}; scale the values down"
                        f"{' or compute in float64' if dt == 'float32' else ''}")
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
            return self.softmax(a[0], n.causal, a[1] if len(a) > 1 else None)
        if t is E.LogSoftmaxRows:
            z = a[0] - xp.max_rows(a[0])
            s = xp.exp(z).sum(1)
            logs = s.log() if xp.name == "torch" else np.log(s)
            return z - logs.reshape(-1, 1)
        if t is E.SoftmaxDiff:
            p, e = a
            return p * self.centre(p, e)
        if t is E.SoftmaxDiff2:
            p, e, f = a
            return p * self.centre(p, self.centre(p, e) * self.centre(p, f))
        if t is E.SoftmaxJac:
            p = a[0]
            return self.block_diag_rows(p, p, diag=p * self.complement(p))
        if t is E.SoftmaxHess:
            p, e = a
            u = p * self.centre(p, e)
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

    def softmax(self, t, causal, mask=None):
        xp = self.xp
        if causal:
            t = xp.where(xp.triu_mask(t.shape[0]), -math.inf, t)
        if mask is not None:           # masked entries: exp(−∞) = 0 exactly (rows keep ≥ 1 entry)
            t = xp.where(mask == 0, -math.inf, t)
        z = xp.exp(t - xp.max_rows(t))
        return z / z.sum(1).reshape(-1, 1)

    def centre(self, p, e):
        """e − rowsum(p ∘ e) for rows p of a softmax, as (e − s) − rowsum(p ∘ (e − s)) with s
        the entry of e at each row's largest p: exact in exact arithmetic (Σ_k p_k = 1), and
        free of cancellation where p saturates (module docstring)."""
        xp = self.xp
        d = e - xp.take_rows(e, xp.argmax_rows(p))
        return d - (p * d).sum(1).reshape(-1, 1)

    def complement(self, p):
        """1 − p for rows p of a softmax; at each row's largest p the sum of the others
        (1 − p_* cancels when p_* → 1; every other p_j ≤ 1/2, where 1 − p_j is exact)."""
        xp = self.xp
        top = xp.arange(p.shape[1]).reshape(1, -1) == xp.argmax_rows(p)
        rest = xp.where(top, 0 * p, p).sum(1).reshape(-1, 1)
        return xp.where(top, rest + 0 * p, 1 - p)

    def block_diag_rows(self, u, p, sym=False, diag=None):
        """blockdiag_i(diag(u_i) − u_i p_iᵀ [− p_i u_iᵀ]); ``diag``: the blocks' diagonals
        given directly (the Jacobian's p ∘ (1 − p), which the subtraction would cancel)."""
        xp = self.xp
        m, k = p.shape
        blocks = -xp.einsum("ij,ik->ijk", u, p)
        if sym:
            blocks = blocks - xp.einsum("ij,ik->ijk", p, u)
        r = xp.arange(k)
        blocks[:, r, r] = blocks[:, r, r] + u if diag is None else diag
        out = xp.zeros(m * k, m * k).reshape(m, k, m, k)
        i = xp.arange(m)
        out[i, :, i, :] = blocks
        return out.reshape(m * k, m * k)

"""Kernels of a layer: ``symhess.kernel(layer, backend, loss, **options)``.

``layer`` is a registered name or a declared ``Layer`` (registered or not).  A ``Kernel``
validates values and binds them to the generated variant (``prepare``): the returned
state computes the forward quantities once and answers every curvature query exactly at the
call's sizes; the ``Kernel`` methods taking ``values`` are one-shot shortcuts for it.

Values: a dict of arrays by variable name (NumPy arrays for ``backend="numpy"``, tensors on
any device for ``"torch"``), all float32 or all float64.  Data (the layer's inputs and the
target Y) may carry a leading batch axis of N ≥ 1 sequences; the loss is the batch mean and
so is every Hessian quantity.  Tensors that require grad are used detached.  Bad values
raise ``InputError`` naming the array (non-finite entries: the first bad index; pass
``check_finite=False`` to skip that scan).
"""
from __future__ import annotations

import math

import numpy as np
import sympy as sp

from ..codegen import render as codegen
from ..expr.budget import check_budget
from ..errors import DeclarationError, InputError, UnknownNameError
from ..expr.evaluate import bind_dims, check_values
from ..calculus.hessian import check_part, derive
from ..expr.layer import Layer
from ..layers.registry import layer as get_layer, layer_options
from ..calculus.losses import get_loss
from ..runtime import checks
from ..runtime import network as N  # noqa: F401
from ..runtime.jacobian import CompactJacobian
from ..runtime.schedule import Schedule

BACKENDS = codegen.BACKENDS
FLOATS = ("float32", "float64")


class _Shape:
    """Shape-only stand-in for ``bind_dims``."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


def kernel(layer, backend="numpy", loss="mse", *, module=None, **options) -> "Kernel":
    """Kernels of a registered layer by name (with its options) or of a ``Layer`` object,
    e.g. ``kernel("attention", "torch", "ce", causal=True)`` or ``kernel(my_layer, "numpy")``.
    ``module``: the path of a kernel module written by ``symhess generate LAYER --out DIR``,
    used instead of the committed, cached or freshly rendered one (it must hold this
    declaration's variant for ``loss``: a ``DeclarationError`` otherwise)."""
    if backend not in BACKENDS:
        raise DeclarationError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    get_loss(loss)
    if isinstance(layer, Layer):
        if options:
            raise DeclarationError("options are given to the layer's factory, not to kernel() "
                                   "with a Layer object")
        return Kernel(layer, backend, loss, (), None, module)
    if not isinstance(layer, str):
        raise DeclarationError(f"kernel() takes a layer name or a Layer, got {type(layer).__name__}")
    lay = get_layer(layer, **options)
    opts = dict(layer_options(layer))
    opts.update(options)
    return Kernel(lay, backend, loss, tuple(sorted(opts.items())), layer, module)


class Kernel:
    """Exact curvature of one layer, loss and backend; see ``prepare``."""

    def __init__(self, layer, backend, loss, options, registered, module=None):
        self.layer, self.backend, self.loss_name = layer, backend, loss
        self.options, self.registered, self.module = options, registered, module
        self.params = layer.param_names
        self._data = [v.name for v in layer.inputs if v.role == "input"] + ["Y"]
        variables = dict(layer.variables)
        variables["Y"] = derive(layer, loss).Y
        self._vars = variables
        self.names = sorted(variables)
        self._cls = None if module is None else \
            codegen.module_class(module, layer, backend, loss)
        self._dims_seen = {}

    def __repr__(self):
        return f"<symhess kernel {self.layer.name} ({self.backend}, {self.loss_name})>"

    @property
    def variant(self):
        """The generated class (loaded or rendered on first use)."""
        if self._cls is None:
            self._cls = codegen.variant_class(self.layer, self.backend, self.loss_name,
                                              self.options, self.registered)
        return self._cls

    @property
    def ops(self):
        if self.backend == "torch":
            from ..runtime.torch_ops import OPS
        else:
            from ..runtime.numpy_ops import OPS
        return OPS

    # -- values --------------------------------------------------------------------------
    def _array(self, name, x):
        """``x`` as the backend's array type (a tensor that requires grad is detached)."""
        if self.backend == "torch":
            import torch
            if not isinstance(x, torch.Tensor):
                from ..expr.evaluate import real_array
                x = torch.as_tensor(real_array(x, name))
            return x.detach() if x.requires_grad else x
        if type(x).__module__.startswith("torch"):
            raise InputError(f"{name} is a torch tensor; use backend='torch' or pass a NumPy array")
        return np.asarray(x)

    def prepare(self, values, check_finite=True, memory_budget=None, need_target=True):
        """The values bound to the generated variant: a state whose methods (``hvp``,
        ``diag``, ``trace``, ``frobenius_norm``, ``frobenius_split``, ``hessian_block``,
        ``hessian``, ``loss``, ``gradient`` …) share the forward quantities.
        ``memory_budget``: bytes any intermediate may take (``runtime.schedule``)."""
        if not isinstance(values, dict):
            raise InputError(f"values must be a dict of arrays by name ({', '.join(self.names)})")
        bad = [k for k in values if not isinstance(k, str)]
        if bad:
            raise InputError(f"value names must be strings, got {bad[0]!r}; valid: {', '.join(self.names)}")
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise InputError(f"unknown value name(s) {', '.join(unknown)} for layer "
                             f"{self.layer.name!r}; valid: {', '.join(self.names)}")
        needed = [n for n in self.names if need_target or n != "Y"]
        missing = [n for n in needed if n not in values]
        if missing:
            raise InputError(f"missing value(s) {', '.join(missing)}; needed: {', '.join(needed)}")
        names = [n for n in self.names if n in values]
        arrays = {n: self._array(n, values[n]) for n in names}
        check_values(arrays, check_finite=False)       # dtypes (finiteness after the shapes)
        given = dict(arrays)            # as the caller shaped them: a bad entry's index is theirs
        if self.backend == "torch":
            _same(arrays, "device", lambda a: a.device)
        data = [n for n in self._data if n in arrays]
        shapes_given = ", ".join(f"{n}: {tuple(arrays[n].shape)}" for n in data)
        batch = {}
        for n in names:
            a = arrays[n]
            if n in data and a.ndim == 2:
                arrays[n] = a[None]
            elif n in data and a.ndim == 3:
                batch[n] = a.shape[0]
            elif n in data or a.ndim != 2:
                want = f"{_declared(self._vars[n])}" + (" or (N, …) with a batch axis" if n in data else "")
                raise InputError(f"{n} must have shape {want}, got shape {tuple(a.shape)}")
        if len(set(batch.values())) > 1 or (batch and len(batch) < len(data)):
            raise InputError(f"the data values need the same leading batch size (every one "
                             f"(N, …) with the same N, or none), got {shapes_given}")
        n_batch = next(iter(batch.values()), 1) if data else 1
        if n_batch == 0:
            raise InputError("the batch is empty (N = 0 sequences); give at least one")
        order = data + list(self.params) + [n for n in names if n not in data and n not in self.params]
        key = tuple((n, tuple(arrays[n].shape[-2:])) for n in order)
        if key not in self._dims_seen:         # shapes checked once need no sympy again
            shapes = {n: _Shape(shape) for n, shape in key}
            self._dims_seen[key] = bind_dims([self._vars[n] for n in order], shapes)
        env = self._dims_seen[key]
        if check_finite:
            check_values(given)
        like = arrays[self.params[0]]
        itemsize = 4 if "32" in str(like.dtype) else 8
        sched = Schedule.default(memory_budget, itemsize, getattr(like, "device", None))
        dims = {s.name: int(v) for s, v in env.items()}
        state = self.variant(arrays, dims, n_batch, self.ops, sched, like)
        state.dims = dims
        self._run_layer_checks(state, arrays, data)
        return state

    def _run_layer_checks(self, state, arrays, data):
        checks = self.layer.checks
        if not checks:
            return
        if len(self.layer.batch_checks) == len(checks):
            with np.errstate(all="ignore"):
                inputs = state.check_inputs()
            for check, u in zip(checks, inputs):
                u = u.detach().cpu().numpy() if hasattr(u, "detach") else np.asarray(u)
                check.check_batch(u if u.ndim == 3 else u[None])
            return
        host = {n: (a.detach().cpu().numpy() if hasattr(a, "detach") else a) for n, a in arrays.items()}
        for i in range(state.n_batch):
            self.layer.validate({n: (a[i] if n in data else a) for n, a in host.items()})

    def _param(self, p):
        if p not in self.params:
            raise UnknownNameError(f"unknown block {p!r} for layer {self.layer.name!r}; "
                             f"valid: {', '.join(self.params)}")
        return p

    # -- one-shot shortcuts ----------------------------------------------------------------
    def loss(self, values):
        """ℓ (batch mean)."""
        return self.prepare(values).loss()

    def gradient(self, values):
        """{p: ∂ℓ/∂W_p}."""
        return dict(zip(self.params, self.prepare(values).gradient()))

    def hessian_block(self, values, p, q, part="full"):
        """H_part(p, q) as a dense (numel p × numel q) array, vec_r layout."""
        check_part(part)
        st = self.prepare(values)
        _fits(st, [(st.numel(self._param(p)), st.numel(self._param(q)))])
        return st.hessian_block(p, q, part)

    def hessian(self, values, part="full", out=None):
        """The full Hessian, parameters in declared order; ``out``: a C-contiguous array of
        shape (n, n) to write it into (the values' dtype and device)."""
        check_part(part)
        st = self.prepare(values)
        n = sum(st.numel(p) for p in self.params)
        if out is not None:
            self._check_out(out, st, n)
        else:
            _fits(st, [(n, n)])
        return st.hessian(part, out)

    def _check_out(self, out, st, n):
        if self.backend == "torch":
            import torch
            if not isinstance(out, torch.Tensor):
                raise InputError(f"out must be a torch tensor, got {type(out).__name__}")
            contiguous, writeable = out.is_contiguous(), not out.requires_grad
        else:
            if not isinstance(out, np.ndarray):
                raise InputError(f"out must be a NumPy array, got {type(out).__name__}")
            contiguous, writeable = out.flags.c_contiguous, out.flags.writeable
        if tuple(out.shape) != (n, n):
            raise InputError(f"out must have shape ({n}, {n}) (numel of "
                             f"{' + '.join(self.params)} each way), got {tuple(out.shape)}")
        if out.dtype != st.like.dtype:
            raise InputError(f"out has dtype {out.dtype} but the values have dtype {st.like.dtype}")
        if self.backend == "torch" and out.device != st.like.device:
            raise InputError(f"out is on {out.device} but the values are on {st.like.device}")
        if not contiguous:
            raise InputError("out must be C-contiguous (row-major, no gaps)")
        if not writeable:
            raise InputError("out must be writeable (a NumPy array with the writeable flag, "
                             "a torch tensor that does not require grad)")

    def hvp(self, values, v, part="full"):
        """H_part v for a flat vector v (parameters in declared order), no block built."""
        check_part(part)
        st = self.prepare(values)
        st._one_shot = True
        return st.hvp(self.vector(st, v), part)

    def vector(self, st, v, name="v"):
        """``v`` validated as a flat vector over every parameter (declared order)."""
        n = sum(st.numel(p) for p in self.params)
        return checks.vector(v, st.like, [(n,)], name,
                             over=f"{', '.join(self.params)} in declared order, vec_r")

    def diag(self, values, p, part="full"):
        """diag H_part(p, p), vec_r order."""
        check_part(part)
        return self.prepare(values).diag(self._param(p), part)

    def diagonals(self, values, part="full"):
        """{p: diag H_part(p, p)} for every parameter, in one pass (``Forward.diagonals``)."""
        check_part(part)
        return self.prepare(values).diagonals(part)

    def trace(self, values, p, part="full"):
        """tr H_part(p, p)."""
        check_part(part)
        return self.prepare(values).trace(self._param(p), part)

    def frobenius_norm(self, values, p, q, part="full"):
        """‖H_part(p, q)‖_F, exact, without building the block."""
        check_part(part)
        return self.prepare(values).frobenius_norm(self._param(p), self._param(q), part)

    def frobenius_split(self, values, p, q):
        """{outer, functional, full: ‖H_part(p, q)‖_F}."""
        return self.prepare(values).frobenius_split(self._param(p), self._param(q))

    def frobenius_norms(self, values, part="full"):
        """{(p, q): ‖H_part(p, q)‖_F} for every block."""
        check_part(part)
        return self.prepare(values).frobenius_norms(part)

    def jacobian(self, values, p, compact=False):
        """∂vec_r F/∂vec_r W_p per sequence (not a batch mean); the target Y is not needed.

        Dense: shape (numel F, numel W_p), or (N, numel F, numel W_p) when the data carry a
        batch axis (a Jacobian that does not read the data is broadcast, read-only).
        ``compact=True``: a ``CompactJacobian`` (its index networks; ``.dense()`` expands it).
        """
        p = self._param(p)
        st = self.prepare(values, need_target=False)
        batched = any(np.ndim(values[n]) == 3 for n in self._data if n in values and n != "Y")
        fn = getattr(st, f"jacobian__{p}", None)
        nets = fn() if fn is not None else []
        F = self.layer.output
        dims = {sp.Symbol(k, positive=True, integer=True): v for k, v in st.dims.items()}
        numel_f = int(sp.sympify(F.rows * F.cols).subs(dims))
        jac = CompactJacobian(st, nets, numel_f, st.numel(p), batched, f"jacobian({p!r})")
        return jac if compact else jac.dense()


def _same(arrays, what, get):
    kinds = {str(get(a)) for a in arrays.values()}
    if len(kinds) > 1:
        desc = ", ".join(f"{n}: {get(a)}" for n, a in arrays.items())
        raise InputError(f"all values must share one {what}, got {desc}")


def _fits(st, shapes):
    """Refuse results beyond the memory budget (one line naming the sizes and the estimate)."""
    need = sum(math.prod(s) for s in shapes) * st.schedule.itemsize
    desc = " and ".join(" × ".join(str(x) for x in s) for s in shapes)
    check_budget(need, f"the result ({desc} entries)", device=getattr(st.like, "device", None))


def _declared(var):
    return f"({var.rows} × {var.cols})"


__all__ = ["kernel", "Kernel", "CompactJacobian"]

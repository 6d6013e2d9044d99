"""Load generated kernels and call them safely: ``symhess.kernel(name, backend, loss, **options)``.

The generated functions (``generated/<backend>/<layer>.py``) assume validated inputs with
a leading batch axis on the data; ``Kernel`` checks names, shapes, dtypes, devices and
vector lengths, adds the batch axis when it is missing, and dispatches.  Option
combinations that were not generated are rendered in memory on first use.
"""
from __future__ import annotations

import re
import threading
from functools import lru_cache

import numpy as np
import sympy as sp

from . import codegen
from .evaluate import InputError, bind_dims
from .hessian import PARTS, check_part
from .layers import layer as get_layer, layer_options
from .losses import get_loss
from .memory import ResultPool
from .replay import ReplayTable

BACKENDS = ("numpy", "torch")


class _Shape:
    """Shape-only stand-in (per sequence) for ``bind_dims``."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


@lru_cache(maxsize=None)
def _generated_module(backend, name):
    path = codegen.ROOT / "generated" / backend / f"{name}.py"
    if not path.exists():
        return None
    # exec the source (rather than import it) so no __pycache__ lands in generated/
    return lazy_module(path.read_text(), str(path), f"symhess_generated_{backend}_{name}")


def lazy_module(src, filename, module_name):
    """The namespace of a generated module whose functions are compiled on their first call.

    Compiling a whole module costs about 0.4 s per MB of source (≈ 3 s for the post-LN block,
    6.6 MB for multi-head attention) while a session calls a handful of its hundreds of
    routines. The template puts every function at the start of a line (``def`` at column 0)
    and the ``VARIANTS`` table last, so the source splits there; each function keeps its own
    text and first line number, so tracebacks point into the generated file as before.
    """
    table = src.find("\nVARIANTS = {")
    if table < 0:
        raise RuntimeError(f"{filename} has no VARIANTS table: not a module written by "
                           "`symhess generate` (run it to regenerate generated/)")
    first = re.compile(r"\ndef [^_]").search(src, 0, table)   # module helpers (_empty) stay eager
    start = table if first is None else first.start()
    ns = {"__name__": module_name, "__file__": filename}
    exec(compile(src[:start], filename, "exec"), ns)
    functions, line = {}, src.count("\n", 0, start) + 2
    for chunk in src[start:table].split("\ndef ")[1:]:
        fname = chunk[:chunk.index("(")]
        functions[fname] = LazyFunction(fname, "def " + chunk, line, filename, ns)
        line += chunk.count("\n") + 1
    names = _Names(functions)
    exec(compile("\n" * src.count("\n", 0, table + 1) + src[table + 1:], filename, "exec"),
         ns, names)
    ns.update(functions)
    ns["VARIANTS"] = names["VARIANTS"]
    return ns


class _Names(dict):
    """Local names for the ``VARIANTS`` table: function names resolve to their lazy stand-ins."""

    def __init__(self, functions):
        super().__init__()
        self.functions = functions

    def __missing__(self, key):
        return self.functions[key]


_COMPILING = threading.Lock()


class LazyFunction:
    """A generated function compiled from its source text on the first call."""

    __slots__ = ("__name__", "_src", "_line", "_file", "_ns", "_fn")

    def __init__(self, name, src, line, filename, ns):
        self.__name__ = name
        self._src, self._line, self._file, self._ns, self._fn = src, line, filename, ns, None

    @property
    def compiled(self) -> bool:
        return self._fn is not None

    def __call__(self, *args, **kwargs):
        fn = self._fn
        if fn is None:
            fn = self._compile()
        return fn(*args, **kwargs)

    def _compile(self):
        with _COMPILING:            # two threads' first calls compile once
            if self._fn is None:
                code = compile("\n" * (self._line - 1) + self._src, self._file, "exec")
                local = {}
                exec(code, self._ns, local)
                self._fn, self._src = local[self.__name__], None
            return self._fn

    def __repr__(self):
        state = "compiled" if self._fn is not None else "not compiled yet"
        return f"<generated function {self.__name__} ({state})>"


@lru_cache(maxsize=None)
def _table(backend, name, loss, options):
    mod = _generated_module(backend, name)
    if mod is not None and (loss, options) in mod["VARIANTS"]:
        return mod["VARIANTS"][(loss, options)]
    return _LazyTable(backend, name, loss, options)


class _LazyTable(dict):
    """Routines of a variant that is not committed, each rendered in memory on first use
    (a large layer's whole module takes minutes to print; one routine takes seconds)."""

    def __init__(self, backend, name, loss, options):
        super().__init__()
        self.spec = (name, backend, loss, options)

    def __missing__(self, key):
        name, backend, loss, options = self.spec
        self.update(codegen.render_routine(name, backend, loss, options, key))
        if key not in self:
            raise KeyError(f"no generated routine {key!r} for layer {name!r}")
        return self[key]


def kernel(name, backend="numpy", loss="mse", **options) -> "Kernel":
    """Kernels for a registered layer, e.g. ``kernel("attention", "torch", "ce", causal=True)``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    get_loss(loss)
    lay = get_layer(name, **options)        # validates the option names
    opts = dict(layer_options(name))
    opts.update(options)
    key = tuple(sorted(opts.items()))
    return Kernel(lay, backend, loss, _table(backend, name, loss, key))


class Kernel:
    """Hessian kernels of one layer/loss/options; every method takes ``values`` by name."""

    def __init__(self, layer, backend, loss, table):
        self.layer, self.backend, self.loss_name, self._fns = layer, backend, loss, table
        self.params = layer.param_names
        # only data (role "input") and the target carry the batch axis; constants such as
        # W_E, P or LayerNorm's γ, β are shared by all sequences
        self._data = [v.name for v in layer.inputs if v.role == "input"] + ["Y"]
        variables = dict(layer.variables)
        from .hessian import derive
        variables["Y"] = derive(layer, loss).Y
        self._vars = variables
        self.names = sorted(variables)
        self._dims_seen = {}      # (name, shape) tuples → bound dimensions (shapes that passed)
        self._results = ResultPool()   # CPU arrays for fresh Hessians, reused once let go

    def __repr__(self):
        mode = f", {self._mode}" if self._mode else ""
        return f"<symhess kernel {self.layer.name} ({self.backend}, {self.loss_name}{mode})>"

    @property
    def _mode(self):
        """The mode of a kernel replaying its routines ("CUDA graphs", "traced graphs"), or
        None for eager calls."""
        return self._fns.wrap.mode if isinstance(self._fns, ReplayTable) else None

    @property
    def _graphed(self) -> bool:
        return self._mode == "CUDA graphs"

    @property
    def _traced(self) -> bool:
        return self._mode == "traced graphs"

    def _with_table(self, wrap) -> "Kernel":
        """A kernel sharing this one's routines, each wrapped by ``wrap`` on first use."""
        other = Kernel.__new__(Kernel)
        other.__dict__.update(self.__dict__)
        other._fns = ReplayTable(self._fns, wrap)
        other._dims_seen = {}
        return other

    def _replaying(self, wrap, method):
        """This kernel with its routines replayed by ``wrap`` (a ``Replayed`` class), made by
        the Kernel method ``method``: itself when it already is; one mode at a time."""
        if self.backend != "torch":
            raise ValueError(f"{wrap.mode} need the torch backend; this kernel's backend is "
                             f"{self.backend!r}")
        if self._mode == wrap.mode:
            return self
        if self._mode is not None:
            raise ValueError(f"this kernel replays {self._mode}; call {method}() on the kernel "
                             "it was made from")
        return self._with_table(wrap)

    def with_cuda_graphs(self) -> "Kernel":
        """The same kernels, replayed from CUDA graphs on CUDA inputs (torch backend).

        Each routine is captured on its first CUDA call with a new input signature (names,
        shapes, dtype, device) and replayed afterwards, which removes the launch overhead of
        its many small statements; inputs are validated on every call as before, and every
        call returns fresh tensors. CPU inputs run eagerly. ``symhess.graphs`` has the
        details; ``clear_cuda_graphs()`` frees the captured graphs' memory.
        """
        from .graphs import GraphedFunction
        return self._replaying(GraphedFunction, "with_cuda_graphs")

    def clear_cuda_graphs(self):
        """Free the graphs captured by ``with_cuda_graphs()`` (they are captured again on use)."""
        if self._graphed:
            self._fns.clear_recorded()

    def traced(self) -> "Kernel":
        """The same kernels, replayed from traced graphs (torch backend, any device).

        Each routine is traced (``torch.jit.trace``) on its first call with a new signature
        (names, shapes, dtypes, devices) and replayed afterwards without the Python layer of
        its many small statements: the post-LN block's full Hessian at the issue's sizes
        takes ≈ 15 ms instead of ≈ 18 (BENCHMARKS.md). The numbers are the eager routine's
        (each trace's first replays are checked against it); inputs are validated on every
        call as before. A routine that cannot be traced runs eagerly after one warning.
        ``symhess.traces`` has the details; ``clear_traces()`` drops the graphs.
        """
        from .traces import TracedFunction
        return self._replaying(TracedFunction, "traced")

    def clear_traces(self):
        """Drop the graphs traced by ``traced()`` (they are traced again on use)."""
        if self._traced:
            self._fns.clear_recorded()

    # -- validation ------------------------------------------------------------------
    def _array(self, name, x):
        if self.backend == "torch":
            import torch
            if not isinstance(x, torch.Tensor):
                x = torch.as_tensor(np.asarray(x))
            ok = x.dtype in (torch.float32, torch.float64)
        else:
            if type(x).__module__.startswith("torch"):
                raise InputError(f"{name} is a torch tensor; use backend='torch' or pass a NumPy array")
            x = np.asarray(x)
            ok = x.dtype in (np.float32, np.float64)
        if not ok:
            raise InputError(f"{name} has dtype {x.dtype}; expected float32 or float64")
        return x

    def _prepare(self, values, optional=()):
        """Validated arrays (data with a batch axis); ``optional`` names may be absent."""
        if not isinstance(values, dict):
            raise InputError(f"values must be a dict of arrays by name ({', '.join(self.names)})")
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise InputError(f"unknown value name(s) {', '.join(unknown)} for layer "
                             f"{self.layer.name!r}; valid: {', '.join(self.names)}")
        needed = [n for n in self.names if n not in optional]
        missing = [n for n in needed if n not in values]
        if missing:
            raise InputError(f"missing value(s) {', '.join(missing)}; needed: {', '.join(needed)}")
        names = [n for n in self.names if n in values]
        data = [n for n in self._data if n in values]
        arrays = {n: self._array(n, values[n]) for n in names}
        dtypes = {str(a.dtype) for a in arrays.values()}
        if len(dtypes) > 1:
            desc = ", ".join(f"{n}: {a.dtype}" for n, a in arrays.items())
            raise InputError(f"all values must share one dtype, got {desc}")
        if self.backend == "torch":
            devices = {str(a.device) for a in arrays.values()}
            if len(devices) > 1:
                desc = ", ".join(f"{n}: {a.device}" for n, a in arrays.items())
                raise InputError(f"all values must be on one device, got {desc}")
        batch = {}
        for n, a in arrays.items():
            if n in data:
                if a.ndim == 2:
                    arrays[n] = a[None]
                elif a.ndim == 3:
                    batch[n] = a.shape[0]
                else:
                    raise InputError(f"{n} must have shape {_declared(self._vars[n])} or "
                                     f"(N, …) with a batch axis, got shape {tuple(a.shape)}")
            elif a.ndim != 2:
                raise InputError(f"{n} must be a 2-D array of shape {_declared(self._vars[n])}, "
                                 f"got shape {tuple(a.shape)}")
        if len(set(batch.values())) > 1 or (batch and len(batch) < len(data)):
            desc = ", ".join(f"{n}: {tuple(arrays[n].shape)}" for n in data)
            raise InputError(f"the data values need the same leading batch size, got {desc}")
        order = data + list(self.params) + [n for n in names
                                            if n not in data and n not in self.params]
        key = tuple((n, tuple(arrays[n].shape[-2:])) for n in order)
        if key not in self._dims_seen:   # shapes already checked once need no sympy again
            shapes = {n: _Shape(shape) for n, shape in key}
            # data first: it fixes the sizes
            self._dims_seen[key] = bind_dims([self._vars[n] for n in order], shapes)
        self._dims = self._dims_seen[key]
        self._run_layer_checks(arrays)
        return arrays

    def _run_layer_checks(self, arrays):
        """The layer's own value checks (e.g. zero-variance LayerNorm rows): on the whole
        batch at once by the generated ``check_inputs`` routine where every check allows it
        (on the values' device; one boolean per check comes back to the host), else by
        interpreting the declaration one sequence at a time."""
        checks = self.layer.checks
        if not checks:
            return
        if len(self.layer.batch_checks) == len(checks):
            with np.errstate(all="ignore"):      # a later input may be undefined: reported first
                inputs = self._run(("check_inputs",), **{n: a for n, a in arrays.items() if n != "Y"})
            for check, u in zip(checks, inputs):
                check.check_batch(u if u.ndim == 3 else u[None])
            return
        host = {n: (a.detach().cpu().numpy() if hasattr(a, "detach") else a) for n, a in arrays.items()}
        data = [n for n in self._data if n in host]
        n_seq = max((host[n].shape[0] for n in data), default=1)
        for i in range(n_seq):
            self.layer.validate({n: (a[i] if n in data else a) for n, a in host.items()})

    def _param(self, p):
        if p not in self.params:
            raise KeyError(f"unknown block {p!r} for layer {self.layer.name!r}; "
                           f"valid: {', '.join(self.params)}")
        return p

    def _call(self, key, values, *extra):
        arrays = self._prepare(values)
        return self._run(key, **arrays, **dict(extra)), arrays

    def _run(self, key, **arrays):
        """Call the generated routine ``key``.  Torch routines run under
        ``torch.inference_mode()``: they are plain numeric code that nothing differentiates
        through, and leaving out autograd's dispatch takes ≈ 25 % off their per-statement
        cost (BENCHMARKS.md, seventh session).  Results come back as ordinary tensors: a
        tensor made inside is cloned (the routines whose results are block-sized, dense blocks
        and Jacobians, run outside instead; ``hessian`` is handed an ordinary ``out``).  Inputs
        that require grad, and calls already in inference mode, run as they are."""
        fn = self._fns[key]
        if self.backend != "torch" or self._graphed or key[0] in _DENSE_RESULTS:
            return fn(**arrays)
        import torch
        if torch.is_inference_mode_enabled() or \
                any(getattr(a, "requires_grad", False) for a in arrays.values()):
            return fn(**arrays)      # the caller's own mode, or inputs autograd is tracking
        with torch.inference_mode():
            result = fn(**arrays)
        return _ordinary(result)

    # -- the interface -----------------------------------------------------------------
    def loss(self, values):
        """ℓ (batch mean)."""
        return self._call(("loss",), values)[0]

    def gradient(self, values):
        """{p: ∂ℓ/∂W_p}."""
        return dict(zip(self.params, self._call(("gradient",), values)[0]))

    def hessian_block(self, values, p, q, part="full"):
        """H_part(p, q) as a dense (numel p × numel q) array, vec_r layout."""
        check_part(part)
        return self._call(("block", self._param(p), self._param(q), part), values)[0]

    def hessian(self, values, part="full", out=None):
        """The full Hessian, parameters in declared order.

        ``out``: an array to write it into and return (C-contiguous, the values' dtype and
        device, shape (n, n) for n parameters in all), e.g. one reused across the calls of a
        loop; every entry is overwritten. Without it, a CPU result is written into the memory
        of an earlier result of this kernel that nothing references any more (a loop that
        lets each Hessian go reuses its pages; fresh pages cost ≈ 8 ms of a 63 MB Hessian,
        BENCHMARKS.md), else into a new array: ``symhess.memory.ResultPool``, emptied by
        ``release_memory()``."""
        check_part(part)
        arrays = self._prepare(values)
        if out is not None:
            self._check_out(out, arrays)
        else:                             # made here, outside the routines' inference mode
            n = sum(int(np.prod(arrays[p].shape)) for p in self.params)
            out = self._fresh_result((n, n), arrays[self.params[0]])
        arrays["out"] = out
        return self._run(("hessian", part), **arrays)

    def _fresh_result(self, shape, like):
        """An array for a result: from the pool on the CPU (NumPy's allocator asks for huge
        pages), ``torch.empty`` on other devices (whose caching allocator pools already)."""
        if self.backend == "numpy":
            return self._results.take(shape, like.dtype)
        helpers = _torch_preamble()
        dtypes = helpers["_NUMPY_DTYPES"]       # the dtypes the modules' _empty takes from NumPy
        if like.device.type == "cpu" and like.dtype in dtypes:
            import torch
            return torch.from_numpy(self._results.take(shape, dtypes[like.dtype]))
        return helpers["_empty"](shape, like)

    def release_memory(self):
        """Drop the arrays kept for reuse by ``hessian`` (results still held stay yours)."""
        self._results.clear()

    def _like_values(self, name, a, arrays):
        """An InputError unless ``a`` has the values' dtype (and, for torch, device)."""
        like = arrays[self.params[0]]
        if a.dtype != like.dtype:
            raise InputError(f"{name} has dtype {a.dtype} but the values have dtype {like.dtype}")
        if self.backend == "torch" and a.device != like.device:
            raise InputError(f"{name} is on {a.device} but the values are on {like.device}")

    def _check_out(self, out, arrays):
        """``out`` fits the full Hessian of ``arrays``, or an InputError that says why not."""
        n = sum(int(np.prod(arrays[p].shape)) for p in self.params)
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
        self._like_values("out", out, arrays)
        if not contiguous:
            raise InputError("out must be C-contiguous (row-major, no gaps)")
        if not writeable:
            raise InputError("out must be writeable (a NumPy array with the writeable flag, "
                             "a torch tensor that does not require grad)")

    def hvp(self, values, v, part="full"):
        """H_part v for a flat vector v (parameters in declared order), no block built."""
        check_part(part)
        arrays = self._prepare(values)
        sizes = [int(np.prod(arrays[p].shape)) for p in self.params]
        n = sum(sizes)
        v = self._array("v", v)
        if tuple(v.shape) != (n,):
            raise InputError(f"v must be a flat vector of length {n} (= numel of "
                             f"{' + '.join(self.params)}), got shape {tuple(v.shape)}")
        self._like_values("v", v, arrays)
        dirs, off = {}, 0
        for p, s in zip(self.params, sizes):
            dirs[f"V_{p}"] = v[off:off + s].reshape(arrays[p].shape)
            off += s
        outs = self._run(("hvp", part), **arrays, **dirs)
        flat = [o.reshape(-1) for o in outs]
        if self.backend == "torch":
            import torch
            return torch.cat(flat)
        return np.concatenate(flat)

    def diag(self, values, p, part="full"):
        """diag H_part(p, p), vec_r order."""
        check_part(part)
        return self._call(("diag", self._param(p), part), values)[0]

    def trace(self, values, p, part="full"):
        """tr H_part(p, p)."""
        check_part(part)
        return self._call(("trace", self._param(p), part), values)[0]

    def frobenius_norms(self, values, part="full"):
        """{(p, q): ‖H_part(p, q)‖_F} for every block, sharing the moments between blocks."""
        check_part(part)
        norms = self._call(("frobenius_all", part), values)[0]
        pairs = [(p, q) for p in self.params for q in self.params]
        return dict(zip(pairs, norms))

    def jacobian(self, values, p, compact=False):
        """∂vec_r F/∂vec_r W_p per sequence (not a batch mean); the target Y is not needed.

        Dense (``compact=False``): shape (numel F, numel W_p), or (N, numel F, numel W_p)
        when the data carry a batch axis of N sequences (a Jacobian that does not read the
        data is broadcast, as a read-only view).  ``compact=True``: a ``CompactJacobian``
        whose layout is derived from the index structure (``symhess.jacobians``), e.g. the
        LayerNorm input Jacobian as J[i, a, b] = ∂F[i, a]/∂X[i, b] (L × d × d) and the FFN
        W_1 Jacobian as the factors X[i, b], σ'(H)[i, k], W_2[k, a]; ``.dense()`` expands it.
        """
        p = self._param(p)
        arrays = self._prepare(values, optional=("Y",))
        data = [n for n in self._data if n != "Y"]
        per_seq = any(np.ndim(values[n]) == 3 for n in data)
        n_seq = arrays[data[0]].shape[0] if data else 1
        args = {n: a for n, a in arrays.items() if n != "Y"}
        layout = self._fns[("jacobian_layout", p)]
        dims = {s.name: v for s, v in self._dims.items()}
        if not compact:
            return self._per_seq(self._run(("jacobian", p), **args), 2, per_seq, n_seq)
        factors = self._run(("jacobian_compact", p), **args)
        factors = tuple(self._per_seq(f, len(ax), per_seq, n_seq)
                        for f, ax in zip(factors, layout["factors"]))
        return CompactJacobian(self.backend, layout, factors, dims, per_seq)

    def _per_seq(self, a, ndim, per_seq, n_seq):
        """One array per sequence when the data are batched, none otherwise."""
        if a.ndim == ndim + 1 and not per_seq:
            return a[0]
        if a.ndim == ndim and per_seq:
            shape = (n_seq,) + tuple(a.shape)
            return a.expand(*shape) if self.backend == "torch" else np.broadcast_to(a, shape)
        return a

    def frobenius_split(self, values, p, q):
        """{part: ‖H_part(p, q)‖_F} for outer, functional and full from one routine: the
        full norm costs only the cross term ⟨H_o, H_f⟩ more."""
        out = self._call(("frobenius_split", self._param(p), self._param(q)), values)[0]
        return dict(zip(("outer", "functional", "full"), out))

    def frobenius_norm(self, values, p, q, part="full"):
        """‖H_part(p, q)‖_F, exact, without building the block."""
        check_part(part)
        return self._call(("frobenius", self._param(p), self._param(q), part), values)[0]


# routines run outside inference mode: block-sized results (a clone would copy the block) and
# the Jacobians (a few statements each: entering the mode and cloning would cost more)
_DENSE_RESULTS = ("block", "jacobian", "jacobian_compact")


def _ordinary(result):
    """``result`` with every inference-mode tensor in it cloned into an ordinary one (which
    autograd and in-place updates outside inference mode accept)."""
    if isinstance(result, (tuple, list)):
        return type(result)(_ordinary(r) for r in result)
    if getattr(result, "is_inference", None) is not None and result.is_inference():
        return result.clone()
    return result


@lru_cache(maxsize=None)
def _torch_preamble():
    """The torch modules' own helpers (``_empty(shape, like)``, NumPy-backed on the CPU for
    huge pages, and its ``_NUMPY_DTYPES``), from the one source the modules print them from."""
    import torch
    ns = {"np": np, "torch": torch}
    exec("\n".join(codegen.TARGETS["torch"]["preamble"]), ns)
    return ns


@lru_cache(maxsize=None)
def _size(text, env):
    """A dimension expression (as text) at the bound sizes; parsed once."""
    return int(sp.sympify(text).subs(dict(env)))


class CompactJacobian:
    """A Jacobian in its compact layout: J[rows, cols] = Π_f factors[f][axes_f] where the
    positions that share a compact axis agree, and 0 elsewhere (``symhess.jacobians.Layout``).

    ``row_axes[k]``: the compact axis of F's k-th index atom; ``col_axes[k]``: that of
    W_p's; ``shape``: the compact shape; ``axes[f]``: the compact axes of ``factors[f]``
    (after a leading batch axis when ``batched``).  Axes on no factor carry the value 1.
    """

    def __init__(self, backend, layout, factors, dims, batched):
        env = tuple(sorted(dims.items()))
        ev = lambda s: _size(s, env)
        self.backend, self.factors, self.batched = backend, factors, batched
        self.axes = tuple(tuple(ax) for ax in layout["factors"])
        self.row_axes, self.col_axes = tuple(layout["row_axes"]), tuple(layout["col_axes"])
        self.row_sizes = tuple(ev(s) for s in layout["row_sizes"])
        self.col_sizes = tuple(ev(s) for s in layout["col_sizes"])
        self.shape = tuple(ev(s) for s in layout["axis_sizes"])

    def __repr__(self):
        return (f"<CompactJacobian shape {self.shape}, rows → axes {self.row_axes}, "
                f"columns → axes {self.col_axes}, factors over {self.axes}>")

    def _lib(self):
        if self.backend == "torch":
            import torch
            return torch
        return np

    def tensor(self):
        """The compact tensor Π_f factors[f] broadcast over all compact axes."""
        lib = self._lib()
        letters = "abcdefghijklmnopqrstuvwxyz"
        b = "Z" if self.batched else ""
        ops, specs = list(self.factors), [b + "".join(letters[a] for a in ax) for ax in self.axes]
        like = self.factors[0]
        ones = lib.ones(self.shape, dtype=like.dtype, **({"device": like.device} if lib is not np else {}))
        ops.append(ones)
        specs.append(letters[:len(self.shape)])
        out = (b if self.batched else "") + letters[:len(self.shape)]
        return lib.einsum(",".join(specs) + "->" + out, *ops)

    def dense(self):
        """The dense (numel F × numel W_p) Jacobian (per sequence when batched)."""
        lib = self._lib()
        c = self.tensor()
        lead = tuple(c.shape[:1]) if self.batched else ()
        sizes = self.row_sizes + self.col_sizes
        if lib is np:
            out = np.zeros(lead + sizes, dtype=c.dtype)
        else:
            out = lib.zeros(lead + sizes, dtype=c.dtype, device=c.device)
        positions = self.row_axes + self.col_axes
        strides = [0] * len(self.shape)
        step = 1
        for k in reversed(range(len(sizes))):      # element strides of the C-ordered dense
            strides[positions[k]] += step
            step *= sizes[k]
        lead_s = (step,) if self.batched else ()
        if lib is np:
            view = np.lib.stride_tricks.as_strided(
                out, lead + self.shape, tuple(s * out.itemsize for s in lead_s + tuple(strides)))
        else:
            view = out.as_strided(lead + self.shape, lead_s + tuple(strides))
        view[...] = c
        r = int(np.prod(self.row_sizes))
        return out.reshape(lead + (r, -1))


def _declared(var):
    return f"({var.rows} × {var.cols})"


__all__ = ["kernel", "Kernel", "PARTS"]

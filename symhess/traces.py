"""Replay of generated torch routines from traced graphs: ``kernel(...).traced()``.

A generated routine is a long run of small tensor statements (626 for the post-LN block's
full Hessian). On the CPU each statement costs a few microseconds of Python (argument
parsing, view objects, temporaries' wrappers) on top of its arithmetic; for the post-LN
Hessian that is ≈ 3 ms of ≈ 18 (BENCHMARKS.md, eighth session). ``torch.jit.trace`` records
the aten operations one call performs into a graph that the TorchScript executor then
replays without the Python layer, operation for operation, so the numbers are the eager
routine's.

Each routine is traced on its first call with a new signature (argument names, shapes,
dtypes, devices, which ones require grad, and whether inference mode is on): sizes enter a
generated routine only through its arguments' shapes, and its control flow depends on
nothing else (the ``n_batch`` branch of the full Hessian), so one trace serves every call
with that signature. While tracing, the routine allocates with ``torch.empty`` (the
NumPy-backed ``_empty`` of the CPU modules would be recorded as a constant array).
The first two replays (the executor's profiling run and its optimised graph) are compared
with the eager result; a routine that cannot be traced, or whose replay differs, runs
eagerly from then on, after one warning that names it.

``torch.jit.trace`` is deprecated (TorchScript is in maintenance; torch 2.13 warns on every
call, which this module silences for its own calls). Where it is missing or fails, routines
run eagerly and give the same numbers: the traced mode is an accelerator, never a
requirement.
"""
from __future__ import annotations

import types
import warnings

import torch

from .replay import Replayed

# relative difference allowed between the eager routine and a replay on the same values
# (each operation computes as in eager mode; the executor may reorder independent ones)
REPLAY_RTOL = 1e-12
# the executor profiles the first replay (torch._C._jit_get_num_profiled_runs() is 1) and
# runs an optimised graph from the next; both are checked against the eager result
REPLAYS_CHECKED = 2


def _no_stored_inputs():
    """``torch.jit.trace`` keeps its example inputs (a 63 MB ``out`` array, say) unless told
    not to, where it takes the private ``_store_inputs`` flag."""
    import inspect
    try:
        return {"_store_inputs": False} if "_store_inputs" in \
            inspect.signature(torch.jit.trace).parameters else {}
    except (AttributeError, TypeError, ValueError):
        return {}


_NO_STORED_INPUTS = _no_stored_inputs()


def _torch_empty(shape, like):
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _plain(fn):
    """The Python function behind ``fn`` (a generated module's lazy stand-in compiles it),
    with ``_empty`` rebound to ``torch.empty`` so that allocations are traced as operations."""
    compile_ = getattr(fn, "_compile", None)
    f = compile_() if compile_ is not None else fn
    if not isinstance(f, types.FunctionType):
        return None
    g = dict(f.__globals__)
    if "_empty" in g:
        g["_empty"] = _torch_empty
    return types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _agree(a, b) -> bool:
    """The same structure and values, to REPLAY_RTOL of each tensor's largest entry
    (non-finite entries where the other has the same)."""
    ta, tb = [t.detach() for t in _tensors(a)], [t.detach() for t in _tensors(b)]
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return False
            continue
        finite = torch.isfinite(x)
        if not torch.equal(finite, torch.isfinite(y)) or \
                not torch.equal(x[~finite].nan_to_num(), y[~finite].nan_to_num()):
            return False
        if finite.any():
            xf, yf = x[finite], y[finite]
            if float((xf - yf).abs().max()) > REPLAY_RTOL * float(xf.abs().max()):
                return False
    return True


def _perturbed(a, i):
    """``a`` with every floating entry scaled by 1.03–1.07 and shifted by at most 0.01
    (seeded, deterministic): other values of the same kind, still valid inputs."""
    if not a.is_floating_point():
        return a.clone()
    g = torch.Generator(device=a.device).manual_seed(1000 + i)
    noise = torch.rand(a.shape, generator=g, dtype=a.dtype, device=a.device)
    return a * (1.03 + 0.04 * noise) + 0.01 * noise


class TracedFunction(Replayed):
    """A generated routine replayed from traced graphs, one per call signature."""

    mode = "traced graphs"
    cannot = "cannot be replayed from a trace"

    @property
    def traced(self) -> int:
        """How many graphs (call signatures) this routine holds."""
        return len(self._recorded)

    def __call__(self, out=None, **kwargs):
        if self._eager or not all(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return self._eager_call(out, kwargs)
        names = tuple(sorted(kwargs))
        args = [kwargs[n] for n in names] + ([out] if out is not None else [])
        sig = (names, out is not None, torch.is_inference_mode_enabled(),
               tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
                     for a in args))
        graph = self._recorded.get(sig)
        if graph is None:
            with self._lock:
                graph = self._recorded.get(sig)
                if graph is None:
                    graph, result = self._trace(names, args, out is not None)
                    if graph is None:
                        return result
                    self._recorded[sig] = graph
                    return out if out is not None else result
        result = graph(*args)
        return out if out is not None else result

    def _fallback(self, why, out, kwargs):
        """(None, the eager result) after ``Replayed._give_up``."""
        self._give_up(why, 5)                    # _fallback, _trace, __call__, caller
        return None, self._eager_call(out, kwargs)

    def _trace(self, names, args, has_out):
        """(graph, result of the call), or (None, eager result) after a warning."""
        n = len(names)
        out = args[n] if has_out else None
        kwargs = dict(zip(names, args[:n]))
        plain = _plain(self.fn)
        jit = getattr(torch, "jit", None)
        if plain is None or jit is None or not hasattr(jit, "trace"):
            return self._fallback("torch.jit.trace is not available", out, kwargs)

        def run(*a):
            kw = dict(zip(names, a[:n]))
            return plain(**kw, out=a[n]) if has_out else plain(**kw)

        try:
            with warnings.catch_warnings():
                # the deprecation notice, and the tracer's notes on sizes turned into Python
                # numbers (the signature fixes the sizes; other values are checked below)
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", jit.TracerWarning)
                graph = jit.trace(run, tuple(args), check_trace=False,
                                  **_NO_STORED_INPUTS)
        except Exception as e:            # an operation the tracer cannot record
            return self._fallback(f"{type(e).__name__}: {e}", out, kwargs)
        # other values than the traced ones: a value that entered the trace as a constant
        # (data-dependent control flow, a tensor read into Python) shows up here
        other = [_perturbed(a, i) for i, a in enumerate(args[:n])]
        if has_out:
            other.append(torch.empty_like(out))
        expected = self._eager_call(torch.empty_like(out) if has_out else None,
                                    dict(zip(names, other[:n])))
        for _ in range(REPLAYS_CHECKED):     # the profiling run, then the optimised graph
            got = graph(*other)
        if not _agree(expected, other[n] if has_out else got):
            return self._fallback("its replay differs from the eager routine", out, kwargs)
        del other, expected, got
        result = graph(*args)
        return graph, (out if has_out else result)

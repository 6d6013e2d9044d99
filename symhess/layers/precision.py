"""Comparing a declaration with its module: tolerances, the module's output tensor, the
relative error, and ``no_downcasts`` — the module's own forward in the caller's dtype.

``CHECK_TOLERANCE``: the relative error a declaration's forward may have against its module
run under ``no_downcasts`` (float64); ``CAST_TOLERANCE``: against the module as it is, in
units of ε of the lowest dtype it casts to.  ``rel(got, want) = ‖got − want‖ / ‖want‖``.
"""
from __future__ import annotations

CHECK_TOLERANCE = 1e-10
CAST_TOLERANCE = 1e3          # × ε of the lowest dtype a module casts to


def no_downcasts():
    """A context in which a module's casts to a lower floating precision than the tensor's
    are no-ops (``x.to(torch.float32)`` of a float64 x returns x; ``softmax(…, dtype=float32)``
    keeps float64): the module's own forward, computing in the caller's dtype."""
    import torch
    from torch.overrides import TorchFunctionMode

    lower = lambda src, dt: (isinstance(dt, torch.dtype) and dt.is_floating_point and  # noqa: E731
                             src.is_floating_point() and
                             torch.finfo(dt).eps > torch.finfo(src.dtype).eps)
    softmaxes = {torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
                 torch.nn.functional.softmax, torch.nn.functional.log_softmax}

    class _NoDowncasts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.Tensor.to, torch.Tensor.type) and args and isinstance(args[0], torch.Tensor):
                src = args[0]
                dt = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
                if lower(src, dt):
                    args = tuple(src.dtype if a is dt else a for a in args)
                    if "dtype" in kwargs:
                        kwargs["dtype"] = src.dtype
            elif func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16) and args:
                if args[0].dtype == torch.float64:
                    return args[0]
            elif func in softmaxes and args and isinstance(args[0], torch.Tensor):
                if lower(args[0], kwargs.get("dtype")):
                    kwargs["dtype"] = None
                elif len(args) > 2 and lower(args[0], args[2]):
                    args = args[:2] + (None,) + tuple(args[3:])
            return func(*args, **kwargs)

    return _NoDowncasts()


def first_tensor(out):
    """The first tensor of a module's output (a tensor, tuple, list, dict or ModelOutput)."""
    import torch
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = first_tensor(o)
            if t is not None:
                return t
    if hasattr(out, "values") and callable(out.values):       # a ModelOutput / dict
        return first_tensor(list(out.values()))
    return None


def rel(got, want):
    return float((got - want).norm() / max(float(want.norm()), 1e-300))


__all__ = ["CHECK_TOLERANCE", "CAST_TOLERANCE", "no_downcasts", "first_tensor", "rel"]

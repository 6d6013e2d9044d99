"""What the kernels accept as vectors and what they return: nothing silently wrong.

* ``vector(v, like, shapes)`` — a vector (or matrix of vectors) given to a product: the
  backend's array type (NumPy for NumPy kernels, a tensor on the values' device for torch
  ones; a NumPy array or list is converted, a tensor for a NumPy kernel is refused), real
  (a complex vector would lose its imaginary part), one of the allowed ``shapes``, cast to
  the values' dtype, and finite (after the cast: 1e300 is inf in float32).  Cost: one pass
  over v.
* ``finite(x, what, values)`` — a result checked once for NaN/inf (one reduction over the
  result, nothing per operation).  From finite values a non-finite result means the
  computation overflowed the dtype; the ``InputError`` names the quantity, the dtype, the
  largest entries of the values (and of the vector) as the likely cause and what to do.
* ``all_finite(xs)`` — whether results and vectors are all finite: one read-only reduction
  each (a sum: finite only if every entry is) and, for torch tensors, one host read of their
  combined flag.  A prepared state's call reads
  that one flag (``vector(..., deferred=[])`` leaves a vector's flag to it): on an
  accelerator it is the one synchronisation of the call; the results stay on the device.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InputError

FLOAT_MAX = {"float32": float(np.finfo(np.float32).max), "float64": float(np.finfo(np.float64).max)}


def _is_tensor(x):
    return type(x).__module__.startswith("torch")


def _dtype(a):
    return str(a.dtype).removeprefix("torch.")


def vector(v, like, shapes, name="v", convert=False, over="", deferred=None):
    """``v`` checked for a product with values like ``like`` (module docstring); ``shapes``:
    the allowed shapes (tuples).  ``convert``: cast to the values' dtype and move to their
    device (operators); otherwise a different dtype or device is an InputError.  ``over``:
    what the entries are (for the message, e.g. "W_Q, W_K, W_V in declared order").
    ``deferred``: a list that receives (name, vector) for the result's message; a torch
    vector's finiteness is then read later with the result's (``vector_finite`` raising)."""
    from ..expr.evaluate import real_array
    torch_kernel = _is_tensor(like)
    if not torch_kernel and _is_tensor(v):
        raise InputError(f"{name} is a torch tensor but the kernel is NumPy's; pass a NumPy "
                         f"array (or use backend='torch')")
    a = real_array(v, name)          # complex and non-numeric input are InputErrors
    if tuple(a.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        if len(shapes) == 1 and len(shapes[0]) == 1:
            want = f"a flat vector of length {shapes[0][0]}{f' ({over})' if over else ''}, shape {want}"
        else:
            want = f"shape {want}{f' ({over})' if over else ''}"
        raise InputError(f"{name} must be {want}, got shape {tuple(a.shape)}")
    if a.ndim == 2 and a.shape[1] == 0:
        raise InputError(f"{name} is a matrix of no columns (shape {tuple(a.shape)}); give at "
                         f"least one")
    if torch_kernel:
        import torch
        if not _is_tensor(a):
            a = torch.as_tensor(np.ascontiguousarray(a), device=like.device)
        a = a.detach()
        if a.device != like.device and not convert:
            raise InputError(f"{name} is on {a.device} but the values are on {like.device}")
    if _dtype(a) != _dtype(like):
        if not convert:
            raise InputError(f"{name} has dtype {_dtype(a)} but the values have dtype {_dtype(like)}")
    if torch_kernel:
        a = a.to(device=like.device, dtype=like.dtype)
    else:
        with np.errstate(over="ignore"):        # beyond the dtype's range: inf, named below
            a = np.asarray(a, dtype=like.dtype)
    if deferred is not None:                 # named with the result; a tensor read with it
        deferred.append((name, a))
        if torch_kernel:
            return a
    return vector_finite(name, a, like)


def vector_or_columns(n, v):
    """The shapes a product takes for ``v``: a flat vector (n,) and, when v is a matrix,
    its columns (n, k)."""
    k = tuple(getattr(v, "shape", ()))[1:2]
    return [(n,)] + ([(n,) + k] if k else [])


def vector_finite(name, a, like):
    """``a``, or the InputError of a vector with NaN/inf entries (after the cast to the
    values' dtype: 1e300 is inf in float32)."""
    if not _all_finite(a):
        raise InputError(f"{name} contains non-finite entries (NaN or inf) in {_dtype(like)}"
                         f"{'' if _dtype(like) == 'float64' else ' (or entries beyond its range)'}; "
                         f"products need a finite vector")
    return a


def _all_finite(x):
    if isinstance(x, (float, int)):
        return math.isfinite(x)
    if _is_tensor(x):
        return all_finite([x])
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(x))) or bool(np.isfinite(x).all())


def all_finite(xs):
    """Whether every array, tensor or number in ``xs`` is finite; torch tensors are reduced
    on their device and read once, together (module docstring).

    A sum is finite only if every entry is (a NaN or inf entry makes it NaN or inf), so the
    check is one read-only pass (a sum) per array; only when a sum is not finite (a NaN or
    inf entry, or finite entries whose sum overflowed) are the entries tested one by one."""
    flags, tensors = [], []
    for x in xs:
        if _is_tensor(x):
            tensors.append(x.detach())
            flags.append(tensors[-1].sum().isfinite())
        elif not _all_finite(x):
            return False
    if not flags:
        return True
    import torch
    if bool(torch.stack(flags).all()) if len(flags) > 1 else bool(flags[0]):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _max_abs(a):
    if _is_tensor(a):
        a = a.detach()
        return float(a.abs().max()) if a.numel() else 0.0
    a = np.asarray(a)
    return float(np.abs(a).max()) if a.size else 0.0


def finite(x, what, values, like):
    """``x``, or an InputError naming ``what`` and the likely cause (module docstring).
    ``values``: {name: array} the result was computed from (the vector included)."""
    if _all_finite(x):
        return x
    dt = _dtype(like)
    bad = [n for n, a in values.items() if not _all_finite(a)]
    if bad:
        raise InputError(f"{what} is not finite: {', '.join(bad)} contain(s) NaN or inf "
                         f"(check_finite=False skipped the check of the values)")
    big = sorted(((_max_abs(a), n) for n, a in values.items()), reverse=True)[:3]
    largest = ", ".join(f"|{n}| ≤ {m:.3g}" for m, n in big)
    raise InputError(f"{what} is not finite (NaN or inf) although every value is: the "
                     f"computation overflowed {dt} (largest {FLOAT_MAX[dt]:.3g}); the largest "
                     f"entries are {largest}; scale the data, parameters or vector down"
                     f"{' or compute in float64' if dt == 'float32' else ''}")


__all__ = ["vector", "vector_finite", "finite", "all_finite"]

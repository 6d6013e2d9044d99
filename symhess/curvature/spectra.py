"""Spectra of Hessian operators: extreme eigenvalues and spectral densities.

* ``spectrum(op, k=5, which="LA")`` — the k largest ("LA"), smallest ("SA"), largest in
  magnitude ("LM") or both ends ("BE") eigenvalues of a symmetric operator by ARPACK's
  implicitly restarted Lanczos (``scipy.sparse.linalg.eigsh``), or, with ``method="eigh"``,
  from the dense matrix by LAPACK (exact to rounding: the check for small blocks).  An
  off-diagonal block H(p, q) is not symmetric: its k largest *singular values* are returned
  (``svds`` / ``svd``), ``kind`` says which.  ``method="auto"`` takes eigh when the operator
  has at most ``DENSE_MAX`` columns or k is too close to the size for ARPACK.
* ``density(op)`` — the spectral density p(λ) = (1/n) Σ_i δ(λ − λ_i), smoothed by Gaussians,
  by stochastic Lanczos quadrature.  The quadrature is curvlinops' implementation of
  Papyan (2020)'s algorithm (``curvlinops.lanczos_approximate_spectrum``, Lanczos without
  reorthogonalisation, Gaussian kernels of width set by ``kappa``), called through a small
  torch view of the operator; the spectrum's ends come from ``spectrum`` (so every process
  of a distributed run uses the same numbers).

Every random start vector is drawn from ``seed``: runs are reproducible, and processes that
share a distributed operator iterate identically.  An operator that does not say whether it
is symmetric (``op.symmetric``: a NumPy matrix, a SciPy operator) is checked before Lanczos
trusts it: a matrix against its transpose, an operator by one pair of products
|uᵀAv − vᵀAu| ≤ √ε (‖u‖‖Av‖ + ‖v‖‖Au‖) for random u, v; a square one that is not symmetric
is an ``InputError`` (Lanczos would return numbers that are no eigenvalues).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import DeclarationError, InputError, SymhessError


class ConvergenceError(SymhessError, RuntimeError):
    """ARPACK did not converge within ``maxiter`` (raise it, or the tolerance)."""

DENSE_MAX = 64
WHICH = ("LA", "SA", "LM", "BE")
METHODS = ("auto", "eigsh", "eigh")


@dataclass
class Spectrum:
    """Extreme eigenvalues (or singular values) of an operator, in decreasing order."""

    values: np.ndarray
    kind: str                      # "eigenvalues" or "singular values"
    which: str
    method: str
    n: int
    vectors: np.ndarray | None = field(default=None, repr=False)

    @property
    def top(self) -> float:
        return float(self.values[0])

    @property
    def spectral_norm(self) -> float:
        """max |λ| among the values found (the spectral norm when they include both ends
        or the block is positive semi-definite, or for singular values)."""
        return float(np.max(np.abs(self.values)))


def spectrum(op, k=5, which="LA", tol=0.0, method="auto", seed=0, ncv=None, maxiter=None,
             return_eigenvectors=False) -> Spectrum:
    """Extreme eigenvalues of a symmetric operator (singular values of a non-symmetric one)."""
    n = _check_square_or_block(op)
    if which not in WHICH:
        raise InputError(f"unknown which {which!r}; valid: {', '.join(WHICH)}")
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    symmetric = _symmetric(op)
    small = min(op.shape)
    if k > small:
        raise InputError(f"k = {k} exceeds the operator's size {small}")
    if method == "auto":
        method = "eigh" if (max(op.shape) <= DENSE_MAX or k >= small - 1) else "eigsh"
    if method == "eigsh" and k >= small:
        raise InputError(f"eigsh needs k < {small} (the operator's size); use method='eigh'")
    _check_iteration(k, small, tol, ncv, maxiter, seed)
    if getattr(op, "is_zero", False):        # a structural zero: nothing to iterate on
        kind = "eigenvalues" if symmetric else "singular values"
        return Spectrum(np.zeros(k), kind, which, "structural zero", n)
    from scipy.sparse.linalg import ArpackError, ArpackNoConvergence
    try:
        if symmetric:
            return _eigen(op, n, k, which, tol, method, seed, ncv, maxiter, return_eigenvectors)
        return _singular(op, k, tol, method, seed, ncv, maxiter, return_eigenvectors)
    except ArpackNoConvergence as exc:
        raise ConvergenceError(f"eigsh did not converge ({len(exc.eigenvalues)} of {k} "
                               f"eigenvalues within maxiter = {maxiter or 'the default'}); "
                               f"raise maxiter or tol") from None
    except ArpackError as exc:
        raise ConvergenceError(f"ARPACK stopped: {' '.join(str(exc).split())} (k = {k}, "
                               f"ncv = {ncv or 'the default'}, size {small}); try another k, "
                               f"ncv or method='eigh' for a small operator") from None


def _check_iteration(k, n, tol, ncv, maxiter, seed):
    """One-line errors for the iteration's settings (before ARPACK sees them)."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float, np.floating)) \
            or not np.isfinite(tol) or tol < 0:
        raise InputError(f"tol must be a finite number >= 0 (0: machine precision), got {tol!r}")
    if maxiter is not None and (isinstance(maxiter, bool) or not isinstance(maxiter, (int, np.integer))
                                or maxiter < 1):
        raise InputError(f"maxiter must be a positive integer or None (ARPACK's default), "
                         f"got {maxiter!r}")
    if ncv is not None and (isinstance(ncv, bool) or not isinstance(ncv, (int, np.integer))
                            or not k < ncv <= n):
        raise InputError(f"ncv (Lanczos vectors) must be an integer with k < ncv <= {n} "
                         f"(k = {k}, the operator's size {n}) or None, got {ncv!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")


def _check_square_or_block(op):
    if not hasattr(op, "shape") or len(op.shape) != 2:
        raise InputError(f"expected a linear operator, got {type(op).__name__}")
    return op.shape[1]


def _symmetric(op):
    """``op.symmetric`` where the operator says; otherwise a square operator is checked (module
    docstring: two products for an operator, a comparison for a matrix) and a non-square one
    is not symmetric."""
    known = getattr(op, "symmetric", None)
    if known is not None:
        return bool(known)
    n = op.shape[0]
    if n != op.shape[1]:
        return False
    dtype = np.dtype(getattr(op, "dtype", np.float64))
    eps = np.finfo(dtype if dtype.kind == "f" else np.float64).eps
    if isinstance(op, np.ndarray):
        gap = float(np.abs(op - op.T).max()) if op.size else 0.0
        size = float(np.abs(op).max()) if op.size else 0.0
        if gap <= np.sqrt(eps) * size:
            return True
        how = f"max |A − Aᵀ| = {gap:.3g}, max |A| = {size:.3g}"
    else:
        u, v = np.random.default_rng(0).standard_normal((2, n)).astype(dtype)
        au, av = (np.asarray(op @ x, dtype=np.float64).reshape(-1) for x in (u, v))
        gap = abs(float(u @ av) - float(v @ au))
        size = np.linalg.norm(u) * np.linalg.norm(av) + np.linalg.norm(v) * np.linalg.norm(au)
        if gap <= np.sqrt(eps) * size:
            return True
        how = f"uᵀAv − vᵀAu = {gap:.3g} for random u, v, against {size:.3g}"
    raise InputError(f"the {n} × {n} operator is not symmetric ({how}); its eigenvalues are "
                     f"not what Lanczos computes: pass a symmetric one, e.g. (A + Aᵀ)/2")


def start_vector(n, dtype, seed):
    """The deterministic Lanczos start vector (the same in every process)."""
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def _dense(op):
    if hasattr(op, "to_dense"):
        return np.asarray(op.to_dense(), dtype=np.float64)
    from ..expr.budget import check_budget
    check_budget(8 * op.shape[0] * op.shape[1], "the dense operator")
    return np.asarray(op @ np.eye(op.shape[1], dtype=op.dtype), dtype=np.float64)


def _select(vals, k, which):
    """Indices of the k values ``which`` asks for (vals ascending), returned in decreasing order."""
    m = len(vals)
    if which == "LA":
        idx = np.arange(m - k, m)
    elif which == "SA":
        idx = np.arange(0, k)
    elif which == "LM":
        idx = np.argsort(np.abs(vals))[m - k:]
    else:                     # BE: alternately from the high and the low end
        hi, lo = k - k // 2, k // 2
        idx = np.concatenate([np.arange(0, lo), np.arange(m - hi, m)])
    return idx[np.argsort(vals[idx])[::-1]]


def _eigen(op, n, k, which, tol, method, seed, ncv, maxiter, vectors):
    if method == "eigh":
        vals, vecs = np.linalg.eigh(_dense(op))
        idx = _select(vals, k, which)
        return Spectrum(vals[idx], "eigenvalues", which, "eigh", n, vecs[:, idx] if vectors else None)
    from scipy.sparse.linalg import eigsh
    v0 = start_vector(n, op.dtype, seed)
    kw = dict(tol=tol, v0=v0, ncv=ncv, maxiter=maxiter, return_eigenvectors=vectors)
    if which in ("SA", "BE"):
        vals, vecs = _bottom(op, n, k if which == "SA" else k // 2, kw)
        if which == "BE":
            hi = eigsh(op, k=k - k // 2, which="LA", **kw)
            hv, hvec = (hi if vectors else (hi, None))
            vals = np.concatenate([vals, hv])
            vecs = None if not vectors else np.concatenate([vecs, hvec], 1)
    else:
        out = eigsh(op, k=k, which=which, **kw)
        vals, vecs = (out if vectors else (out, None))
    order = np.argsort(vals)[::-1]
    return Spectrum(np.asarray(vals)[order], "eigenvalues", which, "eigsh", n,
                    None if vecs is None else vecs[:, order])


def _bottom(op, n, k, kw):
    """The k smallest eigenvalues as the largest of s I − H, s ≥ ‖H‖₂ (from one "LM" run):
    the tolerance then holds relative to the spectrum's scale, and a cluster of eigenvalues
    near 0 (rank-deficient Gauss–Newton blocks) does not stall ARPACK as "SA" does."""
    from scipy.sparse.linalg import LinearOperator, eigsh
    if k == 0:
        return np.zeros(0), np.zeros((n, 0))
    lm = eigsh(op, k=1, which="LM", **{**kw, "return_eigenvectors": False})
    s = float(abs(lm[0])) * (1 + 1e-3) or 1.0
    shifted = LinearOperator(op.shape, dtype=op.dtype, matvec=lambda x: s * x - op @ x,
                             matmat=lambda X: s * X - op @ X)
    out = eigsh(shifted, k=k, which="LA", **kw)
    vals, vecs = (out if kw["return_eigenvectors"] else (out, None))
    return s - np.asarray(vals), vecs


def _singular(op, k, tol, method, seed, ncv, maxiter, vectors):
    if method == "eigh":
        u, s, vt = np.linalg.svd(_dense(op))
        return Spectrum(s[:k], "singular values", "LM", "svd", min(op.shape),
                        u[:, :k] if vectors else None)
    from scipy.sparse.linalg import svds
    v0 = start_vector(min(op.shape), op.dtype, seed)
    out = svds(op, k=k, which="LM", tol=tol, v0=v0, ncv=ncv, maxiter=maxiter,
               return_singular_vectors="u" if vectors else False, solver="arpack")
    s = out[1] if vectors else out
    order = np.argsort(s)[::-1]
    return Spectrum(np.asarray(s)[order], "singular values", "LM", "svds", min(op.shape),
                    out[0][:, order] if vectors else None)


# ----------------------------------------------------------------------------- density
class _TorchView:
    """The operator as curvlinops' spectral routines use one: ``shape``, ``device``,
    ``dtype`` (torch), ``A @ v`` on tensors."""

    def __init__(self, op):
        import torch
        self.op, self.shape = op, op.shape
        dev = getattr(op, "device", "cpu")
        self.device = torch.device(str(dev))
        self.dtype = getattr(torch, str(np.dtype(op.dtype)))

    def __matmul__(self, v):
        import torch
        native = hasattr(self.op, "device") and not isinstance(self.op, np.ndarray)  # symhess's
        out = self.op @ (v if native else v.detach().cpu().numpy())
        return out if isinstance(out, torch.Tensor) else torch.as_tensor(out, device=self.device)

    def to_scipy(self):
        return self.op


def require_curvlinops():
    """curvlinops' ``lanczos_approximate_spectrum``, or a one-line error saying how to install it
    (callers check this before any work that only the density would use)."""
    import warnings
    with warnings.catch_warnings():     # its dependencies import torch.jit.script, deprecated
        warnings.simplefilter("ignore", FutureWarning)
        try:
            from curvlinops import lanczos_approximate_spectrum
        except ImportError:
            raise DeclarationError("the spectral density needs curvlinops: pip install "
                                   "'symhess[spectra]' (or curvlinops-for-pytorch)") from None
    return lanczos_approximate_spectrum


def density(op, num_points=1024, ncv=128, num_repeats=1, kappa=3.0, margin=0.05,
            boundaries=None, seed=0, tol=1e-2):
    """(grid λ, density p(λ)) by stochastic Lanczos quadrature (module docstring) as NumPy
    arrays; ``boundaries``: (λ_min, λ_max) if known (else estimated to relative ``tol``)."""
    import torch
    lanczos_approximate_spectrum = require_curvlinops()
    _check_square_or_block(op)
    if not _symmetric(op):
        raise InputError("the spectral density needs a symmetric operator (a diagonal block, "
                         "a whole Hessian or one of its parts)")
    n = op.shape[0]
    if isinstance(ncv, bool) or not isinstance(ncv, int) or ncv < 2:
        raise InputError(f"ncv must be an integer >= 2, got {ncv!r}")
    for name, x, low in (("num_points", num_points, 2), ("num_repeats", num_repeats, 1)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low:
            raise InputError(f"{name} must be an integer >= {low}, got {x!r}")
    if n < 2:
        raise InputError(f"the spectral density needs an operator of size >= 2, got {n} × {n}")
    for name, x, low, strict in (("kappa", kappa, 1, True), ("margin", margin, 0, False),
                                 ("tol", tol, 0, True)):     # bumps of width ∝ 1/√(8 log κ)
        if isinstance(x, bool) or not isinstance(x, (int, float, np.floating)) or not np.isfinite(x) \
                or x < low or (strict and x == low):
            raise InputError(f"{name} must be a finite number {'>' if strict else '>='} {low}, "
                             f"got {x!r}")
    if boundaries is not None:
        try:
            lo, hi = (float(b) for b in boundaries)
        except (TypeError, ValueError):
            raise InputError(f"boundaries must be two numbers (λ_min, λ_max), got {boundaries!r}") from None
        if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi):
            raise InputError(f"boundaries must be finite with λ_min <= λ_max, got {boundaries!r}")
    ncv = min(ncv, n)
    if boundaries is None:
        s = spectrum(op, k=2, which="BE", tol=tol, seed=seed) if n > 2 else \
            spectrum(op, k=n, which="LA", method="eigh")
        boundaries = (float(s.values.min()), float(s.values.max()))
    lo, hi = boundaries
    if hi - lo <= 1e-300:
        hi, lo = hi + max(abs(hi), 1.0) * 1e-3, lo - max(abs(lo), 1.0) * 1e-3
    view = _TorchView(op)
    devices = [view.device.index or 0] if view.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            grid, dens = lanczos_approximate_spectrum(view, ncv, num_points=num_points,
                                                      num_repeats=num_repeats, kappa=kappa,
                                                      boundaries=(lo, hi), margin=margin)
        except SymhessError:
            raise
        except ValueError:           # NaN Lanczos nodes, refused by torch's Normal
            dens = None
    if dens is None or not bool(torch.isfinite(dens).all()):
        raise ConvergenceError(f"the Lanczos iteration of the density broke down (NaN nodes): "
                               f"the operator has fewer than ncv = {ncv} distinct eigenvalues "
                               f"reachable from the start vector; lower ncv, or use "
                               f"spectrum() for so few eigenvalues")
    return grid.detach().cpu().numpy(), dens.detach().cpu().numpy()


__all__ = ["spectrum", "Spectrum", "density", "start_vector", "require_curvlinops"]

"""Products with a short inner dimension written into rows of a larger array: the slab
GEMMs of the full Hessians, ``out = a @ b`` with ``a`` (M, K), ``b`` (K, N), K ≤ 16 and
M·N in the millions (K is the sequence length L for the post-LN block's Hessian).

BLAS libraries are tuned for long inner dimensions; with K = 8 the arithmetic of MKL's
dgemm is not hidden behind the writes on every machine (on an AMD EPYC it costs more than
writing the output, BENCHMARKS.md, tenth session). Here a loop nest is generated for each K
(unrolled over K and over four rows of ``out``, vectorised over N by LLVM) and compiled with
numba: every entry of ``out`` is computed in registers and written once.

``matmul_into(a, b, out)`` takes that path for CPU tensors or NumPy arrays of float64 or
float32 whose last axis has unit stride; everything else (CUDA, other dtypes, K > 16,
batched operands, a missing numba) goes to ``torch.matmul`` / ``np.matmul`` with ``out=``,
the same numbers up to rounding. For torch it is the operator ``symhess::matmul_into``, so
``torch.jit.trace`` records it (``symhess.traces``) and CUDA graphs capture its CUDA branch.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

try:        # an accelerator, never a requirement: without numba every call uses BLAS
    import numba
except ImportError:     # pragma: no cover - exercised where numba is missing
    numba = None

MAX_K = 16          # inner dimensions up to this use the generated loop nest
ROWS = 4            # rows of ``out`` computed together (each value of ``b`` read once for them)
MIN_ENTRIES = 4096  # smaller outputs: BLAS (the loop nest's call overhead is a few µs)
_DTYPES = (np.float64, np.float32)

_kernels: dict[int, object] = {}
_lock = threading.Lock()


def _source(k: int, rows: int = ROWS) -> str:
    """The loop nest for inner dimension ``k``. ``B`` and ``C`` are flat 1-D arrays: row
    ``r`` of b starts at ``bo + r*bs``, row ``i`` of out at ``co + i*cs`` (a row of a flat
    contiguous array is contiguous to numba, so the loop over N vectorises)."""
    ks, rs = range(k), range(rows)
    lines = ["def kernel(A, B, bo, bs, C, co, cs, N):",
             "    M = A.shape[0]"]
    lines += [f"    b{q} = B[bo + {q}*bs:bo + {q}*bs + N]" for q in ks]
    lines += [f"    for i in range(0, M - {rows - 1}, {rows}):",
              "        o = co + i*cs"]
    lines += [f"        c{r} = C[o + {r}*cs:o + {r}*cs + N]" for r in rs]
    lines += [f"        a{r}_{q} = A[i + {r}, {q}]" for r in rs for q in ks]
    lines += ["        for j in range(N):"]
    lines += [f"            x{q} = b{q}[j]" for q in ks]
    lines += [f"            c{r}[j] = " + " + ".join(f"a{r}_{q}*x{q}" for q in ks) for r in rs]
    lines += [f"    for i in range(M - M % {rows}, M):",
              "        o = co + i*cs",
              "        c = C[o:o + N]"]
    lines += [f"        a_{q} = A[i, {q}]" for q in ks]
    lines += ["        for j in range(N):",
              "            c[j] = " + " + ".join(f"a_{q}*b{q}[j]" for q in ks)]
    return "\n".join(lines) + "\n"


def _kernel(k: int):
    """The compiled loop nest for inner dimension ``k`` (compiled once per process and
    argument types, ≈ 0.5 s each)."""
    with _lock:
        kern = _kernels.get(k)
        if kern is None:
            ns: dict = {}
            exec(compile(_source(k), f"<symhess.smallk K={k}>", "exec"), ns)
            kern = _kernels[k] = numba.njit(fastmath=False, boundscheck=False,
                                            error_model="numpy", nogil=True)(ns["kernel"])
        return kern


def _flat(x: np.ndarray) -> tuple[np.ndarray, int, int] | None:
    """(a flat contiguous view from x's first entry to its last, row stride) of a 2-D array
    whose rows are contiguous, or None."""
    m, n = x.shape
    s0, s1 = (s // x.itemsize for s in x.strides)
    if (n > 1 and s1 != 1) or (m > 1 and s0 < n):
        return None
    span = (m - 1) * s0 + n if m else 0
    flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(x.itemsize,))
    return flat, (s0 if m > 1 else n)


def fast_path(a, b, out) -> bool:
    """True where ``matmul_into`` uses the compiled loop nest for these NumPy arrays."""
    return (numba is not None and a.ndim == b.ndim == out.ndim == 2
            and out.dtype in _DTYPES and a.dtype == b.dtype == out.dtype
            and 0 < a.shape[1] <= MAX_K and out.shape[0] * out.shape[1] >= MIN_ENTRIES
            and a.shape[0] == out.shape[0] and b.shape[1] == out.shape[1]
            and a.shape[1] == b.shape[0])


def matmul_numpy(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = a @ b`` for NumPy arrays (the loop nest where ``fast_path``, else
    ``np.matmul(a, b, out=out)``)."""
    if fast_path(a, b, out):
        fo, fb = _flat(out), _flat(b)
        if fo is not None:
            if fb is None:
                fb = _flat(np.ascontiguousarray(b))
            (cflat, cs), (bflat, bs) = fo, fb
            _kernel(a.shape[1])(np.ascontiguousarray(a), bflat, 0, bs, cflat, 0, cs, out.shape[1])
            return
    np.matmul(a, b, out=out)


# -- the torch operator ------------------------------------------------------------------

_LIB = torch.library.Library("symhess", "DEF")
_LIB.define("matmul_into(Tensor a, Tensor b, Tensor(a!) out) -> ()")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(a flat view of a 2-D tensor from its first entry to its last, row stride) where its
    rows are contiguous and do not overlap, else None (the tensor counterpart of ``_flat``,
    cheaper per call than NumPy's ``as_strided``)."""
    m, n = x.shape
    s0, s1 = x.stride()
    if (n > 1 and s1 != 1) or (m > 1 and s0 < n):
        return None
    return x.as_strided(((m - 1) * s0 + n if m else 0,), (1,)), (s0 if m > 1 else n)


def _cpu(a, b, out):
    if numba is not None and a.dim() == b.dim() == out.dim() == 2 \
            and out.dtype in (torch.float64, torch.float32) and a.dtype == b.dtype == out.dtype \
            and 0 < a.shape[1] <= MAX_K and out.numel() >= MIN_ENTRIES \
            and not (a.requires_grad or b.requires_grad or out.requires_grad):
        fo = _rows(out)
        if fo is not None:
            fb = _rows(b) or _rows(b.contiguous())
            (cflat, cs), (bflat, bs) = fo, fb
            _kernel(a.shape[1])(a.contiguous().numpy(), bflat.numpy(), 0, bs, cflat.numpy(), 0, cs,
                                out.shape[1])
            return
    torch.matmul(a, b, out=out)


def _other(a, b, out):
    torch.matmul(a, b, out=out)


_LIB.impl("matmul_into", _cpu, "CPU")
for _key in ("CUDA", "Meta", "MPS", "XPU"):
    try:
        _LIB.impl("matmul_into", _other, _key)
    except RuntimeError:      # pragma: no cover - a dispatch key this build lacks
        pass

_op = torch.ops.symhess.matmul_into.default


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``torch.matmul(a, b, out=out)``, through the loop nest for CPU tensors (module doc).
    Eager calls skip the dispatcher (a few µs each); a trace records the operator."""
    if torch.jit.is_tracing():
        _op(a, b, out)
    elif out.device.type == "cpu":
        _cpu(a, b, out)
    else:
        torch.matmul(a, b, out=out)

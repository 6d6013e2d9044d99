"""Products with a short inner dimension written (or added) into a larger array: the slab
GEMMs of the full Hessians and the batched products written into Hessian blocks,
``out = a @ b`` with ``a`` (P, M, K), ``b`` (P, K, N), K ≤ 16 and P·M·N in the hundreds of
thousands or more (K is L · n_batch for the post-LN block's Hessian).

BLAS libraries are tuned for long inner dimensions; with K = 8 the arithmetic of MKL's
dgemm is not hidden behind the writes on every machine (on the AMD EPYC of the tenth session
it cost more than writing the output, BENCHMARKS.md). Here a loop nest is generated for each
K (unrolled over K and over four rows of ``out``, vectorised over N by LLVM) and compiled
with numba: every entry of ``out`` is computed in registers and written (or added) once.

``matmul_into(a, b, out, add=False)`` takes that path for CPU tensors (``matmul_numpy`` for
NumPy arrays) of float64 or float32, 2-D or equally batched 3-D (a half may be broadcast
along the batch), whose ``out`` has contiguous, non-overlapping rows; everything else (CUDA,
other dtypes, K > 16, small outputs, overlapping views, a missing numba, a loop nest numba
cannot compile) goes to BLAS (``torch.matmul``, ``addmm_``, ``baddbmm_``; ``np.matmul``),
the same numbers up to rounding. For torch it is the operator ``symhess::matmul_into``, so
that ``torch.jit.trace`` records it (``symhess.traces``); on CUDA it calls BLAS directly,
which CUDA graphs capture.

``transpose_into(src, dst)`` (``transpose_numpy`` for NumPy arrays) writes ``dst[...] = srcᵀ``
for two 2-D blocks of a larger array (the full Hessian's blocks below the diagonal copied from
those above): 8 × 8 tiles transposed in registers, every cache line read or written used
whole, ≈ 0.5 ns per entry against ≈ 3.1 for the strided ``dst.copy_(src.T)`` and 0.27 for
``fill_`` (BENCHMARKS.md, eleventh session); tensors or arrays it does not take (other
dtypes, small blocks, CUDA, no numba) get ``copy_`` / ``np.copyto``.
"""
from __future__ import annotations

import math
import os
import threading
import warnings

import numpy as np
import torch

try:        # an accelerator, never a requirement: without numba every call uses BLAS
    import numba
except ImportError:     # pragma: no cover - exercised where numba is missing
    numba = None

MAX_K = 16          # inner dimensions up to this use the generated loop nest
ROWS = 4            # rows of ``out`` computed together (each value of ``b`` read once for them)
MIN_ENTRIES = 4096  # smaller outputs: BLAS (the loop nest's call overhead is a few µs)
BLAS_ROWS = 32      # the BLAS fallback on the CPU: at most this many rows of out per call
_DTYPES = (np.float64, np.float32)

# why the loop nest is off for this process: numba failed, or SYMHESS_SMALLK=0 (BLAS for every
# product, e.g. to compare the two on another machine)
_disabled: list[str] = ["SYMHESS_SMALLK=0"] if os.environ.get("SYMHESS_SMALLK") == "0" else []
_kernels: dict[tuple[int, bool], object] = {}
_lock = threading.Lock()


def _source(k: int, add: bool, rows: int = ROWS) -> str:
    """The loop nest for inner dimension ``k`` that writes (or, ``add``, adds to) ``out``,
    for each of P products. ``A`` is (P, M, K); ``B`` and ``C`` are flat 1-D arrays: row
    ``r`` of product ``p``'s b starts at ``bo + p*bp + r*bs``, its row ``i`` of out at
    ``co + p*cp + i*cs`` (a row of a flat contiguous array is contiguous to numba, so the
    loop over N vectorises)."""
    ks, rs, op = range(k), range(rows), "+=" if add else "="
    lines = ["def kernel(A, B, bo, bp, bs, C, co, cp, cs, N):",
             "    P, M = A.shape[0], A.shape[1]",
             "    for p in range(P):",
             "        b = bo + p*bp"]
    lines += [f"        b{q} = B[b + {q}*bs:b + {q}*bs + N]" for q in ks]
    lines += [f"        for i in range(0, M - {rows - 1}, {rows}):",
              "            o = co + p*cp + i*cs"]
    lines += [f"            c{r} = C[o + {r}*cs:o + {r}*cs + N]" for r in rs]
    lines += [f"            a{r}_{q} = A[p, i + {r}, {q}]" for r in rs for q in ks]
    lines += ["            for j in range(N):"]
    lines += [f"                x{q} = b{q}[j]" for q in ks]
    lines += [f"                c{r}[j] {op} " + " + ".join(f"a{r}_{q}*x{q}" for q in ks)
              for r in rs]
    lines += [f"        for i in range(M - M % {rows}, M):",
              "            o = co + p*cp + i*cs",
              "            c = C[o:o + N]"]
    lines += [f"            a_{q} = A[p, i, {q}]" for q in ks]
    lines += ["            for j in range(N):",
              f"                c[j] {op} " + " + ".join(f"a_{q}*b{q}[j]" for q in ks)]
    return "\n".join(lines) + "\n"


def _kernel(k: int, add: bool = False):
    """The compiled loop nest for inner dimension ``k`` (compiled once per process and
    argument types, ≈ 0.5 s each)."""
    with _lock:
        kern = _kernels.get((k, add))
        if kern is None:
            ns: dict = {}
            exec(compile(_source(k, add), f"<symhess.smallk K={k} add={add}>", "exec"), ns)
            kern = _kernels[(k, add)] = numba.njit(fastmath=False, boundscheck=False,
                                                   error_model="numpy", nogil=True)(ns["kernel"])
        return kern


def _compiled(kernel, what, instead, *args) -> bool:
    """Run ``kernel()`` (compiled on first use) on ``args``; False where numba cannot compile
    it (before anything is written): one warning naming ``what``, and ``instead`` (BLAS, the
    strided copy) for every product and transpose from then on."""
    try:
        kernel()(*args)
        return True
    except numba.core.errors.NumbaError as e:
        _disabled.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        warnings.warn(f"symhess.smallk: numba could not compile {what} ({_disabled[-1]}); "
                      f"{instead} from now on (same numbers)", RuntimeWarning, stacklevel=4)
        return False


def _call(k, add, *args) -> bool:
    """Run the loop nest for inner dimension ``k`` (``_compiled``)."""
    return _compiled(lambda: _kernel(k, add), f"the loop nest for K={k}", "products use BLAS",
                     *args)


_transpose: list = []       # the compiled transpose (one per process, made on first use)

# an 8 × 8 tile transposed in registers: rows unpacked in pairs, then merged two and four
# entries at a time (LLVM lowers these shuffles to the target's unpack/permute instructions)
_SHUFFLES = ([0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15],
             [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15],
             [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _tile_intrinsic():
    """A numba intrinsic ``tile8(S, so, ss, D, do, ds)``: the 8 × 8 tile of flat ``S`` whose
    rows start at ``so + a*ss`` written transposed into flat ``D`` at ``do + b*ds``: eight
    vector loads, 24 shuffles, eight vector stores."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
    lo, hi, a2, b2, a4, b4 = _SHUFFLES

    @intrinsic
    def tile8(typingctx, S, so, ss, D, do, ds):
        def codegen(context, builder, signature, args):
            src, so_, ss_, dst, do_, ds_ = args
            sdata = context.make_array(signature.args[0])(context, builder, src).data
            ddata = context.make_array(signature.args[3])(context, builder, dst).data
            vec = ir.VectorType(context.get_data_type(signature.args[0].dtype), 8)
            i64, mask = ir.IntType(64), ir.VectorType(ir.IntType(32), 8)

            def at(data, start, stride, k):
                off = builder.add(start, builder.mul(stride, ir.Constant(i64, k)))
                return builder.bitcast(builder.gep(data, [off]), vec.as_pointer())

            def shuf(x, y, m):
                return builder.shuffle_vector(x, y, ir.Constant(mask, m))

            r = [builder.load(at(sdata, so_, ss_, k), align=1) for k in range(8)]
            t = [shuf(r[k], r[k + 1], m) for k in range(0, 8, 2) for m in (lo, hi)]
            u = [shuf(t[k + kk], t[k + kk + 2], m) for k in (0, 4)
                 for m, kk in ((a2, 0), (a2, 1), (b2, 0), (b2, 1))]
            v = [shuf(u[k], u[k + 4], m) for m in (a4, b4) for k in range(4)]
            for k in range(8):
                builder.store(v[k], at(ddata, do_, ds_, k), align=1)
            return context.get_dummy_value()
        return types.void(S, so, ss, D, do, ds), codegen
    return tile8


def _transpose_kernel():
    """``D[do + i*ds + j] = S[so + j*ss + i]`` for i < K, j < M: 8 × 8 tiles transposed in
    registers (each of the tile's cache lines read and written whole), then the rows and
    columns no tile covers one entry at a time."""
    with _lock:
        if not _transpose:
            tile8 = _tile_intrinsic()

            def kernel(S, so, ss, D, do, ds, K, M):
                M8, K8 = M - M % 8, K - K % 8
                for j0 in range(0, M8, 8):
                    for i0 in range(0, K8, 8):
                        tile8(S, so + j0*ss + i0, ss, D, do + i0*ds + j0, ds)
                    for i in range(K8, K):
                        for j in range(j0, j0 + 8):
                            D[do + i*ds + j] = S[so + j*ss + i]
                for i in range(K):
                    for j in range(M8, M):
                        D[do + i*ds + j] = S[so + j*ss + i]
            _transpose.append(numba.njit(boundscheck=False, error_model="numpy",
                                         nogil=True)(kernel))
        return _transpose[0]


def _transpose_call(src_flat, so, ss, dst_flat, do, ds, k, m) -> bool:
    """Run the compiled transpose (``_compiled``)."""
    return _compiled(lambda: _transpose_kernel(), "the transpose", "the strided copy is used",
                     src_flat, so, ss, dst_flat, do, ds, k, m)


def _layout(shape, strides, written):
    """(batch stride, row stride) of a (P, M, N) operand whose last axis has unit stride
    (size-1 axes aside), else None; ``written``: its entries must not overlap either."""
    (p, m, n), (sp, sm, sn) = shape, strides
    if n > 1 and sn != 1:
        return None
    sm, sp = (sm if m > 1 else n), (sp if p > 1 else 0)
    if written:
        dims = sorted((s, size) for s, size in ((sm, m), (sp, p)) if size > 1)
        extent = n                       # entries spanned by the faster axes so far
        for s, size in dims:
            if s < extent:
                return None
            extent = s * (size - 1) + extent
    elif sm < 0 or sp < 0 or (m > 1 and sm < n):
        return None
    return sp, sm


def _applies(a, b, out, dtypes) -> bool:
    """The loop nest's conditions on shapes and dtypes (NumPy arrays or tensors alike):
    (M, K) @ (K, N) → (M, N), or batched (P, M, K) @ (P, K, N) → (P, M, N)."""
    return (numba is not None and not _disabled and out.ndim in (2, 3)
            and a.ndim == b.ndim == out.ndim and out.dtype in dtypes and a.dtype == b.dtype == out.dtype
            and 0 < a.shape[-1] <= MAX_K and a.shape[-1] == b.shape[-2]
            and a.shape[-2] == out.shape[-2] and b.shape[-1] == out.shape[-1]
            and (out.ndim == 2 or a.shape[0] == b.shape[0] == out.shape[0])
            and math.prod(out.shape) >= MIN_ENTRIES)


def _as3(shape, strides):
    if len(shape) == 3:
        return tuple(shape), tuple(strides)
    return (1, shape[0], shape[1]), (0, strides[0], strides[1])


def _span(shape, strides):
    """Entries from an operand's first to its last (non-negative strides)."""
    (p, m, n), (sp, sm, sn) = shape, strides
    return 1 + (p - 1) * sp + (m - 1) * sm + (n - 1) * sn


def _flat(x, written, strides, contiguous, flatten):
    """(a flat view from x's first entry to its last, (batch stride, row stride)) of a
    (P,) M, N array or tensor laid out for the loop nest (``_layout``); a read operand that
    is not is made contiguous first; None for a written one. ``strides`` (in entries),
    ``contiguous`` and ``flatten(x, entries)`` are NumPy's or torch's."""
    shape, st = _as3(x.shape, strides(x))
    lay = _layout(shape, st, written)
    if lay is None:
        if written:
            return None
        x = contiguous(x)
        shape, st = _as3(x.shape, strides(x))
        lay = _layout(shape, st, False)
    return flatten(x, _span(shape, st)), lay


def _np_strides(x):
    return [s // x.itemsize for s in x.strides]


def _np_flatten(x, n):
    return np.lib.stride_tricks.as_strided(x, shape=(n,), strides=(x.itemsize,))


def _torch_flatten(x, n):
    return x.as_strided((n,), (1,))


def _flat_np(x: np.ndarray, written: bool):
    return _flat(x, written, _np_strides, np.ascontiguousarray, _np_flatten)


def _flat_torch(x: torch.Tensor, written: bool):
    return _flat(x, written, torch.Tensor.stride, torch.Tensor.contiguous, _torch_flatten)


def fast_path(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """True where ``matmul_numpy`` uses the compiled loop nest for these arrays."""
    return _applies(a, b, out, _DTYPES) and _flat_np(out, True) is not None


def matmul_numpy(a: np.ndarray, b: np.ndarray, out: np.ndarray, add: bool = False) -> None:
    """``out[...] = a @ b`` (``add``: ``out += a @ b``) for NumPy arrays: the loop nest where
    ``fast_path``, else ``np.matmul``."""
    fo = _flat_np(out, True) if _applies(a, b, out, _DTYPES) else None
    if fo is not None:
        (cflat, (cp, cs)), (bflat, (bp, bs)) = fo, _flat_np(b, False)
        a3 = np.ascontiguousarray(a.reshape(_as3(a.shape, a.strides)[0]))
        if _call(a.shape[-1], add, a3, bflat, 0, bp, bs, cflat, 0, cp, cs, out.shape[-1]):
            return
    if add:
        out += np.matmul(a, b)
    else:
        np.matmul(a, b, out=out)


def _transposes(src, dst, dtypes) -> bool:
    """The compiled transpose's conditions: two 2-D arrays, ``dst`` shaped as ``src``
    transposed, one dtype, enough entries to pay for the call."""
    return (numba is not None and not _disabled and src.ndim == dst.ndim == 2
            and dst.dtype in dtypes and src.dtype == dst.dtype
            and tuple(dst.shape) == tuple(src.shape[::-1])
            and math.prod(dst.shape) >= MIN_ENTRIES)


def transpose_numpy(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.T`` for NumPy arrays (module doc); ``dst`` must not overlap ``src``."""
    fd = _flat_np(dst, True) if _transposes(src, dst, _DTYPES) else None
    if fd is not None:
        (dflat, (_, ds)), (sflat, (_, ss)) = fd, _flat_np(src, False)
        if _transpose_call(sflat, 0, ss, dflat, 0, ds, dst.shape[0], dst.shape[1]):
            return
    np.copyto(dst, src.T)


# -- the torch operator ------------------------------------------------------------------

_LIB = torch.library.Library("symhess", "DEF")
_LIB.define("matmul_into(Tensor a, Tensor b, Tensor(a!) out, bool add=False) -> ()")
_TORCH_DTYPES = (torch.float64, torch.float32)


def _blas(a, b, out, add):
    if not add:
        torch.matmul(a, b, out=out)
    elif out.dim() == 2:
        out.addmm_(a, b)
    elif out.dim() == 3:
        out.baddbmm_(a, b)
    else:
        out += torch.matmul(a, b)


def _blas_rows(a, b, out, add):
    """``_blas`` a block of at most ``BLAS_ROWS`` rows of ``out`` at a time (on the CPU, where
    MKL wrote the slab GEMMs' 16- or 32-row blocks faster than 64 rows at once)."""
    m = out.shape[-2] if out.dim() in (2, 3) and a.dim() == out.dim() else 0
    if m <= BLAS_ROWS:
        _blas(a, b, out, add)
        return
    for r in range(0, m, BLAS_ROWS):
        k = min(BLAS_ROWS, m - r)
        _blas(a.narrow(-2, r, k), b, out.narrow(-2, r, k), add)


def _cpu(a, b, out, add=False):
    fo = _flat_torch(out, True) if _applies(a, b, out, _TORCH_DTYPES) and not (
        a.requires_grad or b.requires_grad or out.requires_grad) else None
    if fo is None:
        _blas_rows(a, b, out, add)
        return
    (cflat, (cp, cs)), (bflat, (bp, bs)) = fo, _flat_torch(b, False)
    a3 = a.reshape(_as3(a.shape, a.stride())[0]).contiguous()
    if not _call(a.shape[-1], add, a3.numpy(), bflat.numpy(), 0, bp, bs, cflat.numpy(), 0, cp,
                 cs, out.shape[-1]):
        _blas_rows(a, b, out, add)


_LIB.impl("matmul_into", _cpu, "CPU")
for _key in ("CUDA", "Meta", "MPS", "XPU"):
    try:
        _LIB.impl("matmul_into", _blas, _key)
    except RuntimeError:      # pragma: no cover - a dispatch key this build lacks
        pass

_LIB.define("transpose_into(Tensor src, Tensor(a!) dst) -> ()")


def _copy_t(src, dst):
    dst.copy_(src.transpose(-1, -2))


def _transpose_cpu(src, dst):
    fd = _flat_torch(dst, True) if _transposes(src, dst, _TORCH_DTYPES) and not (
        src.requires_grad or dst.requires_grad) else None
    if fd is not None:
        (dflat, (_, ds)), (sflat, (_, ss)) = fd, _flat_torch(src, False)
        if _transpose_call(sflat.numpy(), 0, ss, dflat.numpy(), 0, ds, dst.shape[0], dst.shape[1]):
            return
    _copy_t(src, dst)


_LIB.impl("transpose_into", _transpose_cpu, "CPU")
for _key in ("CUDA", "Meta", "MPS", "XPU"):
    try:
        _LIB.impl("transpose_into", _copy_t, _key)
    except RuntimeError:      # pragma: no cover - a dispatch key this build lacks
        pass

_op = torch.ops.symhess.matmul_into.default


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
    """``torch.matmul(a, b, out=out)`` (``add``: ``out += a @ b``), through the loop nest for
    CPU tensors (module doc). Eager calls skip the dispatcher (a few µs each); a trace records
    the operator."""
    if torch.jit.is_tracing():
        _op(a, b, out, add)
    elif out.device.type == "cpu":
        _cpu(a, b, out, add)
    else:
        _blas(a, b, out, add)


_top = torch.ops.symhess.transpose_into.default


def transpose_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src.T)`` for 2-D tensors, through the compiled transpose on the CPU
    (module doc); a torch operator like ``matmul_into`` (traced, eager calls skip the
    dispatcher). ``dst`` must not overlap ``src``."""
    if torch.jit.is_tracing():
        _top(src, dst)
    elif dst.device.type == "cpu":
        _transpose_cpu(src, dst)
    else:
        _copy_t(src, dst)

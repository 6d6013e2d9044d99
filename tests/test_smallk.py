"""The short-inner-dimension products of the slab GEMMs (symhess.smallk): the compiled loop
nest against BLAS, on strided rows of a larger array, traced, and its fallbacks."""
import warnings

import numpy as np
import pytest
import torch

from symhess import smallk

pytestmark = pytest.mark.skipif(smallk.numba is None, reason="numba is not installed")


def _strided_out(m, n, dtype):
    """Rows 0, 3, 6, … of a larger zeroed array, columns 7 … 7+n: what lies between must stay 0."""
    big = np.zeros((3 * m, n + 11), dtype=dtype)
    return big, big[::3, 7:7 + n]


# each (K, add, dtype) compiles once (≈ 0.5 s): a few K, float32 only for one
@pytest.mark.parametrize("k,dtype,tol", [(1, np.float64, 1e-13), (5, np.float64, 1e-13),
                                         (8, np.float64, 1e-13), (16, np.float64, 1e-13),
                                         (8, np.float32, 1e-5)])
@pytest.mark.parametrize("m", [1, 4, 7, 33])
@pytest.mark.parametrize("add", [False, True])
def test_loop_nest_matches_blas_on_strided_rows(k, m, dtype, tol, add):
    rng = np.random.default_rng(k * 100 + m)
    n = 4099
    big, out = _strided_out(m, n, dtype)
    before = rng.standard_normal(out.shape).astype(dtype)
    out[...] = before
    a = rng.standard_normal((k, m)).astype(dtype).T          # a transposed (column-major) factor
    b = rng.standard_normal((k, 2 * n)).astype(dtype)[:, ::2] if k % 2 else \
        rng.standard_normal((k, n)).astype(dtype)           # odd k: b's rows strided too
    assert smallk.fast_path(a, b, out)
    smallk.matmul_numpy(a, b, out, add)
    assert (k, add) in smallk._kernels
    ref = a.astype(np.float64) @ b.astype(np.float64) + (before if add else 0)
    assert np.abs(out - ref).max() <= tol * np.abs(ref).max()
    mask = np.ones(big.shape, bool)
    mask[::3, 7:7 + n] = False
    assert not big[mask].any()


@pytest.mark.parametrize("layout", ["batch outer", "batch inside rows", "a broadcast", "b broadcast"])
def test_batched_products_into_strided_blocks(layout):
    """(P, M, K) @ (P, K, N) into a (P, M, N) view of a larger array, as the printer's
    batched writes do (``baddbmm_`` into Hessian blocks, one half expanded along P)."""
    rng = np.random.default_rng(3)
    p, m, k, n = 5, 6, 8, 700
    big = torch.zeros(40, 8000, dtype=torch.float64)
    if layout == "batch inside rows":      # out[p, i] is row i of big, columns p*n … p*n+n
        out = big[:m, :p * n].view(m, p, n).permute(1, 0, 2)
    else:
        out = big[:p * m].view(p, m, 8000)[..., 13:13 + n]
    a = torch.tensor(rng.standard_normal((p, m, k)))
    b = torch.tensor(rng.standard_normal((p, k, n)))
    if layout == "a broadcast":
        a = a[:1].expand(p, m, k)
    if layout == "b broadcast":
        b = b[:1].expand(p, k, n)
    assert smallk.fast_path(a.numpy(), b.numpy(), out.numpy())
    before = big.clone()
    smallk.matmul_into(a, b, out)
    assert _close(out, a @ b)
    smallk.matmul_into(a, b, out, add=True)
    assert _close(out, 2 * (a @ b))
    out.zero_()
    assert torch.equal(big, before), "entries outside the view were written"


def test_overlapping_outputs_take_blas():
    base = torch.zeros(10000, dtype=torch.float64)
    out = base.as_strided((8, 1000), (500, 1))          # rows overlap: not the loop nest
    a, b = np.ones((8, 4)), np.ones((4, 1000))
    assert not smallk.fast_path(a, b, out.numpy())


def _close(x, y, tol=1e-13):
    """Agreement up to rounding, relative to the largest entry (summation orders differ)."""
    return float((x - y).abs().max()) <= tol * float(y.abs().max())


def test_torch_operator_and_its_fallbacks():
    rng = np.random.default_rng(1)
    h = torch.zeros(64, 3000, dtype=torch.float64)
    a = torch.tensor(rng.standard_normal((16, 8)))
    b = torch.tensor(rng.standard_normal((8, 3000)))
    smallk.matmul_into(a, b, h[::4])
    assert _close(h[::4], a @ b)
    assert not h[1::4].any()
    smallk.matmul_into(a, b, h[::4], add=True)
    assert _close(h[::4], 2 * (a @ b))
    assert not h[1::4].any()
    # K above the loop nest's limit, float16: BLAS; batched operands: the loop nest per batch
    a17 = torch.tensor(rng.standard_normal((16, smallk.MAX_K + 1)))
    b17 = torch.tensor(rng.standard_normal((smallk.MAX_K + 1, 3000)))
    assert not smallk.fast_path(a17.numpy(), b17.numpy(), h[:16].numpy())
    smallk.matmul_into(a17, b17, h[:16])
    assert _close(h[:16], a17 @ b17)
    smallk.matmul_into(a17, b17, h[:16], add=True)
    assert _close(h[:16], 2 * (a17 @ b17))
    a3, b3 = a.expand(2, 16, 8), b.expand(2, 8, 3000)
    out3 = torch.empty(2, 16, 3000, dtype=torch.float64)
    smallk.matmul_into(a3, b3, out3)
    assert _close(out3, a3 @ b3)
    smallk.matmul_into(a3, b3, out3, add=True)
    assert _close(out3, 2 * (a3 @ b3))
    o16 = torch.empty(16, 64, dtype=torch.float16)
    smallk.matmul_into(a.half(), b[:, :64].half(), o16)
    assert torch.equal(o16, a.half() @ b[:, :64].half())


def test_traced_graph_records_the_operator():
    rng = np.random.default_rng(2)

    def f(a, b, out):
        smallk.matmul_into(a, b, out[::2])
        smallk.matmul_into(a, b, out[1::2], add=True)
        return out

    a, b = (torch.tensor(rng.standard_normal(s)) for s in ((8, 6), (6, 5000)))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # torch.jit.trace's notice
        traced = torch.jit.trace(f, (a, b, torch.zeros(16, 5000, dtype=torch.float64)),
                                 check_trace=False)
        assert "symhess::matmul_into" in str(traced.graph)
        a2, b2 = a + 1, b * 2          # replayed on new values, not the traced ones
        out = traced(a2, b2, torch.ones(16, 5000, dtype=torch.float64))
    assert _close(out[::2], a2 @ b2)
    assert _close(out[1::2], 1 + a2 @ b2)


def test_post_ln_hessian_through_the_loop_nest_matches_the_numpy_kernel(monkeypatch):
    """At the issue's sizes (L=8, d=16, d_K=16, d_ff=64) the torch kernel's slab GEMMs go
    through the loop nest (K = 8) and its blocks below the diagonal through the compiled
    transpose; its full Hessian equals the NumPy kernel's (BLAS products) to rounding."""
    import symhess as sh
    rng = np.random.default_rng(5)
    L, d, dk, dff = 8, 16, 16, 64
    vals = {"X": rng.standard_normal((L, d)), "Y": rng.standard_normal((L, d)),
            "W_Q": rng.standard_normal((d, dk)) / 4, "W_K": rng.standard_normal((d, dk)) / 4,
            "W_V": rng.standard_normal((d, d)) / 4, "W_1": rng.standard_normal((d, dff)) / 4,
            "W_2": rng.standard_normal((dff, d)) / 8}
    used = []
    real = smallk._kernel
    real_t = smallk._transpose_kernel
    monkeypatch.setattr(smallk, "_kernel", lambda k, add=False: used.append((k, add)) or real(k, add))
    monkeypatch.setattr(smallk, "_transpose_kernel", lambda: used.append("T") or real_t())
    got = sh.kernel("post_ln_block", "torch", "mse").hessian(
        {n: torch.tensor(v) for n, v in vals.items()}, "full").numpy()
    assert {(8, False), "T"} <= set(used)
    want = sh.kernel("post_ln_block", "numpy", "mse").hessian(vals, "full")
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_a_loop_nest_numba_cannot_compile_falls_back_to_blas_once(monkeypatch):
    """Should numba fail to compile (a new numba, an odd platform), the product still comes
    out right through BLAS, with one warning, and later calls skip the loop nest."""
    def broken(k, add=False):
        def kern(*args):
            raise smallk.numba.core.errors.TypingError("no loop nest today")
        return kern

    monkeypatch.setattr(smallk, "_kernel", broken)
    monkeypatch.setattr(smallk, "_disabled", [])
    rng = np.random.default_rng(6)
    a = torch.tensor(rng.standard_normal((32, 8)))
    b = torch.tensor(rng.standard_normal((8, 3000)))
    out = torch.full((32, 3000), 7.0, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no loop nest today"):
        smallk.matmul_into(a, b, out, add=True)
    assert _close(out, 7 + a @ b)
    assert smallk._disabled and not smallk.fast_path(a.numpy(), b.numpy(), out.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smallk.matmul_into(a, b, out)              # no second warning
    assert _close(out, a @ b)


def test_the_environment_can_turn_the_loop_nest_off():
    """SYMHESS_SMALLK=0: every product through BLAS (to compare the two on a machine)."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np; from symhess import smallk; "
            "print(smallk.fast_path(np.ones((64, 8)), np.ones((8, 4096)), np.ones((64, 4096))))")
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, SYMHESS_SMALLK=value)
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert got == want, (value, got)


# -- the tiled transpose (the full Hessian's blocks below the diagonal) ---------------------

@pytest.mark.parametrize("k,m", [(64, 64), (13, 333), (333, 13), (9, 1000), (7, 7)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_transpose_writes_the_block_and_nothing_around_it(k, m, dtype, monkeypatch):
    """dst = srcᵀ for blocks of larger arrays (rows strided, sizes not multiples of the 8 × 8
    tile, one too small for the compiled path), NumPy and torch alike; the entries around
    dst stay as they were."""
    calls = []
    real = smallk._transpose_call
    monkeypatch.setattr(smallk, "_transpose_call", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(k + m)
    src = rng.standard_normal((m + 3, k + 5)).astype(dtype)[1:m + 1, 2:k + 2]
    big = np.zeros((k + 4, m + 9), dtype=dtype)
    dst = big[2:k + 2, 3:m + 3]
    smallk.transpose_numpy(src, dst)
    assert np.array_equal(dst, src.T)
    mask = np.ones(big.shape, bool)
    mask[2:k + 2, 3:m + 3] = False
    assert not big[mask].any()
    tbig = torch.zeros(big.shape, dtype=torch.float64 if dtype == np.float64 else torch.float32)
    smallk.transpose_into(torch.from_numpy(src), tbig[2:k + 2, 3:m + 3])
    assert np.array_equal(tbig.numpy(), big)
    assert len(calls) == (2 if k * m >= smallk.MIN_ENTRIES else 0)     # else np.copyto / copy_


def test_transpose_within_one_array_traced_and_its_fallbacks(monkeypatch):
    """The Hessian's case: both blocks views of one tensor; a trace records the operator and
    replays it on new values; other dtypes, shapes that do not match and a transpose numba
    cannot compile all give dst.copy_(srcᵀ)."""
    rng = np.random.default_rng(4)
    h = torch.tensor(rng.standard_normal((300, 300)))

    def f(h):
        smallk.transpose_into(h[:100, 100:], h[100:, :100])
        return h

    ref = h.clone()
    ref[100:, :100] = ref[:100, 100:].T
    assert torch.equal(f(h.clone()), ref)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(f, (h.clone(),), check_trace=False)
        assert "symhess::transpose_into" in str(traced.graph)
        h2 = h * 3
        got = traced(h2.clone())
    want = h2.clone()
    want[100:, :100] = want[:100, 100:].T
    assert torch.equal(got, want)
    half = torch.tensor(rng.standard_normal((96, 80))).half()
    out = torch.empty(80, 96, dtype=torch.float16)
    smallk.transpose_into(half, out)
    assert torch.equal(out, half.T)

    def broken():
        def kern(*args):
            raise smallk.numba.core.errors.TypingError("no transpose today")
        return kern

    monkeypatch.setattr(smallk, "_transpose_kernel", broken)
    monkeypatch.setattr(smallk, "_disabled", [])
    dst = torch.empty(200, 100, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="could not compile the transpose"):
        smallk.transpose_into(h[:100, 100:], dst)
    assert torch.equal(dst, h[:100, 100:].T)
    assert smallk._disabled


def test_blas_fallback_writes_a_few_rows_at_a_time(monkeypatch):
    """Products the loop nest does not take (here K > MAX_K) go to BLAS in blocks of at most
    BLAS_ROWS rows of out, written or added, 2-D or batched; the last block shorter."""
    rng = np.random.default_rng(8)
    calls = []
    real = smallk._blas
    monkeypatch.setattr(smallk, "_blas", lambda a, b, out, add: calls.append(out.shape[-2]) or
                        real(a, b, out, add))
    k = smallk.MAX_K + 3
    for shape_a, shape_b in (((70, k), (k, 300)), ((2, 70, k), (2, k, 300))):
        a, b = (torch.tensor(rng.standard_normal(s)) for s in (shape_a, shape_b))
        out = torch.zeros(shape_a[:-1] + shape_b[-1:], dtype=torch.float64)
        calls.clear()
        smallk.matmul_into(a, b, out)
        smallk.matmul_into(a, b, out, add=True)
        assert calls == [32, 32, 6] * 2
        assert _close(out, 2 * (a @ b))

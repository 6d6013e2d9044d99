"""Operators, datasets and spectra: every number against torch autograd (float64) of the
declaration, or against the kernel on the whole data as one batch."""
import numpy as np
import pytest
import torch

import symhess as sh
from symhess.curvature.dataset import Dataset
from symhess.errors import InputError
from symhess.calculus.hessian import derive
from symhess.calculus.verify import autograd_blocks

L, D, DK, N = 5, 4, 3, 7
PARTS = ("outer", "functional", "full")


def make(seed=0, loss="mse", causal=False):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, L, D, generator=g, dtype=torch.float64)
    Y = torch.randn(N, L, D, generator=g, dtype=torch.float64)
    if loss == "ce":
        Y = torch.softmax(Y, -1)
    W = {n: torch.randn(D, k, generator=g, dtype=torch.float64) / D ** 0.5
         for n, k in (("W_Q", DK), ("W_K", DK), ("W_V", D))}
    return X, Y, W


def reference(X, Y, W, loss="mse", causal=False):
    """{(p, q, part): block} of the dataset mean, from autograd of each sequence."""
    d = derive(sh.layer("attention", causal=causal), loss)
    out = {}
    for i in range(N):
        vals = {"X": X[i].numpy(), "Y": Y[i].numpy(), **{k: v.numpy() for k, v in W.items()}}
        for key, b in autograd_blocks(d, vals).items():
            out[key] = out.get(key, 0) + b / N
    return out


def whole(ref, part):
    names = ("W_Q", "W_K", "W_V")
    return np.block([[ref[(p, q, part)] for q in names] for p in names])


BATCHES = [slice(0, 3), slice(3, 4), slice(4, 7)]


@pytest.fixture(scope="module")
def setup():
    X, Y, W = make()
    return X, Y, W, reference(X, Y, W)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_operators_over_batches_equal_autograd(setup, backend):
    X, Y, W, ref = setup
    conv = (lambda a: a) if backend == "torch" else (lambda a: a.numpy())
    k = sh.kernel("attention", backend=backend, loss="mse")
    params = {n: conv(w) for n, w in W.items()}
    ds = Dataset(k, [(conv(X[s]), conv(Y[s])) for s in BATCHES], params=params)
    rng = np.random.default_rng(0)
    off = {"W_Q": (0, 12), "W_K": (12, 24), "W_V": (24, 40)}
    for part in PARTS:
        H = whole(ref, part)
        scale = np.linalg.norm(H)
        op = sh.operator(k, ds, part=part)
        assert op.shape == (40, 40) and op.symmetric and op.dtype == np.float64
        v = rng.standard_normal(40)
        assert np.linalg.norm(op @ v - H @ v) <= 1e-12 * scale * np.linalg.norm(v)
        M = rng.standard_normal((40, 3))
        assert np.linalg.norm(op.matmat(M) - H @ M) <= 1e-12 * scale * np.linalg.norm(M)
        for p, q in (("W_Q", "W_Q"), ("W_Q", "W_K"), ("W_V", "W_Q")):
            b = sh.operator(k, ds, p, q, part)
            Hb = H[off[p][0]:off[p][1], off[q][0]:off[q][1]]
            x = rng.standard_normal(b.shape[1])
            y = rng.standard_normal(b.shape[0])
            assert np.linalg.norm(b @ x - Hb @ x) <= 1e-12 * scale * np.linalg.norm(x)
            assert np.linalg.norm(b.rmatvec(y) - Hb.T @ y) <= 1e-12 * scale * np.linalg.norm(y)
            assert np.linalg.norm(b.H @ y - Hb.T @ y) <= 1e-12 * scale * np.linalg.norm(y)
            Xm = rng.standard_normal((b.shape[1], 2))
            assert np.linalg.norm(b.matmat(Xm) - Hb @ Xm) <= 1e-12 * scale * np.linalg.norm(Xm)
        row = sh.operator(k, ds, "W_K", part=part)
        Hr = H[12:24]
        assert row.shape == (12, 40) and not row.symmetric
        assert np.linalg.norm(row @ v - Hr @ v) <= 1e-12 * scale * np.linalg.norm(v)
        y = rng.standard_normal(12)
        assert np.linalg.norm(row.rmatvec(y) - Hr.T @ y) <= 1e-12 * scale * np.linalg.norm(y)
        # reductions of the dataset mean
        for p in ("W_Q", "W_V"):
            Hp = H[off[p][0]:off[p][1], off[p][0]:off[p][1]]
            dg = ds.diag(p, part)
            dg = dg.numpy() if backend == "torch" else dg
            assert np.abs(dg - np.diag(Hp)).max() <= 1e-12 * scale
            assert abs(ds.trace(p, part) - np.trace(Hp)) <= 1e-12 * scale
        Hqk = H[0:12, 12:24]
        for method in ("dense", "pairs"):
            assert abs(ds.frobenius_norm("W_Q", "W_K", part, method) - np.linalg.norm(Hqk)) \
                <= 1e-12 * scale


def test_dataset_loss_gradient_and_weights(setup):
    """Batches of different sizes weigh by their sequences: the mean over all sequences."""
    X, Y, W, _ = setup
    k = sh.kernel("attention", backend="torch", loss="mse")
    st = k.prepare({"X": X, "Y": Y, **W})
    ds = Dataset(k, [(X[s], Y[s]) for s in BATCHES], params=W, num_data=N)
    assert abs(ds.loss() - float(st.loss())) <= 1e-14
    assert torch.allclose(ds.gradient(), st.gradient_flat(), rtol=0, atol=1e-14)
    assert ds._total == N
    bad = Dataset(k, [(X[s], Y[s]) for s in BATCHES], params=W, num_data=N + 1)
    with pytest.raises(InputError, match="num_data is 8 but the data hold 7 sequences"):
        bad.loss()


def test_kept_and_streamed_passes_agree(setup):
    """keep=0 reads the data every pass (nothing kept); the default keeps small datasets."""
    X, Y, W, ref = setup
    k = sh.kernel("attention", backend="torch", loss="mse")
    data = [(X[s], Y[s]) for s in BATCHES]
    kept, streamed = Dataset(k, data, params=W), Dataset(k, data, params=W, keep=0)
    v = torch.randn(12, dtype=torch.float64)
    a = sh.operator(k, kept, "W_Q", "W_Q") @ v
    b = sh.operator(k, streamed, "W_Q", "W_Q") @ v
    assert kept._kept is not None and len(kept._kept) == 3 and streamed._kept is None
    assert torch.allclose(a, b, rtol=0, atol=1e-15)
    assert np.allclose(a.numpy(), ref[("W_Q", "W_Q", "full")] @ v.numpy(), rtol=0, atol=1e-13)


def test_torch_in_torch_out_and_float32(setup):
    X, Y, W, ref = setup
    k = sh.kernel("attention", backend="torch", loss="mse")
    op = sh.operator(k, {"X": X, "Y": Y, **W}, "W_V", "W_V", "outer")
    v = torch.randn(16, dtype=torch.float64)
    out = op @ v
    assert isinstance(out, torch.Tensor) and out.device == v.device
    assert np.allclose(out.numpy(), ref[("W_V", "W_V", "outer")] @ v.numpy(), rtol=0, atol=1e-14)
    f32 = {n: t.float() for n, t in {"X": X, "Y": Y, **W}.items()}
    op32 = sh.operator(k, f32, "W_Q", "W_Q")
    assert op32.dtype == np.float32
    r = op32 @ np.ones(12, dtype=np.float32)
    assert r.dtype == np.float32
    assert np.allclose(r, ref[("W_Q", "W_Q", "full")] @ np.ones(12), rtol=1e-4, atol=1e-6)


def test_spectrum_eigsh_matches_eigh_and_autograd(setup):
    X, Y, W, ref = setup
    k = sh.kernel("attention", backend="numpy", loss="mse")
    params = {n: w.numpy() for n, w in W.items()}
    ds = Dataset(k, [(X[s].numpy(), Y[s].numpy()) for s in BATCHES], params=params)
    for p, part in (("W_Q", "full"), ("W_K", "functional"), ("W_Q", "outer")):
        op = sh.operator(k, ds, p, p, part)
        exact = np.linalg.eigvalsh(ref[(p, p, part)])
        for which, want in (("LA", exact[::-1][:3]), ("SA", exact[:3][::-1])):
            s = sh.spectrum(op, k=3, which=which, method="eigsh")
            d = sh.spectrum(op, k=3, which=which, method="eigh")
            assert s.kind == "eigenvalues" and s.method == "eigsh"
            assert np.allclose(s.values, want, rtol=0, atol=1e-12)
            assert np.allclose(d.values, want, rtol=0, atol=1e-12)
    off = sh.operator(k, ds, "W_Q", "W_V")
    s = sh.spectrum(off, k=2, method="eigsh")
    assert s.kind == "singular values"
    assert np.allclose(s.values, np.linalg.svd(ref[("W_Q", "W_V", "full")], compute_uv=False)[:2],
                       rtol=0, atol=1e-12)
    opw = sh.operator(k, ds)
    assert np.isclose(sh.spectrum(opw, k=1).top, np.linalg.eigvalsh(whole(ref, "full"))[-1],
                      rtol=0, atol=1e-12)


def test_density_integrates_to_one_and_locates_the_spectrum(setup):
    X, Y, W, ref = setup
    k = sh.kernel("attention", backend="torch", loss="mse")
    op = sh.operator(k, {"X": X, "Y": Y, **W}, "W_V", "W_V", "outer")
    grid, dens = sh.density(op, ncv=16, num_points=400)
    mass = float(np.sum(dens) * (grid[1] - grid[0]))
    assert abs(mass - 1) < 1e-2
    ev = np.linalg.eigvalsh(ref[("W_V", "W_V", "outer")])
    assert grid[0] <= ev.min() and grid[-1] >= ev.max()
    assert np.all(dens >= 0)
    again = sh.density(op, ncv=16, num_points=400)[1]
    assert np.array_equal(again, dens)       # the seed fixes the start vectors


@pytest.mark.parametrize("loss,causal", [("ce", True)])
def test_cross_entropy_causal_blocks(loss, causal):
    X, Y, W = make(1, loss)
    ref = reference(X, Y, W, loss, causal)
    k = sh.kernel("attention", backend="torch", loss=loss, causal=causal)
    ds = Dataset(k, [(X[s], Y[s]) for s in BATCHES], params=W)
    for p, q in (("W_Q", "W_K"), ("W_K", "W_K")):
        for part in PARTS:
            op = sh.operator(k, ds, p, q, part)
            Hb = ref[(p, q, part)]
            assert np.abs(op.to_dense() - Hb).max() <= 1e-12 * max(np.abs(Hb).max(), 1e-3)


def test_bad_input_is_one_line():
    X, Y, W = make()
    k = sh.kernel("attention", backend="torch", loss="mse")
    with pytest.raises(InputError, match="params .* are needed with batches"):
        Dataset(k, [(X, Y)])
    with pytest.raises(InputError, match="read more than once"):
        Dataset(k, ((X, Y) for _ in range(2)), params=W)
    with pytest.raises(InputError, match="unknown block 'W_Z'"):
        sh.operator(k, {"X": X, "Y": Y, **W}, "W_Z")
    with pytest.raises(InputError, match="give p with q"):
        sh.operator(k, {"X": X, "Y": Y, **W}, None, "W_Q")
    op = sh.operator(k, {"X": X, "Y": Y, **W}, "W_Q", "W_Q")
    with pytest.raises(InputError, match=r"must be shape \(12,\) or \(12, 1\), got shape \(5,\)"):
        op @ torch.ones(5, dtype=torch.float64)
    with pytest.raises(InputError, match="k = 13 exceeds"):
        sh.spectrum(op, k=13)
    with pytest.raises(InputError, match="unknown which"):
        sh.spectrum(op, which="XX")

"""Vectors given to products are checked, and results that overflow from finite values are
named: never a NaN, a dropped imaginary part or a SciPy message."""
import numpy as np
import pytest
import torch

import symhess as sh
from symhess.errors import InputError
from symhess.curvature.spectra import ConvergenceError
from symhess.calculus.verify import random_values

PARAMS = ("W_Q", "W_K", "W_V")


@pytest.fixture(scope="module")
def values():
    return random_values(sh.derive(sh.layer("attention"), "mse"), seed=0)


def _conv(backend, vals, dtype=np.float64):
    if backend == "numpy":
        return {k: v.astype(dtype) for k, v in vals.items()}
    return {k: torch.as_tensor(v.astype(dtype)) for k, v in vals.items()}


def _vec(backend, a):
    return a if backend == "numpy" else torch.as_tensor(a)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_product_vectors_are_checked_at_every_entry_point(values, backend):
    vals = _conv(backend, values)
    k = sh.kernel("attention", backend, "mse")
    st = k.prepare(vals)
    n = sum(st.numel(p) for p in PARAMS)
    nq = st.numel("W_K")
    op = sh.operator(k, vals)
    block = sh.operator(k, vals, "W_Q", "W_K")
    def bad(m):
        """Vectors refused where a flat vector of length m is expected."""
        nan, inf = np.ones(m), np.ones(m)
        nan[m // 2], inf[-1] = np.nan, -np.inf
        return {"complex": (np.ones(m) * (1 + 1j), "complex"), "nan": (nan, "non-finite"),
                "inf": (inf, "non-finite"), "short": (np.ones(m - 1), rf"got shape \({m - 1},\)"),
                "long": (np.ones(m + 1), rf"got shape \({m + 1},\)"),
                "rank 3": (np.ones((m, 2, 1)), r"got shape \(\d+, 2, 1\)")}

    for v, needle in bad(n).values():
        for call in (lambda v: st.hvp(_vec(backend, v)), lambda v: k.hvp(vals, _vec(backend, v)),
                     lambda v: op @ v, lambda v: op.matvec(v), lambda v: op.dot(v),
                     lambda v: op @ torch.as_tensor(v)):
            with pytest.raises(InputError, match=needle):
                call(v)
    for w, needle in bad(nq).values():
        for call in (lambda w: st.block_hvp("W_Q", "W_K", _vec(backend, w)), lambda w: block @ w):
            with pytest.raises(InputError, match=needle):
                call(w)
    with pytest.raises(InputError, match=r"got shape \(31,\)"):    # Hᵀ takes W_Q's size
        block.rmatvec(np.ones(st.numel("W_Q") + 1))
    with pytest.raises(InputError, match="must be a real numeric array"):
        op @ np.array(["a"] * n)
    with pytest.raises(InputError, match=r"shape \(12,\) or \(12, 1\)|shape \(\d+,\) or"):
        block @ np.ones(3)
    if backend == "numpy":
        with pytest.raises(InputError, match="is a torch tensor but the kernel is NumPy's"):
            st.hvp(torch.ones(n, dtype=torch.float64))
    # a correct vector (a list, a column, a float32 vector cast by the operator) gives H v
    H = k.hessian(values if backend == "numpy" else vals)
    H = H if backend == "numpy" else H.numpy()
    x = np.linspace(-1, 1, n)
    assert np.allclose(np.asarray(op @ list(x)), H @ x, rtol=1e-12, atol=1e-14)
    assert np.allclose(np.asarray(op @ x[:, None])[:, 0], H @ x, rtol=1e-12, atol=1e-14)
    assert np.allclose(np.asarray(op @ x.astype(np.float32)), H @ x.astype(np.float32), rtol=1e-12)


@pytest.mark.parametrize("backend, dtype, factor", [("numpy", np.float64, 1e200),
                                                    ("torch", np.float64, 1e200),
                                                    ("numpy", np.float32, 1e19),
                                                    ("torch", np.float32, 1e19)])
def test_overflow_from_finite_data_is_named_with_its_cause(values, backend, dtype, factor):
    """X·1e200 (float64) or X·1e19 (float32) is finite but overflows inside: every quantity
    raises naming itself, the dtype and the largest entries (X), like the interpreter does."""
    big = dict(values, X=values["X"] * factor)
    vals = _conv(backend, big, dtype)
    dt = np.dtype(dtype).name
    with np.errstate(all="ignore"), pytest.raises(    # the interpreter refuses them too
            InputError, match=rf"@ X.T overflowed {dt} .* from operands as large as \d"):
        sh.derive(sh.layer("attention"), "mse").block("W_Q", "W_Q").evaluate(_conv(backend, big, dtype),
                                                                             backend=backend)
    k = sh.kernel("attention", backend, "mse")
    st = k.prepare(vals)
    n = sum(st.numel(p) for p in PARAMS)
    v = _vec(backend, np.ones(n, dtype=dtype))
    dt = np.dtype(dtype).name
    calls = {"loss": st.loss, "gradient": st.gradient, "hvp": lambda: st.hvp(v),
             "diag": lambda: st.diag("W_Q"), "trace": lambda: st.trace("W_K", "outer"),
             "frobenius_norm": lambda: st.frobenius_norm("W_Q", "W_K"),
             "hessian_block": lambda: st.hessian_block("W_Q", "W_Q"),
             "frobenius_split": lambda: st.frobenius_split("W_V", "W_Q"),
             "frobenius_norms": st.frobenius_norms, "hessian": st.hessian,
             "kernel.hvp": lambda: k.hvp(vals, v),
             "jacobian": lambda: k.jacobian(vals, "W_Q"),
             "compact jacobian": lambda: k.jacobian(vals, "W_Q", compact=True)}
    for name, call in calls.items():
        with np.errstate(all="ignore"), pytest.raises(
                InputError, match=rf"not finite.*overflowed {dt}.*\|X\| ≤"):
            call()
    op = sh.operator(k, vals, "W_Q", "W_Q")
    with np.errstate(all="ignore"), pytest.raises(InputError, match=rf"dataset mean of hvp.*overflowed {dt}"):
        sh.spectrum(op, k=1, method="eigsh")


def test_a_vector_that_overflows_the_product_is_named(values):
    k = sh.kernel("attention", "numpy", "mse")
    op = sh.operator(k, values)
    n = op.shape[1]
    with np.errstate(all="ignore"), pytest.raises(InputError, match=r"hvp\(v, 'full'\) is not finite.*overflowed float64.*\|v\| ≤ 1e\+308"):
        op @ np.full(n, 1e308)
    st = k.prepare(values)
    with np.errstate(all="ignore"), pytest.raises(InputError, match=r"hvp\(v\) is not finite"):
        st.hvp(np.full(n, 1e308))
    f32 = sh.operator(k, {k_: v.astype(np.float32) for k_, v in values.items()})
    with pytest.raises(InputError, match="non-finite entries.*beyond its range"):
        f32 @ np.full(n, 1e300)          # finite in float64, inf once cast to float32


def test_iteration_settings_are_checked_before_arpack(values):
    k = sh.kernel("attention", "numpy", "mse")
    op = sh.operator(k, values, "W_V", "W_V")
    for kw, needle in [({"maxiter": 0}, "maxiter must be a positive integer"),
                       ({"ncv": 1}, r"ncv .* k < ncv <= 25"),
                       ({"ncv": 26}, r"k < ncv <= 25"),
                       ({"tol": float("nan")}, "tol must be a finite number"),
                       ({"tol": -1.0}, "tol must be"),
                       ({"seed": -1}, "seed must be a non-negative integer")]:
        with pytest.raises(InputError, match=needle):
            sh.spectrum(op, k=2, method="eigsh", **kw)
    with pytest.raises(ConvergenceError, match="did not converge"):
        sh.spectrum(op, k=2, method="eigsh", maxiter=1, ncv=3, tol=1e-15)
    for kw, needle in [({"num_points": 1}, "num_points"), ({"kappa": 0.0}, "kappa"),
                       ({"kappa": 0.5}, r"kappa must be a finite number > 1, got 0.5"),
                       ({"margin": float("inf")}, "margin"), ({"boundaries": (1.0, 0.0)}, "boundaries"),
                       ({"boundaries": "ab"}, "boundaries")]:
        with pytest.raises(InputError, match=needle):
            sh.density(op, ncv=4, **kw)


@pytest.mark.parametrize("method", ["pairs", "dense"])
def test_dataset_results_that_overflow_are_named(values, method):
    """A dataset whose first batch overflows: reductions and the Frobenius norm by pairs
    of batches raise instead of returning NaN."""
    batches = [{"X": values["X"] * 1e200, "Y": values["Y"]}, {"X": values["X"], "Y": values["Y"]}]
    ds = sh.Dataset(sh.kernel("attention", "numpy", "mse"), batches,
                    params={p: values[p] for p in PARAMS})
    with np.errstate(all="ignore"):
        with pytest.raises(InputError, match=r"not finite.*overflowed float64.*\|X\| ≤ 2\.\d+e\+200"):
            ds.frobenius_norm("W_Q", "W_K", "full", method)
        for call in (ds.loss, ds.gradient, lambda: ds.diag("W_V"), lambda: ds.trace("W_Q")):
            with pytest.raises(InputError, match="not finite"):
                call()


def test_a_prepared_torch_state_reads_one_flag_per_result(values):
    """The result check of a prepared torch state costs one read of a flag on the host per
    call (the results and the vector reduced on their device, read together): a trace or a
    norm stays a 0-d tensor and nothing else waits for the device.  Counted as the tensor
    reads torch dispatches (``aten._local_scalar_dense``), after the forward quantities."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    k = sh.kernel("attention", "torch", "mse")
    st = k.prepare(_conv("torch", values))
    st.loss()                                  # the forward (its one saturation check)
    n = sum(st.numel(p) for p in PARAMS)
    v = torch.linspace(-1, 1, n, dtype=torch.float64)
    calls = {"loss": st.loss, "gradient": st.gradient, "trace": lambda: st.trace("W_Q"),
             "diag": lambda: st.diag("W_K"), "trace after diag": lambda: st.trace("W_K"),
             "frobenius_norm": lambda: st.frobenius_norm("W_Q", "W_K"),
             "frobenius_split": lambda: st.frobenius_split("W_V", "W_Q"),
             "frobenius_norms": st.frobenius_norms, "hvp": lambda: st.hvp(v),
             "block_hvp": lambda: st.block_hvp("W_Q", "W_K", v[:st.numel("W_K")]),
             "hessian_block": lambda: st.hessian_block("W_Q", "W_K"), "hessian": st.hessian}
    for name, call in calls.items():
        with Reads() as reads:
            out = call()
        assert reads.n == 1, (name, reads.n)
        if name in ("trace", "frobenius_norm"):
            assert isinstance(out, torch.Tensor) and out.ndim == 0
    bad = v.clone()
    bad[3] = float("nan")                      # the vector's flag is read with the result's
    with pytest.raises(InputError, match="v contains non-finite entries"):
        st.hvp(bad)
    with pytest.raises(InputError, match="v contains non-finite entries"):
        st.block_hvp("W_V", "W_V", torch.full((st.numel("W_V"),), float("inf"), dtype=torch.float64),
                     "functional")               # a zero block: nothing multiplies v


def test_an_operator_that_is_not_symmetric_is_refused_by_spectrum_and_density():
    """A NumPy matrix or SciPy operator does not say whether it is symmetric: a square one
    that is not would give Lanczos numbers that are no eigenvalues (eigh reads one triangle),
    so it is refused; a symmetric one gives its eigenvalues and density."""
    from scipy.sparse.linalg import aslinearoperator
    rng = np.random.default_rng(0)
    A = rng.standard_normal((40, 40))
    S = A + A.T
    ev = np.linalg.eigvalsh(S)
    for op in (np.triu(S), aslinearoperator(np.triu(S)), np.array([[0.0, 1.0], [0.0, 0.0]])):
        with pytest.raises(InputError, match=r"operator is not symmetric"):
            sh.spectrum(op, k=1)
        with pytest.raises(InputError, match=r"operator is not symmetric"):
            sh.density(op, num_points=8, ncv=4)
    for op in (S, aslinearoperator(S)):
        got = sh.spectrum(op, k=3, which="BE", method="eigsh").values
        assert np.allclose(np.sort(got), np.sort(np.r_[ev[:1], ev[-2:]]), rtol=1e-10)
        grid, dens = sh.density(op, num_points=64, ncv=20)
        assert grid[0] <= ev[0] and grid[-1] >= ev[-1] and np.isfinite(dens).all()


def test_a_density_whose_lanczos_iteration_breaks_down_is_a_convergence_error():
    """The identity has one eigenvalue: Lanczos stops after one step and its nodes are NaN;
    the density raises instead of returning them (or torch's distribution error)."""
    with pytest.raises(ConvergenceError, match="fewer than ncv = 3 distinct eigenvalues"):
        sh.density(np.eye(3), num_points=4, ncv=3)
    grid, dens = sh.density(np.diag([1.0, 2.0, 3.0]), num_points=61, ncv=3, kappa=100.0)
    peaks = grid[1:-1][(dens[1:-1] > dens[:-2]) & (dens[1:-1] > dens[2:])]
    assert np.allclose(peaks, [1.0, 2.0, 3.0], atol=0.05)

"""Generated Jacobian kernels (dense and compact) against torch.func.jacrev in float64."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from torch.func import jacrev

import symhess as sh
from symhess.expr.evaluate import InputError, evaluate
from symhess.calculus.verify import random_values

TOL = 1e-10
CASES = [
    ("layernorm", {}),
    ("layernorm", {"eps": 0.1, "affine": "const"}),
    ("layernorm", {"eps": 0.25, "affine": "param"}),
    ("layernorm", {"affine": "param"}),
    ("ffn", {}),
    ("ffn", {"activation": "gelu", "bias": True}),
    ("ffn", {"activation": "gelu", "residual": True}),
    ("ffn", {"bias": True, "residual": True}),
    ("attention", {}),
    ("attention", {"causal": True}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in CASES]


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def rel(got, want):
    got, want = _np(got), _np(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


@lru_cache(maxsize=None)
def case(name, opts):
    """(derivation, values, {p: jacrev Jacobian (numel F × numel p)})."""
    opts = dict(opts)
    d = sh.derive(sh.layer(name, **opts), "mse")
    values = random_values(d, seed=3)
    tv = {k: torch.tensor(v) for k, v in values.items()}
    ref = {}
    for p in d.layer.param_names:
        def f(w, p=p):
            return evaluate(d.F, {**tv, p: w}, backend="torch").reshape(-1)
        ref[p] = jacrev(f)(tv[p]).reshape(-1, tv[p].numel()).numpy()
    return d, values, ref


def key(opts):
    return tuple(sorted(opts.items()))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_dense_and_compact_match_jacrev(name, opts, backend):
    d, values, ref = case(name, key(opts))
    k = sh.kernel(name, backend, "mse", **opts)
    vals = {n: v for n, v in values.items() if n != "Y"}       # a Jacobian needs no target
    if backend == "torch":
        vals = {n: torch.tensor(v) for n, v in vals.items()}
    for p in d.layer.param_names:
        J = k.jacobian(vals, p)
        assert rel(J, ref[p]) <= TOL, (p, rel(J, ref[p]))
        C = k.jacobian(vals, p, compact=True)
        assert rel(C.dense(), ref[p]) <= TOL, (p, "compact")
        assert C.dense().shape == J.shape
        if backend == "torch":
            assert isinstance(J, torch.Tensor) and all(isinstance(f, torch.Tensor) for f in C.factors)


def test_numpy_and_torch_agree():
    for name, opts in CASES[:1] + CASES[5:6] + CASES[8:9]:
        d, values, _ = case(name, key(opts))
        vals = {n: v for n, v in values.items() if n != "Y"}
        kn, kt = sh.kernel(name, "numpy", **opts), sh.kernel(name, "torch", **opts)
        tv = {n: torch.tensor(v) for n, v in vals.items()}
        for p in d.layer.param_names:
            assert rel(kt.jacobian(tv, p), kn.jacobian(vals, p)) <= 1e-13
            a, b = kn.jacobian(vals, p, compact=True), kt.jacobian(tv, p, compact=True)
            assert a.axes == b.axes and a.shape == b.shape
            for fa, fb in zip(a.factors, b.factors):
                assert rel(fb, fa) <= 1e-13


def test_layernorm_input_jacobian_is_per_row_blocks():
    """J[(i,a),(j,b)] = δ_ij J_c[i,a,b]: compact is L × d × d, rows and columns share axis 0."""
    d, values, ref = case("layernorm", key({}))
    L, dv = values["X"].shape
    C = sh.kernel("layernorm").jacobian({"X": values["X"]}, "X", compact=True)
    assert C.shape == (L, dv, dv) and C.row_axes == (0, 1) and C.col_axes == (0, 2)
    assert len(C.factors) == 1 and C.factors[0].shape == (L, dv, dv)
    J4 = ref["X"].reshape(L, dv, L, dv)
    for i in range(L):
        assert np.allclose(C.factors[0][i], J4[i, :, i, :], rtol=0, atol=1e-12)
    off = J4.copy()
    off[np.arange(L), :, np.arange(L), :] = 0
    assert np.count_nonzero(off) == 0          # the dense Jacobian is block-diagonal


def test_ffn_w1_jacobian_is_factored():
    """No shared index, one product: the structured form is three small factors."""
    d, values, ref = case("ffn", key({}))
    C = sh.kernel("ffn").jacobian({n: v for n, v in values.items() if n != "Y"}, "W_1", compact=True)
    L, dv = values["X"].shape
    dff = values["W_1"].shape[1]
    assert C.shape == (L, dv, dv, dff)
    assert sum(f.size for f in C.factors) < L * dv * dv * dff // 2
    assert sorted(C.axes) == sorted([(0, 2), (0, 3), (1, 3)])


def test_batched_data_give_one_jacobian_per_sequence():
    d, values, _ = case("ffn", key({"activation": "gelu", "bias": True}))
    rng = np.random.default_rng(0)
    X = np.stack([values["X"], rng.standard_normal(values["X"].shape)])
    k = sh.kernel("ffn", activation="gelu", bias=True)
    vals = {n: v for n, v in values.items() if n != "Y"}
    for p in ("W_1", "b_2"):
        J = k.jacobian({**vals, "X": X}, p)
        C = k.jacobian({**vals, "X": X}, p, compact=True)
        assert J.shape[0] == 2 and C.dense().shape == J.shape
        for s in range(2):
            one = k.jacobian({**vals, "X": X[s]}, p)
            assert rel(J[s], one) <= 1e-14 and rel(C.dense()[s], one) <= 1e-14
    Jw = k.jacobian({**vals, "X": X}, "W_1")
    assert rel(Jw[0], Jw[1]) > 1e-3           # not a mean: the two sequences differ


def test_jacobian_bad_input():
    d, values, _ = case("layernorm", key({}))
    k = sh.kernel("layernorm")
    with pytest.raises(KeyError, match="unknown block 'W'"):
        k.jacobian({"X": values["X"]}, "W")
    with pytest.raises(InputError, match="missing value"):
        k.jacobian({}, "X")
    X = values["X"].copy()
    X[1] = 2.0
    with pytest.raises(InputError, match="row 1"):
        k.jacobian({"X": X}, "X", compact=True)
    kf = sh.kernel("ffn")
    _, fv, _ = case("ffn", key({}))
    with pytest.raises(InputError, match="shape mismatch"):
        kf.jacobian({"X": fv["X"], "W_1": fv["W_1"][:-1], "W_2": fv["W_2"]}, "W_1")

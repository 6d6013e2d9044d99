"""The operators agree with curvlinops' HessianLinearOperator / GGNLinearOperator on the same
module and data (float64)."""
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import symhess as sh

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from curvlinops import GGNLinearOperator, HessianLinearOperator

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")

L, D, DK = 5, 4, 3


class Attention(nn.Module):
    """softmax(X W_Q W_Kᵀ Xᵀ/√d_K) X W_V with the declaration's parameters (F = X W)."""

    def __init__(self, W, transpose_out=False):
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(W[n].clone()) for n in ("W_Q", "W_K", "W_V"))
        self.transpose_out = transpose_out

    def forward(self, x):
        a = torch.softmax(x @ self.W_Q @ self.W_K.T @ x.transpose(-1, -2) / DK ** 0.5, -1)
        f = a @ x @ self.W_V
        return f.transpose(1, 2) if self.transpose_out else f


def setup(loss="mse", seed=0):
    g = torch.Generator().manual_seed(seed)
    W = {n: torch.randn(D, k, generator=g, dtype=torch.float64) / D ** 0.5
         for n, k in (("W_Q", DK), ("W_K", DK), ("W_V", D))}
    data = []
    for n in (3, 1, 2):
        X = torch.randn(n, L, D, generator=g, dtype=torch.float64)
        Y = torch.randn(n, L, D, generator=g, dtype=torch.float64)
        data.append((X, torch.softmax(Y, -1) if loss == "ce" else Y))
    return W, data


def close(a, b, tol=1e-12):
    a, b = (torch.as_tensor(np.asarray(t)) if not isinstance(t, torch.Tensor) else t for t in (a, b))
    return float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-300)


def test_hessian_and_ggn_operators_mse():
    W, data = setup()
    model = Attention(W)
    params = [model.W_Q, model.W_K, model.W_V]
    k = sh.kernel("attention", backend="torch", loss="mse")
    ds = sh.Dataset(k, data, params=W)
    v = torch.randn(40, dtype=torch.float64)
    M = torch.randn(40, 3, dtype=torch.float64)
    for cls, part in ((HessianLinearOperator, "full"), (GGNLinearOperator, "outer")):
        theirs = cls(model, nn.MSELoss(), params, data)
        ours = sh.operator(k, ds, part=part)
        assert close(ours @ v, theirs @ v) and close(ours @ M, theirs @ M)
        assert close(ours @ v.numpy(), theirs.to_scipy() @ v.numpy())
        # the diagonals of every block in one pass = the diagonal of their dense matrix
        dense = theirs @ torch.eye(40, dtype=torch.float64)
        assert close(torch.cat([d.reshape(-1) for d in ds.diagonals(part).values()]),
                     torch.diagonal(dense))
        # one block (curvlinops: the Hessian of the sub-model in W_Q alone)
        theirs_q = cls(model, nn.MSELoss(), [model.W_Q], data, check_deterministic=False)
        ours_q = sh.operator(k, ds, "W_Q", "W_Q", part)
        assert close(ours_q @ v[:12], theirs_q @ v[:12])
        # block-diagonal (curvlinops' block_sizes) = our diagonal blocks
        if cls is HessianLinearOperator:
            bd = cls(model, nn.MSELoss(), params, data, block_sizes=[1, 1, 1],
                     check_deterministic=False)
            ours_bd = torch.cat([sh.operator(k, ds, p, p, part) @ v[a:b]
                                 for p, (a, b) in zip(("W_Q", "W_K", "W_V"),
                                                      ((0, 12), (12, 24), (24, 40)))])
            assert close(ours_bd, bd @ v)
    # the same eigsh on both gives the same top eigenvalues
    from scipy.sparse.linalg import eigsh
    theirs = HessianLinearOperator(model, nn.MSELoss(), [model.W_Q], data,
                                   check_deterministic=False).to_scipy()
    v0 = np.ones(12)
    want = np.sort(eigsh(theirs, k=3, which="LA", tol=1e-12, v0=v0,
                         return_eigenvectors=False))[::-1]
    got = sh.spectrum(sh.operator(k, ds, "W_Q", "W_Q"), k=3, tol=1e-12, method="eigsh").values
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    assert ds._total == theirs_q._N_data == 6


def test_hessian_operator_cross_entropy():
    W, data = setup("ce", 1)
    model = Attention(W, transpose_out=True)        # CrossEntropyLoss wants classes on dim 1
    theirs_data = [(X, Y.transpose(1, 2)) for X, Y in data]
    k = sh.kernel("attention", backend="torch", loss="ce")
    theirs = HessianLinearOperator(model, nn.CrossEntropyLoss(),
                                   [model.W_Q, model.W_K, model.W_V], theirs_data)
    ours = sh.operator(k, data, params=W)
    v = torch.randn(40, dtype=torch.float64)
    assert close(ours @ v, theirs @ v)


def test_module_block_mapped_to_parameters():
    """nn.MultiheadAttention through from_module: our Hessian mapped back onto the module's
    parameters, restricted to out_proj.weight (declared as one piece per head), is curvlinops'
    Hessian in that parameter."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(D, 2, batch_first=True).double()

    class Self(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    _, data = setup()
    ml = sh.from_module(m)
    k = sh.kernel(ml.layer, "torch", "mse")
    ds = sh.Dataset(k, ml.batches(data), params=ml.params())
    theirs = HessianLinearOperator(Self(m), nn.MSELoss(), [m.out_proj.weight], data)
    dense_theirs = theirs @ torch.eye(D * D, dtype=torch.float64)
    ours = ml.to_module_matrix(sh.operator(k, ds).to_dense())
    offsets, o = {}, 0
    for n, p in m.named_parameters():
        offsets[n] = o
        o += p.numel()
    at = slice(offsets["out_proj.weight"], offsets["out_proj.weight"] + D * D)
    assert close(ours[at, at], dense_theirs.numpy())

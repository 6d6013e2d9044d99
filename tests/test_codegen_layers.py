"""Every committed layer's generated kernels against torch autograd (float64, small shapes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.codegen import render as codegen
from symhess.layers.registry import LAYERS
from symhess.runtime import contract
from symhess.calculus.verify import autograd_blocks, random_values

COMMITTED = sorted(n for n in LAYERS if n not in codegen.ON_DEMAND)
PART = "full"


def tol(name):
    """1e-10; 1e-9 where a LayerNorm's rsqrt amplifies rounding."""
    return 1e-9 if "ln" in name or "norm" in name else 1e-10


def rel(got, want, scale):
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    return float(np.linalg.norm(got - want)) / max(float(scale), 1e-300)


# every layer's NumPy kernels and the light layers' torch kernels in the default profile; the
# torch kernels of the heavy layers (the same generated code on the other backend) in the slow one
HEAVY = {"multihead_attention", "post_ln_block", "pre_ln_block", "value_output_attention"}


@pytest.mark.parametrize("name,backend", [
    pytest.param(n, b, marks=pytest.mark.slow if (b == "torch" and n in HEAVY) else (), id=f"{n}-{b}")
    for n in COMMITTED for b in ("numpy", "torch")])
def test_layer_kernels_match_autograd(name, backend):
    _check_layer(name, backend)


@pytest.mark.parametrize("name,backend", [("modern_block", "numpy"), ("attention", "torch"),
                                          pytest.param("post_ln_block", "numpy", marks=pytest.mark.slow)])
def test_triangle_loops_match_autograd(name, backend, monkeypatch):
    """Every outer product that the next step multiplies by a third operand and sums over one
    label (the rotary key factors with ∂A/∂T, attention's key blocks) runs as one loop over
    that label at these small sizes too (``TRIANGLE_MIN`` at 1): autograd's numbers."""
    monkeypatch.setattr(contract, "TRIANGLE_MIN", 1)
    _check_layer(name, backend)


def _check_layer(name, backend):
    d = sh.derive(sh.layer(name), "mse")
    values = random_values(d, seed=3)
    ref = autograd_blocks(d, values)
    names = d.layer.param_names
    H = np.block([[ref[(p, q, PART)] for q in names] for p in names])
    scale = np.linalg.norm(H)
    k = sh.kernel(name, backend, "mse")
    vals = {n: torch.tensor(v) for n, v in values.items()} if backend == "torch" else values
    t = tol(name)
    assert rel(k.hessian(vals, PART), H, scale) <= t
    v = np.random.default_rng(0).standard_normal(H.shape[0])
    vv = torch.tensor(v) if backend == "torch" else v
    assert rel(k.hvp(vals, vv, PART), H @ v, scale * np.linalg.norm(v)) <= t
    norms = k.frobenius_norms(vals, PART)
    for p in names:
        B = ref[(p, p, PART)]
        assert rel(k.diag(vals, p, PART), np.diag(B), scale) <= t, p
        assert abs(float(k.trace(vals, p, PART)) - np.trace(B)) <= t * scale, p
        for q in names:
            B = ref[(p, q, PART)]
            assert rel(k.hessian_block(vals, p, q, PART), B, scale) <= t, (p, q)
            assert abs(float(k.frobenius_norm(vals, p, q, PART)) - np.linalg.norm(B)) <= t * scale, (p, q)
            assert abs(float(norms[(p, q)]) - np.linalg.norm(B)) <= t * scale, (p, q)


def test_constants_take_no_batch_axis():
    """LayerNorm's γ, β (role const) stay 2-D while the target carries the batch axis."""
    d = sh.derive(sh.layer("layernorm", affine="const"), "mse")
    seqs = [random_values(d, seed=s, sizes={"L": 4, "d_V": 5}) for s in range(2)]
    for s in seqs[1:]:
        for n in ("X", "gamma", "beta"):
            s[n] = seqs[0][n]
    names = d.layer.param_names
    want = np.mean([autograd_blocks(d, s)[("X", "X", PART)] for s in seqs], axis=0)
    batch = {n: torch.tensor(np.stack([s[n] for s in seqs]) if n == "Y" else seqs[0][n])
             for n in seqs[0]}
    k = sh.kernel("layernorm", "torch", "mse", affine="const")
    assert batch["gamma"].ndim == 2 and names == ("X",)
    assert rel(k.hessian(batch, PART), want, np.linalg.norm(want)) <= 1e-9

"""``Kernel.traced()``: generated torch routines replayed from traced graphs (CPU here).

The replay must give the eager routine's numbers for values it was not traced with (a value
that entered a trace as a constant would not), for every routine kind, at sizes whose
reciprocals are not exact in float32 (sizes traced as tensors once made 1/d a float32
scalar), and fall back to eager calls, with a warning naming the routine, where a routine
cannot be traced."""
import warnings

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.traces import TracedFunction

from test_block_kernels import reference
from test_hessian_out import values_for

SIZES = {"L": 3, "d_V": 5, "d_K": 3, "d_ff": 7}      # 1/3, 1/5, 1/7: inexact in float32


def torch_values(name, seed, batch=1):
    """(derivation, the NumPy values, the same as tensors) of ``batch`` sequences."""
    values = values_for(name, batch, sizes=SIZES, seed=seed)
    return (sh.derive(sh.layer(name), "mse"), values,
            {n: torch.tensor(v) for n, v in values.items()})


def test_traced_post_ln_kernels_match_eager_and_autograd():
    k = sh.kernel("post_ln_block", "torch", "mse")
    t = k.traced()
    assert "traced" in repr(t) and "traced" not in repr(k) and t.traced() is t
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback warning, no deprecation notice
        for seed in (3, 4):                     # traced with the first values, replayed
            d, values, tv = torch_values("post_ln_block", seed)
            ref = reference(d, values, list(d.layer.param_names))
            for part in ("full", "outer", "functional"):
                got, want = t.hessian(tv, part), k.hessian(tv, part)
                assert not got.is_inference()
                assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())
            got = t.hessian(tv, "full").numpy()
            assert np.linalg.norm(got - ref) <= 1e-10 * np.linalg.norm(ref)
            n = got.shape[0]
            v = torch.linspace(-1, 1, n, dtype=torch.float64)
            assert torch.allclose(t.hvp(tv, v), k.hvp(tv, v), rtol=1e-13, atol=0)
            gt, gk = t.gradient(tv), k.gradient(tv)
            assert all(torch.allclose(gt[p], gk[p], rtol=1e-13, atol=1e-300) for p in gk)
            assert torch.allclose(t.hessian_block(tv, "W_1", "W_Q", "functional"),
                                  k.hessian_block(tv, "W_1", "W_Q", "functional"),
                                  rtol=1e-13, atol=1e-300)
            buf = torch.full((n, n), float("nan"), dtype=torch.float64)
            assert t.hessian(tv, "outer", out=buf) is buf
            assert torch.allclose(buf, k.hessian(tv, "outer"), rtol=1e-13, atol=1e-300)
    fn = t._fns[("hessian", "full")]
    assert isinstance(fn, TracedFunction) and fn.traced == 1     # hessian always passes out
    assert not isinstance(k._fns[("hessian", "full")], TracedFunction)   # k is unchanged


def test_a_new_batch_size_is_traced_again():
    k = sh.kernel("pre_ln_block", "torch", "mse")
    t = k.traced()
    for batch in (2, 4, 2):
        _, _, tv = torch_values("pre_ln_block", 7, batch=batch)
        got, want = t.hessian(tv, "full"), k.hessian(tv, "full")
        assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())
    assert t._fns[("hessian", "full")].traced == 2
    t.clear_traces()
    assert t._fns[("hessian", "full")].traced == 0


def test_inputs_that_require_grad_get_their_own_trace():
    _, _, tv = torch_values("attention", 5)
    k = sh.kernel("attention", "torch", "mse")
    t = k.traced()
    plain = t.loss(tv)
    tv = {n: v.clone().requires_grad_(n == "W_Q") for n, v in tv.items()}
    loss = t.loss(tv)
    (g,) = torch.autograd.grad(loss.sum(), tv["W_Q"])
    want = k.gradient({n: v.detach() for n, v in tv.items()})["W_Q"]
    assert torch.allclose(loss, plain) and torch.allclose(g, want, rtol=1e-12, atol=1e-300)
    assert t._fns[("loss",)].traced == 2


def test_a_routine_that_reads_values_into_python_runs_eagerly():
    def routine(X, W):
        return (X @ W) * float(X.sum())      # a value read into Python: a trace constant

    fn = TracedFunction(routine, name="mse__odd")
    X, W = torch.ones(2, 3), torch.ones(3, 2)
    with pytest.warns(RuntimeWarning, match="mse__odd cannot be replayed from a trace"):
        first = fn(X=X, W=W)
    assert torch.equal(first, routine(X, W)) and fn.traced == 0
    assert torch.equal(fn(X=2 * X, W=W), routine(2 * X, W))     # eager from then on


def test_traced_needs_torch_and_excludes_cuda_graphs():
    with pytest.raises(ValueError, match="traced graphs need the torch backend.*'numpy'"):
        sh.kernel("attention", "numpy", "mse").traced()
    k = sh.kernel("attention", "torch", "mse")
    with pytest.raises(ValueError, match="replays traced graphs"):
        k.traced().with_cuda_graphs()
    with pytest.raises(ValueError, match="replays CUDA graphs"):
        k.with_cuda_graphs().traced()


@pytest.mark.parametrize("name", [n for n in sh.codegen.LAYERS if n not in sh.codegen.ON_DEMAND])
def test_every_committed_layer_replays_its_hessian(name):
    """Every committed layer's full Hessian routine traces (no fallback warning) and its
    replay gives the eager numbers on values it was not traced with."""
    k = sh.kernel(name, "torch", "mse")
    t = k.traced()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in (1, 3):
            vals = {n: torch.tensor(v) for n, v in values_for(name, batch).items()}
            t.hessian(vals, "full")                       # traced with these values
            other = {n: v * 1.1 if v.is_floating_point() else v for n, v in vals.items()}
            got, want = t.hessian(other, "full"), k.hessian(other, "full")
            assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max()), batch


def test_float32_ce_causal_kernels_replay_the_eager_numbers():
    """A committed CE/causal variant in float32, and an option combination rendered in
    memory (post-LN with GELU), replayed from traces on values they were not traced with."""
    from test_codegen import case as attention_case
    _, values, _ = attention_case("ce", True)
    k = sh.kernel("attention", "torch", "ce", causal=True)
    t = k.traced()
    v32 = {n: torch.tensor(np.asarray(v), dtype=torch.float32) for n, v in values.items()}
    t.hessian(v32, "full")
    other = {n: v * 1.05 if n != "Y" else v for n, v in v32.items()}
    got, want = t.hessian(other, "functional"), k.hessian(other, "functional")
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    kg = sh.kernel("post_ln_block", "torch", "mse", activation="gelu")
    tg = kg.traced()
    for seed in (5, 6):
        _, _, tv = torch_values("post_ln_block", seed)
        got, want = tg.hessian(tv, "full"), kg.hessian(tv, "full")
        assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())

"""``Kernel.hessian(values, part, out=...)``: the Hessian written into a caller's array.

The generated routines start from uninitialised memory and must write every entry; a
fresh allocation often holds zeros, which would hide a skipped block, so here ``out`` starts
full of NaN. Both versions of a routine that has a row-slab branch run (one sequence, and a
batch past every committed slab limit)."""
import numpy as np
import pytest
import torch

import symhess as sh
from symhess import codegen
from symhess.evaluate import InputError
from symhess.verify import random_values

SIZES = {"L": 3, "d_V": 4, "d_K": 2, "d_ff": 5, "d_H": 2, "h": 2, "d_model": 4, "d": 4}


def values_for(name, batch, sizes=SIZES, seed=0):
    """Random values of ``batch`` sequences (seeds ``seed``, ``seed + 1``, …); one sequence
    without a batch axis."""
    d = sh.derive(sh.layer(name), "mse")
    seqs = [random_values(d, seed=seed + s, sizes=sizes) for s in range(batch)]
    data = set(sh.kernel(name, "numpy", "mse")._data)
    return {n: (np.stack([s[n] for s in seqs]) if n in data and batch > 1 else seqs[0][n])
            for n in seqs[0]}


COMMITTED = [n for n in codegen.LAYERS if n not in codegen.ON_DEMAND]


@pytest.mark.parametrize("name", COMMITTED)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_out_receives_every_entry(name, backend):
    k = sh.kernel(name, backend, "mse")
    for batch in (1, 5):
        vals = values_for(name, batch)
        if backend == "torch":
            vals = {n: torch.tensor(v) for n, v in vals.items()}
        for part in ("full", "outer", "functional"):
            want = k.hessian(vals, part)
            out = (torch.full_like(want, float("nan")) if backend == "torch"
                   else np.full_like(want, np.nan))
            got = k.hessian(vals, part, out=out)
            assert got is out, (batch, part)
            assert bool((got == want).all()), (batch, part)


def test_bad_out_is_named():
    vals = values_for("attention", 1)
    k = sh.kernel("attention", "numpy", "mse")
    n = k.hessian(vals).shape[0]
    with pytest.raises(InputError, match=rf"out must have shape \({n}, {n}\).*got \(3, 3\)"):
        k.hessian(vals, out=np.empty((3, 3)))
    with pytest.raises(InputError, match="out has dtype float32 but the values have dtype float64"):
        k.hessian(vals, out=np.empty((n, n), dtype=np.float32))
    with pytest.raises(InputError, match="C-contiguous"):
        k.hessian(vals, out=np.empty((n, n)).T)
    ro = np.empty((n, n))
    ro.flags.writeable = False
    with pytest.raises(InputError, match="writeable"):
        k.hessian(vals, out=ro)
    with pytest.raises(InputError, match="out must be a NumPy array, got Tensor"):
        k.hessian(vals, out=torch.empty(n, n, dtype=torch.float64))
    kt = sh.kernel("attention", "torch", "mse")
    tv = {a: torch.tensor(b) for a, b in vals.items()}
    with pytest.raises(InputError, match="out must be a torch tensor, got ndarray"):
        kt.hessian(tv, out=np.empty((n, n)))
    with pytest.raises(InputError, match="out is on meta but the values are on cpu"):
        kt.hessian(tv, out=torch.empty(n, n, dtype=torch.float64, device="meta"))
    with pytest.raises(InputError, match="writeable"):
        kt.hessian(tv, out=torch.zeros(n, n, dtype=torch.float64, requires_grad=True))


def test_torch_results_are_ordinary_tensors_whatever_the_routines_mode():
    """The torch routines run under inference mode (no autograd dispatch), but what a kernel
    returns is an ordinary tensor: updated in place and used by autograd like any other.
    Inputs that require grad, or a caller already in inference mode, get the same values."""
    k = sh.kernel("post_ln_block", "torch", "mse")
    vals = {n: torch.tensor(v) for n, v in values_for("post_ln_block", 2).items()}
    n = sum(vals[p].numel() for p in k.params)
    v = torch.randn(n, dtype=torch.float64)
    results = {"hessian": k.hessian(vals), "hvp": k.hvp(vals, v), "loss": k.loss(vals),
               "gradient": k.gradient(vals)["W_Q"], "diag": k.diag(vals, "W_1"),
               "trace": k.trace(vals, "W_2"), "block": k.hessian_block(vals, "W_Q", "W_2")}
    for name, r in results.items():
        assert not r.is_inference(), name
        r.add_(0.0)                               # in place, outside inference mode
    w = torch.ones(n, dtype=torch.float64, requires_grad=True)
    (results["hessian"] @ w).sum().backward()     # saved for backward: ordinary tensors only
    assert torch.allclose(w.grad, results["hessian"].sum(0))
    grad_in = {m: t.clone().requires_grad_(m in k.params) for m, t in vals.items()}
    # (matmul may fold operands differently while autograd records: equal up to rounding)
    assert torch.allclose(k.hvp(grad_in, v).detach(), results["hvp"], rtol=1e-13, atol=1e-14)
    with torch.inference_mode():
        assert torch.equal(k.hessian(vals), results["hessian"])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fresh_results_reuse_only_memory_nothing_references(backend):
    """Without ``out``, ``hessian`` writes into an earlier result of the kernel that nothing
    references any more: never into one still held, as an array, a view of it or (torch) a
    NumPy view of the tensor."""
    k = sh.kernel("post_ln_block", backend, "mse")
    k.release_memory()
    a = values_for("post_ln_block", 1)
    b = values_for("post_ln_block", 2)           # other values, the same Hessian shape

    def conv(v):
        return {n: torch.tensor(x) for n, x in v.items()} if backend == "torch" else v

    def ptr(x):
        return x.data_ptr() if backend == "torch" else x.__array_interface__["data"][0]

    want_a = k.hessian(conv(a), out=_blank(k, a, backend))
    want_b = k.hessian(conv(b), out=_blank(k, b, backend))
    h = k.hessian(conv(a))
    first = ptr(h)
    del h
    h = k.hessian(conv(b))                       # the same memory, new values
    assert ptr(h) == first and bool((h == want_b).all())
    h2 = k.hessian(conv(a))                      # h still holds the first array
    assert ptr(h2) != first and bool((h == want_b).all()) and bool((h2 == want_a).all())
    del h, h2
    makers = [lambda x: x[1:3]] + ([lambda x: x.numpy()[1:3]] if backend == "torch" else [])
    for make in makers:                          # a view alone keeps the array its own
        k.release_memory()
        h = k.hessian(conv(b))
        base, view = ptr(h), make(h)
        del h
        for _ in range(3):
            h3 = k.hessian(conv(a))
            assert ptr(h3) != base and bool((h3 == want_a).all())
            del h3
        assert np.array_equal(np.asarray(view), np.asarray(want_b[1:3]))
    assert len(k._results) <= 2
    k.release_memory()
    assert len(k._results) == 0


def _blank(k, values, backend):
    n = sum(int(np.prod(np.shape(values[p]))) for p in k.params)
    return torch.full((n, n), float("nan"), dtype=torch.float64) if backend == "torch" \
        else np.full((n, n), np.nan)

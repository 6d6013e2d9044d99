"""``Kernel.with_cuda_graphs()`` where no GPU is needed: its errors and its eager path.

The replay itself is tested on a CUDA device in test_cuda.py (skipped without one)."""
import numpy as np
import pytest
import torch

import symhess as sh
from symhess.evaluate import InputError
from symhess.graphs import GraphedFunction
from symhess.verify import random_values


def test_cuda_graphs_need_the_torch_backend():
    with pytest.raises(ValueError, match="torch backend.*'numpy'"):
        sh.kernel("attention", "numpy", "mse").with_cuda_graphs()


def test_cpu_inputs_run_eagerly_with_the_same_numbers_and_checks():
    d = sh.derive(sh.layer("post_ln_block"), "mse")
    values = random_values(d, seed=4, sizes={"L": 3, "d_V": 4, "d_K": 2, "d_ff": 5})
    tv = {n: torch.tensor(v) for n, v in values.items()}
    k = sh.kernel("post_ln_block", "torch", "mse")
    g = k.with_cuda_graphs()
    assert "CUDA graphs" in repr(g) and "CUDA graphs" not in repr(k)
    assert torch.equal(g.hessian(tv, "full"), k.hessian(tv, "full"))
    n = sum(tv[p].numel() for p in k.params)
    v = torch.linspace(-1, 1, n, dtype=torch.float64)
    assert torch.equal(g.hvp(tv, v), k.hvp(tv, v))
    buf = torch.full((n, n), float("nan"), dtype=torch.float64)
    assert g.hessian(tv, "outer", out=buf) is buf and torch.equal(buf, k.hessian(tv, "outer"))
    J = g.jacobian({n_: t for n_, t in tv.items() if n_ != "Y"}, "W_1", compact=True)
    assert np.allclose(J.dense(), k.jacobian({n_: t for n_, t in tv.items() if n_ != "Y"}, "W_1"))
    fn = g._fns[("hessian", "full")]
    assert isinstance(fn, GraphedFunction) and fn.captured == 0
    assert not isinstance(k._fns[("hessian", "full")], GraphedFunction)   # k is unchanged


def test_graphed_kernels_still_validate_the_values():
    d = sh.derive(sh.layer("layernorm"), "mse")
    values = {n: torch.tensor(v) for n, v in random_values(d, seed=0).items()}
    values["X"][1] = 3.0                    # a zero-variance LayerNorm row (ε = 0)
    g = sh.kernel("layernorm", "torch", "mse").with_cuda_graphs()
    with pytest.raises(InputError, match=r"row 1 \(0-based\).*zero variance"):
        g.hessian(values, "full")
    with pytest.raises(InputError, match=r"X must be .*got shape \(1, 1, 4, 6\)"):
        g.hessian(dict(values, X=values["X"][None, None]), "full")


def test_mixed_devices_are_not_captured():
    calls = []
    fn = GraphedFunction(lambda **kw: calls.append(sorted(kw)) or kw["a"] + 1, name="f")
    out = fn(a=torch.ones(2), b=torch.zeros(2, device="meta"))
    assert calls == [["a", "b"]] and torch.equal(out, torch.full((2,), 2.0)) and fn.captured == 0

"""Kernels run the layer's own value checks: a zero-variance LayerNorm row is an error, not NaN."""
import numpy as np
import pytest
import torch

import symhess as sh
from symhess.expr.evaluate import InputError
from symhess.calculus.verify import random_values


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_zero_variance_row_is_rejected_by_the_kernel(backend):
    d = sh.derive(sh.layer("layernorm"), "mse")
    values = random_values(d, seed=0)
    values["X"][1] = 3.0
    if backend == "torch":
        values = {k: torch.as_tensor(v) for k, v in values.items()}
    k = sh.kernel("layernorm", backend, "mse")
    with pytest.raises(InputError, match=r"row 1 \(0-based\).*zero variance"):
        k.hessian(values, "full")


def _batch(name, n, sizes):
    d = sh.derive(sh.layer(name), "mse")
    seqs = [random_values(d, seed=s, sizes=sizes) for s in range(n)]
    return {k: (np.stack([s[k] for s in seqs]) if k in ("X", "Y") else seqs[0][k]) for k in seqs[0]}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_batched_check_names_the_sequence_and_row(backend):
    """The kernels check a whole batch with the generated ``check_inputs`` routine; a bad row
    in one sequence is named with its sequence (post-LN: X + SA(X) is X when W_V = 0)."""
    sizes = {"L": 4, "d_V": 3, "d_K": 2, "d_ff": 5}
    vals = _batch("post_ln_block", 4, sizes)
    vals["W_V"] = np.zeros_like(vals["W_V"])
    vals["X"][2, 3] = -1.5
    vals["X"][2, 1] = 0.5
    if backend == "torch":
        vals = {k: torch.as_tensor(v) for k, v in vals.items()}
    k = sh.kernel("post_ln_block", backend, "mse")
    with pytest.raises(InputError, match=r"LayerNorm Y: sequence 2, row 1 \(0-based\).*zero "
                                         r"variance \(σ² = 0, rows 1, 3\)"):
        k.loss(vals)
    with pytest.raises(InputError, match=r"sequence 2, row 1"):
        k.jacobian({n: v for n, v in vals.items() if n != "Y"}, "W_1")
    assert callable(getattr(k.variant, "check_inputs", None))


@pytest.mark.parametrize("name", ["post_ln_block", "pre_ln_block"])
def test_batched_check_agrees_with_the_interpreter(name):
    """Valid batches pass; one constant row (pre-LN: in X itself) fails the routine and the
    per-sequence interpreter check alike, with the same message for a single sequence."""
    sizes = {"L": 3, "d_V": 4, "d_K": 2, "d_ff": 5}
    vals = _batch(name, 3, sizes)
    k = sh.kernel(name, "numpy", "mse")
    k.loss(vals)                                        # valid: no error
    one = {n: (v[0] if n in ("X", "Y") else v) for n, v in vals.items()}
    one["X"] = one["X"].copy()
    if name == "post_ln_block":
        one["W_V"] = np.zeros_like(one["W_V"])
    one["X"][0] = 7.0
    with pytest.raises(InputError) as routine:
        k.loss(one)
    lay = sh.layer(name)
    with pytest.raises(InputError) as interpreted:
        lay.validate(one)
    assert str(routine.value) == str(interpreted.value)
    assert "sequence" not in str(routine.value) and "row 0 (0-based)" in str(routine.value)
